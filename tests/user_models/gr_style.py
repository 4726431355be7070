"""A ranking model written in generative-recommenders' manner, with nothing for hstu-export.

What makes it like that library's ``DlrmHSTU`` (and what a compiler has to hold over the whole range of
requests, down to one user with one history item and one candidate):
- contextual tokens (one per user, from the user id) are prepended to each user's history;
- the number of history items and of candidates is counted from the batch
  (``int(lengths.sum().item())``), and the rows are concatenated and split with those counts;
- attention pads to the batch's longest sequence (``int(lengths.max().item())``) and divides by it;
- the candidates' rows are taken back out of the sequence and joined with the candidates' embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from user_models.dlrm_hstu import STULayer

UIH_KEYS = ["user_id", "uih_item_id", "uih_action"]
CANDIDATE_KEYS = ["cand_item_id"]
ITEMS, ACTIONS, USERS = 300, 6, 50


def jagged_concat(parts: list[Tensor], lengths: list[Tensor], total: int) -> Tensor:
    """Per user: its rows of ``parts[0]``, then of ``parts[1]``, ... (each part jagged by ``lengths[i]``)."""
    users = lengths[0].size(0)
    per_user = torch.stack(lengths, dim=1)  # [B, parts]
    out_offsets = F.pad(torch.cumsum(per_user.sum(1), 0), (1, 0))
    values = torch.cat(parts, dim=0)
    # Where each part's rows start in ``values``; each row's place in the output is its user's start, plus
    # the user's rows of the earlier parts, plus its rank among the user's rows of this part.
    part_starts = F.pad(torch.cumsum(torch.stack([n.sum() for n in lengths]), 0), (1, 0))
    order = torch.empty(total, dtype=torch.long, device=values.device)
    for i, n in enumerate(lengths):
        owner = torch.repeat_interleave(torch.arange(users, device=n.device), n, output_size=int(n.sum().item()))
        rank = torch.arange(owner.size(0), device=n.device) - F.pad(torch.cumsum(n, 0), (1, 0))[owner]
        earlier = per_user[:, :i].sum(1)
        order[out_offsets[owner] + earlier[owner] + rank] = part_starts[i] + torch.arange(owner.size(0), device=n.device)
    return values[order]


def take_last(values: Tensor, offsets: Tensor, counts: Tensor, total: int) -> Tensor:
    """The last ``counts[u]`` rows of each user's sequence."""
    owner = torch.repeat_interleave(torch.arange(counts.size(0), device=values.device), counts, output_size=total)
    first = F.pad(torch.cumsum(counts, 0), (1, 0))
    rank = torch.arange(total, device=values.device) - first[owner]
    return values[offsets[1:][owner] - counts[owner] + rank]


