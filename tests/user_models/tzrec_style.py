"""A multi-task HSTU ranker written in TorchEasyRec's manner, with nothing for hstu-export.

What makes it like that library's models (and what a compiler has to take as it is):
- ``forward(batch: Batch)`` takes one dataclass of dicts: dense features as KeyedTensors by feature group,
  sparse features as KeyedJaggedTensors by group (contextual ids, one per user; the user's history; the
  candidates), dense sequence features as JaggedTensors by feature name, and the fields a trainer fills
  (labels, sample weights, raw rows, bookkeeping) empty, None or at their defaults at inference;
- an EmbeddingBagCollection pools the contextual ids, an EmbeddingCollection looks the sequences up;
- contextual tokens (the pooled ids and the dense features, a fixed number per user) are prepended to
  each user's history, the candidates appended, and HSTU layers run over them (``user_models.dlrm_hstu``'s
  layer, whose attention pads to the batch's longest sequence and divides by it);
- an item tower and a multi-task tower over the candidates' rows: two classification tasks and one
  regression, predictions named ``logits_<task>``, ``probs_<task>``, ``y_<task>``.

``ScriptWrapper`` is the flat entry a serving stack calls: ``forward(data, device)`` on a dict of
``<feature>.values`` / ``<feature>.lengths`` tensors, turned into a ``Batch`` by the wrapper itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from user_models.dlrm_hstu import STULayer, jagged_concat, jagged_take_right

USERS, CITIES, ITEMS, ACTIONS, CATEGORIES = 80, 12, 400, 6, 16
CONTEXTUAL_KEYS = ["user_id", "user_city"]
UIH_KEYS = ["uih_item_id", "uih_action"]
CANDIDATE_KEYS = ["cand_item_id", "cand_category"]
DENSE_KEYS = {"user_age": 1, "user_stats": 3}
SEQUENCE_DENSE = "uih_watch_ratio"
TASKS = {"ctr": "classification", "cvr": "classification", "watch_time": "regression"}
# What a user states when saving the bundle: the sequence groups' lengths (the contextual keys have one id
# per user, and stay so).
RANGES = {"batch.sparse_features.uih": (1, 8), "batch.sparse_features.candidate": (1, 4)}
ATTENTION = "user_models.dlrm_hstu.jagged_hstu_attention"


class RawRows:
    """The raw input rows of a batch, kept to write predictions out beside them (empty at inference)."""

    def __init__(self, rows: bytes | None = None) -> None:
        self._schema: str | None = None
        self._buffer: bytes | None = None
        if rows:
            self._schema, self._buffer = "rows", rows


@dataclass
class Batch:
    """One batch of inputs, by kind of feature and then by feature group (or feature name)."""

    dense_features: dict[str, KeyedTensor] = field(default_factory=dict)
    sparse_features: dict[str, KeyedJaggedTensor] = field(default_factory=dict)
    sequence_dense_features: dict[str, JaggedTensor] = field(default_factory=dict)
    labels: dict[str, Tensor] = field(default_factory=dict)
    jagged_labels: dict[str, JaggedTensor] = field(default_factory=dict)
    reserves: RawRows = field(default_factory=RawRows)
    tile_size: int = -1
    sample_weights: dict[str, Tensor] = field(default_factory=dict)
    dummy: bool = False
    checkpoint_info: dict[str, int] | None = None
    data_timestamp: float = -1.0


class MultiTaskTower(nn.Module):
    """A shared layer over user ⊙ item and user ⊕ item, then one small head per task."""

    def __init__(self, dim: int, tasks: dict[str, str]) -> None:
        super().__init__()
        self.tasks = dict(tasks)
        self.shared = nn.Sequential(nn.Linear(3 * dim, 2 * dim), nn.SiLU(), nn.LayerNorm(2 * dim))
        self.heads = nn.ModuleDict({name: nn.Linear(2 * dim, 1) for name in tasks})

    def forward(self, user: Tensor, item: Tensor) -> dict[str, Tensor]:
        x = self.shared(torch.cat([user * item, user, item], dim=-1))
        return {name: head(x).squeeze(-1) for name, head in self.heads.items()}


class TzrecStyleRanker(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 2, attention_len: int | None = None) -> None:
        super().__init__()
        self.attention_len = attention_len  # the attention's length (its padding and divisor); None: the batch's
        self.contextual_ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", embedding_dim=dim, num_embeddings=USERS, feature_names=["user_id"],
                                   pooling=PoolingType.SUM),
                EmbeddingBagConfig(name="city", embedding_dim=dim, num_embeddings=CITIES, feature_names=["user_city"],
                                   pooling=PoolingType.SUM),
            ],
            device=torch.device("cpu"),
        )
        self.sequence_ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="item", embedding_dim=dim, num_embeddings=ITEMS,
                                feature_names=["uih_item_id", "cand_item_id"]),
                EmbeddingConfig(name="action", embedding_dim=dim, num_embeddings=ACTIONS, feature_names=["uih_action"]),
                EmbeddingConfig(name="category", embedding_dim=dim, num_embeddings=CATEGORIES,
                                feature_names=["cand_category"]),
            ],
            device=torch.device("cpu"),
        )
        self.dense_proj = nn.Linear(sum(DENSE_KEYS.values()), dim)
        self.uih_proj = nn.Linear(2 * dim + 1, dim)
        self.candidate_proj = nn.Linear(2 * dim, dim)
        self.layers = nn.ModuleList([STULayer(dim, heads, dim // heads) for _ in range(layers)])
        self.item_mlp = nn.Sequential(nn.Linear(2 * dim, dim), nn.SiLU(), nn.LayerNorm(dim))
        self.tower = MultiTaskTower(dim, TASKS)
        self.num_contextual = len(CONTEXTUAL_KEYS) + 1

    def build_input(self, batch: Batch) -> dict[str, Tensor]:
        """Grouped features: the contextual tokens [B, C, D], the history's and the candidates' rows."""
        pooled = self.contextual_ebc(batch.sparse_features["contextual"])
        dense = batch.dense_features["user"].values()
        contextual = torch.stack([pooled["user_id"], pooled["user_city"], self.dense_proj(dense)], dim=1)
        sequences = self.sequence_ec(KeyedJaggedTensor.from_lengths_sync(
            keys=UIH_KEYS + CANDIDATE_KEYS,
            values=torch.cat([batch.sparse_features["uih"].values(), batch.sparse_features["candidate"].values()]),
            lengths=torch.cat([batch.sparse_features["uih"].lengths(), batch.sparse_features["candidate"].lengths()]),
        ))
        watch_ratio = batch.sequence_dense_features[SEQUENCE_DENSE]
        uih = torch.cat([sequences["uih_item_id"].values(), sequences["uih_action"].values(), watch_ratio.values()],
                        dim=-1)
        candidate = torch.cat([sequences["cand_item_id"].values(), sequences["cand_category"].values()], dim=-1)
        return {
            "contextual": contextual,
            "uih.sequence": self.uih_proj(uih),
            "uih.sequence_length": batch.sparse_features["uih"]["uih_item_id"].lengths(),
            "candidate.sequence": candidate,
            "candidate.sequence_length": batch.sparse_features["candidate"]["cand_item_id"].lengths(),
        }

    def user_forward(self, grouped: dict[str, Tensor]) -> Tensor:
        """The HSTU stack over [contextual, history, candidates] per user; the candidates' rows out."""
        contextual = grouped["contextual"]
        users, c = contextual.size(0), self.num_contextual
        uih_lengths, num_targets = grouped["uih.sequence_length"], grouped["candidate.sequence_length"]
        max_uih = int(uih_lengths.max().item())
        max_candidates = int(num_targets.max().item())
        context_offsets = torch.arange(users + 1, device=contextual.device) * c
        uih_offsets = F.pad(torch.cumsum(uih_lengths, 0), (1, 0))
        candidate_offsets = F.pad(torch.cumsum(num_targets, 0), (1, 0))
        candidates = self.candidate_proj(grouped["candidate.sequence"])
        x = jagged_concat(contextual.reshape(users * c, -1), context_offsets, c,
                          grouped["uih.sequence"], uih_offsets, max_uih)
        left_offsets = context_offsets + uih_offsets
        x = jagged_concat(x, left_offsets, c + max_uih, candidates, candidate_offsets, max_candidates)
        offsets = left_offsets + candidate_offsets
        for layer in self.layers:
            x = layer(x, offsets, self.attention_len or c + max_uih + max_candidates, num_targets)
        return jagged_take_right(x, left_offsets, candidate_offsets, candidates.size(0))

    def predict(self, batch: Batch) -> dict[str, Tensor]:
        grouped = self.build_input(batch)
        item = self.item_mlp(grouped["candidate.sequence"])
        user = self.user_forward(grouped)
        outputs = self.tower(user, item)
        predictions: dict[str, Tensor] = {}
        for task, kind in TASKS.items():
            if kind == "classification":
                predictions[f"logits_{task}"] = outputs[task]
                predictions[f"probs_{task}"] = torch.sigmoid(outputs[task])
            else:
                predictions[f"y_{task}"] = outputs[task]
        return predictions

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        return self.predict(batch)


