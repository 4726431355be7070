"""generative-recommenders (meta-recsys/generative-recommenders) functions mapped onto our ops.

Facts this table relies on (read from the library's public code, 2026-07 snapshot):
- ``pytorch_hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal, dropout_pr, training,
  num_targets, attn_scale, max_attn_len, contextual_seq_len, min_full_attn_seq_len)`` pads every
  sequence to ``max_seq_len`` and divides SiLU(alpha·qk) by ``max_seq_len`` unless ``attn_scale`` is
  given (then it multiplies by it). ``DlrmHSTU`` passes the batch's max length, computed from the
  batch; we keep that divisor by default (``--attention-scale batch``) and pad to the largest value
  seen at the export's maxima, checked at run time.
- ``pytorch_cached_hstu_mha`` is the same for the last ``L // B`` rows of each sequence.
- ``triton_hstu_mha(N, ...)``/``triton_cached_hstu_mha(N, ...)`` (the TRITON kernel setting) are
  causal and divide by ``N``.
- ``pytorch_concat_2D_jagged``/``pytorch_split_2D_jagged`` take optional offsets (a missing side is
  dense: ``max_len * arange(B + 1)``). The concat pads each side to its ``max_len``, the split the
  combined sequences to ``max_seq_len`` (its ``max_len_*`` only size a dense side; DlrmHSTU passes a
  ``max_len_left`` without the contextual tokens there). Rows past a padding bound would be dropped,
  which our ops never do, so the mapped graph checks at run time that none are.
- ``pytorch_add_timestamp_positional_embeddings`` (and ``triton_add_...``, the same arguments) pads the
  rows to ``max_seq_len``, adds to each row a position embedding and a time embedding, and cuts the
  padding away again. The position counts back from the user's last history row (``seq_lengths``
  less ``num_targets``, twice that with ``interleave_targets``; every target row takes position 0),
  shifted by ``max_contextual_seq_len`` and capped at the table's last row; the first
  ``max_contextual_seq_len`` rows of a user take their own index. The time bucket is
  ``int(f(max(q - t, 1e-6) / 60))``, where ``q`` is the timestamp of the user's last row
  (``seq_lengths - 1``), ``t`` the row's and ``f`` sqrt or log, capped by the Triton function at the
  time table's last row and by the PyTorch one at the table's width less one (``size(1) - 1``). The sum is
  ``row + (time + position).to(row dtype)``. We compute the same per row on the jagged rows, with no
  padded copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hstu_export.capture.graph_functions import check_lengths_at_most, tensor_to_int
from hstu_export.ops.mappings import FunctionMapping, MappingCall, Unmappable
from hstu_export.runtimes.symbolic import check_non_negative

LIBRARY = "generative-recommenders"
Divisor = Callable[[MappingCall, Any], Any]
_PT = "generative_recommenders.ops.pytorch.pt_hstu_attention."
_TRITON = "generative_recommenders.ops.triton.triton_hstu_attention."
_JAGGED = "generative_recommenders.ops.pytorch.pt_jagged_tensors."
_POSITION = "generative_recommenders.ops.pytorch.pt_position."
_TRITON_POSITION = "generative_recommenders.ops.triton.triton_position."


def hstu_mha(call: MappingCall) -> Any:
    if call["attn_scale"] is not None:
        raise Unmappable("attn_scale (a per-position scale) has no equivalent in hstu_export::hstu_mha")
    check_inference_only(call)
    return attention(call, "max_seq_len", call["causal"])


def triton_hstu_mha(call: MappingCall) -> Any:
    return attention(call, "N", True)


def check_inference_only(call: MappingCall) -> None:
    """Arguments of the PyTorch attention that only training uses (or that no model of the library sets)."""
    if call["min_full_attn_seq_len"]:
        raise Unmappable("min_full_attn_seq_len > 0 has no equivalent in hstu_export::hstu_mha")
    if call["dropout_pr"] and call["training"]:
        raise Unmappable("dropout in training mode is not exported")


def _runtime_divisor(call: MappingCall, runtime: Any) -> Any:
    return call.scaling(runtime)


def attention(call: MappingCall, length_key: str, causal: Any, divisor: Divisor = _runtime_divisor) -> Any:
    """Our attention op over the call's q/k/v: padded to the bound of ``length_key`` seen at the
    export's maxima (checked at run time), divided by ``divisor(call, runtime length)``."""
    bound, runtime = call.checked_bound(length_key)
    return torch.ops.hstu_export.hstu_mha.default(
        call["q"], call["k"], call["v"], call["seq_offsets"], bound, divisor(call, runtime), call["alpha"], causal,
        call["num_targets"], call["contextual_seq_len"], call["max_attn_len"],
    )  # fmt: skip


def cached_hstu_mha(call: MappingCall) -> Any:
    return cached_attention(call, "max_seq_len")


