"""A DLRM-HSTU ranking model written the way research code writes one, with nothing for hstu-export.

- ``forward(uih_features, candidates_features)`` takes two torchrec KeyedJaggedTensors and merges them
  for one EmbeddingCollection lookup; the history keys share their lengths, so do the candidate keys.
- Max lengths come from the batch (``int(lengths.max().item())``).
- Its own attention function divides by the max length it is passed (the batch's), its own jagged
  concat/split call fbgemm's jagged ops, and a dense ``nn.Embedding`` buckets the event times.
- It returns a tuple: candidate embeddings and a dict of task probabilities.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

UIH_KEYS = ["uih_item_id", "uih_action", "uih_time"]
CANDIDATE_KEYS = ["cand_item_id", "cand_category"]


def jagged_hstu_attention(
    max_seq_len: int,
    alpha: float,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    num_targets: Tensor | None = None,
) -> Tensor:
    """Causal HSTU attention over jagged q/k/v [L, H, D]; targets (the last num_targets tokens of each
    sequence) see the history and themselves. Scores are SiLU(alpha·qk) / max_seq_len."""
    total, heads, _ = q.shape
    padded = [
        torch.ops.fbgemm.jagged_to_padded_dense(t.reshape(total, -1), [seq_offsets], [max_seq_len], 0.0)
        .view(-1, max_seq_len, heads, t.size(-1)).transpose(1, 2)
        for t in (q, k, v)
    ]
    scores = F.silu(torch.einsum("bhxd,bhyd->bhxy", padded[0], padded[1]) * alpha) / max_seq_len
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    ids = torch.arange(max_seq_len, device=q.device).view(1, -1)
    if num_targets is not None:
        ids = torch.minimum(ids, (lengths - num_targets).view(-1, 1))
    else:
        ids = ids.expand(lengths.size(0), -1)
    row, col = ids.unsqueeze(2), ids.unsqueeze(1)
    valid = (row > col) | torch.eye(max_seq_len, dtype=torch.bool, device=q.device).unsqueeze(0)
    out = torch.einsum("bhxy,bhyd->bhxd", scores * valid.unsqueeze(1), padded[2])
    flat = out.transpose(1, 2).reshape(-1, max_seq_len, heads * v.size(-1))
    return torch.ops.fbgemm.dense_to_jagged(flat, [seq_offsets], total)[0].view(total, heads, v.size(-1))


def jagged_concat(left: Tensor, left_offsets: Tensor, max_left: int,
                  right: Tensor, right_offsets: Tensor, max_right: int) -> Tensor:
    """Per user: its left rows, then its right rows."""
    padded = torch.cat([
        torch.ops.fbgemm.jagged_to_padded_dense(left, [left_offsets], [max_left], 0.0),
        torch.ops.fbgemm.jagged_to_padded_dense(right, [right_offsets], [max_right], 0.0),
    ], dim=1)
    left_len = left_offsets[1:] - left_offsets[:-1]
    right_len = right_offsets[1:] - right_offsets[:-1]
    # Move each user's right rows up against its left rows, then unpad.
    pos = torch.arange(max_left + max_right, device=left.device).view(1, -1)
    source = torch.where(pos < left_len.view(-1, 1), pos, pos - left_len.view(-1, 1) + max_left)
    source = source.clamp(max=max_left + max_right - 1)
    packed = torch.gather(padded, 1, source.unsqueeze(-1).expand(-1, -1, left.size(-1)))
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(left_len + right_len)
    return torch.ops.fbgemm.dense_to_jagged(packed, [offsets], left.size(0) + right.size(0))[0]


def jagged_take_right(values: Tensor, left_offsets: Tensor, right_offsets: Tensor, num_right: int) -> Tensor:
    """The right rows of each user from concatenated [left; right] rows."""
    right_len = right_offsets[1:] - right_offsets[:-1]
    users = torch.repeat_interleave(torch.arange(right_len.size(0), device=values.device), right_len,
                                    output_size=num_right)
    # Right row j of user u sits after all rows of users < u and u's left rows: left_offsets[u + 1] + j.
    return values[left_offsets[1:][users] + torch.arange(num_right, device=values.device)]


class STULayer(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * heads * head_dim)
        self.out_norm = nn.LayerNorm(heads * head_dim)
        self.out = nn.Linear(3 * heads * head_dim, dim)

    def forward(self, x: Tensor, offsets: Tensor, max_seq_len: int, num_targets: Tensor) -> Tensor:
        u, v, q, k = torch.split(self.uvqk(self.norm(x)), self.heads * self.head_dim, dim=-1)
        u = F.silu(u)
        shape = (-1, self.heads, self.head_dim)
        a = jagged_hstu_attention(max_seq_len=max_seq_len, alpha=1.0 / math.sqrt(self.head_dim), q=q.reshape(shape),
                                  k=k.reshape(shape), v=v.reshape(shape), seq_offsets=offsets, num_targets=num_targets)
        a = a.reshape(x.size(0), -1)
        return x + self.out(torch.cat([u, a, u * self.out_norm(a)], dim=-1))


class DlrmHstu(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 2, items: int = 500, actions: int = 8,
                 categories: int = 20, time_buckets: int = 32) -> None:
        super().__init__()
        self.embedding_collection = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="item", embedding_dim=dim, num_embeddings=items,
                                feature_names=["uih_item_id", "cand_item_id"]),
                EmbeddingConfig(name="action", embedding_dim=dim, num_embeddings=actions, feature_names=["uih_action"]),
                EmbeddingConfig(name="category", embedding_dim=dim, num_embeddings=categories,
                                feature_names=["cand_category"]),
            ],
            device=torch.device("cpu"),
        )
        self.time_buckets = time_buckets
        self.time_embedding = nn.Embedding(time_buckets, dim)
        self.history_proj = nn.Linear(2 * dim, dim)
        self.candidate_proj = nn.Linear(2 * dim, dim)
        self.layers = nn.ModuleList([STULayer(dim, heads, dim // heads) for _ in range(layers)])
        self.heads = nn.ModuleDict({task: nn.Sequential(nn.Linear(2 * dim, dim), nn.SiLU(), nn.Linear(dim, 1))
                                    for task in ("click", "like")})

    def forward(self, uih_features: KeyedJaggedTensor,
                candidates_features: KeyedJaggedTensor) -> tuple[Tensor, dict[str, Tensor]]:
        merged = KeyedJaggedTensor.from_lengths_sync(
            keys=uih_features.keys() + candidates_features.keys(),
            values=torch.cat([uih_features.values(), candidates_features.values()]),
            lengths=torch.cat([uih_features.lengths(), candidates_features.lengths()]),
        )
        embeddings = self.embedding_collection(merged)
        uih_lengths = uih_features["uih_item_id"].lengths()
        num_candidates = candidates_features["cand_item_id"].lengths()
        max_uih = int(uih_lengths.max().item())
        max_candidates = int(num_candidates.max().item())

        times = uih_features["uih_time"].values()
        age = (times.max() - times).clamp(min=1).float()
        buckets = torch.log(age).long().clamp(0, self.time_buckets - 1)
        history = self.history_proj(torch.cat([embeddings["uih_item_id"].values(),
                                               embeddings["uih_action"].values()], dim=-1))
        history = history + self.time_embedding(buckets)
        candidates = self.candidate_proj(torch.cat([embeddings["cand_item_id"].values(),
                                                    embeddings["cand_category"].values()], dim=-1))
        uih_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(uih_lengths)
        cand_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(num_candidates)
        x = jagged_concat(history, uih_offsets, max_uih, candidates, cand_offsets, max_candidates)
        offsets = uih_offsets + cand_offsets
        for layer in self.layers:
            x = layer(x, offsets, max_uih + max_candidates, num_candidates)
        user = jagged_take_right(x, uih_offsets, cand_offsets, candidates.size(0))
        pair = torch.cat([user, embeddings["cand_item_id"].values()], dim=-1)
        return user, {task: torch.sigmoid(head(pair).squeeze(-1)) for task, head in self.heads.items()}


def build_ranker(dim: int = 16, heads: int = 2, layers: int = 2, seed: int = 0) -> DlrmHstu:
    """The factory a bundle names: ``user_models.dlrm_hstu:build_ranker``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DlrmHstu(dim, heads, layers)
        for table in model.embedding_collection.embeddings.values():
            nn.init.normal_(table.weight, std=0.1)
    return model.eval()


def example_inputs(batch_size: int = 3, seed: int = 0, max_history: int = 12,
                   max_candidates: int = 5) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """One batch in the model's own format."""
    gen = torch.Generator().manual_seed(seed)
    uih_len = torch.randint(1, max_history + 1, (batch_size,), generator=gen)
    cand_len = torch.randint(1, max_candidates + 1, (batch_size,), generator=gen)
    n_uih, n_cand = int(uih_len.sum()), int(cand_len.sum())
    uih = KeyedJaggedTensor.from_lengths_sync(
        keys=UIH_KEYS,
        values=torch.cat([torch.randint(0, 500, (n_uih,), generator=gen), torch.randint(0, 8, (n_uih,), generator=gen),
                          1_700_000_000 + torch.randint(0, 10**6, (n_uih,), generator=gen)]),
        lengths=torch.cat([uih_len, uih_len, uih_len]),
    )
    cand = KeyedJaggedTensor.from_lengths_sync(
        keys=CANDIDATE_KEYS,
        values=torch.cat([torch.randint(0, 500, (n_cand,), generator=gen), torch.randint(0, 20, (n_cand,), generator=gen)]),
        lengths=torch.cat([cand_len, cand_len]),
    )
    return uih, cand