class ScriptWrapper(nn.Module):
    """The flat serving entry: a dict of ``<feature>.values`` / ``<feature>.lengths`` made into a Batch."""

    def __init__(self, model: TzrecStyleRanker) -> None:
        super().__init__()
        self.model = model

    def get_batch(self, data: dict[str, Tensor]) -> Batch:
        sparse = {
            group: KeyedJaggedTensor(
                keys=keys,
                values=torch.cat([data[f"{key}.values"] for key in keys]),
                lengths=torch.cat([data[f"{key}.lengths"] for key in keys]),
            )
            for group, keys in (("contextual", CONTEXTUAL_KEYS), ("uih", UIH_KEYS), ("candidate", CANDIDATE_KEYS))
        }
        dense = {"user": KeyedTensor.from_tensor_list(list(DENSE_KEYS), [data[f"{k}.values"] for k in DENSE_KEYS])}
        sequence_dense = {SEQUENCE_DENSE: JaggedTensor(values=data[f"{SEQUENCE_DENSE}.values"],
                                                       lengths=data[f"{SEQUENCE_DENSE}.lengths"])}
        return Batch(dense_features=dense, sparse_features=sparse, sequence_dense_features=sequence_dense)

    def forward(self, data: dict[str, Tensor], device: str = "cpu") -> dict[str, Tensor]:
        return self.model.predict(self.get_batch(data))


