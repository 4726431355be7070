"""Mappings of our own ops (``hstu_export::*``) to each target: our Triton kernels, the plain-torch
references (``aten``), or fbgemm's jagged ops. See ``hstu_export/ops/mappings/__init__.py`` for the
spelling of an entry."""

from __future__ import annotations

import torch
from torch import Tensor

_REF = "fn:hstu_export.ops.reference:"
_HERE = "fn:hstu_export.ops.mappings.ours:"

OPS: dict[str, dict[str, str]] = {
    "hstu_export::hstu_mha": {
        "triton": "op:hstu_export::hstu_mha_triton", "aten": _REF + "hstu_mha_reference",
        "fbgemm": _REF + "hstu_mha_reference",
    },
    "hstu_export::cached_hstu_mha": {
        "triton": "op:hstu_export::cached_hstu_mha_triton", "aten": _REF + "cached_hstu_mha_reference",
        "fbgemm": _REF + "cached_hstu_mha_reference",
    },
    "hstu_export::hstu_mha_gated": {
        "triton": "op:hstu_export::hstu_mha_gated_triton", "aten": _REF + "hstu_mha_gated_reference",
        "fbgemm": _REF + "hstu_mha_gated_reference",
    },
    # The running count of the reference is one long scan on a GPU; the search is parallel (and has
    # no ONNX lowering, hence only for triton).
    "hstu_export::jagged_positions": {
        "triton": "fn:hstu_export.ops.jagged:jagged_positions_by_search", "aten": _REF + "jagged_positions_reference",
        "fbgemm": _REF + "jagged_positions_reference",
    },
    "hstu_export::jagged_to_padded_dense": {
        "triton": "op:hstu_export::jagged_to_padded_dense_triton", "aten": _REF + "jagged_to_padded_dense_reference",
        "fbgemm": _HERE + "jagged_to_padded_dense_via_fbgemm",
    },
    "hstu_export::dense_to_jagged": {
        "triton": "op:hstu_export::dense_to_jagged_triton", "aten": _REF + "dense_to_jagged_reference",
        "fbgemm": _HERE + "dense_to_jagged_via_fbgemm",
    },
    "hstu_export::concat_2D_jagged": {
        "triton": "op:hstu_export::concat_2D_jagged_triton", "aten": _REF + "concat_2D_jagged_reference",
        "fbgemm": _REF + "concat_2D_jagged_reference",
    },
    "hstu_export::split_2D_jagged": {
        "triton": "op:hstu_export::split_2D_jagged_triton", "aten": _REF + "split_2D_jagged_reference",
        "fbgemm": _REF + "split_2D_jagged_reference",
    },
}


# -- replacement functions (argument names follow the source op's schema) ---------------------------

def jagged_to_padded_dense_via_fbgemm(values: Tensor, offsets: Tensor, max_len: int, padding_value: float = 0.0) -> Tensor:
    return torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [max_len], padding_value)


def dense_to_jagged_via_fbgemm(dense: Tensor, offsets: Tensor, total_len: int | None = None) -> Tensor:
    return torch.ops.fbgemm.dense_to_jagged(dense, [offsets], total_len)[0]
