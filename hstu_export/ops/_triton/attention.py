"""HSTU attention forward (full and cached/delta) as Triton kernels, registered as ``hstu_export::`` ops.

Math (DESIGN.md, "HSTU semantics"), per sequence of length n with t targets and c contextual tokens:
score(i, j) = SiLU(alpha * <q_i, k_j>) / S * valid(i, j), out_i = sum_j score(i, j) * v_j.

One program computes a BLOCK_M x Dv output tile of one (sequence, head). The key range it visits is
derived from the mask, so blocks the mask zeroes are never loaded:
  * range A = [lo, hi): history keys. hi stops at the diagonal (causal) and at the first target;
    lo starts at the window's lower edge when max_attn_len > 0.
  * the self term of target rows (a target sees the history and itself only) is added row by row,
    without a matrix product over the diagonal block.
Inside A, keys valid for every row of the tile run without any mask arithmetic; only the edge
chunks (window edge, diagonal, sequence end) evaluate the mask. ``block_skipping=False`` visits
every key block of the sequence with the mask instead (the benchmark's comparison point).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .configs import AttentionConfig, attention_config, dot_precision, next_power_of_2

__all__ = ["cached_hstu_mha_triton_fwd", "hstu_mha_triton_fwd"]


@triton.jit
def _silu_scaled(qk, alpha, FAST: tl.constexpr):
    """SiLU(alpha * qk)."""
    if FAST:
        # SiLU(x) = h + h * tanh(h) with h = x / 2: one MUFU op per element instead of exp + rcp.
        # tanh.approx.f32 has ~2^-11 relative error, below bf16/fp16 rounding of the scores.
        h = qk * (0.5 * alpha)
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [h], dtype=tl.float32, is_pure=True, pack=1
        )
        return h + h * t
    else:
        x = qk * alpha
        return x / (1.0 + tl.exp(-x))


@triton.jit
def _position(x, ctx_shift, m_pos):
    # p(x) = max(x - c + 1, 0) for c > 0 (ctx_shift = c - 1), else x; targets clamp to m.
    return tl.minimum(tl.maximum(x - ctx_shift, 0), m_pos)


@triton.jit
def _accumulate(
    acc,
    q,
    K_base,
    V_base,
    k_offs,
    v_offs,
    stride_kn,
    stride_vn,
    start_n,
    end_n,
    rows,
    row_pos,
    row_ctx,
    ctx_shift,
    m_pos,
    max_attn_len,
    alpha,
    offs_n,
    offs_dqk,
    offs_dv,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    FAST_SILU: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    cols = start_n + offs_n
    # Scalar 64-bit base per chunk plus loop-invariant 32-bit tile offsets.
    k_ptrs = K_base + tl.cast(start_n, tl.int64) * stride_kn + k_offs
    v_ptrs = V_base + tl.cast(start_n, tl.int64) * stride_vn + v_offs
    if MASKED:
        # Keys past end_n load as zeros: their score is SiLU(0) = 0 and their v row is 0.
        col_ok = cols < end_n
        kt = tl.load(k_ptrs, mask=col_ok[None, :] & (offs_dqk[:, None] < DQK), other=0.0)
    elif BLOCK_DQK != DQK:
        kt = tl.load(k_ptrs, mask=offs_dqk[:, None] < DQK, other=0.0)
    else:
        kt = tl.load(k_ptrs)
    if UPCAST_DOTS:
        kt = kt.to(tl.float32)
    s = _silu_scaled(tl.dot(q, kt, input_precision=DOT_PRECISION), alpha, FAST_SILU)
    if MASKED:
        if CAUSAL:
            col_pos = _position(cols, ctx_shift, m_pos)
            dist = row_pos[:, None] - col_pos[None, :]
            valid = (dist > 0) & ((dist <= max_attn_len) | (max_attn_len <= 0))
            valid = valid | (rows[:, None] == cols[None, :])
            valid = valid | (row_ctx[:, None] & (col_pos < m_pos)[None, :])
            s = tl.where(valid, s, 0.0)
        v = tl.load(v_ptrs, mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    elif BLOCK_DV != DV:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
    else:
        v = tl.load(v_ptrs)
    if UPCAST_DOTS:
        # Same rounding of the scores as the 16-bit product below, then an fp32 product.
        return tl.dot(s.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision=DOT_PRECISION)
    return tl.dot(s.to(v.dtype), v, acc, input_precision=DOT_PRECISION)


@triton.jit
def _hstu_attn_fwd(
    Q,
    K,
    V,
    Out,
    seq_offsets,
    num_targets,
    stride_qm,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_om,
    stride_oh,
    o_col0,
    alpha,
    scaling_seqlen,
    contextual_seq_len,
    max_attn_len,
    delta_size,
    H,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    IS_DELTA: tl.constexpr,
    SKIP: tl.constexpr,
    FAST_SILU: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Inductor passes Python floats as fp64 scalars; keep every product in fp32.
    alpha = tl.cast(alpha, tl.float32)
    # The scale's length is an integer argument (it may be a size read from the data, which the tracers
    # carry as a symbol), divided here rather than on the host.
    inv_scale = 1.0 / tl.cast(scaling_seqlen, tl.float32)
    pid_m = tl.program_id(0)
    num_m = tl.num_programs(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H

    seq_start = tl.load(seq_offsets + b)
    n = (tl.load(seq_offsets + b + 1) - seq_start).to(tl.int32)
    if IS_DELTA:
        q_count = delta_size  # rows of this sequence in delta_q
        q_row0 = b.to(tl.int64) * delta_size
        first_query = n - delta_size
    else:
        q_count = n
        q_row0 = seq_start
        first_query = 0
    if HAS_TARGETS:
        n_targets = tl.load(num_targets + b).to(tl.int32)
    else:
        n_targets = 0
    # Positions: context tokens share 0, history counts up, targets share m_pos.
    ctx_shift = tl.maximum(contextual_seq_len - 1, 0)
    hist_end = n - n_targets
    m_pos = hist_end - ctx_shift

    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    K_base = K + seq_start * stride_kn + h * stride_kh
    V_base = V + seq_start * stride_vn + h * stride_vh
    k_offs = offs_n[None, :] * stride_kn + offs_dqk[:, None]  # K^T tile [BLOCK_DQK, BLOCK_N]
    v_offs = offs_n[:, None] * stride_vn + offs_dv[None, :]  # V tile [BLOCK_N, BLOCK_DV]

    # Grid-stride over query blocks, the last (heaviest under a causal mask) first, so that a
    # sequence longer than the grid assumed is still computed in full.
    for start in range((num_m - 1 - pid_m) * BLOCK_M, q_count, num_m * BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        rows = first_query + offs_m  # index within the sequence
        row_in = offs_m < q_count
        row_ok = row_in & (rows >= 0)
        q_ptrs = Q + (q_row0 + offs_m)[:, None].to(tl.int64) * stride_qm + h * stride_qh + offs_dqk[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)
        if UPCAST_DOTS:
            q = q.to(tl.float32)
        row_pos = _position(rows, ctx_shift, m_pos)
        row_ctx = (row_pos == 0) & (contextual_seq_len > 0)

        m0 = tl.maximum(first_query + start, 0)
        m1 = tl.minimum(first_query + start + BLOCK_M, n)
        if CAUSAL:
            if SKIP:
                has_ctx_rows = m0 < contextual_seq_len
                # Range A: keys a row of this tile can see, the self term of targets aside.
                hi = tl.where(has_ctx_rows, hist_end, tl.minimum(m1, hist_end))
                lo_pos = _position(m0, ctx_shift, m_pos) - max_attn_len
                lo = tl.where((max_attn_len > 0) & (lo_pos > 0) & (~has_ctx_rows), lo_pos + ctx_shift, 0)
                # Keys valid for every row of the tile: strictly before the tile and before the
                # first target, and inside the window of the tile's last row.
                ulo_pos = _position(m1 - 1, ctx_shift, m_pos) - max_attn_len
                ulo = tl.where((max_attn_len > 0) & (ulo_pos > 0), ulo_pos + ctx_shift, 0)
                ulo = tl.minimum(tl.maximum(ulo, lo), hi)
                uhi = tl.minimum(tl.maximum(tl.minimum(m0, hist_end), ulo), hi)
                uhi = ulo + ((uhi - ulo) // BLOCK_N) * BLOCK_N
                self_lo = tl.maximum(m0, hi)
            else:
                lo = 0
                hi = n
                ulo = 0
                uhi = 0
                self_lo = m1
        else:
            # Every pair inside the sequence is valid: whole chunks need no mask, the tail does.
            lo = 0
            hi = n
            if SKIP:
                ulo = 0
                uhi = (n // BLOCK_N) * BLOCK_N
            else:
                ulo = 0
                uhi = 0
            self_lo = m1

        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        for start_n in range(ulo, uhi, BLOCK_N):
            acc = _accumulate(
                acc, q, K_base, V_base, k_offs, v_offs, stride_kn, stride_vn, start_n, uhi, rows, row_pos, row_ctx,
                ctx_shift, m_pos, max_attn_len, alpha, offs_n, offs_dqk, offs_dv,
                DQK, DV, BLOCK_DQK, BLOCK_DV, CAUSAL, False, FAST_SILU, UPCAST_DOTS, DOT_PRECISION,
            )  # fmt: skip
        # Edge chunks with the mask: [lo, ulo) then [uhi, hi), one loop over both.
        n_lo = tl.cdiv(ulo - lo, BLOCK_N)
        n_hi = tl.cdiv(hi - uhi, BLOCK_N)
        for it in range(0, n_lo + n_hi):
            in_lo = it < n_lo
            start_n = tl.where(in_lo, lo + it * BLOCK_N, uhi + (it - n_lo) * BLOCK_N)
            end_n = tl.where(in_lo, ulo, hi)
            acc = _accumulate(
                acc, q, K_base, V_base, k_offs, v_offs, stride_kn, stride_vn, start_n, end_n, rows, row_pos, row_ctx,
                ctx_shift, m_pos, max_attn_len, alpha, offs_n, offs_dqk, offs_dv,
                DQK, DV, BLOCK_DQK, BLOCK_DV, CAUSAL, True, FAST_SILU, UPCAST_DOTS, DOT_PRECISION,
            )  # fmt: skip
        if CAUSAL:
            if SKIP:
                # Target rows (and rows past range A) see themselves: add that term row by row.
                if self_lo < m1:
                    is_self = row_ok & (rows >= self_lo) & (rows < m1)
                    k_self = tl.load(
                        K_base + rows[:, None].to(tl.int64) * stride_kn + offs_dqk[None, :],
                        mask=is_self[:, None] & (offs_dqk[None, :] < DQK),
                        other=0.0,
                    )
                    v_self = tl.load(
                        V_base + rows[:, None].to(tl.int64) * stride_vn + offs_dv[None, :],
                        mask=is_self[:, None] & (offs_dv[None, :] < DV),
                        other=0.0,
                    )
                    qk_self = tl.sum(q.to(tl.float32) * k_self.to(tl.float32), axis=1)
                    s_self = _silu_scaled(qk_self, alpha, FAST_SILU)
                    acc += s_self[:, None] * v_self.to(tl.float32)

        acc = acc * inv_scale
        o_ptrs = Out + o_col0 + (q_row0 + offs_m)[:, None].to(tl.int64) * stride_om + h * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_in[:, None] & (offs_dv[None, :] < DV))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type == "cuda" and not _interpreting():
        return torch.cuda.get_device_capability(device)
    return None


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [L, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if seq_offsets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"seq_offsets must be int64 (or int32), got {seq_offsets.dtype}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_query_rows: int,
    max_query_len: int,
    delta_size: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    *,
    is_delta: bool,
    block_skipping: bool,
    config: AttentionConfig | None,
    traceable: bool,
    fast_silu: bool | None = None,
    out: torch.Tensor | None = None,
    out_col0: int = 0,
) -> torch.Tensor:
    """Launches the attention kernel. ``out`` (optional): a 2-D buffer [num_query_rows, W] whose
    columns [out_col0, out_col0 + H*Dv) receive the result (the gated op's concat buffer); it is
    passed whole, not as a view, so the tracers see one buffer that the kernel writes in place."""
    _check_inputs(q, k, v, seq_offsets)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    _, H, DQK = q.shape
    DV = v.shape[2]
    B = seq_offsets.shape[0] - 1
    if out is None:
        out = torch.empty((num_query_rows, H, DV), dtype=q.dtype, device=q.device)
    capability = _device_capability(q.device)
    cfg = config if config is not None else attention_config(capability, DQK, DV, q.dtype)
    if fast_silu is None:  # the tanh.approx SiLU: CUDA only, and for 16-bit inputs only
        fast_silu = capability is not None and q.dtype != torch.float32
    grid = (triton.cdiv(max_query_len, cfg.block_m), B * H)
    # Inside the ops, wrap_triton makes the launch visible to torch.export/Inductor; the eager-only
    # entry points launch directly (wrap_triton outside an op dispatches through a higher-order op,
    # tens of microseconds per call).
    kernel = wrap_triton(_hstu_attn_fwd) if traceable else _hstu_attn_fwd
    kernel[grid](
        q,
        k,
        v,
        out,
        seq_offsets,
        num_targets if num_targets is not None else seq_offsets,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        DV,  # head h starts at column out_col0 + h * Dv
        out_col0,
        float(alpha),
        scaling_seqlen,
        contextual_seq_len,
        max_attn_len,
        delta_size,
        H,
        DQK=DQK,
        DV=DV,
        BLOCK_DQK=max(next_power_of_2(DQK), 16),
        BLOCK_DV=max(next_power_of_2(DV), 16),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        CAUSAL=bool(causal),
        HAS_TARGETS=num_targets is not None,
        IS_DELTA=is_delta,
        SKIP=bool(block_skipping),
        FAST_SILU=fast_silu,
        # Triton's CPU interpreter multiplies 16-bit floats wrongly (3.7): it gets fp32 operands.
        UPCAST_DOTS=_interpreting() and q.dtype != torch.float32,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def hstu_mha_triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    *,
    block_skipping: bool = True,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """``hstu_export::hstu_mha_triton`` with the knobs the op hides (block skipping, a config override).

    Eager only (benchmarks, tests): torch.export and AOTInductor see the op, not this function.
    """
    return _launch_attention(
        q, k, v, seq_offsets, q.shape[0], max_seq_len, 0, scaling_seqlen, alpha, causal, num_targets,
        contextual_seq_len, max_attn_len, is_delta=False, block_skipping=block_skipping, config=config,
        traceable=False,
    )  # fmt: skip


def cached_hstu_mha_triton_fwd(
    delta_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    delta_size: int,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    *,
    block_skipping: bool = True,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """``hstu_export::cached_hstu_mha_triton`` with the knobs the op hides (eager only, as above)."""
    return _launch_attention(
        delta_q, k, v, seq_offsets, delta_q.shape[0], delta_size, delta_size, scaling_seqlen, alpha, True,
        num_targets, contextual_seq_len, max_attn_len, is_delta=True, block_skipping=block_skipping,
        config=config, traceable=False,
    )  # fmt: skip


@triton_op("hstu_export::hstu_mha_triton", mutates_args=())
def hstu_mha_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
) -> torch.Tensor:
    """HSTU attention on jagged q [L, H, Dqk], k [L, H, Dqk], v [L, H, Dv] -> [L, H, Dv]."""
    return _launch_attention(
        q, k, v, seq_offsets, q.shape[0], max_seq_len, 0, scaling_seqlen, alpha, causal, num_targets,
        contextual_seq_len, max_attn_len, is_delta=False, block_skipping=True, config=None, traceable=True,
    )  # fmt: skip


@triton_op("hstu_export::cached_hstu_mha_triton", mutates_args=())
def cached_hstu_mha_triton(
    delta_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    delta_size: int,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
) -> torch.Tensor:
    """Causal HSTU attention of the last ``delta_size`` tokens of each sequence against full k/v.

    delta_q: [B * delta_size, H, Dqk] (row b * delta_size + r is token n_b - delta_size + r).
    """
    return _launch_attention(
        delta_q, k, v, seq_offsets, delta_q.shape[0], delta_size, delta_size, scaling_seqlen, alpha, True,
        num_targets, contextual_seq_len, max_attn_len, is_delta=True, block_skipping=True, config=None,
        traceable=True,
    )  # fmt: skip