def build_ranker(dim: int = 16, heads: int = 2, layers: int = 2, seed: int = 0,
                 attention_len: int | None = None) -> TzrecStyleRanker:
    """The factory a bundle names: ``user_models.tzrec_style:build_ranker``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TzrecStyleRanker(dim, heads, layers, attention_len)
        for module in (model.contextual_ebc, model.sequence_ec):
            for table in module.embedding_bags.values() if isinstance(module, EmbeddingBagCollection) \
                    else module.embeddings.values():
                nn.init.normal_(table.weight, std=0.1)
    return model.eval()


def build_cacheable_ranker() -> TzrecStyleRanker:
    """``user_models.tzrec_style:build_cacheable_ranker``: the attention's length fixed, as TorchEasyRec configures
    it, at the longest sequence ``RANGES`` allow (3 contextual tokens, 8 history items, 4 candidates)."""
    return build_ranker(attention_len=len(CONTEXTUAL_KEYS) + 1 + 8 + 4)


def build_script_wrapper(dim: int = 16, heads: int = 2, layers: int = 2, seed: int = 0) -> ScriptWrapper:
    """The factory of the flat entry: ``user_models.tzrec_style:build_script_wrapper``."""
    return ScriptWrapper(build_ranker(dim, heads, layers, seed)).eval()


def example_batch(history: list[int], candidates: list[int], seed: int = 0) -> Batch:
    """One Batch as a TorchEasyRec data parser would hand it to the model at inference: per user, its
    history length and its number of candidates."""
    gen = torch.Generator().manual_seed(seed)
    b, n, c = len(history), sum(history), sum(candidates)
    ones = torch.ones(b, dtype=torch.int64)
    uih_lengths, candidate_lengths = torch.tensor(history), torch.tensor(candidates)
    contextual = KeyedJaggedTensor.from_lengths_sync(
        keys=CONTEXTUAL_KEYS,
        values=torch.cat([torch.randint(0, USERS, (b,), generator=gen), torch.randint(0, CITIES, (b,), generator=gen)]),
        lengths=torch.cat([ones, ones]),
    )
    uih = KeyedJaggedTensor.from_lengths_sync(
        keys=UIH_KEYS,
        values=torch.cat([torch.randint(0, ITEMS, (n,), generator=gen), torch.randint(0, ACTIONS, (n,), generator=gen)]),
        lengths=torch.cat([uih_lengths, uih_lengths]),
    )
    candidate = KeyedJaggedTensor.from_lengths_sync(
        keys=CANDIDATE_KEYS,
        values=torch.cat([torch.randint(0, ITEMS, (c,), generator=gen),
                          torch.randint(0, CATEGORIES, (c,), generator=gen)]),
        lengths=torch.cat([candidate_lengths, candidate_lengths]),
    )
    dense = KeyedTensor.from_tensor_list(
        list(DENSE_KEYS), [torch.rand(b, dim, generator=gen) for dim in DENSE_KEYS.values()])
    watch_ratio = JaggedTensor(values=torch.rand(n, 1, generator=gen), lengths=uih_lengths.clone())
    return Batch(dense_features={"user": dense},
                 sparse_features={"contextual": contextual, "uih": uih, "candidate": candidate},
                 sequence_dense_features={SEQUENCE_DENSE: watch_ratio})


def flat_data(batch: Batch) -> dict[str, Tensor]:
    """The same batch as the flat dict ``ScriptWrapper`` takes (``<feature>.values`` / ``.lengths``)."""
    data: dict[str, Tensor] = {}
    for kjt in batch.sparse_features.values():
        for key, jt in kjt.to_dict().items():
            data[f"{key}.values"], data[f"{key}.lengths"] = jt.values(), jt.lengths()
    for key, tensor in batch.dense_features["user"].to_dict().items():
        data[f"{key}.values"] = tensor
    watch_ratio = batch.sequence_dense_features[SEQUENCE_DENSE]
    data[f"{SEQUENCE_DENSE}.values"], data[f"{SEQUENCE_DENSE}.lengths"] = watch_ratio.values(), watch_ratio.lengths()
    return data
