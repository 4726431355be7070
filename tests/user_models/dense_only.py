"""A model with no embedding tables at all: per-user dense features into an MLP (quantizing its
embeddings must be refused)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class DenseOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, features: Tensor) -> dict[str, Tensor]:
        return {"ctr": torch.sigmoid(self.mlp(features).squeeze(-1))}


def build_dense_only() -> DenseOnly:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return DenseOnly().eval()
