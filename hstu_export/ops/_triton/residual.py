"""``hstu_export::add_layer_norm_triton``: an STU layer's residual sum and the next layer's input norm, in one
kernel.

x [L, D], y [L, D] (the output projection's product) -> (s = x + y, LN(s)), both in x's dtype; the norm is
computed in fp32 on s as rounded (as ``layer_norm_fp32(x + y)`` is), over D, with its weight and bias.

Written as ``x + y @ W`` and normed after, Inductor gives the sum to cuBLAS as the bias of an addmm, and
ATen's addmm first copies that bias into the output (a device copy a layer), while the norm is a kernel of
its own. Here the product is a plain mm and this kernel writes both the sum and its norm: the copy is
gone, at the cost of rounding the product to x's dtype before the sum (the addmm adds in fp32). The KV
cache's delta program uses it on the Triton path (docs/KV_CACHE.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .attention import _device_capability
from .configs import gate_config
from .rows import centred_rstd, row_block

__all__ = ["add_layer_norm_triton", "add_layer_norm_triton_fwd"]


@triton.jit
def _add_layer_norm_kernel(X, Y, W, Bias, Sum, Normed, num_rows, stride_x, stride_y, eps, WIDTH: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    eps = tl.cast(eps, tl.float32)
    rows64, cols, col_ok, ok = row_block(num_rows, WIDTH, BLOCK_ROWS, BLOCK_D)
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = tl.load(Y + rows64 * stride_y + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = (x + y).to(Sum.dtype.element_ty)
    tl.store(Sum + rows64 * WIDTH + cols[None, :], s, mask=ok)
    centred, rstd = centred_rstd(s.to(tl.float32), ok, eps, WIDTH)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    normed = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Normed + rows64 * WIDTH + cols[None, :], normed.to(Normed.dtype.element_ty), mask=ok)


def add_layer_norm_triton_fwd(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                              eps: float, *, traceable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x + y, LN(x + y)) for x, y [L, D] with unit stride along D (``traceable``: launched inside the op,
    so that torch.export and Inductor see the kernel)."""
    if x.dim() != 2 or x.shape != y.shape or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(f"add_layer_norm needs x and y of one shape [L, D], rows contiguous; got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    num_rows, width = x.shape
    total = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    normed = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    cfg = gate_config(_device_capability(x.device), width)
    kernel = wrap_triton(_add_layer_norm_kernel) if traceable else _add_layer_norm_kernel
    kernel[(triton.cdiv(num_rows, cfg.block_rows),)](
        x, y, weight, bias, total, normed, num_rows, x.stride(0), y.stride(0), float(eps), WIDTH=width,
        BLOCK_ROWS=cfg.block_rows, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
    )  # fmt: skip
    return total, normed


@triton_op("hstu_export::add_layer_norm_triton", mutates_args=())
def add_layer_norm_triton(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x + y, LN(x + y)) as an op an exported program calls (AOTInductor compiles the kernel in)."""
    return add_layer_norm_triton_fwd(x, y, weight, bias, eps, traceable=True)
