"""Public HSTU ops: each picks the ``hstu_export::<name>`` op (PyTorch) or ``hstu_export::<name>_triton`` (Triton).

The ops are called positionally in schema order, so every trace holds one node whose ``args`` line
up with the matching ``*_reference`` function in :mod:`hstu_export.ops.reference`.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import Tensor

import hstu_export.ops.library  # noqa: F401  (registers the hstu_export::* ops)
from hstu_export.errors import ConfigError

__all__ = [
    "Kernel",
    "cached_hstu_mha",
    "concat_2D_jagged",
    "dense_to_jagged",
    "hstu_mha",
    "hstu_mha_gated",
    "jagged_positions",
    "jagged_to_padded_dense",
    "split_2D_jagged",
]


class Kernel(str, enum.Enum):
    """Which implementation an op call dispatches to."""

    PYTORCH = "pytorch"
    TRITON = "triton"


def _kernel(kernel: Kernel | str) -> Kernel:
    try:
        return Kernel(kernel)
    except ValueError:
        choices = ", ".join(k.value for k in Kernel)
        raise ConfigError(f"unknown kernel {kernel!r}; choose one of: {choices}") from None


def _op(name: str, kernel: Kernel | str) -> Any:
    """The OpOverload implementing ``name`` for ``kernel``."""
    if _kernel(kernel) is Kernel.PYTORCH:
        return getattr(torch.ops.hstu_export, name).default
    try:
        import hstu_export.ops._triton  # noqa: F401  (registers the hstu_export::*_triton ops)
    except Exception as exc:  # ImportError without triton, or a kernel module failing to load
        raise ConfigError(
            f"Kernel.TRITON was requested for {name} but hstu_export.ops._triton failed to import "
            f"({type(exc).__name__}: {exc}); install triton on a CUDA machine or use Kernel.PYTORCH"
        ) from exc
    try:
        return getattr(torch.ops.hstu_export, f"{name}_triton").default
    except AttributeError:
        raise ConfigError(
            f"Kernel.TRITON was requested for {name} but no hstu_export::{name}_triton op is registered; "
            "use Kernel.PYTORCH"
        ) from None


def _check_non_negative(**values: object) -> None:
    # Only plain ints are checked: SymInts and FX proxies are left to the op.
    for name, value in values.items():
        if isinstance(value, int) and value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")


def _check_positive(**values: object) -> None:
    for name, value in values.items():
        if isinstance(value, int) and value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")


def hstu_mha(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    *,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    causal: bool = True,
    num_targets: Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    kernel: Kernel = Kernel.PYTORCH,
) -> Tensor:
    """HSTU attention (DESIGN.md, "HSTU semantics") over jagged q, k [L, H, Dqk], v [L, H, Dv].

    ``seq_offsets`` [B+1] int64; ``num_targets`` [B] int64 or None; ``max_seq_len`` is the static
    bound on one sequence's length; ``causal=False`` makes every pair inside a sequence valid.
    Returns [L, H, Dv].
    """
    _check_positive(max_seq_len=max_seq_len, scaling_seqlen=scaling_seqlen)
    _check_non_negative(contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len)
    return _op("hstu_mha", kernel)(
        q, k, v, seq_offsets, max_seq_len, scaling_seqlen, alpha, causal, num_targets,
        contextual_seq_len, max_attn_len,
    )  # fmt: skip


def hstu_mha_gated(
    uvqk: Tensor,
    seq_offsets: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    *,
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
    kernel: Kernel = Kernel.PYTORCH,
) -> Tensor:
    """The STU layer between its projections, one op: uvqk [L, H*(2*Dv + 2*Dqk)] (columns u, v, q, k)
    -> concat(SiLU(u), a, SiLU(u) * LN(a)) [L, 3*H*Dv], with a = :func:`hstu_mha` of q, k, v and
    LN over H*Dv (``norm_weight``/``norm_bias``, fp32, ``eps``).

    The Triton version writes the attention straight into the middle third of the output and fills
    the other two in one more pass, so the attention output is never copied into the concat.
    """
    _check_positive(
        num_heads=num_heads, attention_dim=attention_dim, linear_dim=linear_dim, max_seq_len=max_seq_len,
        scaling_seqlen=scaling_seqlen,
    )  # fmt: skip
    _check_non_negative(contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len)
    return _op("hstu_mha_gated", kernel)(
        uvqk, seq_offsets, norm_weight, norm_bias, num_heads, attention_dim, linear_dim, max_seq_len,
        scaling_seqlen, alpha, causal, num_targets, contextual_seq_len, max_attn_len, eps,
    )  # fmt: skip


def jagged_positions(offsets: Tensor, total_len: int, kernel: Kernel = Kernel.PYTORCH) -> tuple[Tensor, Tensor]:
    """(sequence id, position inside its sequence) of each of ``total_len`` jagged tokens, int64 [L].

    ``Kernel.TRITON`` computes it by a parallel binary search (no Triton kernel: the plain torch ops
    compile well), ``Kernel.PYTORCH`` by the op, whose running count also exports to ONNX.
    """
    if _kernel(kernel) is Kernel.TRITON:
        from hstu_export.ops.jagged import jagged_positions_by_search

        return jagged_positions_by_search(offsets, total_len)
    return torch.ops.hstu_export.jagged_positions.default(offsets, total_len)


def cached_hstu_mha(
    delta_q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    *,
    delta_size: int,
    max_seq_len: int,
    scaling_seqlen: int,
    alpha: float,
    num_targets: Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    kernel: Kernel = Kernel.PYTORCH,
) -> Tensor:
    """Cached (delta) HSTU attention: the last ``delta_size`` queries of each sequence.

    ``delta_q`` [B*delta_size, H, Dqk], full jagged k/v; returns [B*delta_size, H, Dv], equal to
    those rows of :func:`hstu_mha` with the same arguments.
    """
    _check_positive(delta_size=delta_size, max_seq_len=max_seq_len, scaling_seqlen=scaling_seqlen)
    _check_non_negative(contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len)
    return _op("cached_hstu_mha", kernel)(
        delta_q, k, v, seq_offsets, delta_size, max_seq_len, scaling_seqlen, alpha, num_targets,
        contextual_seq_len, max_attn_len,
    )  # fmt: skip


def jagged_to_padded_dense(
    values: Tensor,
    offsets: Tensor,
    max_len: int,
    padding_value: float = 0.0,
    kernel: Kernel = Kernel.PYTORCH,
) -> Tensor:
    """values [L, D] -> [B, max_len, D]; longer sequences are truncated (fbgemm semantics)."""
    _check_non_negative(max_len=max_len)
    return _op("jagged_to_padded_dense", kernel)(values, offsets, max_len, padding_value)


def dense_to_jagged(
    dense: Tensor, offsets: Tensor, total_len: int | None = None, kernel: Kernel = Kernel.PYTORCH
) -> Tensor:
    """dense [B, N, D] -> [L, D]. Pass ``total_len`` (L, a SymInt from an input shape) under export;
    None reads ``offsets[-1]`` in eager and gives an unbacked size under tracing."""
    return _op("dense_to_jagged", kernel)(dense, offsets, total_len)


def concat_2D_jagged(
    values_left: Tensor,
    offsets_left: Tensor,
    values_right: Tensor,
    offsets_right: Tensor,
    kernel: Kernel = Kernel.PYTORCH,
) -> Tensor:
    """[La, D], [Lb, D] -> [La+Lb, D]: sequence b is left_b then right_b
    (output offsets = offsets_left + offsets_right)."""
    return _op("concat_2D_jagged", kernel)(values_left, offsets_left, values_right, offsets_right)


def split_2D_jagged(
    values: Tensor,
    offsets_left: Tensor,
    offsets_right: Tensor,
    total_len_left: int,
    total_len_right: int,
    kernel: Kernel = Kernel.PYTORCH,
) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`concat_2D_jagged`: [La+Lb, D] -> ([La, D], [Lb, D])."""
    return _op("split_2D_jagged", kernel)(
        values, offsets_left, offsets_right, total_len_left, total_len_right
    )
