"""The pooled ranker with a kernel switch, as TorchEasyRec's and generative-recommenders' models have:
with ``kernel="triton"`` (the default here, as in TorchEasyRec's configs) its dense code runs a Triton
kernel, which needs a GPU; ``kernel="pytorch"`` runs the same computation with PyTorch ops."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from user_models.pooled import PooledRanker


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


def scaled(x: Tensor, factor: float, kernel: str) -> Tensor:
    if kernel == "pytorch":
        return x * factor
    out = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), 64),)](x, out, x.numel(), factor, BLOCK=64)
    return out


class KernelRanker(PooledRanker):
    def __init__(self, dim: int = 8, kernel: str = "triton") -> None:
        super().__init__(dim)
        self.kernel = kernel

    def forward(self, sparse_features: KeyedJaggedTensor, dense_features: dict[str, Tensor]) -> dict[str, Tensor]:
        out = super().forward(sparse_features, dense_features)
        return {**out, "affinity": scaled(out["affinity"].contiguous(), 0.5, self.kernel)}


def build_kernel_ranker(kernel: str = "triton", seed: int = 0) -> KernelRanker:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return KernelRanker(kernel=kernel).eval()
