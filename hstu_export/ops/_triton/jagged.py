"""Jagged <-> padded conversions and 2-D jagged concat/split as Triton kernels (``hstu_export::`` ops).

Grids depend only on shapes (and on ``max_len`` / the dense tensor's N), never on the offsets'
values, so the ops trace under torch.export without data-dependent sizes.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .configs import JaggedConfig, jagged_config

__all__: list[str] = []


@triton.jit
def _jagged_to_padded_dense_kernel(
    values,
    offsets,
    out,
    L,
    max_len,
    D,
    stride_v,
    padding_value,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets + b)
    n = tl.load(offsets + b + 1) - start
    col_ok = cols < D
    # Rows past L are never read, even with offsets that disagree with values (Inductor runs the
    # kernel on all-zero offsets while compiling).
    in_seq = (rows < n) & (start + rows < L)
    src = values + (start + rows)[:, None] * stride_v + cols[None, :]
    x = tl.load(src, mask=in_seq[:, None] & col_ok[None, :], other=0.0)
    # The padding is cast once to the values' dtype: exact for integer values too.
    x = tl.where(in_seq[:, None], x, tl.cast(padding_value, out.dtype.element_ty))
    dst = out + (b.to(tl.int64) * max_len + rows)[:, None] * D + cols[None, :]
    tl.store(dst, x, mask=(rows < max_len)[:, None] & col_ok[None, :])


@triton.jit
def _dense_to_jagged_kernel(
    dense,
    offsets,
    out,
    L,
    N,
    D,
    stride_db,
    stride_dn,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    start = tl.load(offsets + b)
    n = (tl.load(offsets + b + 1) - start).to(tl.int32)
    step = tl.num_programs(0) * BLOCK_ROWS
    # Grid-stride over the sequence: rows past the dense tensor's N (a sequence longer than the
    # padded length) come out as zeros, as in fbgemm's dense_to_jagged.
    for r0 in range(tl.program_id(0) * BLOCK_ROWS, n, step):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        src = dense + b.to(tl.int64) * stride_db + rows[:, None].to(tl.int64) * stride_dn + cols[None, :]
        x = tl.load(src, mask=(rows < N)[:, None] & col_ok[None, :], other=0.0)
        dst = out + (start + rows)[:, None] * D + cols[None, :]
        tl.store(dst, x, mask=((rows < n) & (start + rows < L))[:, None] & col_ok[None, :])


@triton.jit
def _concat_split_2d_jagged_kernel(
    joined,
    left,
    right,
    offsets_left,
    offsets_right,
    B,
    total_rows,
    rows_left,
    rows_right,
    D,
    stride_joined,
    stride_left,
    stride_right,
    SPLIT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per BLOCK_ROWS rows of the joined tensor (per sequence: left rows, then right).
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < total_rows
    col_ok = cols < D
    rows64 = rows.to(tl.int64)
    # Binary search for each row's sequence: the last b with joined_offset[b] <= row, where
    # joined_offset[b] = offsets_left[b] + offsets_right[b].
    # ceil(log2(B)) steps suffice; extra steps leave lo == hi unchanged, so float rounding of
    # the log only ever adds a harmless step.
    n_iter = tl.max(tl.log2(tl.zeros([BLOCK_ROWS], dtype=tl.float32) + B).to(tl.int32), axis=0) + 2
    lo = tl.zeros([BLOCK_ROWS], dtype=tl.int64)
    hi = lo + (B - 1)
    for _ in range(n_iter):
        mid = (lo + hi + 1) // 2
        off = tl.load(offsets_left + mid) + tl.load(offsets_right + mid)
        go_right = off <= rows64
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    start_l = tl.load(offsets_left + lo)
    start_r = tl.load(offsets_right + lo)
    n_l = tl.load(offsets_left + lo + 1) - start_l
    k = rows64 - start_l - start_r  # position within the joined sequence
    is_left = k < n_l
    left_row = start_l + k
    right_row = start_r + k - n_l
    # Bounds on the source/destination rows keep offsets that disagree with the tensors (Inductor
    # runs the kernel on all-zero offsets while compiling) from touching memory out of range.
    ok_l = row_ok & is_left & (left_row >= 0) & (left_row < rows_left)
    ok_r = row_ok & ~is_left & (right_row >= 0) & (right_row < rows_right)
    mask_l = ok_l[:, None] & col_ok[None, :]
    mask_r = ok_r[:, None] & col_ok[None, :]
    joined_ptrs = joined + rows64[:, None] * stride_joined + cols[None, :]
    left_ptrs = left + left_row[:, None] * stride_left + cols[None, :]
    right_ptrs = right + right_row[:, None] * stride_right + cols[None, :]
    if SPLIT:
        x = tl.load(joined_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        tl.store(left_ptrs, x, mask=mask_l)
        tl.store(right_ptrs, x, mask=mask_r)
    else:
        x_l = tl.load(left_ptrs, mask=mask_l, other=0.0)
        x_r = tl.load(right_ptrs, mask=mask_r, other=0.0)
        tl.store(joined_ptrs, tl.where(is_left[:, None], x_l, x_r), mask=row_ok[:, None] & col_ok[None, :])


def _config(x: torch.Tensor) -> JaggedConfig:
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return jagged_config(
        None if x.device.type != "cuda" or interpreting else torch.cuda.get_device_capability(x.device)
    )


def _as_2d_rows(values: torch.Tensor, name: str, leading: int = 1) -> torch.Tensor:
    """[*lead, *rest] -> [*lead, prod(rest)] with a unit stride on the last dim (rest may be empty)."""
    if values.dim() < leading:
        raise ValueError(f"{name} must have at least {leading} dims, got shape {tuple(values.shape)}")
    rows = values.reshape(*values.shape[:leading], math.prod(values.shape[leading:]))
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _block_d(D: int, cfg: JaggedConfig) -> int:
    return min(cfg.block_d, max(triton.next_power_of_2(D), 16))


@triton_op("hstu_export::jagged_to_padded_dense_triton", mutates_args=())
def jagged_to_padded_dense_triton(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float
) -> torch.Tensor:
    """values [L, *rest] with offsets [B+1] -> [B, max_len, *rest]; rows past a sequence's end =
    padding, sequences longer than max_len are truncated (fbgemm semantics)."""
    rest = values.shape[1:]
    values = _as_2d_rows(values, "values")
    B = offsets.shape[0] - 1
    D = values.shape[1]
    out = torch.empty((B, max_len, D), dtype=values.dtype, device=values.device)
    cfg = _config(values)
    block_d = _block_d(D, cfg)
    # sym_max: max_len may be a size read from the data (the model's own .max().item()), a symbol when traced.
    grid = (torch.sym_max(triton.cdiv(max_len, cfg.block_rows), 1), B, triton.cdiv(D, block_d))
    wrap_triton(_jagged_to_padded_dense_kernel)[grid](
        values, offsets, out, values.shape[0], max_len, D, values.stride(0), float(padding_value),
        BLOCK_ROWS=cfg.block_rows, BLOCK_D=block_d, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out.view(B, max_len, *rest)


@triton_op("hstu_export::dense_to_jagged_triton", mutates_args=())
def dense_to_jagged_triton(dense: torch.Tensor, offsets: torch.Tensor, total_len: int | None) -> torch.Tensor:
    """dense [B, N, *rest] -> values [L, *rest] (L = total_len, else offsets[-1], a device sync).

    Rows of a sequence past N come out as zeros. Pass ``total_len`` when exporting: without it the
    output size depends on data.
    """
    rest = dense.shape[2:]
    dense = _as_2d_rows(dense, "dense", leading=2)
    B, N, D = dense.shape
    L = int(offsets[-1].item()) if total_len is None else total_len
    out = torch.empty((L, D), dtype=dense.dtype, device=dense.device)
    cfg = _config(dense)
    block_d = _block_d(D, cfg)
    grid = (torch.sym_max(triton.cdiv(N, cfg.block_rows), 1), B, triton.cdiv(D, block_d))
    wrap_triton(_dense_to_jagged_kernel)[grid](
        dense, offsets, out, L, N, D, dense.stride(0), dense.stride(1),
        BLOCK_ROWS=cfg.block_rows, BLOCK_D=block_d, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out.view(L, *rest)


@triton_op("hstu_export::concat_2D_jagged_triton", mutates_args=())
def concat_2D_jagged_triton(
    values_left: torch.Tensor,
    offsets_left: torch.Tensor,
    values_right: torch.Tensor,
    offsets_right: torch.Tensor,
) -> torch.Tensor:
    """Per sequence b: rows of left[b] then rows of right[b]: [La, *rest], [Lb, *rest] -> [La + Lb, *rest]."""
    rest = values_left.shape[1:]
    if values_right.shape[1:] != rest or values_left.dtype != values_right.dtype:
        raise ValueError(
            f"left and right values must share D and dtype, got {tuple(values_left.shape)} {values_left.dtype} "
            f"and {tuple(values_right.shape)} {values_right.dtype}"
        )
    values_left = _as_2d_rows(values_left, "values_left")
    values_right = _as_2d_rows(values_right, "values_right")
    total = values_left.shape[0] + values_right.shape[0]
    D = values_left.shape[1]
    out = torch.empty((total, D), dtype=values_left.dtype, device=values_left.device)
    _launch_concat_split(out, values_left, values_right, offsets_left, offsets_right, split=False)
    return out.view(total, *rest)


@triton_op("hstu_export::split_2D_jagged_triton", mutates_args=())
def split_2D_jagged_triton(
    values: torch.Tensor,
    offsets_left: torch.Tensor,
    offsets_right: torch.Tensor,
    total_len_left: int,
    total_len_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of concat_2D_jagged: values [La + Lb, *rest] -> (left [La, *rest], right [Lb, *rest])."""
    rest = values.shape[1:]
    values = _as_2d_rows(values, "values")
    D = values.shape[1]
    left = torch.empty((total_len_left, D), dtype=values.dtype, device=values.device)
    right = torch.empty((total_len_right, D), dtype=values.dtype, device=values.device)
    _launch_concat_split(values, left, right, offsets_left, offsets_right, split=True)
    return left.view(total_len_left, *rest), right.view(total_len_right, *rest)


def _launch_concat_split(
    joined: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    offsets_left: torch.Tensor,
    offsets_right: torch.Tensor,
    *,
    split: bool,
) -> None:
    B = offsets_left.shape[0] - 1
    total, D = joined.shape
    cfg = _config(joined)
    block_d = _block_d(D, cfg)
    grid = (torch.sym_max(triton.cdiv(total, cfg.block_rows), 1), triton.cdiv(D, block_d))
    wrap_triton(_concat_split_2d_jagged_kernel)[grid](
        joined, left, right, offsets_left, offsets_right, B, total, left.shape[0], right.shape[0], D,
        joined.stride(0), left.stride(0), right.stride(0),
        SPLIT=split, BLOCK_ROWS=cfg.block_rows, BLOCK_D=block_d, num_warps=cfg.num_warps,
    )  # fmt: skip
