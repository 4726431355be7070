"""HSTU attention of new tokens against a paged K/V cache (the delta path of KV-cached serving).

Layout (one layer): ``k_pages [P, page_size, H, Dqk]``, ``v_pages [P, page_size, H, Dv]``; user ``b``'s
token ``j`` lives in page ``page_table[b, j // page_size]`` at row ``j % page_size``.

Per user ``b``: ``seq_lens[b]`` tokens in all, ``num_targets[b]`` of them targets (candidates, last), the
last ``q_offsets[b+1] - q_offsets[b]`` of them new (the rows of ``q``, ``k_new``, ``v_new``); the tokens
before those are cached and read from the pages. :func:`paged_hstu_mha` only reads the pages;
:func:`paged_hstu_mha_store` (what a delta run calls, one layer of the whole pool at a time) also writes
the new non-target tokens' K/V into them, where the page table says. Targets, and tokens the table has no
column for, go to no user's page: the Triton kernel skips them, the PyTorch version writes them to the
pool's scratch page (:func:`scratch_page`), which nothing reads. Targets are never cached (no later token
attends to them).
The result equals those rows of :func:`hstu_export.ops.reference.hstu_mha_reference` over the whole
sequence (same mask, same scale), which is what makes cached serving exact.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from hstu_export.ops.jagged import jagged_positions_by_search, lengths_to_offsets
from hstu_export.ops.reference import _hstu_attend, hstu_attention_mask

__all__ = ["delta_counts", "paged_attention_inputs", "paged_attention_inputs_reference", "paged_hstu_mha",
           "paged_hstu_mha_reference", "paged_hstu_mha_store", "paged_hstu_mha_store_reference", "scratch_page",
           "store_new_kv_reference"]


def scratch_page(k_pool: Tensor) -> int:
    """The page of a pool ``[layers, pages, ...]`` where the K/V of tokens that are not stored are written:
    its last, which no user owns and nothing reads (:class:`hstu_export.serving.kv_cache.PagedKVCache`)."""
    return k_pool.shape[1] - 1


def delta_counts(cached: Tensor, new_hist: Tensor, cand_len: Tensor, contextual_seq_len: int) -> dict[str, Tensor]:
    """A delta request's counts per user, from the tokens cached, the new history tokens and the candidates
    (a user with nothing cached also brings its ``contextual_seq_len`` contextual tokens): those three, and
    ``ctx_new`` (the contextual tokens it brings), ``new_len`` (its new tokens), ``seq_len`` (its whole
    sequence)."""
    ctx_new = torch.where(cached == 0, contextual_seq_len, 0)
    new_len = ctx_new + new_hist + cand_len
    return {"cached": cached, "ctx_new": ctx_new, "new_len": new_len, "seq_len": cached + new_len,
            "cand_len": cand_len, "new_hist": new_hist}


def paged_attention_inputs_reference(cached: Tensor, new_hist: Tensor, cand_len: Tensor, page_table: Tensor,
                                     contextual_seq_len: int, total_new: int, page_size: int, num_pages: int,
                                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """What a delta run's attention takes, from the request's counts per user (``cached`` tokens,
    ``new_hist`` new history tokens, ``cand_len`` candidates; a user with nothing cached also brings its
    ``contextual_seq_len`` contextual tokens): ``(q_offsets, seq_lens, num_targets, page_table)`` of
    :func:`paged_hstu_mha_store`, int64 (the table in its own dtype). Each is kept inside what it indexes,
    whatever the counts (a negative count is 0): query rows within the ``total_new`` new tokens, keys within
    the page table's width (``page_size`` tokens a page), pages within the pool's ``num_pages``."""
    on = delta_counts(*(t.to(torch.int64).clamp(min=0) for t in (cached, new_hist, cand_len)), contextual_seq_len)
    q_offsets = lengths_to_offsets(on["new_len"]).clamp(0, total_new)
    seq_lens = on["cached"].clamp(max=page_table.shape[1] * page_size) + q_offsets[1:] - q_offsets[:-1]
    return q_offsets, seq_lens, on["cand_len"], page_table.clamp(0, num_pages - 1)


def paged_attention_inputs(cached: Tensor, new_hist: Tensor, cand_len: Tensor, page_table: Tensor,
                           contextual_seq_len: int, total_new: int, page_size: int, num_pages: int,
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """:func:`paged_attention_inputs_reference` in one Triton kernel on CUDA (or under TRITON_INTERPRET=1),
    the PyTorch version elsewhere. In an exported program the kernel's outputs are buffers of their own,
    which each layer's attention reads as they are (AOTInductor copies a computed input of a user kernel for
    each kernel that takes it: five layers, five copies of each)."""
    if cached.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        import hstu_export.ops._triton  # noqa: F401  (registers hstu_export::paged_attention_inputs_triton)

        return torch.ops.hstu_export.paged_attention_inputs_triton(
            cached, new_hist, cand_len, page_table, contextual_seq_len, total_new, page_size, num_pages)
    return paged_attention_inputs_reference(cached, new_hist, cand_len, page_table, contextual_seq_len, total_new,
                                            page_size, num_pages)  # fmt: skip


def _padded_rows(values: Tensor, offsets: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """Jagged rows [L, ...] -> ([B, max_len, ...] zero-padded, index [B, max_len] into values or -1)."""
    steps = torch.arange(max_len, device=values.device)
    lengths = offsets[1:] - offsets[:-1]
    index = offsets[:-1].unsqueeze(1) + steps
    index = torch.where(steps < lengths.unsqueeze(1), index, -1)
    padded = torch.cat([values, values.new_zeros((1, *values.shape[1:]))])[index]
    return padded, index


def paged_hstu_mha_reference(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    q_offsets: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    num_targets: Tensor,
    scaling_seqlen: int,
    alpha: float,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    *,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> Tensor:
    """PyTorch version of :func:`paged_hstu_mha` (padded, on any device): q [Lq, H, Dqk] -> [Lq, H, Dv].

    Padded to the batch's longest sequence and new rows, or, when given, to ``max_seq_len`` /
    ``max_query_len``: fixed bounds read nothing from the device, so the function traces into plain aten
    ops (an exported program's portable attention)."""
    page_size = k_pages.size(1)
    seq_lens = seq_lens.to(torch.int64)
    num_targets = num_targets.to(torch.int64)
    q_lens = (q_offsets[1:] - q_offsets[:-1]).to(torch.int64)
    if max_seq_len is not None:
        n_max = max_seq_len
    else:
        n_max = int(seq_lens.max()) if seq_lens.numel() else 0
    if max_query_len is not None:
        q_max = max_query_len
    else:
        q_max = int(q_lens.max()) if q_lens.numel() else 0
    cols = torch.arange(n_max, device=q.device)
    # Keys: cached tokens from the pages, the new ones from k_new/v_new.
    pages = page_table.to(torch.int64).gather(1, (cols // page_size).expand(seq_lens.shape[0], -1).clamp(
        max=page_table.size(1) - 1))
    slots = pages * page_size + cols % page_size
    from_pages = cols.unsqueeze(0) < (seq_lens - q_lens).unsqueeze(1)
    new_row = q_offsets[:-1].to(torch.int64).unsqueeze(1) + cols - (seq_lens - q_lens).unsqueeze(1)
    new_row = new_row.clamp(min=0, max=max(q.size(0) - 1, 0))

    def keys(pages_of_layer: Tensor, new: Tensor) -> Tensor:
        cached = pages_of_layer.flatten(0, 1)[slots.clamp(max=pages_of_layer.size(0) * page_size - 1)]
        return torch.where(from_pages[:, :, None, None], cached, new[new_row])

    padded_q, index = _padded_rows(q, q_offsets.to(torch.int64), q_max)
    rows = (seq_lens - q_lens).unsqueeze(1) + torch.arange(q_max, device=q.device)
    rows = torch.where(index >= 0, rows, -1)
    mask = hstu_attention_mask(rows, n_max, seq_lens, num_targets, True, contextual_seq_len, max_attn_len)
    out = _hstu_attend(padded_q, keys(k_pages, k_new), keys(v_pages, v_new), mask, scaling_seqlen, alpha)
    # Back to the jagged rows of q: row t is new token t - q_offsets[b] of its user b.
    user = torch.repeat_interleave(torch.arange(q_lens.size(0), device=q.device), q_lens, output_size=q.size(0))
    step = torch.arange(q.size(0), device=q.device) - q_offsets[:-1].to(torch.int64)[user]
    return out.to(v_new.dtype)[user, step]


def paged_hstu_mha(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    q_offsets: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    num_targets: Tensor,
    scaling_seqlen: int,
    alpha: float,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    *,
    max_seq_len: int,
    max_query_len: int,
) -> Tensor:
    """Delta attention against the paged cache: the Triton kernel on CUDA (or under TRITON_INTERPRET=1),
    the PyTorch reference elsewhere. ``max_seq_len`` / ``max_query_len`` bound ``seq_lens`` and the new
    rows per user (they size the launch grid without reading the device)."""
    if q.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        from hstu_export.ops._triton.paged import paged_hstu_mha_triton_fwd

        return paged_hstu_mha_triton_fwd(
            q, k_new, v_new, q_offsets, k_pages, v_pages, page_table, seq_lens, num_targets, scaling_seqlen,
            alpha, contextual_seq_len, max_attn_len, max_seq_len=max_seq_len, max_query_len=max_query_len,
        )  # fmt: skip
    return paged_hstu_mha_reference(
        q, k_new, v_new, q_offsets, k_pages, v_pages, page_table, seq_lens, num_targets, scaling_seqlen, alpha,
        contextual_seq_len, max_attn_len,
    )  # fmt: skip


def store_new_kv_reference(k_new: Tensor, v_new: Tensor, q_offsets: Tensor, k_pool: Tensor, v_pool: Tensor,
                           layer: int, page_table: Tensor, seq_lens: Tensor, num_targets: Tensor) -> None:
    """PyTorch version of the store :func:`paged_hstu_mha_store` makes: the new non-target tokens' K/V into
    the pool's ``layer`` (in place), others to the scratch page. One scatter each for K and V over every new
    row (no size read from the device, so that it traces), indexed on the whole pool, not on a view of it,
    so that an exported program writes straight into its input."""
    page_size, width = k_pool.shape[2], page_table.shape[1]
    seq_lens, num_targets, q_offsets = seq_lens.to(torch.int64), num_targets.to(torch.int64), q_offsets.to(torch.int64)
    user, r = jagged_positions_by_search(q_offsets, k_new.shape[0])
    pos = (seq_lens - (q_offsets[1:] - q_offsets[:-1]))[user] + r  # the row's place in its user's sequence
    col = pos // page_size
    keep = (pos >= 0) & (pos < (seq_lens - num_targets)[user]) & (col < width)
    page = page_table.to(torch.int64)[user, col.clamp(0, max(width - 1, 0))]
    page = torch.where(keep, page, scratch_page(k_pool)).clamp(0, k_pool.shape[1] - 1)
    at = (torch.full_like(page, layer), page, pos % page_size)
    k_pool.index_put_(at, k_new.to(k_pool.dtype))
    v_pool.index_put_(at, v_new.to(v_pool.dtype))


def paged_hstu_mha_store_reference(
    q: Tensor, k_new: Tensor, v_new: Tensor, q_offsets: Tensor, k_pool: Tensor, v_pool: Tensor, layer: int,
    page_table: Tensor, seq_lens: Tensor, num_targets: Tensor, scaling_seqlen: int, alpha: float,
    contextual_seq_len: int = 0, max_attn_len: int = 0, *, max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> Tensor:  # fmt: skip
    """PyTorch version of :func:`paged_hstu_mha_store`: :func:`paged_hstu_mha_reference` on the pool's
    ``layer``, then :func:`store_new_kv_reference`."""
    out = paged_hstu_mha_reference(
        q, k_new, v_new, q_offsets, k_pool[layer], v_pool[layer], page_table, seq_lens, num_targets, scaling_seqlen,
        alpha, contextual_seq_len, max_attn_len, max_seq_len=max_seq_len, max_query_len=max_query_len,
    )  # fmt: skip
    store_new_kv_reference(k_new, v_new, q_offsets, k_pool, v_pool, layer, page_table, seq_lens, num_targets)
    return out


def paged_hstu_mha_store(
    q: Tensor, k_new: Tensor, v_new: Tensor, q_offsets: Tensor, k_pool: Tensor, v_pool: Tensor, layer: int,
    page_table: Tensor, seq_lens: Tensor, num_targets: Tensor, scaling_seqlen: int, alpha: float,
    contextual_seq_len: int = 0, max_attn_len: int = 0, *, max_seq_len: int, max_query_len: int,
) -> Tensor:  # fmt: skip
    """One layer of a delta run: :func:`paged_hstu_mha` against the pool's ``layer`` (``k_pool``/``v_pool``
    [layers, P, page, H, D]), which also stores the new non-target tokens' K/V in that layer's pages. The
    Triton kernel does both in one launch on CUDA (or under TRITON_INTERPRET=1); the PyTorch reference
    elsewhere."""
    if q.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        from hstu_export.ops._triton.paged import paged_hstu_mha_triton_fwd

        return paged_hstu_mha_triton_fwd(
            q, k_new, v_new, q_offsets, k_pool, v_pool, page_table, seq_lens, num_targets, scaling_seqlen, alpha,
            contextual_seq_len, max_attn_len, max_seq_len=max_seq_len, max_query_len=max_query_len, layer=layer,
        )  # fmt: skip
    return paged_hstu_mha_store_reference(
        q, k_new, v_new, q_offsets, k_pool, v_pool, layer, page_table, seq_lens, num_targets, scaling_seqlen, alpha,
        contextual_seq_len, max_attn_len,
    )  # fmt: skip
