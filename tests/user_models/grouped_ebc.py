"""A ranker that groups pooled embeddings the way TorchEasyRec's embedding groups do, with nothing for
hstu-export: an EmbeddingBagCollection pools the ids of one KeyedJaggedTensor, a second one pools
user-side ids that are then tiled to the candidates' rows and rebuilt into a KeyedTensor, and
``KeyedTensor.regroup_as_dict`` gathers the keys into named feature groups that the dense code reads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

ITEM_KEYS = ["item_id", "item_tags"]
USER_KEYS = ["user_id"]
GROUPS = {"wide": ["item_id", "user_id"], "deep": ["item_tags", "item_id"]}


class GroupedRanker(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="item", embedding_dim=dim, num_embeddings=200, feature_names=["item_id"]),
                EmbeddingBagConfig(name="tags", embedding_dim=dim, num_embeddings=50, feature_names=["item_tags"]),
            ],
            device=torch.device("cpu"),
        )
        self.ebc_user = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="user", embedding_dim=dim, num_embeddings=100, feature_names=["user_id"])],
            device=torch.device("cpu"),
        )
        self.wide = nn.Linear(2 * dim, 1)
        self.deep = nn.Sequential(nn.Linear(2 * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, item_features: KeyedJaggedTensor, user_features: KeyedJaggedTensor) -> dict[str, Tensor]:
        items = self.ebc(item_features)
        users = self.ebc_user(user_features)
        rows = items.values().size(0)
        tiled = KeyedTensor(keys=users.keys(), length_per_key=users.length_per_key(),
                            values=users.values().tile(rows // users.values().size(0), 1))
        groups = KeyedTensor.regroup_as_dict([items, tiled], list(GROUPS.values()), list(GROUPS))
        score = self.wide(groups["wide"]).squeeze(-1) + self.deep(groups["deep"]).squeeze(-1)
        return {"score": torch.sigmoid(score), "user_weight": tiled.values().sum(-1)}


def build_grouped(dim: int = 8, seed: int = 0) -> GroupedRanker:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GroupedRanker(dim).eval()


def example_inputs(batch_size: int = 3, seed: int = 0) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """Item features of ``batch_size`` rows and one user (whose pooled row is tiled to every item row)."""
    gen = torch.Generator().manual_seed(seed)
    tag_len = torch.randint(1, 4, (batch_size,), generator=gen)
    items = KeyedJaggedTensor.from_lengths_sync(
        keys=ITEM_KEYS,
        values=torch.cat([torch.randint(0, 200, (batch_size,), generator=gen),
                          torch.randint(0, 50, (int(tag_len.sum()),), generator=gen)]),
        lengths=torch.cat([torch.ones(batch_size, dtype=torch.int64), tag_len]),
    )
    users = KeyedJaggedTensor.from_lengths_sync(keys=USER_KEYS, values=torch.randint(0, 100, (batch_size,), generator=gen),
                                                lengths=torch.ones(batch_size, dtype=torch.int64))
    return items, users
