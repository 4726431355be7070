"""The operator mapping table used by ``passes/map_ops.py``.

One entry per source op: for each target (``triton``, ``aten``, ``fbgemm``) a replacement, written as
- ``"op:ns::name"``: an op with the same schema (the node's target is swapped), or
- ``"fn:module:function"``: a Python function taking the source op's arguments by schema name; the
  pass traces it into the graph in place of the node, so the graph holds its plain torch ops.
- ``"keep"``: the source op stays (its library is then needed at load time).
Adding a mapping is one entry here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hstu_export.ops import reference

_REF = "fn:hstu_export.ops.reference:"
_HERE = "fn:hstu_export.ops.mappings:"

MAPPINGS: dict[str, dict[str, str]] = {
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
    # fbgemm ops found in user models.
    "fbgemm::jagged_to_padded_dense": {
        "triton": _HERE + "fbgemm_jagged_to_padded_dense_as_triton", "aten": _HERE + "fbgemm_jagged_to_padded_dense_as_aten",
        "fbgemm": "keep",
    },
    "fbgemm::dense_to_jagged": {
        "triton": _HERE + "fbgemm_dense_to_jagged_as_triton", "aten": _HERE + "fbgemm_dense_to_jagged_as_aten",
        "fbgemm": "keep",
    },
    "fbgemm::asynchronous_complete_cumsum": {
        "triton": _HERE + "complete_cumsum", "aten": _HERE + "complete_cumsum", "fbgemm": "keep",
    },
    "fbgemm::jagged_dense_elementwise_add_jagged_output": {
        "triton": _HERE + "jagged_dense_add_as_aten", "aten": _HERE + "jagged_dense_add_as_aten", "fbgemm": "keep",
    },
}


def op_key(target: Any) -> str | None:
    """``ns::name`` of an op call target, or None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        ns, _, name = target._qualified_op_name.partition("::")
        return f"{ns}::{name}"
    return None


# -- replacement functions (argument names follow the source op's schema) ---------------------------

def jagged_to_padded_dense_via_fbgemm(values: Tensor, offsets: Tensor, max_len: int, padding_value: float = 0.0) -> Tensor:
    return torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [max_len], padding_value)


def dense_to_jagged_via_fbgemm(dense: Tensor, offsets: Tensor, total_len: int | None = None) -> Tensor:
    return torch.ops.fbgemm.dense_to_jagged(dense, [offsets], total_len)[0]


def fbgemm_jagged_to_padded_dense_as_aten(
    values: Tensor, offsets: list[Tensor], max_lengths: list[int], padding_value: float = 0.0
) -> Tensor:
    _one_jagged_dim(offsets)
    return reference.jagged_to_padded_dense_reference(values, offsets[0], max_lengths[0], padding_value)


def fbgemm_jagged_to_padded_dense_as_triton(
    values: Tensor, offsets: list[Tensor], max_lengths: list[int], padding_value: float = 0.0
) -> Tensor:
    _one_jagged_dim(offsets)
    return torch.ops.hstu_export.jagged_to_padded_dense_triton(values, offsets[0], max_lengths[0], padding_value)


def fbgemm_dense_to_jagged_as_aten(dense: Tensor, x_offsets: list[Tensor], total_L: int | None = None) -> tuple:
    _one_jagged_dim(x_offsets)
    return reference.dense_to_jagged_reference(dense, x_offsets[0], total_L), x_offsets


def fbgemm_dense_to_jagged_as_triton(dense: Tensor, x_offsets: list[Tensor], total_L: int | None = None) -> tuple:
    _one_jagged_dim(x_offsets)
    return torch.ops.hstu_export.dense_to_jagged_triton(dense, x_offsets[0], total_L), x_offsets


def complete_cumsum(t_in: Tensor) -> Tensor:
    return torch.nn.functional.pad(torch.cumsum(t_in, dim=0), (1, 0))


def jagged_dense_add_as_aten(x_values: Tensor, x_offsets: list[Tensor], y: Tensor) -> tuple:
    _one_jagged_dim(x_offsets)
    return x_values + reference.dense_to_jagged_reference(y, x_offsets[0], x_values.size(0)), x_offsets


def _one_jagged_dim(offsets: list[Tensor]) -> None:
    if len(offsets) != 1:
        raise NotImplementedError("only one jagged dimension is mapped")