def triton_cached_hstu_mha(call: MappingCall) -> Any:
    return cached_attention(call, "N")


def cached_attention(call: MappingCall, length_key: str, divisor: Divisor = _runtime_divisor) -> Any:
    bound, runtime = call.checked_bound(length_key)
    delta_q, offsets = call["delta_q"], call["seq_offsets"]
    delta_size = delta_q.size(0) // (offsets.size(0) - 1)
    return torch.ops.hstu_export.cached_hstu_mha.default(
        delta_q, call["k"], call["v"], offsets, delta_size, bound, divisor(call, runtime), call["alpha"],
        call["num_targets"], call["contextual_seq_len"], call["max_attn_len"],
    )  # fmt: skip


def concat_2D_jagged(call: MappingCall) -> Any:
    left, right = call["values_left"], call["values_right"]
    offsets_left = _offsets(call, "offsets_left", "max_len_left", left.size(0))
    offsets_right = _offsets(call, "offsets_right", "max_len_right", right.size(0))
    return torch.ops.hstu_export.concat_2D_jagged.default(left, offsets_left, right, offsets_right)


def split_2D_jagged(call: MappingCall) -> Any:
    values = call["values"]
    given_left, given_right = call["offsets_left"], call["offsets_right"]
    if given_left is None and given_right is None:
        raise Unmappable("split_2D_jagged with neither offsets")
    other = given_right if given_left is None else given_left
    rows = other.size(0) - 1
    # The split pads the combined sequences to max_seq_len only; max_len_* are read for a dense side.
    offsets_left = _offsets(call, "offsets_left", "max_len_left", None, rows, check=False)
    offsets_right = _offsets(call, "offsets_right", "max_len_right", None, rows, check=False)
    call.record(check_lengths_at_most, offsets_left + offsets_right, call["max_seq_len"])
    total_left = call.record(tensor_to_int, offsets_left[-1]) if given_left is not None else rows * call["max_len_left"]
    return torch.ops.hstu_export.split_2D_jagged.default(
        values, offsets_left, offsets_right, total_left, values.size(0) - total_left
    )


def _offsets(call: MappingCall, offsets_key: str, max_len_key: str, rows_total: Any, batch: Any = None,
             check: bool = True) -> Any:
    """The offsets of one side: given ones (with ``check``, checked against the side's max_len when one
    is given: the side is padded to it), or the dense side's ``max_len * arange(B + 1)``."""
    offsets, max_len = call[offsets_key], call[max_len_key]
    if offsets is None:
        if max_len is None:
            raise Unmappable(f"{offsets_key} and {max_len_key} are both None")
        b = rows_total // max_len if batch is None else batch
        device = call["values_left" if "values_left" in call.arguments else "values"].device
        return max_len * torch.arange(b + 1, device=device)
    if max_len is not None and check:
        offsets = call.record(check_lengths_at_most, offsets, max_len)
    return offsets


Bucket = Callable[[Any, Any], Any]  # (elapsed time, the time table) -> the bucket each row looks up


def _capped_bucket(elapsed: Any, table: Any, axis: int) -> Any:
    """The whole elapsed units, capped at the time table's size along ``axis`` less one."""
    return torch.clamp(torch.clamp(elapsed, min=0).int(), min=0, max=table.size(axis) - 1)


def timestamp_positional_embeddings(call: MappingCall) -> Any:
    return positional_embeddings_on_rows(call, functools.partial(_capped_bucket, axis=1))


def triton_timestamp_positional_embeddings(call: MappingCall) -> Any:
    return positional_embeddings_on_rows(call, functools.partial(_capped_bucket, axis=0))


def rows_of_users(call: MappingCall, rows: Any, offsets: Any, max_len_key: str) -> tuple[Any, Any]:
    """Each jagged row's user and index in it, once the run-time check that no user is longer than the
    call's ``max_len_key`` is recorded (the library cuts such a user's rows off; ours would keep them)."""
    offsets = call.record(check_lengths_at_most, offsets, call[max_len_key])
    return torch.ops.hstu_export.jagged_positions.default(offsets, rows.size(0))


