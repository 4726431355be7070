"""Functions that stay single call nodes in FX graphs.

Two kinds live here:
- markers (``sparse_boundary``) that name the sparse→dense boundary and survive tracing as nodes the
  split pass cuts at;
- small helpers whose bodies cannot be symbolically traced (they build a KeyedJaggedTensor, a
  JaggedTensor or a KeyedTensor), so FX records a call instead of stepping into them.

(Token positions inside jagged sequences are the ``hstu_export::jagged_positions`` op, not a helper here, so
that the mapping pass can pick their implementation per target.)

The tracer auto-wraps every function in ``WRAPPED_FUNCTIONS`` wherever a module's forward calls it, so
models may import these by name. Keep them TorchScript-compatible (type hints, no closures): the sparse
graph is scripted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.fx.node import has_side_effect
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def sparse_boundary(value: Tensor, name: str, jagged_by: str = "", dim0: str = "") -> Tensor:
    """Identity that marks ``value`` as a tensor crossing from the sparse to the dense part.

    ``name`` becomes the dense graph's input name; ``jagged_by`` names the model input holding the
    per-user lengths that partition ``value``'s first dim ("" for a dense per-user tensor [B, ...]).
    ``dim0`` states the first dim symbolically instead (``batch``, ``batch+1``, ``<lengths>.total``,
    ``none`` for a 0-d tensor); the automatic marking pass sets it.
    """
    return value


def build_kjt(keys: list[str], values: list[Tensor], lengths: list[Tensor]) -> KeyedJaggedTensor:
    """KeyedJaggedTensor from per-key values and lengths (every key has one length per user)."""
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def build_weighted_kjt(
    keys: list[str], values: list[Tensor], lengths: list[Tensor], weights: list[Tensor]
) -> KeyedJaggedTensor:
    """Like :func:`build_kjt`, with per-value weights."""
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=torch.cat(weights)
    )


def build_jt(values: Tensor, lengths: Tensor) -> JaggedTensor:
    """JaggedTensor from its values and per-user lengths."""
    return JaggedTensor(values=values, lengths=lengths)


def build_weighted_jt(values: Tensor, lengths: Tensor, weights: Tensor) -> JaggedTensor:
    """Like :func:`build_jt`, with per-value weights."""
    return JaggedTensor(values=values, lengths=lengths, weights=weights)


def build_kt(keys: list[str], tensors: list[Tensor]) -> KeyedTensor:
    """KeyedTensor (key dim 1) from per-key ``[B, dim]`` tensors."""
    return KeyedTensor.from_tensor_list(keys, tensors, key_dim=1)


def int_to_tensor(value: int) -> Tensor:
    """A Python int computed by the sparse part, carried across the boundary as a 0-d int64 tensor."""
    return torch.tensor(value, dtype=torch.int64)


def tensor_to_int(value: Tensor) -> int:
    """The dense part's side of :func:`int_to_tensor` (an integer tensor's value; under torch.export an
    unbacked size, which ``int()`` of it would demand as a number)."""
    if torch.jit.is_scripting():
        return int(value.item())
    return value.item()  # type: ignore[return-value]


@torch.jit.unused
def _check_le(value: int, bound: int) -> None:
    # torch._check, not assert: under torch.export it becomes a runtime assertion of the program.
    torch._check(value <= bound, lambda: f"a length of {value} is beyond the exported bound of {bound}")


@has_side_effect
def check_at_most(value: int, bound: int) -> int:
    """``value``, after checking it is at most ``bound`` (the static bound a mapped foreign op pads to):
    a runtime assertion in exported programs, so a larger value fails instead of being cut short."""
    if torch.jit.is_scripting():
        assert value <= bound, "a length is beyond the exported bound"
    else:
        _check_le(value, bound)
    return value


@has_side_effect
def check_lengths_at_most(offsets: Tensor, bound: int) -> Tensor:
    """``offsets``, after checking no sequence they delimit is longer than ``bound`` (where a foreign
    jagged op would have cut it to ``bound`` rows and ours keeps it whole)."""
    if offsets.numel() > 1:
        if torch.jit.is_scripting():
            assert int((offsets[1:] - offsets[:-1]).max().item()) <= bound, "a sequence is longer than its bound"
        else:
            _check_le((offsets[1:] - offsets[:-1]).max().item(), bound)
    return offsets


def length_beyond(offsets: Tensor, bound: int) -> Tensor:
    """``check_lengths_at_most``'s condition left on the device: a 0-d int64 tensor, 1 when a sequence
    ``offsets`` delimit is longer than ``bound`` (passes/defer_length_checks.py)."""
    return ((offsets[1:] - offsets[:-1]) > bound).any().to(torch.int64)


@torch.jit.unused
def _check_none_beyond(beyond: int) -> None:
    torch._check(beyond == 0, lambda: "a sequence is longer than the bound the model's own op would cut it to")


@has_side_effect
def check_no_length_beyond(flags: list[Tensor]) -> None:
    """Fails when any of ``flags`` (:func:`length_beyond`) is set: the length checks of a graph read back
    from the device at once (a runtime assertion in exported programs)."""
    beyond = torch.stack(flags).sum()
    if torch.jit.is_scripting():
        assert int(beyond.item()) == 0, "a sequence is longer than the bound the model's own op would cut it to"
    else:
        _check_none_beyond(beyond.item())


# A bound check_ranges is given where a feature has none (passes/guard_ranges.py).
NO_LIMIT = 2**62


@torch.jit.unused
def _check_at_least(found: int, low: int, what: str) -> None:
    torch._check(found >= low, lambda: f"{what} has value {found}, below the exported minimum {low}")


@torch.jit.unused
def _check_at_most(found: int, high: int, what: str, kind: str) -> None:
    torch._check(found <= high, lambda: f"{what} has {kind} {found}, beyond the exported maximum {high}")


@torch.jit.unused
def _check_ranges_eager(values: list[Tensor], lows: list[int], highs: list[int], rows: list[int],
                        names: list[str]) -> None:
    # Every feature's minimum, maximum and number of rows in one copy to the host: one wait for the device in
    # a compiled program, not three a feature; the reads after it are of host memory. The number of rows is
    # read as data so that a compiled program checks it at run time (its input dims are not checked unless
    # asked for). Each feature's values are read with its minimum beside them, which changes neither check
    # and keeps an empty feature from being a case of its own.
    read = []
    for value, low in zip(values, lows, strict=True):
        device = value.device
        padded = torch.cat([value.reshape(-1).long(), torch.full((1,), low, dtype=torch.int64, device=device)])
        lowest, highest = torch.aminmax(padded)
        read.append(torch.stack([lowest, highest, torch.full((), value.size(0), dtype=torch.int64, device=device)]))
    if not read:
        return
    found = torch.cat(read).cpu()
    for i, (low, high, most, what) in enumerate(zip(lows, highs, rows, names, strict=True)):
        if low > -NO_LIMIT:
            _check_at_least(found[3 * i].item(), low, what)  # type: ignore[arg-type]
        if high < NO_LIMIT:
            _check_at_most(found[3 * i + 1].item(), high, what, "value")  # type: ignore[arg-type]
        if most < NO_LIMIT:
            _check_at_most(found[3 * i + 2].item(), most, what, "rows")  # type: ignore[arg-type]


@has_side_effect
def check_ranges(values: list[Tensor], lows: list[int], highs: list[int], rows: list[int],
                 names: list[str]) -> list[Tensor]:
    """``values``, after checking that each has at most ``rows[i]`` rows and values in [lows[i], highs[i]]:
    the request features a graph takes, checked by the artifact itself (asserts in TorchScript, runtime
    assertions in exported programs).

    In TorchScript all the features' extremes come to the host in one read: on a GPU each read waits for
    the device and costs the host a round trip (a feature's minimum and maximum read apart would be two, ten
    of them a sparse half: docs/PERF_INVESTIGATIONS.md, "KV-cached serving: host round trips")."""
    if torch.jit.is_scripting():
        for i in range(len(values)):
            assert values[i].size(0) <= rows[i], names[i] + " has more rows than the package was exported for"
        # One kernel a feature and one stack of every extreme: ``.long()`` of an int64 extreme is no kernel.
        extremes: list[Tensor] = []
        checked: list[int] = []
        for i in range(len(values)):
            if values[i].numel() > 0:
                lowest, highest = torch.aminmax(values[i])
                extremes.append(lowest.long().to(values[0].device))
                extremes.append(highest.long().to(values[0].device))
                checked.append(i)
        if len(extremes) > 0:
            found: list[int] = torch.stack(extremes).tolist()
            for j in range(len(checked)):
                i = checked[j]
                assert found[2 * j] >= lows[i], names[i] + " has a value below the exported range"
                assert found[2 * j + 1] <= highs[i], names[i] + " has a value beyond the exported range"
    else:
        _check_ranges_eager(values, lows, highs, rows, names)
    return values


# The meta key of a check_ranges node listing, per value, whether it may be clamped to its range instead of checked
# (ids may; lengths may not: a clamped length would no longer match its values).
CLAMPABLE = "clampable"


def clamp_to_ranges(values: list[Tensor], lows: list[int], highs: list[int], clampable: list[bool]) -> list[Tensor]:
    """``values``, each clamped into [lows[i], highs[i]] where ``clampable[i]`` (a bound of NO_LIMIT is none): what a
    program takes in place of :func:`check_ranges` when its callers check the ranges on the host before. It needs no
    read from the device, and no id it passes on can be outside the tables, whatever the caller checked."""
    out = []
    for value, low, high, clamp in zip(values, lows, highs, clampable, strict=True):
        low_bound, high_bound = (low if low > -NO_LIMIT else None), (high if high < NO_LIMIT else None)
        if clamp and (low_bound is not None or high_bound is not None):
            value = value.clamp(low_bound, high_bound)
        out.append(value)
    return out


def to_dtype_of(value: Tensor, like: Tensor) -> Tensor:
    """A floating ``value`` in ``like``'s dtype (the cast autocast makes before a layer;
    passes/follow_parameter_dtypes.py); any other tensor as it is."""
    if value.is_floating_point() and value.dtype != like.dtype:
        return value.to(like.dtype)
    return value


def to_floating_dtype(value: Tensor, dtype: torch.dtype) -> Tensor:
    """A floating ``value`` in ``dtype``; any other tensor as it is (follow_parameter_dtypes, at joins)."""
    if value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def per_user_as_jagged(value: Tensor) -> Tensor:
    """Per-user ids ``[B]`` as jagged values with length 1 each: ``[B]`` -> lengths ``[B]`` of ones."""
    return torch.ones_like(value)


WRAPPED_FUNCTIONS: tuple[Callable[..., object], ...] = (
    sparse_boundary,
    build_kjt,
    build_weighted_kjt,
    build_jt,
    build_weighted_jt,
    build_kt,
    per_user_as_jagged,
    int_to_tensor,
    tensor_to_int,
    check_at_most,
    check_lengths_at_most,
    length_beyond,
    check_no_length_beyond,
    check_ranges,
    to_dtype_of,
    to_floating_dtype,
)

for _fn in WRAPPED_FUNCTIONS:
    torch.fx.wrap(_fn.__name__)
