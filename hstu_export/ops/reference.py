"""Pure-torch reference implementations of the HSTU ops.

These functions are the semantics of the ``hstu_export::*`` custom ops and are what the ``aten`` mapping
target inlines into exported graphs, so they are written to trace cleanly under ``torch.export``,
ONNX and AOTInductor:

- the padded size is the *static* maximum length passed in (``max_seq_len`` / ``max_len``), never
  the batch's longest sequence;
- no ``.item()``, no Python branching on tensor values, no data-dependent output shapes;
- jagged <-> padded conversions are index math (gathers plus one ``scatter_add`` histogram), with
  no ``searchsorted``/``bucketize`` (the ONNX exporter has no lowering for them);
- any batch size works, including 1 (see :func:`_lengths_ext` for how, and
  :func:`jagged_to_padded_dense_reference` for the one exception under torch.export);
- they also trace with FX proxies (``passes/map_ops.py`` calls them on proxies): no use of a
  tensor's rank, dtype or shape as a Python value, no unpacking of shapes.

Each function's parameters (names and order) equal the schema of the matching ``hstu_export::<name>`` op,
so a mapping pass can call ``<name>_reference(*node.args, **node.kwargs)`` or with keywords only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "cached_hstu_mha_reference",
    "concat_2D_jagged_reference",
    "dense_to_jagged_reference",
    "hstu_attention_mask",
    "hstu_mha_gated_reference",
    "hstu_mha_reference",
    "jagged_positions",
    "jagged_positions_reference",
    "jagged_to_padded_dense_reference",
    "split_2D_jagged_reference",
    "stu_gate",
]


def _lengths_ext(offsets: Tensor) -> Tensor:
    """Per-sequence lengths, [B+1]: one trailing empty sequence keeps the size equal to offsets'.

    torch.export (non-strict, torch 2.13) guards a 1-D tensor of size ``offsets.size(0) - 1`` to be
    >= 2, which would reject batch size 1 at run time. Every per-sequence vector here therefore has
    B+1 entries (a gather of ``offsets[b+1]``, clamped, instead of a slice), and the attention
    functions compute B+1 sequences and never materialise a dim of size B.
    """
    num = offsets.size(0)
    nxt = torch.arange(1, num + 1, dtype=torch.int64, device=offsets.device).clamp(max=num - 1)
    return offsets[nxt] - offsets


def jagged_positions(offsets: Tensor, total_len: int) -> tuple[Tensor, Tensor]:
    """Sequence id and position inside its sequence of every jagged token.

    ``offsets`` is [B+1] (offsets[B] == total_len); returns two int64 tensors of shape [total_len].
    The sequence id is a running count of the sequence starts at or before each token: a histogram
    of all offsets (scatter_add, so empty sequences count once each; offsets[B] lands in the spare
    last bin) followed by a cumsum, minus the one count of offsets[0].
    """
    offsets = offsets.to(torch.int64)
    counts = torch.zeros(total_len + 1, dtype=torch.int64, device=offsets.device)
    counts = counts.scatter_add(0, offsets, torch.ones_like(offsets))
    seq_ids = torch.cumsum(counts[:total_len], dim=0) - 1
    positions = torch.arange(total_len, dtype=torch.int64, device=offsets.device) - offsets[seq_ids]
    return seq_ids, positions


def jagged_positions_reference(offsets: Tensor, total_len: int) -> tuple[Tensor, Tensor]:
    """``hstu_export::jagged_positions``: :func:`jagged_positions` under the op's name."""
    return jagged_positions(offsets, total_len)


def _append_row(values: Tensor, fill: float) -> Tensor:
    """values [L, *rest] -> [L+1, *rest], the new last row filled with ``fill``; L may be 0.

    Rank-agnostic on purpose: the mapping pass traces these functions with FX proxies, where a
    tensor's rank and shape are not Python values (no unpacking of ``shape[1:]``).
    """
    flat = F.pad(values.unsqueeze(-1).flatten(1), (0, 0, 0, 1), value=fill)  # [L+1, prod(rest)]
    return flat.reshape((values.size(0) + 1,) + values.shape[1:])  # noqa: RUF005 (no unpacking a Proxy)


