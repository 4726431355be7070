"""Triton kernels of the HSTU ops, registered as ``torch.ops.hstu_export.*_triton`` on import.

Registered with ``torch.library.triton_op`` + ``wrap_triton`` so that torch.export keeps the
kernels visible and AOTInductor compiles them into the package (no Python or Triton at load time):

- ``hstu_export::hstu_mha_triton``, ``hstu_export::cached_hstu_mha_triton`` (attention.py)
- ``hstu_export::hstu_mha_gated_triton``: attention plus the STU output gate (gated.py)
- ``hstu_export::paged_hstu_mha_store_triton``: delta attention against the paged KV cache, storing the
  new K/V in it; ``hstu_export::paged_hstu_mha_gated_store_triton``: the same with the STU output gate; and
  ``hstu_export::paged_attention_inputs_triton``: what they take besides q/k/v, computed once for every
  layer from a request's counts (paged.py)
- ``hstu_export::add_layer_norm_triton``: a residual sum and the next layer's input norm (residual.py)
- ``hstu_export::jagged_to_padded_dense_triton``, ``hstu_export::dense_to_jagged_triton``,
  ``hstu_export::concat_2D_jagged_triton``, ``hstu_export::split_2D_jagged_triton`` (jagged.py)

Python caches modules, so importing this package again does not register twice.
"""

from __future__ import annotations

from . import jagged as _jagged  # noqa: F401  (registers the jagged ops)
from .attention import cached_hstu_mha_triton_fwd, hstu_mha_triton_fwd
from .configs import (
    AttentionConfig,
    JaggedConfig,
    attention_config,
    chosen_configs,
    gate_config,
    jagged_config,
)
from .gated import hstu_mha_gated_triton_fwd
from .paged import paged_hstu_mha_triton_fwd
from .residual import add_layer_norm_triton_fwd

OP_NAMES: tuple[str, ...] = (
    "hstu_export::hstu_mha_triton",
    "hstu_export::cached_hstu_mha_triton",
    "hstu_export::hstu_mha_gated_triton",
    "hstu_export::paged_hstu_mha_store_triton",
    "hstu_export::paged_hstu_mha_gated_store_triton",
    "hstu_export::add_layer_norm_triton",
    "hstu_export::jagged_to_padded_dense_triton",
    "hstu_export::dense_to_jagged_triton",
    "hstu_export::concat_2D_jagged_triton",
    "hstu_export::split_2D_jagged_triton",
)

__all__ = [
    "OP_NAMES",
    "AttentionConfig",
    "JaggedConfig",
    "add_layer_norm_triton_fwd",
    "attention_config",
    "cached_hstu_mha_triton_fwd",
    "chosen_configs",
    "gate_config",
    "hstu_mha_gated_triton_fwd",
    "hstu_mha_triton_fwd",
    "jagged_config",
    "paged_hstu_mha_triton_fwd",
]
