"""HSTU operators: attention and jagged-tensor ops.

Importing this package registers the ``hstu_export::*`` custom ops. Each public function dispatches on
``kernel``: ``Kernel.PYTORCH`` -> ``torch.ops.hstu_export.<name>`` (pure torch, fbgemm for jagged copies
when available); ``Kernel.TRITON`` -> ``torch.ops.hstu_export.<name>_triton`` (registered by
:mod:`hstu_export.ops._triton`, imported only when asked for). The export-friendly pure-torch
semantics live in :mod:`hstu_export.ops.reference`.
"""

from __future__ import annotations

from hstu_export.ops.dispatch import (
    Kernel,
    cached_hstu_mha,
    concat_2D_jagged,
    dense_to_jagged,
    hstu_mha,
    hstu_mha_gated,
    jagged_positions,
    jagged_to_padded_dense,
    split_2D_jagged,
)
from hstu_export.ops.jagged import lengths_to_offsets
from hstu_export.ops.library import OP_NAMES

__all__ = [
    "OP_NAMES",
    "Kernel",
    "cached_hstu_mha",
    "concat_2D_jagged",
    "dense_to_jagged",
    "hstu_mha",
    "hstu_mha_gated",
    "jagged_positions",
    "jagged_to_padded_dense",
    "lengths_to_offsets",
    "split_2D_jagged",
]
