"""A DLRM-style model on an EmbeddingBagCollection: a KeyedJaggedTensor of ids pooled into a
KeyedTensor, read with ``kt[key]``, ``kt.values()`` and ``kt.to_dict()``, plus a dict of dense per-user
features. Nothing in it is for hstu-export."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

KEYS = ["user_id", "item_id", "item_tags"]


class PooledRanker(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", embedding_dim=dim, num_embeddings=100, feature_names=["user_id"]),
                EmbeddingBagConfig(name="item", embedding_dim=dim, num_embeddings=200, feature_names=["item_id"]),
                EmbeddingBagConfig(name="tags", embedding_dim=dim, num_embeddings=50, feature_names=["item_tags"]),
            ],
            device=torch.device("cpu"),
        )
        self.age = nn.Linear(1, dim)
        self.mlp = nn.Sequential(nn.Linear(3 * dim + dim + 4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, sparse_features: KeyedJaggedTensor, dense_features: dict[str, Tensor]) -> dict[str, Tensor]:
        pooled = self.ebc(sparse_features)
        per_key = pooled.to_dict()
        age = self.age(dense_features["user_age"].unsqueeze(-1))
        x = torch.cat([pooled.values(), age, dense_features["context"]], dim=-1)
        return {
            "ctr": torch.sigmoid(self.mlp(x).squeeze(-1)),
            "affinity": (pooled["user_id"] * per_key["item_id"]).sum(-1) + per_key["item_tags"].norm(dim=-1),
        }


def build_pooled(dim: int = 8, seed: int = 0) -> PooledRanker:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return PooledRanker(dim).eval()


def example_inputs(batch_size: int = 3, seed: int = 0) -> tuple[KeyedJaggedTensor, dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tag_len = torch.randint(1, 5, (batch_size,), generator=gen)
    ones = torch.ones(batch_size, dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS,
        values=torch.cat([torch.randint(0, 100, (batch_size,), generator=gen),
                          torch.randint(0, 200, (batch_size,), generator=gen),
                          torch.randint(0, 50, (int(tag_len.sum()),), generator=gen)]),
        lengths=torch.cat([ones, ones, tag_len]),
    )
    dense = {"user_age": torch.rand(batch_size, generator=gen) * 60, "context": torch.randn(batch_size, 4, generator=gen)}
    return kjt, dense