def positional_embeddings_on_rows(call: MappingCall, bucket_of: Bucket) -> Any:
    """The position and time encodings of every jagged row, computed on the rows themselves: each row
    finds its user and index (``hstu_export::jagged_positions``), then both embedding rows are looked
    up and added as the library does on its padded copy (the arithmetic is the same, element by
    element, so the answers are too). ``time_bucket_increments`` (60 s when the function has no such
    argument) and ``query_time`` (one per user, else the timestamp of the user's last row) are read
    when the call has them."""
    bucket_fn = call["time_bucket_fn"]
    if bucket_fn not in ("sqrt", "log"):
        raise Unmappable(f"time_bucket_fn={bucket_fn!r}: only sqrt and log are known")
    contextual, interleave = call["max_contextual_seq_len"], call["interleave_targets"]
    if not isinstance(contextual, int) or not isinstance(interleave, bool):
        raise Unmappable("max_contextual_seq_len and interleave_targets must be constants of the model")
    increments = call.arguments.get("time_bucket_increments", 60.0)
    if not isinstance(increments, (int, float)):
        raise Unmappable("time_bucket_increments must be a constant of the model")
    rows, offsets, lengths = call["seq_embeddings"], call["seq_offsets"], call["seq_lengths"]
    pos_table, time_table = call["pos_embeddings"], call["ts_embeddings"]
    users, index = rows_of_users(call, rows, offsets, "max_seq_len")
    length = lengths[users]
    targets = call["num_targets"]
    if targets is None:
        position = length - index
    else:
        last_history = length - targets[users] * (2 if interleave else 1)
        position = last_history - torch.minimum(index, last_history)
    position = torch.clamp(position + contextual, max=pos_table.size(0) - 1)
    if contextual > 0:
        position = torch.where(index < contextual, index, position)
    timestamps = call["timestamps"]
    given = call.arguments.get("query_time")
    if given is None:
        query_time = timestamps[offsets[users] + torch.clamp(length - 1, min=0)]
    else:
        query_time = given.reshape(-1).to(timestamps.dtype)[users]
    elapsed = torch.clamp(query_time - timestamps, min=1e-6) / increments
    elapsed = torch.log(elapsed) if bucket_fn == "log" else torch.sqrt(elapsed)
    looked_up = torch.index_select(time_table, 0, bucket_of(elapsed, time_table)) + torch.index_select(
        pos_table, 0, position)
    return rows + looked_up.to(rows.dtype)


def infer_max_len(call: MappingCall) -> Any:
    """The library's ``fx_infer_max_len``: the lengths' maximum, read from the device as it does, written as plain
    torch so that prove_length_reads sees it (a maximum read only by length checks it proves is then dropped).
    Like the library's, it is known non-negative from there on: the sizes computed from it need that (the
    library's own position encoding slices by it)."""
    return call.record(check_non_negative, call["lengths"].max().item())


def _fixed_scale_attention(original: Any, arguments: dict[str, Any], n: int) -> Any:
    q = arguments["q"]
    return original(**{**arguments, "attn_scale": torch.tensor(1.0 / n, device=q.device)})


_MHA_DEFAULTS = {"causal": True, "dropout_pr": 0.0, "training": True, "num_targets": None, "attn_scale": None,
                 "max_attn_len": 0, "contextual_seq_len": 0, "min_full_attn_seq_len": 0}
_CACHED_DEFAULTS = {"num_targets": None, "max_attn_len": 0, "contextual_seq_len": 0}

FUNCTIONS: dict[str, FunctionMapping] = {
    "generative_recommenders.common.fx_infer_max_len": FunctionMapping(
        LIBRARY, infer_max_len, {}, description="a maximum length read → plain torch (dropped where proven unneeded)"),
    _PT + "pytorch_hstu_mha": FunctionMapping(LIBRARY, hstu_mha, _MHA_DEFAULTS, _fixed_scale_attention,
                                              "HSTU attention → hstu_export::hstu_mha", attention=True),
    _PT + "pytorch_cached_hstu_mha": FunctionMapping(LIBRARY, cached_hstu_mha, _CACHED_DEFAULTS, None,
                                                     "cached attention → hstu_export::cached_hstu_mha", attention=True),
    _TRITON + "triton_hstu_mha": FunctionMapping(
        LIBRARY, triton_hstu_mha, {"num_targets": None, "max_attn_len": 0, "contextual_seq_len": 0}, None,
        "HSTU attention (Triton) → hstu_export::hstu_mha", attention=True),
    _TRITON + "triton_cached_hstu_mha": FunctionMapping(LIBRARY, triton_cached_hstu_mha, _CACHED_DEFAULTS, None,
                                                        "cached attention (Triton) → hstu_export::cached_hstu_mha", attention=True),
    _JAGGED + "pytorch_concat_2D_jagged": FunctionMapping(LIBRARY, concat_2D_jagged, {},
                                                          description="→ hstu_export::concat_2D_jagged"),
    _JAGGED + "pytorch_split_2D_jagged": FunctionMapping(LIBRARY, split_2D_jagged, {},
                                                         description="→ hstu_export::split_2D_jagged"),
    _POSITION + "pytorch_add_timestamp_positional_embeddings": FunctionMapping(
        LIBRARY, timestamp_positional_embeddings, {},
        description="position and time encodings → computed on the jagged rows (no padded copy)"),
    _TRITON_POSITION + "triton_add_timestamp_positional_embeddings": FunctionMapping(
        LIBRARY, triton_timestamp_positional_embeddings, {},
        description="position and time encodings (Triton) → computed on the jagged rows (no padded copy)"),
}
