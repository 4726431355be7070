"""``torch.library`` registrations of the ``hstu_export::*`` custom ops.

Each op is one opaque node in FX traces and ``torch.export`` graphs (``torch.ops.hstu_export.<name>.default``);
its schema is inferred from the eager kernel's signature below (``int`` -> ``SymInt``) and equals the
positional parameter order of the matching ``*_reference`` function in :mod:`hstu_export.ops.reference`.
Fake kernels give output shapes for tracing; autograd recomputes through the eager kernel.

Eager kernels may sync with the host (the op is opaque to tracers): the attention ops pad to the
batch's longest sequence instead of the static bound, which only saves work.

Importing this module registers the ops once; importing or reloading it again is a no-op.

This module deliberately has no ``from __future__ import annotations``: ``custom_op`` infers the
schema from the runtime annotations.
"""

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hstu_export.errors import ConfigError
from hstu_export.ops.jagged import dense_to_jagged_eager, jagged_to_padded_dense_eager
from hstu_export.ops.reference import (
    cached_hstu_mha_reference,
    concat_2D_jagged_reference,
    hstu_mha_gated_reference,
    hstu_mha_reference,
    jagged_positions_reference,
    split_2D_jagged_reference,
)

NAMESPACE = "hstu_export"
OP_NAMES = (
    "hstu_mha",
    "cached_hstu_mha",
    "jagged_to_padded_dense",
    "dense_to_jagged",
    "concat_2D_jagged",
    "split_2D_jagged",
    "jagged_positions",
    "hstu_mha_gated",
)


def _padded_len(seq_offsets: Tensor, max_seq_len: int, op: str, delta_size: int = 0) -> int:
    """The padded size for the attention kernels: the batch's longest sequence (checked against the
    bounds), or the static ``max_seq_len`` when the tensors are being traced (an AOT-autograd
    backward recompute), where no host sync is possible."""
    if is_fake(seq_offsets):
        return max_seq_len
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    if lengths.numel() == 0:
        return 0
    longest, shortest = int(lengths.max()), int(lengths.min())
    if longest > max_seq_len:
        raise ConfigError(
            f"{op}: a sequence has {longest} tokens but max_seq_len is {max_seq_len}; "
            "raise max_seq_len in the model config or truncate the input sequences"
        )
    if shortest < delta_size:
        raise ConfigError(
            f"{op}: a sequence has {shortest} tokens, fewer than delta_size={delta_size}; "
            "every sequence must hold its delta tokens"
        )
    return longest


# ---- eager kernels (their signatures are the op schemas) ----------------------------------------


