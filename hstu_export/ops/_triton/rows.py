"""Row-block helpers shared by the kernels that normalise rows of a [L, D] tensor (gated.py, paged.py,
residual.py).

They take no pointers: torch's analysis of a user Triton kernel (which Inductor uses to decide what a
kernel writes, and so what to copy before it) takes a pointer passed to a helper whose result reaches a
store for written (docs/KV_CACHE.md, "The delta program").
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_block(num_rows, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows (int64, [BLOCK_ROWS, 1]), the columns, which columns are within WIDTH, and which
    elements are within both."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < WIDTH
    ok = (rows < num_rows)[:, None] & col_ok[None, :]
    return rows.to(tl.int64)[:, None], cols, col_ok, ok


@triton.jit
def centred_rstd(v, ok, eps, WIDTH: tl.constexpr):
    """Each row of fp32 ``v`` less its mean over WIDTH (0 outside ``ok``), and 1 / its standard deviation."""
    mean = tl.sum(v, axis=1) / WIDTH
    centred = tl.where(ok, v - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / WIDTH + eps)
    return centred, rstd


@triton.jit
def stu_gate_rows(u, a, w, b, ok, eps, WIDTH: tl.constexpr, DTYPE: tl.constexpr):
    """The STU gate's outer thirds from fp32 rows ``u`` and ``a`` (the norm's fp32 weight ``w`` and bias ``b``
    over the columns): SiLU(u) and SiLU(u) * LN(a), each rounded to DTYPE as the unfused eager code rounds them
    (SiLU(u) and LN(a) before their product, which is rounded again)."""
    silu_u = (u / (1.0 + tl.exp(-u))).to(DTYPE)
    centred, rstd = centred_rstd(a, ok, eps, WIDTH)
    normed = (centred * rstd[:, None] * w[None, :] + b[None, :]).to(DTYPE)
    return silu_u, (silu_u.to(tl.float32) * normed.to(tl.float32)).to(DTYPE)
