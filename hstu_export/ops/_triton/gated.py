"""``hstu_export::hstu_mha_gated_triton``: the STU layer between its two projections, as two kernels.

uvqk [L, H*(2*Dv + 2*Dqk)] (columns u, v, q, k) -> out [L, 3*H*Dv] = concat(SiLU(u), a, SiLU(u)*LN(a)).

1. The attention kernel reads q, k, v as strided views of uvqk and writes a = hstu_mha(q, k, v)
   straight into columns [H*Dv, 2*H*Dv) of ``out``.
2. The gate kernel reads u and a row by row, normalises a over its H*Dv features in fp32 and
   writes SiLU(u) and SiLU(u)*LN(a) into the outer thirds.

Unfused, Inductor's one SiLU/layernorm/mul/concat kernel writes all three thirds, copying the
attention output (a separate extern buffer) into the concat: one extra write of L x H*Dv elements per
layer (the gate kernel runs at the memory roofline: docs/PERF.md, "The dlrmv3 dense stack on an H100").
Rounding follows the unfused eager code: SiLU(u) and LN(a) are rounded to the input dtype before their
product, which is rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .attention import _device_capability, _launch_attention
from .configs import AttentionConfig, gate_config
from .rows import row_block, stu_gate_rows

__all__ = ["hstu_mha_gated_triton_fwd"]


@triton.jit
def _stu_gate_kernel(
    UVQK,
    Out,
    W,
    Bias,
    num_rows,
    stride_u,
    stride_o,
    eps,
    WIDTH: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    eps = tl.cast(eps, tl.float32)
    rows64, cols, col_ok, ok = row_block(num_rows, WIDTH, BLOCK_ROWS, BLOCK_D)
    u = tl.load(UVQK + rows64 * stride_u + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    a = tl.load(Out + rows64 * stride_o + WIDTH + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    silu_u, gated = stu_gate_rows(u, a, w, b, ok, eps, WIDTH, Out.dtype.element_ty)
    tl.store(Out + rows64 * stride_o + cols[None, :], silu_u, mask=ok)
    tl.store(Out + rows64 * stride_o + 2 * WIDTH + cols[None, :], gated, mask=ok)


def _launch_gated(
    uvqk: torch.Tensor,
    seq_offsets: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    num_heads: int,
    attention_dim: int,
    linear_dim: int,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    eps: float,
    *,
    block_skipping: bool,
    config: AttentionConfig | None,
    traceable: bool,
) -> torch.Tensor:
    h, dqk, dv = num_heads, attention_dim, linear_dim
    width = h * dv
    if uvqk.dim() != 2 or uvqk.shape[1] != 2 * width + 2 * h * dqk:
        raise ValueError(
            f"uvqk must be [L, H*(2*Dv + 2*Dqk)] = [L, {2 * width + 2 * h * dqk}] for H={h}, Dqk={dqk}, "
            f"Dv={dv}; got {tuple(uvqk.shape)}"
        )
    if uvqk.stride(1) != 1:
        uvqk = uvqk.contiguous()
    num_rows = uvqk.shape[0]
    v = uvqk[:, width : 2 * width].view(num_rows, h, dv)
    q = uvqk[:, 2 * width : 2 * width + h * dqk].view(num_rows, h, dqk)
    k = uvqk[:, 2 * width + h * dqk :].view(num_rows, h, dqk)
    out = torch.empty((num_rows, 3 * width), dtype=uvqk.dtype, device=uvqk.device)
    _launch_attention(
        q, k, v, seq_offsets, num_rows, max_seq_len, 0, scaling_seqlen, alpha, causal, num_targets,
        contextual_seq_len, max_attn_len, is_delta=False, block_skipping=block_skipping, config=config,
        traceable=traceable, out=out, out_col0=width,
    )  # fmt: skip
    cfg = gate_config(_device_capability(uvqk.device), width)
    kernel = wrap_triton(_stu_gate_kernel) if traceable else _stu_gate_kernel
    kernel[(triton.cdiv(num_rows, cfg.block_rows),)](
        uvqk,
        out,
        norm_weight,
        norm_bias,
        num_rows,
        uvqk.stride(0),
        out.stride(0),
        float(eps),
        WIDTH=width,
        BLOCK_ROWS=cfg.block_rows,
        BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps,
    )
    return out


def hstu_mha_gated_triton_fwd(
    uvqk: torch.Tensor,
    seq_offsets: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    num_heads: int,
    attention_dim: int,
    linear_dim: int,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    eps: float = 1e-6,
    *,
    block_skipping: bool = True,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """``hstu_export::hstu_mha_gated_triton`` with the knobs the op hides (eager only: benchmarks, tests)."""
    return _launch_gated(
        uvqk, seq_offsets, norm_weight, norm_bias, num_heads, attention_dim, linear_dim, max_seq_len,
        scaling_seqlen, alpha, causal, num_targets, contextual_seq_len, max_attn_len, eps,
        block_skipping=block_skipping, config=config, traceable=False,
    )  # fmt: skip


@triton_op("hstu_export::hstu_mha_gated_triton", mutates_args=())
def hstu_mha_gated_triton(
    uvqk: torch.Tensor,
    seq_offsets: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    num_heads: int,
    attention_dim: int,
    linear_dim: int,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    eps: float,
) -> torch.Tensor:
    """concat(SiLU(u), a, SiLU(u) * LN(a)) of uvqk [L, H*(2*Dv + 2*Dqk)] -> [L, 3*H*Dv]."""
    return _launch_gated(
        uvqk, seq_offsets, norm_weight, norm_bias, num_heads, attention_dim, linear_dim, max_seq_len,
        scaling_seqlen, alpha, causal, num_targets, contextual_seq_len, max_attn_len, eps,
        block_skipping=True, config=None, traceable=True,
    )  # fmt: skip