def _padded_ext(values: Tensor, offsets: Tensor, max_len: int, padding_value: float = 0.0) -> Tensor:
    """values [L, *rest] -> [B+1, max_len, *rest]; the last sequence is all padding."""
    # Every padded slot gathers the one appended row that holds the padding value.
    source = _append_row(values, padding_value)
    slots = torch.arange(max_len, dtype=torch.int64, device=offsets.device).unsqueeze(0)
    index = offsets.unsqueeze(1) + slots
    index = torch.where(slots < _lengths_ext(offsets).unsqueeze(1), index, values.size(0))
    return source[index]


def jagged_to_padded_dense_reference(
    values: Tensor, offsets: Tensor, max_len: int, padding_value: float = 0.0
) -> Tensor:
    """values [L, *rest] -> [B, max_len, *rest]; longer sequences are truncated (fbgemm semantics).

    Under torch.export the B dim (``offsets.size(0) - 1``) makes export guard B != 1 unless it runs
    with ``torch.fx.experimental._config.backed_size_oblivious = True``; the other functions here
    need no such setting for B = 1.
    """
    return _padded_ext(values, offsets.to(torch.int64), max_len, padding_value)[:-1]


def dense_to_jagged_reference(dense: Tensor, offsets: Tensor, total_len: int | None = None) -> Tensor:
    """dense [B, N, *rest] -> [L, *rest]; tokens at positions >= N come out as zeros (fbgemm semantics).

    Pass ``total_len`` (L, e.g. a SymInt from an input's shape) when tracing; ``None`` reads
    ``offsets[-1]`` from the tensor, a host sync that cannot be traced.
    """
    offsets = offsets.to(torch.int64)
    if total_len is None:
        if isinstance(offsets, torch.fx.Proxy):
            raise TypeError("dense_to_jagged_reference needs total_len when traced (offsets[-1] is data)")
        total_len = int(offsets[-1])
    max_len = dense.size(1)
    seq_ids, positions = jagged_positions(offsets, total_len)
    flat = dense.flatten(0, 1)
    # Tokens past max_len gather one appended zero row.
    source = _append_row(flat, 0.0)
    index = torch.where(positions < max_len, seq_ids * max_len + positions, flat.size(0))
    return source[index]


def concat_2D_jagged_reference(
    values_left: Tensor, offsets_left: Tensor, values_right: Tensor, offsets_right: Tensor
) -> Tensor:
    """[La, *rest], [Lb, *rest] -> [La+Lb, *rest]; sequence b of the output is left_b then right_b."""
    offsets_left = offsets_left.to(torch.int64)
    offsets_right = offsets_right.to(torch.int64)
    len_left = values_left.size(0)
    seq_ids, positions = jagged_positions(offsets_left + offsets_right, len_left + values_right.size(0))
    left_len = _lengths_ext(offsets_left)[seq_ids]
    index = torch.where(
        positions < left_len,
        offsets_left[seq_ids] + positions,
        len_left + offsets_right[seq_ids] + positions - left_len,
    )
    return torch.cat([values_left, values_right], dim=0)[index]


