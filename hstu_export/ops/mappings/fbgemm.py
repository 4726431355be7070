"""Mappings of fbgemm's jagged ops, as user models call them (``torch.ops.fbgemm.*``), to each target:
kept as they are (``fbgemm``), or replaced by our Triton kernels or plain torch. With these, the dense
half of a model that calls fbgemm directly still exports to ONNX and TensorRT."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hstu_export.ops import reference

_HERE = "fn:hstu_export.ops.mappings.fbgemm:"

OPS: dict[str, dict[str, str]] = {
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


# -- replacement functions (argument names follow the source op's schema) ---------------------------

def fbgemm_jagged_to_padded_dense_as_aten(
    values: Tensor, offsets: list[Tensor], max_lengths: list[int], padding_value: float = 0.0
) -> Tensor:
    _one_jagged_dim(offsets)
    return reference.jagged_to_padded_dense_reference(values, offsets[0], max_lengths[0], padding_value)


def fbgemm_jagged_to_padded_dense_as_triton(
    values: Tensor, offsets: list[Tensor], max_lengths: list[int], padding_value: float = 0.0
) -> Tensor:
    _one_jagged_dim(offsets)
    return _triton_ops().jagged_to_padded_dense_triton(values, offsets[0], max_lengths[0], padding_value)


def fbgemm_dense_to_jagged_as_aten(dense: Tensor, x_offsets: list[Tensor], total_L: int | None = None) -> tuple:
    _one_jagged_dim(x_offsets)
    return reference.dense_to_jagged_reference(dense, x_offsets[0], total_L), x_offsets


def fbgemm_dense_to_jagged_as_triton(dense: Tensor, x_offsets: list[Tensor], total_L: int | None = None) -> tuple:
    _one_jagged_dim(x_offsets)
    return _triton_ops().dense_to_jagged_triton(dense, x_offsets[0], total_L), x_offsets


def complete_cumsum(t_in: Tensor) -> Tensor:
    return torch.nn.functional.pad(torch.cumsum(t_in, dim=0), (1, 0))


def jagged_dense_add_as_aten(x_values: Tensor, x_offsets: list[Tensor], y: Tensor) -> tuple:
    _one_jagged_dim(x_offsets)
    return x_values + reference.dense_to_jagged_reference(y, x_offsets[0], x_values.size(0)), x_offsets


def _triton_ops() -> Any:
    import hstu_export.ops._triton  # noqa: F401  (registers the hstu_export::*_triton ops)

    return torch.ops.hstu_export


def _one_jagged_dim(offsets: list[Tensor]) -> None:
    if len(offsets) != 1:
        raise NotImplementedError("only one jagged dimension is mapped")