class GrStyleRanker(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 2, cast_to_layers: bool = True,
                 attention_len: int | None = None) -> None:
        super().__init__()
        # The length the attention pads to and divides by: None, the batch's longest sequence (as
        # generative-recommenders does); a number, the same for every batch (what a KV cache needs).
        self.attention_len = attention_len
        # False: the embeddings reach the layers in the tables' dtype, as in a model trained under autocast.
        self.cast_to_layers = cast_to_layers
        self.embedding_collection = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="item", embedding_dim=dim, num_embeddings=ITEMS,
                                feature_names=["uih_item_id", "cand_item_id"]),
                EmbeddingConfig(name="action", embedding_dim=dim, num_embeddings=ACTIONS, feature_names=["uih_action"]),
                EmbeddingConfig(name="user", embedding_dim=dim, num_embeddings=USERS, feature_names=["user_id"]),
            ],
            device=torch.device("cpu"),
        )
        self.contextual_proj = nn.Linear(dim, dim)
        self.history_proj = nn.Linear(2 * dim, dim)
        self.candidate_proj = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([STULayer(dim, heads, dim // heads) for _ in range(layers)])
        self.heads = nn.ModuleDict({task: nn.Sequential(nn.Linear(2 * dim, dim), nn.SiLU(), nn.Linear(dim, 1))
                                    for task in ("click", "watch")})

    def forward(self, uih_features: KeyedJaggedTensor, candidates_features: KeyedJaggedTensor) -> dict[str, Tensor]:
        merged = KeyedJaggedTensor.from_lengths_sync(
            keys=uih_features.keys() + candidates_features.keys(),
            values=torch.cat([uih_features.values(), candidates_features.values()]),
            lengths=torch.cat([uih_features.lengths(), candidates_features.lengths()]),
        )
        embeddings = self.embedding_collection(merged)
        uih_lengths = uih_features["uih_item_id"].lengths()
        num_candidates = candidates_features["cand_item_id"].lengths()
        contextual_lengths = uih_features["user_id"].lengths()
        num_uih = int(uih_lengths.sum().item())
        total_candidates = int(num_candidates.sum().item())

        # The tables look up in their own dtype; the dense layers may run in another (a bf16 export).
        dtype = self.contextual_proj.weight.dtype if self.cast_to_layers else embeddings["user_id"].values().dtype
        contextual = self.contextual_proj(embeddings["user_id"].values().to(dtype))
        history = self.history_proj(torch.cat([embeddings["uih_item_id"].values(),
                                               embeddings["uih_action"].values()], dim=-1).to(dtype))
        candidate_embeddings = embeddings["cand_item_id"].values().to(dtype)
        candidates = self.candidate_proj(candidate_embeddings)
        lengths = contextual_lengths + uih_lengths + num_candidates
        total = int(contextual_lengths.sum().item()) + num_uih + total_candidates
        x = jagged_concat([contextual, history, candidates], [contextual_lengths, uih_lengths, num_candidates], total)
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        max_seq_len = self.attention_len or int(lengths.max().item())
        for layer in self.layers:
            x = layer(x, offsets, max_seq_len, num_candidates)
        user = take_last(x, offsets, num_candidates, total_candidates)
        pair = torch.cat([user, candidate_embeddings], dim=-1)
        return {task: torch.sigmoid(head(pair).squeeze(-1)) for task, head in self.heads.items()}


def build_ranker(dim: int = 16, heads: int = 2, layers: int = 2, seed: int = 0,
                 cast_to_layers: bool = True, attention_len: int | None = None) -> GrStyleRanker:
    """The factory a bundle names: ``user_models.gr_style:build_ranker``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GrStyleRanker(dim, heads, layers, cast_to_layers, attention_len)
        for table in model.embedding_collection.embeddings.values():
            nn.init.normal_(table.weight, std=0.1)
    return model.eval()


def build_autocast_ranker() -> GrStyleRanker:
    """``user_models.gr_style:build_autocast_ranker``: the layers take the tables' fp32 rows as they come."""
    return build_ranker(cast_to_layers=False)


def build_cacheable_ranker() -> GrStyleRanker:
    """``user_models.gr_style:build_cacheable_ranker``: the attention divides by a fixed length, the longest
    sequence ``RANGES`` allow (1 contextual token, 12 history items, 5 candidates)."""
    return build_ranker(attention_len=ATTENTION_LEN)


def example_inputs(history: list[int], candidates: list[int], seed: int = 0) -> tuple[KeyedJaggedTensor, ...]:
    """One batch in the model's own format: per user, its history length and its number of candidates."""
    gen = torch.Generator().manual_seed(seed)
    b, n, c = len(history), sum(history), sum(candidates)
    uih = KeyedJaggedTensor.from_lengths_sync(
        keys=UIH_KEYS,
        values=torch.cat([torch.randint(0, USERS, (b,), generator=gen), torch.randint(0, ITEMS, (n,), generator=gen),
                          torch.randint(0, ACTIONS, (n,), generator=gen)]),
        lengths=torch.tensor([1] * b + history * 2),
    )
    cand = KeyedJaggedTensor.from_lengths_sync(keys=CANDIDATE_KEYS, values=torch.randint(0, ITEMS, (c,), generator=gen),
                                               lengths=torch.tensor(candidates))
    return uih, cand


# The attention of the layers reads the batch's max length: export maps it onto generative-recommenders'
# declared attention (``--map-function``), as a user of that library's functions would have it mapped.
ATTENTION = "user_models.dlrm_hstu.jagged_hstu_attention"
GR_ATTENTION = "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha"
RANGES = {"uih_features.uih_item_id": (1, 12), "uih_features.user_id": (1, 1), "candidates_features": (1, 5)}
ATTENTION_LEN = 18