def _hstu_mha(
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
    padded_len = _padded_len(seq_offsets, max_seq_len, "hstu_mha")
    return hstu_mha_reference(
        q, k, v, seq_offsets, padded_len, scaling_seqlen, alpha, causal, num_targets,
        contextual_seq_len, max_attn_len,
    )  # fmt: skip


def _cached_hstu_mha(
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
    padded_len = _padded_len(seq_offsets, max_seq_len, "cached_hstu_mha", delta_size)
    return cached_hstu_mha_reference(
        delta_q, k, v, seq_offsets, delta_size, padded_len, scaling_seqlen, alpha, num_targets,
        contextual_seq_len, max_attn_len,
    )  # fmt: skip


def _jagged_to_padded_dense(
    values: Tensor, offsets: Tensor, max_len: int, padding_value: float = 0.0
) -> Tensor:
    return jagged_to_padded_dense_eager(values, offsets, max_len, padding_value)


def _dense_to_jagged(dense: Tensor, offsets: Tensor, total_len: int | None = None) -> Tensor:
    return dense_to_jagged_eager(dense, offsets, total_len)


def _concat_2D_jagged(
    values_left: Tensor, offsets_left: Tensor, values_right: Tensor, offsets_right: Tensor
) -> Tensor:
    return concat_2D_jagged_reference(values_left, offsets_left, values_right, offsets_right)


def _split_2D_jagged(
    values: Tensor, offsets_left: Tensor, offsets_right: Tensor, total_len_left: int, total_len_right: int
) -> tuple[Tensor, Tensor]:
    return split_2D_jagged_reference(values, offsets_left, offsets_right, total_len_left, total_len_right)


def _jagged_positions(offsets: Tensor, total_len: int) -> tuple[Tensor, Tensor]:
    return jagged_positions_reference(offsets, total_len)


def _hstu_mha_gated(
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
    padded_len = _padded_len(seq_offsets, max_seq_len, "hstu_mha_gated")
    return hstu_mha_gated_reference(
        uvqk, seq_offsets, norm_weight, norm_bias, num_heads, attention_dim, linear_dim, padded_len,
        scaling_seqlen, alpha, causal, num_targets, contextual_seq_len, max_attn_len, eps,
    )  # fmt: skip


# ---- fake kernels -------------------------------------------------------------------------------


def _hstu_mha_fake(q, k, v, seq_offsets, max_seq_len, scaling_seqlen, alpha, causal=True,
                   num_targets=None, contextual_seq_len=0, max_attn_len=0):  # fmt: skip
    return v.new_empty((q.size(0), q.size(1), v.size(2)))


def _cached_hstu_mha_fake(delta_q, k, v, seq_offsets, delta_size, max_seq_len, scaling_seqlen, alpha,
                          num_targets=None, contextual_seq_len=0, max_attn_len=0):  # fmt: skip
    return v.new_empty((delta_q.size(0), delta_q.size(1), v.size(2)))


def _jagged_to_padded_dense_fake(values, offsets, max_len, padding_value=0.0):
    return values.new_empty((offsets.size(0) - 1, max_len, *values.shape[1:]))


def _dense_to_jagged_fake(dense, offsets, total_len=None):
    if total_len is None:
        total_len = torch.library.get_ctx().new_dynamic_size()
    return dense.new_empty((total_len, *dense.shape[2:]))


def _concat_2D_jagged_fake(values_left, offsets_left, values_right, offsets_right):
    return values_left.new_empty((values_left.size(0) + values_right.size(0), *values_left.shape[1:]))


def _split_2D_jagged_fake(values, offsets_left, offsets_right, total_len_left, total_len_right):
    rest = values.shape[1:]
    return values.new_empty((total_len_left, *rest)), values.new_empty((total_len_right, *rest))


def _jagged_positions_fake(offsets, total_len):
    return offsets.new_empty((total_len,), dtype=torch.int64), offsets.new_empty((total_len,), dtype=torch.int64)


def _hstu_mha_gated_fake(uvqk, seq_offsets, norm_weight, norm_bias, num_heads, attention_dim, linear_dim,
                         max_seq_len, scaling_seqlen, alpha, causal=True, num_targets=None,
                         contextual_seq_len=0, max_attn_len=0, eps=1e-6):  # fmt: skip
    return uvqk.new_empty((uvqk.size(0), 3 * num_heads * linear_dim))


# ---- autograd: recompute through the eager kernel and differentiate that ------------------------


def _recompute_autograd(forward: Callable, output_len_arg: int | None = None) -> tuple[Callable, Callable]:
    """Autograd that recomputes ``forward`` under grad mode. ``output_len_arg``: index of an optional
    length argument that, when None, is filled with the output's dim 0 (so a traced recompute never
    reads it from a tensor)."""

    def setup_context(ctx, inputs: Sequence, output) -> None:
        ctx.tensor_slots = [i for i, x in enumerate(inputs) if isinstance(x, Tensor)]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_slots))
        ctx.other_inputs = [None if isinstance(x, Tensor) else x for x in inputs]
        if output_len_arg is not None and ctx.other_inputs[output_len_arg] is None:
            ctx.other_inputs[output_len_arg] = output.size(0)

    def backward(ctx, *grads: Tensor | None):
        inputs = list(ctx.other_inputs)
        for slot, tensor in zip(ctx.tensor_slots, ctx.saved_tensors):
            inputs[slot] = tensor
        wanted = [i for i in ctx.tensor_slots if ctx.needs_input_grad[i] and inputs[i].is_floating_point()]
        with torch.enable_grad():
            for i in wanted:
                inputs[i] = inputs[i].detach().requires_grad_()
            outputs = forward(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        grads = tuple(torch.zeros_like(o) if g is None else g for g, o in zip(grads, outputs))
        computed = torch.autograd.grad(outputs, [inputs[i] for i in wanted], grads, allow_unused=True)
        result: list[Tensor | None] = [None] * len(inputs)
        for i, grad in zip(wanted, computed):
            result[i] = grad
        return tuple(result)

    return setup_context, backward


# ---- registration -------------------------------------------------------------------------------

# name -> (eager kernel, fake kernel, index of a length argument the backward takes from the output)
_KERNELS: dict[str, tuple[Callable, Callable, int | None]] = {
    "hstu_mha": (_hstu_mha, _hstu_mha_fake, None),
    "cached_hstu_mha": (_cached_hstu_mha, _cached_hstu_mha_fake, None),
    "jagged_to_padded_dense": (_jagged_to_padded_dense, _jagged_to_padded_dense_fake, None),
    "dense_to_jagged": (_dense_to_jagged, _dense_to_jagged_fake, 2),  # total_len
    "concat_2D_jagged": (_concat_2D_jagged, _concat_2D_jagged_fake, None),
    "split_2D_jagged": (_split_2D_jagged, _split_2D_jagged_fake, None),
    "jagged_positions": (_jagged_positions, _jagged_positions_fake, None),
    "hstu_mha_gated": (_hstu_mha_gated, _hstu_mha_gated_fake, None),
}


def _is_registered(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except AttributeError:
        return False
    return True


def register_ops() -> None:
    """Define every ``hstu_export::*`` op that is not defined yet (safe to call any number of times)."""
    for name, (eager, fake, output_len_arg) in _KERNELS.items():
        if _is_registered(name):
            continue
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", eager, mutates_args=())
        op.register_fake(fake)
        setup_context, backward = _recompute_autograd(eager, output_len_arg)
        op.register_autograd(backward, setup_context=setup_context)


register_ops()
