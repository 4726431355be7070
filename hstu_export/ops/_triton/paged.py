"""Delta HSTU attention against a paged K/V cache (layout: hstu_export/ops/paged.py), split over keys.

A request's new tokens are few (hundreds per user) while the keys are many (thousands), so one
program per query block leaves most SMs idle at small batches. Each program here takes a query block
of one (user, head) and one slice of the keys that block sees (its own range cut into equal runs of
whole key blocks, so that the slices are balanced whatever the user's length): HSTU attention has no
softmax, so the slices' partial sums add up (no running max or rescaling as in flash-decoding). With
one slice the program writes the result; with several, fp32 partials go to a workspace that a second
kernel sums in a fixed order (deterministic). The slice count is chosen per call from the request's size
(:func:`split_count`), in an exported program too: it is arithmetic on the symbolic sizes, and the
summing kernel's grid is empty when there is one slice.

The grid's first axis runs over every user's query blocks back to back (a program finds its user from
the query offsets), so a request of users with few new tokens launches no idle programs whatever the
longest user's count.

Cached keys are read straight from the cache pages through the page table (no gather copy; a key
block never straddles a page), the request's own keys from ``k_new``/``v_new``. Given a layer of the
whole pool (``layer``), the kernel also stores the new non-target tokens' K/V in their pages: the program
of the last slice of each query block writes the block's own rows for its head as it finishes (the last
slice is often the shortest, and slice 0 adds the targets' self terms), so a delta run needs no scatter
kernels of its own. No program reads what another writes: pages are read for the cached tokens only,
writes go after them (the pool's scratch page, where tokens that are not kept go, is never read).
Target rows add their self term, in slice 0 only.

A model's last layer needs its targets' rows only (the heads read nothing else): launched for them
(``target_rows``), a user's blocks compute its targets, and block j stores its other new rows
[j * BLOCK_M, (j + 1) * BLOCK_M) (the user has as many blocks as the longer of the two needs); the result's rows
are the targets', user by user.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .attention import _device_capability, _position, _silu_scaled
from .configs import AttentionConfig, attention_config, dot_precision, gate_config, next_power_of_2
from .rows import row_block, stu_gate_rows

__all__ = [
    "paged_attention_inputs_triton",
    "paged_hstu_mha_gated_store_triton",
    "paged_hstu_mha_gated_triton_fwd",
    "paged_hstu_mha_store_triton",
    "paged_hstu_mha_triton_fwd",
    "query_blocks",
    "split_count",
]

# Programs wanted in flight: about two waves of an H100's 132 SMs.
_SMS = 132
_TARGET_PROGRAMS = 2 * _SMS
_MIN_KEYS_PER_SPLIT = 256
_MIN_KEYS_FOR_TWO = 1024  # keys a slice keeps at least when the query blocks already give every SM a program
_USER_CHUNK = 64  # users scanned at once when a program looks for its user
_SUM_BLOCK = 1024
_TABLE_BLOCK = 1024  # page table entries a program clamps


@triton.jit
def _valid(rows, cols, row_pos, row_ctx, ctx_shift, m_pos, max_attn_len):
    """The HSTU mask (DESIGN.md) of a tile: rows [BLOCK_M] against key columns [BLOCK_N]."""
    col_pos = _position(cols, ctx_shift, m_pos)
    dist = row_pos[:, None] - col_pos[None, :]
    valid = (dist > 0) & ((dist <= max_attn_len) | (max_attn_len <= 0))
    valid = valid | (rows[:, None] == cols[None, :])
    return valid | (row_ctx[:, None] & (col_pos < m_pos)[None, :])


@triton.jit
def _dot_acc(acc, s, v, UPCAST_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if UPCAST_DOTS:  # the interpreter's 16-bit products are wrong: same rounding of s, fp32 product
        return tl.dot(s.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision=DOT_PRECISION)
    return tl.dot(s.to(v.dtype), v, acc, input_precision=DOT_PRECISION)


@triton.jit
def _masked_block(acc, q, k_ptrs, v_ptrs, cols, end, rows, row_pos, row_ctx, ctx_shift, m_pos, max_attn_len, alpha,
                  offs_dqk, offs_dv, DQK: tl.constexpr, DV: tl.constexpr, FAST_SILU: tl.constexpr,
                  UPCAST_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One key block (columns ``cols``, those >= ``end`` left out) under the mask."""
    col_ok = cols < end
    kt = tl.load(k_ptrs, mask=col_ok[None, :] & (offs_dqk[:, None] < DQK), other=0.0)
    if UPCAST_DOTS:
        kt = kt.to(tl.float32)
    s = _silu_scaled(tl.dot(q, kt, input_precision=DOT_PRECISION), alpha, FAST_SILU)
    s = tl.where(_valid(rows, cols, row_pos, row_ctx, ctx_shift, m_pos, max_attn_len) & col_ok[None, :], s, 0.0)
    v = tl.load(v_ptrs, mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    return _dot_acc(acc, s, v, UPCAST_DOTS, DOT_PRECISION)


@triton.jit
def _attention_inputs(cached, new_hist, cand_len, table, q_offsets, seq_lens, num_targets, pages,
                      num_users, table_numel, width, stride_table, contextual_seq_len, total_new, key_limit,
                      last_page, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """ops/paged.py's paged_attention_inputs_reference: program 0 the per-user counts and offsets (a running
    sum over chunks of users), the others a block of the page table each."""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(q_offsets, tl.zeros([], dtype=tl.int64))
        carry = tl.zeros([], dtype=tl.int64)  # new tokens of the users before the chunk
        for c0 in range(0, num_users, CHUNK):
            idx = c0 + tl.arange(0, CHUNK)
            ok = idx < num_users
            c = tl.maximum(tl.load(cached + idx, mask=ok, other=0).to(tl.int64), 0)
            hist = tl.maximum(tl.load(new_hist + idx, mask=ok, other=0).to(tl.int64), 0)
            cand = tl.maximum(tl.load(cand_len + idx, mask=ok, other=0).to(tl.int64), 0)
            new_len = tl.where(ok, tl.where(c == 0, contextual_seq_len, 0) + hist + cand, 0)
            end = carry + tl.cumsum(new_len, 0)
            end_in = tl.minimum(tl.maximum(end, 0), total_new)
            start_in = tl.minimum(tl.maximum(end - new_len, 0), total_new)
            tl.store(q_offsets + idx + 1, end_in, mask=ok)
            tl.store(seq_lens + idx, tl.minimum(c, key_limit) + end_in - start_in, mask=ok)
            tl.store(num_targets + idx, cand, mask=ok)
            carry += tl.sum(new_len, 0)
    else:
        offs = (pid - 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < table_numel
        page = tl.load(table + (offs // width) * stride_table + offs % width, mask=ok, other=0)
        tl.store(pages + offs, tl.minimum(tl.maximum(page, 0), last_page).to(pages.dtype.element_ty), mask=ok)


@triton.jit
def _sum_slices(Work, Out, numel, slices, stride_ws, inv_scale, BLOCK: tl.constexpr):
    """Out = (sum of the slices' fp32 partials, in slice order) / scale."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, slices):
        acc += tl.load(Work + tl.cast(s, tl.int64) * stride_ws + offs, mask=ok, other=0.0)
    tl.store(Out + offs, (acc * tl.cast(inv_scale, tl.float32)).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _paged_attn_fwd(
    Q, KN, VN, KP, VP, Out, Work,
    q_offsets, seq_lens, num_targets, page_table,
    stride_qm, stride_qh, stride_knm, stride_knh, stride_vnm, stride_vnh,
    stride_kpl, stride_kpp, stride_kpn, stride_kph, stride_vpl, stride_vpp, stride_vpn, stride_vph,
    stride_pt, stride_om, stride_oh, out_col0, stride_ws, stride_wm, out_rows,
    alpha, inv_scale, contextual_seq_len, max_attn_len, num_users, layer, table_width,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, CHUNK: tl.constexpr,
    FAST_SILU: tl.constexpr, UPCAST_DOTS: tl.constexpr, PREFETCH: tl.constexpr, STORE: tl.constexpr,
    TARGETS_ONLY: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # The layer's pages (0 when the caller passed one layer's).
    KP += tl.cast(layer, tl.int64) * stride_kpl
    VP += tl.cast(layer, tl.int64) * stride_vpl
    alpha = tl.cast(alpha, tl.float32)
    inv_scale = tl.cast(inv_scale, tl.float32)
    h = tl.program_id(1)
    pid_s = tl.program_id(2)
    # (user, first row among the user's new tokens) of this query block, every user's blocks numbered back to
    # back; the user is num_users past the last block. Written here, not in a helper: torch's analysis of a
    # user kernel (Inductor's guide to what the kernel writes) takes every argument of a called function whose
    # result reaches a store for written, and Inductor then copies q_offsets before each layer's launch.
    # TARGETS_ONLY: a user's blocks compute its targets only (the result's rows are the targets', user by user:
    # ``out_rows`` of them), and block j stores the user's new non-target rows [j * BLOCK_M, (j + 1) * BLOCK_M):
    # a user has as many blocks as the longer of the two needs.
    blk = tl.program_id(0)
    b = 0
    before = 0  # blocks of the users before b
    seen = 0  # blocks of the users scanned so far
    targets_before = 0  # with TARGETS_ONLY: target rows of the users before b
    for c0 in range(0, num_users, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        ok = idx < num_users
        first_row = tl.load(q_offsets + idx, mask=ok, other=0)
        end_row = tl.load(q_offsets + idx + 1, mask=ok, other=0)
        if TARGETS_ONLY:
            targets = tl.minimum(tl.maximum(tl.load(num_targets + idx, mask=ok, other=0), 0),
                                 end_row - first_row).to(tl.int32)
            others = (end_row - first_row - targets).to(tl.int32)
            blocks = tl.where(ok, tl.maximum(targets + BLOCK_M - 1, others + BLOCK_M - 1) // BLOCK_M, 0).to(tl.int32)
        else:
            blocks = tl.where(ok, (end_row - first_row + BLOCK_M - 1) // BLOCK_M, 0).to(tl.int32)
        done = ok & (seen + tl.cumsum(blocks, 0) <= blk)  # users whose blocks all come before blk
        b += tl.sum(done.to(tl.int32))
        before += tl.sum(tl.where(done, blocks, 0))
        seen += tl.sum(blocks)
        if TARGETS_ONLY:
            targets_before += tl.sum(tl.where(done, targets, 0))
    start = (blk - before) * BLOCK_M
    if b < num_users:
        q_start = tl.load(q_offsets + b)
        q_len = (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
        n = tl.load(seq_lens + b).to(tl.int32)
        hist_end = n - tl.load(num_targets + b).to(tl.int32)
        if TARGETS_ONLY:
            # Rows before the targets are new non-target rows (stored below, not computed).
            user_targets = tl.minimum(tl.maximum(n - hist_end, 0), q_len)
            start += q_len - user_targets
        first_query = n - q_len
        ctx_shift = tl.maximum(contextual_seq_len - 1, 0)
        m_pos = hist_end - ctx_shift
        offs_m = start + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_dqk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < q_len
        rows = first_query + offs_m
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qm + h * stride_qh + offs_dqk[None, :],
                    mask=row_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)  # fmt: skip
        if UPCAST_DOTS:
            q = q.to(tl.float32)
        row_pos = _position(rows, ctx_shift, m_pos)
        row_ctx = (row_pos == 0) & (contextual_seq_len > 0)

        # Keys a row of the tile can see in the pages: [lo, hi), then this program's slice of them.
        m0 = first_query + start
        m1 = tl.minimum(m0 + BLOCK_M, n)
        has_ctx_rows = m0 < contextual_seq_len
        hi = tl.where(has_ctx_rows, hist_end, tl.minimum(m1, hist_end))
        lo_pos = _position(m0, ctx_shift, m_pos) - max_attn_len
        lo = tl.where((max_attn_len > 0) & (lo_pos > 0) & (~has_ctx_rows), lo_pos + ctx_shift, 0)
        if TARGETS_ONLY:  # no key for a block past the user's targets (it only stores)
            hi = tl.where(start < q_len, hi, 0)
            lo = tl.where(start < q_len, lo, 0)
        # This program's slice: an equal share of the range's key blocks (none when the range is empty).
        lo_block = lo // BLOCK_N
        per_slice = (((hi + BLOCK_N - 1) // BLOCK_N) - lo_block + tl.num_programs(2) - 1) // tl.num_programs(2)
        s_lo = (lo_block + pid_s * per_slice) * BLOCK_N
        s_hi = tl.minimum(s_lo + per_slice * BLOCK_N, hi)

        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        # Cached keys (before first_query), from the pages: a block of BLOCK_N keys lies in one page (the
        # slice starts on a block boundary and BLOCK_N divides the page size). Without a window or
        # contextual rows in the tile every cached key is valid for every row.
        pt_row = page_table + b.to(tl.int64) * stride_pt
        p_hi = tl.minimum(s_hi, first_query)
        full_rows = (max_attn_len <= 0) & (~has_ctx_rows)
        # Whole blocks valid for every row run without any mask (as the full kernel's interior does);
        # the rest (the last partial block, or every block under a window or with contextual rows) with it.
        p_mid = tl.where(full_rows, s_lo + (tl.maximum(p_hi - s_lo, 0) // BLOCK_N) * BLOCK_N, s_lo)
        kp_offs = offs_n[None, :] * stride_kpn + offs_dqk[:, None]
        vp_offs = offs_n[:, None] * stride_vpn + offs_dv[None, :]
        # The next block's page is read one block ahead, so that the K/V loads do not wait on the page table.
        last_page = tl.maximum(p_mid - 1, 0) // PAGE
        page = tl.load(pt_row + tl.minimum(s_lo // PAGE, last_page)).to(tl.int64)
        for start_n in range(s_lo, p_mid, BLOCK_N):
            if PREFETCH:
                next_page = tl.load(pt_row + tl.minimum((start_n + BLOCK_N) // PAGE, last_page)).to(tl.int64)
            else:
                page = tl.load(pt_row + start_n // PAGE).to(tl.int64)
            in_page = tl.cast(start_n % PAGE, tl.int64)
            k_ptrs = KP + page * stride_kpp + in_page * stride_kpn + h * stride_kph + kp_offs
            if BLOCK_DQK != DQK:
                kt = tl.load(k_ptrs, mask=offs_dqk[:, None] < DQK, other=0.0)
            else:
                kt = tl.load(k_ptrs)
            if UPCAST_DOTS:
                kt = kt.to(tl.float32)
            s = _silu_scaled(tl.dot(q, kt, input_precision=DOT_PRECISION), alpha, FAST_SILU)
            v_ptrs = VP + page * stride_vpp + in_page * stride_vpn + h * stride_vph + vp_offs
            if BLOCK_DV != DV:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                v = tl.load(v_ptrs)
            acc = _dot_acc(acc, s, v, UPCAST_DOTS, DOT_PRECISION)
            if PREFETCH:
                page = next_page
        for start_n in range(p_mid, p_hi, BLOCK_N):
            page = tl.load(pt_row + start_n // PAGE).to(tl.int64)
            in_page = tl.cast(start_n % PAGE, tl.int64)
            acc = _masked_block(
                acc, q, KP + page * stride_kpp + in_page * stride_kpn + h * stride_kph + kp_offs,
                VP + page * stride_vpp + in_page * stride_vpn + h * stride_vph + vp_offs, start_n + offs_n, p_hi,
                rows, row_pos, row_ctx, ctx_shift, m_pos, max_attn_len, alpha, offs_dqk, offs_dv,
                DQK, DV, FAST_SILU, UPCAST_DOTS, DOT_PRECISION,
            )  # fmt: skip
        # The request's own non-target keys (first_query onwards), from k_new/v_new rows.
        kn_offs = offs_n[None, :] * stride_knm + offs_dqk[:, None]
        vn_offs = offs_n[:, None] * stride_vnm + offs_dv[None, :]
        for start_n in range(tl.maximum(s_lo, first_query), s_hi, BLOCK_N):
            row0 = (q_start + start_n - first_query).to(tl.int64)
            acc = _masked_block(
                acc, q, KN + row0 * stride_knm + h * stride_knh + kn_offs, VN + row0 * stride_vnm + h * stride_vnh
                + vn_offs, start_n + offs_n, s_hi, rows, row_pos, row_ctx, ctx_shift, m_pos, max_attn_len, alpha,
                offs_dqk, offs_dv, DQK, DV, FAST_SILU, UPCAST_DOTS, DOT_PRECISION,
            )  # fmt: skip

        if pid_s == 0:
            # Target rows see themselves; their K/V are the new ones (targets are not in the pages).
            is_self = row_ok & (rows >= hist_end)
            k_self = tl.load(KN + q_rows[:, None] * stride_knm + h * stride_knh + offs_dqk[None, :],
                             mask=is_self[:, None] & (offs_dqk[None, :] < DQK), other=0.0)  # fmt: skip
            v_self = tl.load(VN + q_rows[:, None] * stride_vnm + h * stride_vnh + offs_dv[None, :],
                             mask=is_self[:, None] & (offs_dv[None, :] < DV), other=0.0)  # fmt: skip
            s_self = _silu_scaled(tl.sum(q.to(tl.float32) * k_self.to(tl.float32), axis=1), alpha, FAST_SILU)
            acc += s_self[:, None] * v_self.to(tl.float32)
        if STORE & (pid_s == tl.num_programs(2) - 1):
            # Non-target rows (this head) go to their pages: row j of the user's sequence to page table column
            # j // PAGE, row j % PAGE; a column past the table is not stored. The rows are this block's own, or
            # with TARGETS_ONLY its share of the user's new rows.
            if TARGETS_ONLY:
                s_new = (blk - before) * BLOCK_M + tl.arange(0, BLOCK_M)
                s_ok = s_new < q_len
                s_rows = first_query + s_new
                s_q_rows = (q_start + s_new).to(tl.int64)
            else:
                s_ok, s_rows, s_q_rows = row_ok, rows, q_rows
            col = s_rows // PAGE
            keep = s_ok & (s_rows < hist_end) & (col < table_width)
            dest_page = tl.load(pt_row + col, mask=keep, other=0).to(tl.int64)
            in_page = tl.cast(s_rows % PAGE, tl.int64)
            keep_k = keep[:, None] & (offs_dqk[None, :] < DQK)
            k_rows = tl.load(KN + s_q_rows[:, None] * stride_knm + h * stride_knh + offs_dqk[None, :], mask=keep_k)
            tl.store(KP + (dest_page * stride_kpp + in_page * stride_kpn + h * stride_kph)[:, None]
                     + offs_dqk[None, :], k_rows.to(KP.dtype.element_ty), mask=keep_k)  # fmt: skip
            keep_v = keep[:, None] & (offs_dv[None, :] < DV)
            v_rows = tl.load(VN + s_q_rows[:, None] * stride_vnm + h * stride_vnh + offs_dv[None, :], mask=keep_v)
            tl.store(VP + (dest_page * stride_vpp + in_page * stride_vpn + h * stride_vph)[:, None]
                     + offs_dv[None, :], v_rows.to(VP.dtype.element_ty), mask=keep_v)  # fmt: skip

        # The result's rows: the query rows', or with TARGETS_ONLY the targets' among all users' targets.
        if TARGETS_ONLY:
            o_rows = (targets_before + offs_m - (q_len - user_targets)).to(tl.int64)
            out_mask = (row_ok & (o_rows < out_rows))[:, None] & (offs_dv[None, :] < DV)
        else:
            o_rows = q_rows
            out_mask = row_ok[:, None] & (offs_dv[None, :] < DV)
        if tl.num_programs(2) > 1:
            w_ptrs = Work + pid_s.to(tl.int64) * stride_ws + o_rows[:, None] * stride_wm + h * DV
            tl.store(w_ptrs + offs_dv[None, :], acc, mask=out_mask)
        else:
            o_ptrs = Out + out_col0 + o_rows[:, None] * stride_om + h * stride_oh + offs_dv[None, :]
            tl.store(o_ptrs, (acc * inv_scale).to(Out.dtype.element_ty), mask=out_mask)


def query_blocks(num_users: Any, total_rows: Any, max_query_len: Any, block_m: int) -> Any:
    """Programs on the grid's first axis: a bound on the users' query blocks together (each user's rows
    rounded up to a block), the tighter of two. Plain or symbolic ints (an exported program's sizes)."""
    by_total = (total_rows + num_users * (block_m - 1)) // block_m
    return torch.sym_max(torch.sym_min(by_total, num_users * triton.cdiv(max_query_len, block_m)), 1)


def split_count(programs: Any, max_seq_len: int, keys: Any = None) -> Any:
    """Key slices for ``programs`` query-block programs (blocks x heads) whose rows see about ``keys`` keys
    each (default: ``max_seq_len``). Arithmetic only (no branch), so that it holds for the symbolic sizes of an
    exported program: the count follows each call's size. The rule, from timings on the H100
    (docs/PERF_INVESTIGATIONS.md, "KV-cached serving: the paged attention's launch choices"):

    - the query blocks fill at most half the SMs: as many slices as make one wave of the programs the GPU
      keeps resident (two an SM: 264), never shorter than 256 keys of the longest sequence;
    - they fill at most all the SMs, one program each: two slices when each keeps at least 1024 keys (two
      programs an SM do about 1.7 times the work of one; shorter slices lose that to the partials' sum);
    - else one slice."""
    keys = max_seq_len if keys is None else keys
    most = max(1, max_seq_len // _MIN_KEYS_PER_SPLIT)
    few = torch.sym_min(_SMS // (2 * programs), 1)  # 1 when the query blocks fill at most half the SMs
    one_each = torch.sym_min(_SMS // programs, 1)  # 1 when they fill at most all of them
    long_slices = torch.sym_min(torch.sym_max(keys, 0) // (2 * _MIN_KEYS_FOR_TWO), 1)
    wanted = few * torch.sym_min(most, _TARGET_PROGRAMS // programs) + (1 - few) * one_each * long_slices * 2
    return torch.sym_max(1, wanted)


def workspace_numel(slices: Any, numel: Any) -> Any:
    """Floats of the slices' workspace: ``slices x numel``, or 1 with one slice (the kernel does not touch
    it then; one element, not none, so that it has a device address). Arithmetic only, like
    :func:`split_count`."""
    return torch.sym_max(slices * torch.sym_min(slices - 1, 1) * numel, 1)


def paged_hstu_mha_triton_fwd(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    q_offsets: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_targets: torch.Tensor,
    scaling_seqlen: int,
    alpha: float,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    *,
    max_seq_len: int,
    max_query_len: int,
    layer: int | None = None,
    splits: int | None = None,
    config: AttentionConfig | None = None,
    prefetch_pages: bool = True,
    traceable: bool = False,
) -> torch.Tensor:
    """Launches the paged delta kernel. With ``layer``, ``k_pages``/``v_pages`` are the whole pool
    [layers, P, page, H, D] and the kernel also stores the new non-target tokens' K/V in that layer's pages
    (in place); without, they are one layer's [P, page, H, D] and only read. ``splits`` (0 or None: chosen
    per call) forces the key-slice count, ``config`` the tile shape, ``prefetch_pages`` whether page
    numbers are read a block ahead (benchmarks). ``traceable``: launched inside the op, so that
    torch.export and Inductor see the kernels; the sizes may then be symbolic."""
    launch = _launch_paged(q, k_new, v_new, q_offsets, k_pages, v_pages, page_table, seq_lens, num_targets,
                           scaling_seqlen, alpha, contextual_seq_len, max_attn_len, max_seq_len=max_seq_len,
                           max_query_len=max_query_len, layer=layer, splits=splits, config=config,
                           prefetch_pages=prefetch_pages, traceable=traceable)  # fmt: skip
    # The sum's grid is empty with one slice (no program runs; AOTInductor skips the launch).
    sum_programs = triton.cdiv(launch.numel, _SUM_BLOCK) * torch.sym_min(launch.slices - 1, 1)
    if traceable or sum_programs > 0:
        summing = wrap_triton(_sum_slices) if traceable else _sum_slices
        summing[(sum_programs,)](launch.work, launch.out, launch.numel, launch.slices, launch.numel,
                                 1.0 / float(scaling_seqlen), BLOCK=_SUM_BLOCK)  # fmt: skip
    return launch.out


class _Launched(NamedTuple):
    out: torch.Tensor  # the result where one slice wrote it (the given buffer, or [L, H, Dv])
    work: torch.Tensor  # the slices' fp32 partials [slices, L, H*Dv] (flat), with several slices
    slices: Any  # int or SymInt
    numel: Any  # L * H * Dv


def _launch_paged(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, q_offsets: torch.Tensor, k_pages: torch.Tensor,
    v_pages: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, num_targets: torch.Tensor,
    scaling_seqlen: int, alpha: float, contextual_seq_len: int, max_attn_len: int, *, max_seq_len: int,
    max_query_len: int, layer: int | None, splits: int | None, config: AttentionConfig | None,
    prefetch_pages: bool, traceable: bool, out: torch.Tensor | None = None, out_col0: int = 0,
    targets: Any = None,
) -> _Launched:
    """The attention kernel alone (see :func:`paged_hstu_mha_triton_fwd`): with one key slice it writes the
    result into ``out`` (a 2-D buffer [L, W] whose columns [out_col0, out_col0 + H*Dv) take it; default a new
    [L, H, Dv]), with several the slices' partials into the returned workspace, for the caller to sum.
    ``targets`` (an int or a symbolic size): compute the targets' rows only, that many in all, whose result
    rows are then the targets', user by user (L = targets above); the new non-target rows' K/V are still
    stored."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    lq, num_heads, dqk = q.shape
    dv = v_new.shape[2]
    store = layer is not None
    if store and (k_pages.dim() != 5 or v_pages.dim() != 5):
        raise ValueError("storing K/V needs the whole pool [layers, pages, page size, heads, dim] and a layer")
    # A layer's stride: the pool's first, or none for one layer's pages; a page's dims come after it.
    k_layer, v_layer = (k_pages.stride(0), v_pages.stride(0)) if store else (0, 0)
    first = 1 if store else 0
    page_size = k_pages.shape[first + 1]
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged attention needs the head dim contiguous in q and the pages")
    capability = None if interpreting or q.device.type != "cuda" else torch.cuda.get_device_capability(q.device)
    cfg = config or attention_config(capability, dqk, dv, q.dtype)
    block_n = min(cfg.block_n, page_size)
    if page_size % block_n or block_n < 16:
        raise ValueError(f"the page size ({page_size}) must be a multiple of 16 and of the key block ({cfg.block_n}); "
                         "use a power of two >= 16")
    num_users = seq_lens.shape[0]
    # No user has more new rows than the request has in all (a symbolic size in an exported program).
    rows = torch.sym_min(lq, max_query_len) if traceable else max_query_len
    # A bound on the query blocks (targets only: a user's blocks are those its targets or its other new rows
    # need, the longer, so no more than for all its rows).
    blocks = query_blocks(num_users, lq, torch.sym_max(rows, 1), cfg.block_m)
    if targets is None:
        out_rows, busy = lq, blocks
    else:
        # The slices follow the blocks that compute, those of the targets when each user's fill whole blocks,
        # not the bound (whose other programs end at once): at 8 users of 256 targets on an H100, 128
        # programs, which two slices spread over both of each SM's places (docs/PERF_INVESTIGATIONS.md,
        # "KV-cached serving: the paged attention's launch choices").
        out_rows = targets
        busy = torch.sym_max((targets + cfg.block_m - 1) // cfg.block_m, 1)
    # The keys a user's new rows see, about: its sequence less its new rows (the request's average).
    slices = splits or split_count(busy * num_heads, max_seq_len, max_seq_len - lq // torch.sym_max(num_users, 1))
    if out is None:
        out = torch.empty((out_rows, num_heads, dv), dtype=v_new.dtype, device=q.device)
        stride_om = num_heads * dv
    else:
        stride_om = out.stride(0)
    # With one slice the kernel writes `out` and the workspace is not touched: it is then one element (not
    # empty, so that it has a device address to pass), instead of slices x rows x heads x dv floats. Flat:
    # the kernels take its strides as arguments.
    numel = out_rows * num_heads * dv
    work = torch.empty(workspace_numel(slices, numel), dtype=torch.float32, device=q.device)
    fast_silu = capability is not None and q.dtype != torch.float32
    kernel = wrap_triton(_paged_attn_fwd) if traceable else _paged_attn_fwd
    kernel[(blocks, num_heads, slices)](
        q, k_new, v_new, k_pages, v_pages, out, work, q_offsets, seq_lens, num_targets, page_table,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_layer, *(k_pages.stride(first + i) for i in range(3)), v_layer, *(v_pages.stride(first + i) for i in range(3)),
        page_table.stride(0), stride_om, dv, out_col0, numel, num_heads * dv, out_rows,
        float(alpha), 1.0 / float(scaling_seqlen), contextual_seq_len, max_attn_len, num_users, layer or 0,
        page_table.shape[1], DQK=dqk, DV=dv, BLOCK_DQK=max(next_power_of_2(dqk), 16),
        BLOCK_DV=max(next_power_of_2(dv), 16), BLOCK_M=cfg.block_m, BLOCK_N=block_n, PAGE=page_size,
        CHUNK=_USER_CHUNK, FAST_SILU=fast_silu, UPCAST_DOTS=interpreting and q.dtype != torch.float32,
        PREFETCH=prefetch_pages, STORE=store, TARGETS_ONLY=targets is not None, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return _Launched(out, work, slices, numel)


@triton.jit
def _gate_slices(UVQK, Out, Work, W, Bias, Rows, num_rows, uvqk_rows, slices, stride_u, stride_o, stride_ws,
                 inv_scale, eps, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                 GATHER: tl.constexpr):  # fmt: skip
    """The STU gate after the paged attention (gated.py's gate): Out [L, 3*WIDTH] gets SiLU(u), a and
    SiLU(u) * LN(a), u being UVQK's first WIDTH columns. With several key slices, a is first their partials
    (Work) summed in slice order and scaled, as _sum_slices computes it, and written into the middle third;
    with one, the attention kernel wrote it there. GATHER: row r's u is UVQK's row Rows[r] (the attention
    computed the targets only, and Out has their rows)."""
    eps = tl.cast(eps, tl.float32)
    rows64, cols, col_ok, ok = row_block(num_rows, WIDTH, BLOCK_ROWS, BLOCK_D)
    if GATHER:
        u_rows = tl.load(Rows + rows64, mask=rows64 < num_rows, other=0).to(tl.int64)
        u_rows = tl.minimum(tl.maximum(u_rows, 0), uvqk_rows - 1)
    else:
        u_rows = rows64
    dtype = Out.dtype.element_ty
    if slices > 1:
        # Four slices' loads at a time, then their sum in slice order (a slice past the last adds 0.0, which
        # changes no sum): a load per step would wait for each one in turn.
        acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
        w_ptrs = Work + rows64 * WIDTH + cols[None, :]
        for s in range(0, slices, 4):
            s64 = tl.cast(s, tl.int64)
            p0 = tl.load(w_ptrs + s64 * stride_ws, mask=ok, other=0.0)
            p1 = tl.load(w_ptrs + (s64 + 1) * stride_ws, mask=ok & (s + 1 < slices), other=0.0)
            p2 = tl.load(w_ptrs + (s64 + 2) * stride_ws, mask=ok & (s + 2 < slices), other=0.0)
            p3 = tl.load(w_ptrs + (s64 + 3) * stride_ws, mask=ok & (s + 3 < slices), other=0.0)
            acc += p0
            acc += p1
            acc += p2
            acc += p3
        a_rounded = (acc * tl.cast(inv_scale, tl.float32)).to(dtype)
        tl.store(Out + rows64 * stride_o + WIDTH + cols[None, :], a_rounded, mask=ok)
        a = a_rounded.to(tl.float32)
    else:
        a = tl.load(Out + rows64 * stride_o + WIDTH + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(UVQK + u_rows * stride_u + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    silu_u, gated = stu_gate_rows(u, a, w, b, ok, eps, WIDTH, dtype)
    tl.store(Out + rows64 * stride_o + cols[None, :], silu_u, mask=ok)
    tl.store(Out + rows64 * stride_o + 2 * WIDTH + cols[None, :], gated, mask=ok)


def paged_hstu_mha_gated_triton_fwd(
    uvqk: torch.Tensor,
    q_offsets: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_targets: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
    num_heads: int,
    attention_dim: int,
    linear_dim: int,
    scaling_seqlen: int,
    alpha: float,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    *,
    max_seq_len: int,
    max_query_len: int,
    splits: int | None = None,
    gate_rows: int | None = None,
    traceable: bool = False,
    target_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """A delta run's STU layer between its two projections: uvqk [L, H*(2*Dv + 2*Dqk)] (columns u, v, q, k) ->
    concat(SiLU(u), a, SiLU(u) * LN(a)) [L, 3*H*Dv], a being the paged attention (which also stores the new
    K/V in the pool's ``layer``, as :func:`paged_hstu_mha_triton_fwd` does). Two kernels: the attention writes
    a into the middle third (or, split over keys, its partials into a workspace), the gate sums the partials
    and writes the outer thirds. So the slices need no kernel of their own, and a is written once.
    ``gate_rows`` forces the gate kernel's rows a program (benchmarks).

    ``target_rows`` [T] (int64): the rows of uvqk that are targets, user by user, each user's in order (its
    last ``num_targets`` new rows): only those rows are computed, and the result is theirs [T, 3*H*Dv] (a
    model's last layer, whose other rows nothing reads). The new non-target tokens' K/V are stored all the
    same."""
    h, dqk, dv = num_heads, attention_dim, linear_dim
    width = h * dv
    if uvqk.dim() != 2 or uvqk.shape[1] != 2 * width + 2 * h * dqk or uvqk.stride(1) != 1:
        raise ValueError(f"uvqk must be [L, H*(2*Dv + 2*Dqk)] = [L, {2 * width + 2 * h * dqk}] with its columns "
                         f"contiguous for H={h}, Dqk={dqk}, Dv={dv}; got {tuple(uvqk.shape)}")
    num_rows = uvqk.shape[0]
    v = uvqk[:, width:2 * width].unflatten(-1, (h, dv))
    q = uvqk[:, 2 * width:2 * width + h * dqk].unflatten(-1, (h, dqk))
    k = uvqk[:, 2 * width + h * dqk:].unflatten(-1, (h, dqk))
    out_rows = num_rows if target_rows is None else target_rows.shape[0]
    out = torch.empty((out_rows, 3 * width), dtype=uvqk.dtype, device=uvqk.device)
    launch = _launch_paged(q, k, v, q_offsets, k_pool, v_pool, page_table, seq_lens, num_targets, scaling_seqlen,
                           alpha, contextual_seq_len, max_attn_len, max_seq_len=max_seq_len,
                           max_query_len=max_query_len, layer=layer, splits=splits, config=None,
                           prefetch_pages=True, traceable=traceable, out=out, out_col0=width,
                           targets=None if target_rows is None else out_rows)  # fmt: skip
    capability = _device_capability(uvqk.device)
    # A row a program on a GPU: the slices' sum is a few rows' loads at a time, so more programs finish it
    # sooner (H100, one layer at 1 user: 22.8 us for the attention and gate at 1 row a program, 26.6 at 8;
    # within 2% of the best at 8 and 32 users: docs/PERF_INVESTIGATIONS.md, "KV-cached serving: the paged
    # attention's launch choices").
    rows_each = gate_rows or (1 if capability is not None else None)
    cfg = gate_config(capability, width, block_rows=rows_each, kernel="paged_stu_gate")
    kernel = wrap_triton(_gate_slices) if traceable else _gate_slices
    kernel[(triton.cdiv(out_rows, cfg.block_rows),)](
        uvqk, out, launch.work, norm_weight, norm_bias, uvqk if target_rows is None else target_rows, out_rows,
        num_rows, launch.slices, uvqk.stride(0), out.stride(0), launch.numel, 1.0 / float(scaling_seqlen), float(eps),
        WIDTH=width, BLOCK_ROWS=cfg.block_rows, BLOCK_D=cfg.block_d, GATHER=target_rows is not None,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


@triton_op("hstu_export::paged_hstu_mha_gated_store_triton", mutates_args={"k_pool", "v_pool"})
def paged_hstu_mha_gated_store_triton(
    uvqk: torch.Tensor,
    q_offsets: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_targets: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
    num_heads: int,
    attention_dim: int,
    linear_dim: int,
    scaling_seqlen: int,
    alpha: float,
    contextual_seq_len: int,
    max_attn_len: int,
    max_seq_len: int,
    max_query_len: int,
    splits: int,
    target_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_hstu_mha_gated_triton_fwd` as an op an exported program calls (the delta program's layers
    on the Triton path): returns the gate's concat (of ``target_rows`` only, when given: the last layer's), and
    stores the new non-target tokens' K/V in the pool's ``layer``."""
    return paged_hstu_mha_gated_triton_fwd(
        uvqk, q_offsets, k_pool, v_pool, layer, page_table, seq_lens, num_targets, norm_weight, norm_bias, eps,
        num_heads, attention_dim, linear_dim, scaling_seqlen, alpha, contextual_seq_len, max_attn_len,
        max_seq_len=max_seq_len, max_query_len=max_query_len, splits=splits, traceable=True,
        target_rows=target_rows,
    )  # fmt: skip


@triton_op("hstu_export::paged_hstu_mha_store_triton", mutates_args={"k_pool", "v_pool"})
def paged_hstu_mha_store_triton(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    q_offsets: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_targets: torch.Tensor,
    scaling_seqlen: int,
    alpha: float,
    contextual_seq_len: int,
    max_attn_len: int,
    max_seq_len: int,
    max_query_len: int,
    splits: int,
) -> torch.Tensor:
    """The paged delta attention of one layer as an op an exported program calls (AOTInductor compiles the
    kernel in): returns the attention, and stores the new non-target tokens' K/V in the pool's ``layer``.
    The op takes the whole pool, not a view of one layer, so that an exported program writes straight into
    its input."""
    return paged_hstu_mha_triton_fwd(
        q, k_new, v_new, q_offsets, k_pool, v_pool, page_table, seq_lens, num_targets, scaling_seqlen, alpha,
        contextual_seq_len, max_attn_len, max_seq_len=max_seq_len, max_query_len=max_query_len, layer=layer,
        splits=splits, traceable=True,
    )  # fmt: skip


@triton_op("hstu_export::paged_attention_inputs_triton", mutates_args={})
def paged_attention_inputs_triton(
    cached: torch.Tensor,
    new_hist: torch.Tensor,
    cand_len: torch.Tensor,
    page_table: torch.Tensor,
    contextual_seq_len: int,
    total_new: int,
    page_size: int,
    num_pages: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ops/paged.py's paged_attention_inputs_reference in one launch: ``(q_offsets, seq_lens, num_targets,
    page_table)`` for :func:`paged_hstu_mha_store_triton`, as buffers of their own."""
    num_users = cached.shape[0]
    q_offsets = torch.empty(num_users + 1, dtype=torch.int64, device=cached.device)
    seq_lens = torch.empty(num_users, dtype=torch.int64, device=cached.device)
    num_targets = torch.empty(num_users, dtype=torch.int64, device=cached.device)
    pages = torch.empty((num_users, page_table.shape[1]), dtype=page_table.dtype, device=cached.device)
    numel = num_users * page_table.shape[1]
    wrap_triton(_attention_inputs)[(1 + triton.cdiv(numel, _TABLE_BLOCK),)](
        cached, new_hist, cand_len, page_table, q_offsets, seq_lens, num_targets, pages, num_users, numel,
        torch.sym_max(page_table.shape[1], 1), page_table.stride(0), contextual_seq_len, total_new,
        page_table.shape[1] * page_size, num_pages - 1, CHUNK=_USER_CHUNK, BLOCK=_TABLE_BLOCK,
    )  # fmt: skip
    return q_offsets, seq_lens, num_targets, pages
