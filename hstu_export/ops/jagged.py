"""Jagged-tensor helpers: offsets from lengths, and the eager kernels of the jagged ops.

The eager kernels use fbgemm's jagged ops when fbgemm_gpu imports and supports the tensor's device
and dtype (fbgemm-gpu-cpu has no CUDA kernels; no build has fp64), and the pure-torch references
otherwise. fbgemm is never required. Both paths give bit-identical results (they only copy values).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from hstu_export.ops.reference import dense_to_jagged_reference, jagged_to_padded_dense_reference

__all__ = [
    "dense_to_jagged_eager",
    "fbgemm_available",
    "jagged_to_padded_dense_eager",
    "lengths_to_offsets",
]

_T = TypeVar("_T")

# (fbgemm op name, device type, dtype) combinations fbgemm raised NotImplementedError for.
_FBGEMM_UNSUPPORTED: set[tuple[str, str, torch.dtype]] = set()


def lengths_to_offsets(lengths: Tensor) -> Tensor:
    """[B] integer lengths -> [B+1] int64 offsets with offsets[0] = 0. Plain torch, export-friendly."""
    return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int64), (1, 0))


@functools.cache
def fbgemm_available() -> bool:
    """Whether fbgemm_gpu's jagged ops can be loaded (imported on first call, never required)."""
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception:  # a missing package, or a build for another torch (ImportError/OSError/...)
        return False
    return hasattr(torch.ops.fbgemm, "jagged_to_padded_dense") and hasattr(
        torch.ops.fbgemm, "dense_to_jagged"
    )


def _with_fbgemm(op_name: str, like: Tensor, fbgemm_call: Callable[[], _T]) -> _T | None:
    """Run ``fbgemm_call`` if fbgemm supports ``like``'s device and dtype; None means fall back."""
    key = (op_name, like.device.type, like.dtype)
    if key in _FBGEMM_UNSUPPORTED or not fbgemm_available():
        return None
    try:
        return fbgemm_call()
    except NotImplementedError:
        # fbgemm signals a missing backend kernel (e.g. CUDA in fbgemm-gpu-cpu) or dtype this way.
        _FBGEMM_UNSUPPORTED.add(key)
        return None


def jagged_to_padded_dense_eager(
    values: Tensor, offsets: Tensor, max_len: int, padding_value: float = 0.0
) -> Tensor:
    offsets = offsets.to(torch.int64)
    # fbgemm takes exactly [L, D]: fold any trailing dims into D and unfold them afterwards.
    values_2d = values.reshape(values.size(0), math.prod(values.shape[1:]))
    out = _with_fbgemm(
        "jagged_to_padded_dense",
        values,
        lambda: torch.ops.fbgemm.jagged_to_padded_dense(values_2d, [offsets], [max_len], padding_value),
    )
    if out is not None:
        out = out.reshape(out.size(0), max_len, *values.shape[1:])
    else:
        out = jagged_to_padded_dense_reference(values, offsets, max_len, padding_value)
    return out


def dense_to_jagged_eager(dense: Tensor, offsets: Tensor, total_len: int | None = None) -> Tensor:
    offsets = offsets.to(torch.int64)
    if total_len is None:
        total_len = int(offsets[-1])
    # fbgemm takes exactly [B, N, D]: fold any trailing dims into D and unfold them afterwards.
    dense_3d = dense.reshape(dense.size(0), dense.size(1), math.prod(dense.shape[2:]))
    out = _with_fbgemm(
        "dense_to_jagged",
        dense,
        lambda: torch.ops.fbgemm.dense_to_jagged(dense_3d, [offsets], total_len)[0],
    )
    if out is not None:
        out = out.reshape(total_len, *dense.shape[2:])
    else:
        out = dense_to_jagged_reference(dense, offsets, total_len)
    return out


def jagged_positions_by_search(offsets: Tensor, total_len: int) -> tuple[Tensor, Tensor]:
    """:func:`~hstu_export.ops.reference.jagged_positions` by a binary search of every token index in
    ``offsets``: parallel over tokens, where the reference's running count is one long scan (about
    0.1 ms for 98k tokens on an H100 as Inductor compiles it). The ``triton`` mapping target uses it;
    the ``aten`` target keeps the reference, because the ONNX exporter has no ``searchsorted``.
    """
    offsets = offsets.to(torch.int64)
    return jagged_positions_of(offsets, torch.arange(total_len, dtype=torch.int64, device=offsets.device))


def jagged_positions_of(offsets: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """(sequence id, position within it) of the tokens ``index`` (int64) of a jagged batch with int64
    ``offsets``, by a binary search of each in ``offsets`` (:func:`jagged_positions_by_search` for every token)."""
    # The count of offsets <= index, minus one; right=True steps over the repeated offsets of empty
    # sequences. The clamp keeps ids inside [0, B-1] for tokens that belong to no sequence (past
    # offsets[B], where the reference says B): only inconsistent inputs have such tokens, and
    # AOTInductor runs kernels on such inputs (zero offsets) while compiling, where an id of B would
    # trip the bounds check of every per-sequence lookup that follows.
    seq_ids = (torch.searchsorted(offsets, index, right=True) - 1).clamp(min=0, max=offsets.size(0) - 2)
    return seq_ids, index - offsets[seq_ids]
