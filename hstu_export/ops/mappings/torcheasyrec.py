"""TorchEasyRec (alibaba/TorchEasyRec, ``tzrec``) functions mapped onto our ops.

Facts this table relies on (read from the library's public code, 2026-08 snapshot):
- ``tzrec.ops._pytorch.pt_hstu_attention.pytorch_hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets,
  causal, dropout_pr, training, num_targets, max_attn_len, contextual_seq_len, min_full_attn_seq_len,
  attn_func, scaling_seqlen)`` divides SiLU(alpha·qk) by ``scaling_seqlen`` when it is not -1, else by
  ``max_seq_len`` (the padding bound, the batch's max length in tzrec's models); releases before
  2026-04 have no ``scaling_seqlen`` and always divide by ``max_seq_len``. ``attn_func`` (an arbitrary
  per-row mask) has no equivalent here.
- ``pytorch_cached_hstu_mha`` is the same for the last ``L // B`` rows of each sequence.
- ``pytorch_concat_2D_jagged(values_left, values_right, max_len_left, max_len_right, offsets_left,
  offsets_right)`` and ``pytorch_split_2D_jagged(max_seq_len, values, total_len_left, total_len_right,
  max_len_left, max_len_right, offsets_left, offsets_right)`` behave as generative-recommenders' (a
  missing offsets side is dense); they are mapped by the same rewrites.
- ``tzrec.ops._pytorch.pt_position.pytorch_add_timestamp_positional_embeddings`` is generative-recommenders'
  function (mapped by the same rewrite) with two more arguments, ``time_bucket_increments`` (the divisor of
  the elapsed seconds) and an optional per-user ``query_time`` (else the timestamp of the user's last row),
  and its own bucket: ``int(clamp(f(...) / n, 0, 1) * n)`` with ``n`` the time table's rows less one.
- ``pytorch_add_position_embeddings(jagged, jagged_offsets, high_inds, max_seq_len, dense, scale)`` (the
  encoding without timestamps) pads the rows to ``max_seq_len`` and adds ``dense[min(i, high_inds[u])]`` to
  ``jagged * scale`` at row ``i`` of user ``u`` (positions count forward).
- With the TRITON kernel setting the graph holds ``torch.ops.tzrec.*`` ops instead; export tzrec
  models with the PYTORCH kernel setting (our mapping brings our Triton kernels back on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch

from hstu_export.ops.mappings import FunctionMapping, MappingCall, Unmappable
from hstu_export.ops.mappings import generative_recommenders as gr

LIBRARY = "TorchEasyRec"
_PT = "tzrec.ops._pytorch.pt_hstu_attention."
_JAGGED = "tzrec.ops._pytorch.pt_jagged_tensors."
_POSITION = "tzrec.ops._pytorch.pt_position."


def _divisor(call: MappingCall, runtime: Any) -> Any:
    scaling = call["scaling_seqlen"]
    if isinstance(scaling, int) and scaling == -1:
        return call.scaling(runtime)
    return call.scaling(scaling)


def hstu_mha(call: MappingCall) -> Any:
    if call["attn_func"] is not None:
        raise Unmappable("attn_func (an arbitrary attention mask) has no equivalent in hstu_export::hstu_mha")
    gr.check_inference_only(call)
    return gr.attention(call, "max_seq_len", call["causal"], _divisor)


def cached_hstu_mha(call: MappingCall) -> Any:
    return gr.cached_attention(call, "max_seq_len", _divisor)


def _scaled_bucket(elapsed: Any, table: Any) -> Any:
    n = table.size(0) - 1
    return (torch.clamp(elapsed / n, min=0, max=1) * n).int()


def timestamp_positional_embeddings(call: MappingCall) -> Any:
    return gr.positional_embeddings_on_rows(call, _scaled_bucket)


def position_embeddings(call: MappingCall) -> Any:
    """tzrec's position encoding without timestamps, on the jagged rows (no padded copy)."""
    rows, table = call["jagged"], call["dense"]
    users, index = gr.rows_of_users(call, rows, call["jagged_offsets"], "max_seq_len")
    position = torch.minimum(index, call["high_inds"][users])
    return rows * call["scale"] + torch.index_select(table, 0, position).to(rows.dtype)


def _fixed_scale(original: Any, arguments: dict[str, Any], n: int) -> Any:
    return original(**{**arguments, "scaling_seqlen": n})


_MHA_DEFAULTS = {"causal": True, "dropout_pr": 0.0, "training": True, "num_targets": None, "max_attn_len": 0,
                 "contextual_seq_len": 0, "min_full_attn_seq_len": 0, "attn_func": None, "scaling_seqlen": -1}
_CACHED_DEFAULTS = {"num_targets": None, "max_attn_len": 0, "contextual_seq_len": 0, "scaling_seqlen": -1}

FUNCTIONS: dict[str, FunctionMapping] = {
    _PT + "pytorch_hstu_mha": FunctionMapping(LIBRARY, hstu_mha, _MHA_DEFAULTS, _fixed_scale,
                                              "HSTU attention → hstu_export::hstu_mha", attention=True),
    _PT + "pytorch_cached_hstu_mha": FunctionMapping(LIBRARY, cached_hstu_mha, _CACHED_DEFAULTS, _fixed_scale,
                                                     "cached attention → hstu_export::cached_hstu_mha", attention=True),
    _JAGGED + "pytorch_concat_2D_jagged": FunctionMapping(
        LIBRARY, gr.concat_2D_jagged, {"offsets_left": None, "offsets_right": None},
        description="→ hstu_export::concat_2D_jagged"),
    _JAGGED + "pytorch_split_2D_jagged": FunctionMapping(
        LIBRARY, gr.split_2D_jagged, {"total_len_left": None, "total_len_right": None, "max_len_left": None,
                                      "max_len_right": None, "offsets_left": None, "offsets_right": None},
        description="→ hstu_export::split_2D_jagged"),
    _POSITION + "pytorch_add_position_embeddings": FunctionMapping(
        LIBRARY, position_embeddings, {"scale": 1.0},
        description="position encodings → computed on the jagged rows (no padded copy)"),
    _POSITION + "pytorch_add_timestamp_positional_embeddings": FunctionMapping(
        LIBRARY, timestamp_positional_embeddings, {"time_bucket_increments": 60.0, "query_time": None},
        description="position and time encodings → computed on the jagged rows (no padded copy)"),
}