def split_2D_jagged_reference(
    values: Tensor, offsets_left: Tensor, offsets_right: Tensor, total_len_left: int, total_len_right: int
) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`concat_2D_jagged_reference`: [La+Lb, *rest] -> ([La, *rest], [Lb, *rest])."""
    offsets_left = offsets_left.to(torch.int64)
    offsets_right = offsets_right.to(torch.int64)
    offsets_joined = offsets_left + offsets_right
    seq_left, pos_left = jagged_positions(offsets_left, total_len_left)
    seq_right, pos_right = jagged_positions(offsets_right, total_len_right)
    left = values[offsets_joined[seq_left] + pos_left]
    right = values[offsets_joined[seq_right] + _lengths_ext(offsets_left)[seq_right] + pos_right]
    return left, right


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs are accumulated in fp32; fp32/fp64 stay as they are. Under FX proxy
    # tracing (the mapping pass) the dtype is not known: compute in fp32.
    if not isinstance(dtype, torch.dtype):
        return torch.float32
    return torch.promote_types(dtype, torch.float32)


def _hstu_positions(index: Tensor, lengths: Tensor, num_targets: Tensor, contextual_seq_len: int) -> Tensor:
    """p(x) of DESIGN.md for token indices ``index`` [B or 1, X] of sequences of ``lengths`` [B]."""
    positions = index
    if contextual_seq_len > 0:
        positions = (index - contextual_seq_len + 1).clamp(min=0)
    # With no targets the clamp is a no-op, so it is applied unconditionally (no branch on values).
    last = _hstu_last_position(lengths, num_targets, contextual_seq_len)
    return torch.minimum(positions, last.unsqueeze(1))


def _hstu_last_position(lengths: Tensor, num_targets: Tensor, contextual_seq_len: int) -> Tensor:
    """m of DESIGN.md: the position every target shares, per sequence [B]."""
    return lengths - num_targets - max(contextual_seq_len - 1, 0)


def hstu_attention_mask(
    rows: Tensor,
    max_seq_len: int,
    lengths: Tensor,
    num_targets: Tensor | None = None,
    causal: bool = True,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
) -> Tensor:
    """valid(i, j) of DESIGN.md as a bool tensor [B, R, max_seq_len].

    ``lengths`` and ``num_targets`` (None: no targets) are [B]; ``rows`` [B or 1, R] holds the
    query token indices i (within their sequence); the columns are j = 0..max_seq_len-1.
    Entries outside a sequence (padding, or i < 0) are False.
    """
    lengths = lengths.to(torch.int64)
    rows = rows.to(torch.int64)
    cols = torch.arange(max_seq_len, dtype=torch.int64, device=lengths.device).unsqueeze(0)
    row_inside = (rows >= 0) & (rows < lengths.unsqueeze(1))
    col_inside = cols < lengths.unsqueeze(1)
    inside = row_inside.unsqueeze(2) & col_inside.unsqueeze(1)
    if not causal:
        return inside
    if num_targets is None:
        num_targets = torch.zeros_like(lengths)
    num_targets = num_targets.to(torch.int64)
    p_row = _hstu_positions(rows, lengths, num_targets, contextual_seq_len)
    p_col = _hstu_positions(cols, lengths, num_targets, contextual_seq_len)
    distance = p_row.unsqueeze(2) - p_col.unsqueeze(1)
    valid = distance > 0
    if max_attn_len > 0:
        valid = valid & (distance <= max_attn_len)
    valid = valid | (rows.unsqueeze(2) == cols.unsqueeze(1))
    if contextual_seq_len > 0:
        last = _hstu_last_position(lengths, num_targets, contextual_seq_len)
        sees_all_history = (p_row == 0).unsqueeze(2) & (p_col < last.unsqueeze(1)).unsqueeze(1)
        valid = valid | sees_all_history
    return valid & inside


def _num_targets_ext(num_targets: Tensor | None, lengths_ext: Tensor) -> Tensor:
    """num_targets [B] (or None: zeros) -> [B+1], matching :func:`_lengths_ext`."""
    if num_targets is None:
        return torch.zeros_like(lengths_ext)
    return F.pad(num_targets.to(torch.int64), (0, 1))


def _hstu_attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling_seqlen: int, alpha: float) -> Tensor:
    """q [B, R, H, Dqk], k [B, N, H, Dqk], v [B, N, H, Dv], mask [B, R, N] -> [B, R, H, Dv]."""
    compute = _compute_dtype(q.dtype)
    q = q.to(compute).transpose(1, 2)
    k = k.to(compute).transpose(1, 2)
    v = v.to(compute).transpose(1, 2)
    scores = F.silu(torch.matmul(q, k.transpose(-1, -2)) * alpha) / scaling_seqlen
    scores = torch.where(mask.unsqueeze(1), scores, 0.0)
    return torch.matmul(scores, v).transpose(1, 2)


def hstu_mha_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool = True,
    num_targets: Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
) -> Tensor:
    """HSTU attention over jagged q, k [L, H, Dqk], v [L, H, Dv] -> [L, H, Dv].

    Works on a [B, H, max_seq_len, max_seq_len] padded score tensor. Tokens at positions
    >= max_seq_len (a sequence longer than the bound) are not attended and come out as zeros.
    """
    # Everything per sequence is computed for B+1 sequences, the last one empty (see _lengths_ext).
    seq_offsets = seq_offsets.to(torch.int64)
    lengths = _lengths_ext(seq_offsets)
    padded_q = _padded_ext(q, seq_offsets, max_seq_len)
    padded_k = _padded_ext(k, seq_offsets, max_seq_len)
    padded_v = _padded_ext(v, seq_offsets, max_seq_len)
    rows = torch.arange(max_seq_len, dtype=torch.int64, device=q.device).unsqueeze(0)
    mask = hstu_attention_mask(
        rows, max_seq_len, lengths, _num_targets_ext(num_targets, lengths), causal,
        contextual_seq_len, max_attn_len,
    )  # fmt: skip
    out = _hstu_attend(padded_q, padded_k, padded_v, mask, scaling_seqlen, alpha).to(v.dtype)
    return dense_to_jagged_reference(out, seq_offsets, q.size(0))


def cached_hstu_mha_reference(
    delta_q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    delta_size: int,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    num_targets: Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
) -> Tensor:
    """Queries of the last ``delta_size`` tokens of each sequence against full jagged k/v.

    delta_q [B*delta_size, H, Dqk] -> [B*delta_size, H, Dv]; equal to those rows of
    :func:`hstu_mha_reference` (same mask rows, same scale). Every sequence has >= delta_size tokens.
    """
    # Everything per sequence is computed for B+1 sequences, the last one empty (see _lengths_ext):
    # delta_q gets delta_size zero rows appended, and the output is cut back to delta_q's rows.
    seq_offsets = seq_offsets.to(torch.int64)
    lengths = _lengths_ext(seq_offsets)
    num_heads, dim_qk = delta_q.size(1), delta_q.size(2)
    spare = delta_q.new_zeros((delta_size, num_heads, dim_qk))
    padded_q = torch.cat([delta_q, spare], dim=0).reshape(-1, delta_size, num_heads, dim_qk)
    padded_k = _padded_ext(k, seq_offsets, max_seq_len)
    padded_v = _padded_ext(v, seq_offsets, max_seq_len)
    steps = torch.arange(delta_size, dtype=torch.int64, device=delta_q.device)
    rows = lengths.unsqueeze(1) - delta_size + steps.unsqueeze(0)
    mask = hstu_attention_mask(
        rows, max_seq_len, lengths, _num_targets_ext(num_targets, lengths), True,
        contextual_seq_len, max_attn_len,
    )  # fmt: skip
    out = _hstu_attend(padded_q, padded_k, padded_v, mask, scaling_seqlen, alpha).to(v.dtype)
    return out.reshape(-1, out.size(2), out.size(3))[: delta_q.size(0)]


def hstu_mha_gated_reference(
    uvqk: Tensor,
    seq_offsets: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    num_heads: int,
    attention_dim: int,
    linear_dim: int,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool = True,
    num_targets: Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    eps: float = 1e-6,
) -> Tensor:
    """The STU layer between its two projections: uvqk [L, H*(2*Dv + 2*Dqk)] -> [L, 3*H*Dv].

    u, v, q, k = split(uvqk); u = SiLU(u); a = hstu_mha(q, k, v) flattened to [L, H*Dv];
    returns concat(u, a, u * LN(a)) with LN over H*Dv in fp32 (``eps``), rounded to uvqk's dtype.
    """
    h, dqk, dv = num_heads, attention_dim, linear_dim
    u, v, q, k = torch.split(uvqk, [dv * h, dv * h, dqk * h, dqk * h], dim=-1)
    a = hstu_mha_reference(
        q.reshape(-1, h, dqk), k.reshape(-1, h, dqk), v.reshape(-1, h, dv), seq_offsets, max_seq_len,
        scaling_seqlen, alpha, causal, num_targets, contextual_seq_len, max_attn_len,
    ).reshape(-1, h * dv)  # fmt: skip
    return stu_gate(u, a, norm_weight, norm_bias, eps)


def stu_gate(u: Tensor, a: Tensor, norm_weight: Tensor, norm_bias: Tensor, eps: float = 1e-6) -> Tensor:
    """The STU output gate: concat(SiLU(u), a, SiLU(u) * LN(a)), LN over a's last dim in fp32 (``eps``),
    rounded to a's dtype."""
    u = F.silu(u)
    normed = F.layer_norm(a.float(), (a.shape[-1],), norm_weight.float(), norm_bias.float(), eps).type_as(a)
    return torch.cat([u, a, u * normed], dim=-1)
