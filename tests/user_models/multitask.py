"""A multi-task ranker that returns what generative-recommenders' ``DlrmHSTU`` returns at inference: a
tuple of the candidates' user embeddings, their item embeddings, the aux losses (an empty dict), the
per-task predictions ``[tasks, candidates]`` (sigmoid for the binary tasks, raw for the regression one),
and two ``None``s (labels, weights). It lists its tasks as that library does (``_multitask_configs``:
objects with a ``task_name`` and a ``task_type``). Variants return a namedtuple or a dataclass instead,
or list no tasks. Nothing in it is for hstu-export.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

UIH_KEYS = ["user_id", "uih_item_id"]
CANDIDATE_KEYS = ["cand_item_id"]
ITEMS, USERS = 300, 50
RANGES = {"uih_features.uih_item_id": (1, 10), "uih_features.user_id": (1, 1), "candidates_features": (1, 6)}


class TaskType(IntEnum):
    BINARY_CLASSIFICATION = 0
    REGRESSION = 1


@dataclass
class Task:
    task_name: str
    task_weight: int
    task_type: TaskType


TASKS = [Task("click", 1, TaskType.BINARY_CLASSIFICATION), Task("like", 1, TaskType.BINARY_CLASSIFICATION),
         Task("watch_time", 1, TaskType.REGRESSION)]


class RankerOutput(NamedTuple):
    user_embeddings: Tensor
    item_embeddings: Tensor
    predictions: Tensor


@dataclass
class RankerResult:
    user_embeddings: Tensor
    item_embeddings: Tensor
    predictions: Tensor


class MultitaskRanker(nn.Module):
    def __init__(self, dim: int = 8, returns: str = "tuple", lists_tasks: bool = True) -> None:
        super().__init__()
        self.embedding_collection = EmbeddingCollection(
            tables=[EmbeddingConfig(name="item", embedding_dim=dim, num_embeddings=ITEMS,
                                    feature_names=["uih_item_id", "cand_item_id"]),
                    EmbeddingConfig(name="user", embedding_dim=dim, num_embeddings=USERS, feature_names=["user_id"])],
            device=torch.device("cpu"),
        )
        self.user_tower = nn.Sequential(nn.Linear(2 * dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.item_tower = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.prediction = nn.Linear(dim, len(TASKS))
        self.returns = returns
        if lists_tasks:
            self._multitask_configs = list(TASKS)

    def forward(self, uih_features: KeyedJaggedTensor, candidates_features: KeyedJaggedTensor) -> object:
        merged = KeyedJaggedTensor.from_lengths_sync(
            keys=uih_features.keys() + candidates_features.keys(),
            values=torch.cat([uih_features.values(), candidates_features.values()]),
            lengths=torch.cat([uih_features.lengths(), candidates_features.lengths()]),
        )
        embeddings = self.embedding_collection(merged)
        uih_lengths = uih_features["uih_item_id"].lengths()
        num_candidates = candidates_features["cand_item_id"].lengths()
        history = embeddings["uih_item_id"].values()
        users = uih_lengths.size(0)
        owner = torch.repeat_interleave(torch.arange(users, device=history.device), uih_lengths,
                                        output_size=history.size(0))
        user_id = embeddings["user_id"].values()  # one row per user
        pooled = torch.zeros_like(user_id).index_add(0, owner, history) / uih_lengths.clamp_min(1).unsqueeze(1).to(
            history.dtype)
        user = user_id + self.user_tower(torch.cat([pooled, user_id], dim=-1))
        candidates = embeddings["cand_item_id"].values()
        candidate_owner = torch.repeat_interleave(torch.arange(users, device=history.device), num_candidates,
                                                  output_size=candidates.size(0))
        user_embeddings = user[candidate_owner]
        item_embeddings = candidates + self.item_tower(candidates)
        logits = self.prediction(user_embeddings * item_embeddings).transpose(0, 1)  # [tasks, candidates]
        predictions = torch.cat([torch.sigmoid(logits[:2]), logits[2:]], dim=0)
        if self.returns == "namedtuple":
            return RankerOutput(user_embeddings, item_embeddings, predictions)
        if self.returns == "dataclass":
            return RankerResult(user_embeddings, item_embeddings, predictions)
        return user_embeddings, item_embeddings, {}, predictions, None, None


def build_ranker(dim: int = 8, returns: str = "tuple", lists_tasks: bool = True, seed: int = 0) -> MultitaskRanker:
    """The factory a bundle names: ``user_models.multitask:build_ranker``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = MultitaskRanker(dim, returns, lists_tasks)
        # Embeddings of a few units, as trained tables have, and moderate logits.
        for table in model.embedding_collection.embeddings.values():
            nn.init.normal_(table.weight, std=2.0)
        model.prediction.weight.data.mul_(0.1)
    return model.eval()


def example_inputs(history: list[int], candidates: list[int], seed: int = 0) -> tuple[KeyedJaggedTensor, ...]:
    """One batch in the model's own format: per user, its history length and its number of candidates."""
    gen = torch.Generator().manual_seed(seed)
    b, n, c = len(history), sum(history), sum(candidates)
    uih = KeyedJaggedTensor.from_lengths_sync(
        keys=UIH_KEYS,
        values=torch.cat([torch.randint(0, USERS, (b,), generator=gen), torch.randint(0, ITEMS, (n,), generator=gen)]),
        lengths=torch.tensor([1] * b + history),
    )
    cand = KeyedJaggedTensor.from_lengths_sync(keys=CANDIDATE_KEYS, values=torch.randint(0, ITEMS, (c,), generator=gen),
                                               lengths=torch.tensor(candidates))
    return uih, cand
