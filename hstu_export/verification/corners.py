"""The batches verification runs, derived from the schema and the exported ranges.

The corners of the ranges (every dynamic dim, the number of users and each lengths feature, at its minimum
and its maximum, alone and combined: 1 user with 1 history item and 1 candidate, the maximum batch with
every user at the minimum, ...), batches mixing the shortest and the longest users, then seeded random
batches. ``settle_ranges`` finds the ranges a compiled program really takes (docs/PACKAGE.md, "Every
request inside the ranges").
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import VerificationError
from hstu_export.package.ranges import ExportRanges, exported_schema
from hstu_export.package.schema import InputSchema
from hstu_export.verification.batch import generate_batch
from hstu_export.verification.parity import first_line

# Every dynamic dim at its minimum and maximum, all combinations up to this many dims; beyond, each dim at
# one extreme with the others at the other (2 * dims + 2 corners).
ALL_COMBINATIONS_UP_TO = 4


def dynamic_dims(schema: InputSchema, ranges: ExportRanges) -> list[tuple[str, int, int]]:
    """(name, min, max) of every dim a request can vary: ``batch`` (users), and each lengths feature whose
    keys do not share another's lengths and whose range is not one fixed value (every user's length)."""
    dims = [("batch", 1, ranges.max_batch_size)] if ranges.max_batch_size > 1 else []
    for f in schema.lengths_features():
        lo, hi = ranges.min_lengths[f.name], ranges.max_lengths[f.name]
        if not f.same_as and lo != hi:
            dims.append((f.name, lo, hi))
    return dims


def corner_sizes(schema: InputSchema, ranges: ExportRanges) -> list[dict[str, int]]:
    """The corners of the exported ranges, each ``{dim: value}`` over :func:`dynamic_dims` (a lengths
    feature's value is every user's length): every dim at its minimum and at its maximum, alone and
    combined; with more than ``ALL_COMBINATIONS_UP_TO`` dims, all at one extreme, and each dim at one extreme
    with the rest at the other."""
    dims = dynamic_dims(schema, ranges)
    if len(dims) <= ALL_COMBINATIONS_UP_TO:
        picks = list(itertools.product((0, 1), repeat=len(dims)))
    else:
        n = len(dims)
        picks = [(0,) * n, (1,) * n]
        for i in range(n):
            picks += [tuple(int(j == i) for j in range(n)), tuple(int(j != i) for j in range(n))]
    return [{name: (hi if pick else lo) for (name, lo, hi), pick in zip(dims, chosen)} for chosen in picks]


def corner_batch(schema: InputSchema, ranges: ExportRanges, sizes: dict[str, int], seed: int) -> dict[str, Tensor]:
    """A batch at the given dims (:func:`corner_sizes`); dims not given are at their maximum (the batch) or
    their only value."""
    users = sizes.get("batch", 1 if ranges.max_batch_size == 1 else ranges.max_batch_size)
    lengths = {f.name: [sizes.get(f.name, ranges.max_lengths[f.name])] * users
               for f in schema.lengths_features() if not f.same_as}
    return generate_batch(exported_schema(schema, ranges), users, seed=seed, lengths=lengths)


def describe_sizes(sizes: dict[str, int], dims: list[tuple[str, int, int]]) -> str:
    """``B=1, uih_lengths=1 (min), candidate_lengths=20 (max)``."""
    parts = []
    for name, lo, hi in dims:
        value = sizes[name]
        where = " (min)" if value == lo else " (max)" if value == hi else ""
        parts.append(f"B={value}" if name == "batch" else f"{name}={value}{where}")
    return ", ".join(parts) or "the only size"


def verification_batches(
    schema: InputSchema, ranges: ExportRanges, seed: int, num_random: int
) -> list[tuple[str, dict[str, Tensor]]]:
    """(label, batch) pairs: the corners of the ranges (:func:`corner_sizes`), batches mixing the shortest
    and the longest users, then ``num_random`` seeded random batches."""
    # Lengths drawn where none are given stay inside the exported ranges, not the model's own (wider) ones.
    bounded = exported_schema(schema, ranges)
    lengths = [f for f in bounded.lengths_features() if not f.same_as]
    dims = dynamic_dims(schema, ranges)
    b_max = ranges.max_batch_size
    cases: list[tuple[str, dict[str, Tensor]]] = []
    for i, sizes in enumerate(corner_sizes(schema, ranges)):
        cases.append((f"corner: {describe_sizes(sizes, dims)}", corner_batch(schema, ranges, sizes, seed + i)))

    def mixed(users: int) -> dict[str, list[int]]:
        return {f.name: [ranges.min_lengths[f.name] if u % 2 == 0 else ranges.max_lengths[f.name]
                         for u in range(users)] for f in lengths}

    base = seed + len(cases)
    if b_max >= 2:
        cases.append(("mixed: the shortest and the longest user in one batch",
                      generate_batch(bounded, 2, seed=base, lengths=mixed(2))))
    if b_max >= 3:
        cases.append((f"mixed: {b_max} users alternating shortest and longest",
                      generate_batch(bounded, b_max, seed=base + 1, lengths=mixed(b_max))))
    gen = torch.Generator().manual_seed(seed)
    for i in range(num_random):
        b = int(torch.randint(1, b_max + 1, (1,), generator=gen))
        chosen = {
            f.name: torch.randint(ranges.min_lengths[f.name], ranges.max_lengths[f.name] + 1, (b,), generator=gen).tolist()
            for f in lengths
        }
        cases.append((f"random batch {i + 1} (B={b})", generate_batch(bounded, b, seed=seed + 10 + i, lengths=chosen)))
    return cases


# -- ranges the compiled program really takes ---------------------------------------------------------

NARROWING_ROUNDS = 8


def _refusal(run: Callable[[dict[str, Tensor]], Any], batch: dict[str, Tensor]) -> str | None:
    try:
        run(batch)
    except Exception as exc:
        # The program's own words: a predictor names the refusal for its callers, raised from them.
        return first_line(exc.__cause__ if exc.__cause__ is not None else exc)
    return None


def _narrowed(schema: InputSchema, ranges: ExportRanges, name: str, at_min: bool, value: int) -> ExportRanges:
    if name == "batch":
        return dataclasses.replace(ranges, max_batch_size=value)
    lows, highs = dict(ranges.min_lengths), dict(ranges.max_lengths)
    for f in schema.lengths_features():
        if schema.canonical_lengths(f.name) == name:
            (lows if at_min else highs)[f.name] = value
    return ExportRanges(ranges.max_batch_size, highs, lows)


def _nearest_taken(run: Callable[[dict[str, Tensor]], Any], schema: InputSchema, ranges: ExportRanges,
                   sizes: dict[str, int], name: str, inward: list[int], seed: int) -> int | None:
    """The first of ``inward`` (values of dim ``name``, from the refused extreme inwards) at which the
    package takes the corner ``sizes``; a binary search that assumes a refusal at a value means one at
    every value before it."""
    def takes(value: int) -> bool:
        return _refusal(run, corner_batch(schema, ranges, {**sizes, name: value}, seed)) is None

    if not inward or not takes(inward[-1]):
        return None
    first, last = 0, len(inward) - 1  # inward[last] is taken
    while first < last:
        middle = (first + last) // 2
        if takes(inward[middle]):
            last = middle
        else:
            first = middle + 1
    return inward[first]


def settle_ranges(run: Callable[[dict[str, Tensor]], Any], schema: InputSchema, ranges: ExportRanges,
                  seed: int) -> tuple[ExportRanges, list[dict[str, Any]]]:
    """The ranges the package serves at every corner, and what had to be narrowed to get there.

    Runs the package (``run``) alone on every corner of ``ranges``. Where it refuses one, each dim at an
    extreme of that corner is moved inward to the nearest value the package takes, and the dim needing the
    smallest move is narrowed; then the corners of the narrower ranges run again. The number of users is
    never narrowed below 1. Returns the final ranges and one record per narrowed bound (``feature``,
    ``bound``, ``declared``, ``exported``, ``reason``). Raises VerificationError when no narrowing makes a
    refused corner pass."""
    declared = {("batch", False): ranges.max_batch_size,
                **{(name, True): ranges.min_lengths[name] for name in ranges.min_lengths},
                **{(name, False): ranges.max_lengths[name] for name in ranges.max_lengths}}
    narrowed: dict[tuple[str, bool], dict[str, Any]] = {}
    for _ in range(NARROWING_ROUNDS):
        dims = dynamic_dims(schema, ranges)
        refusal = None
        for sizes in corner_sizes(schema, ranges):
            message = _refusal(run, corner_batch(schema, ranges, sizes, seed))
            if message is not None:
                refusal = (sizes, message)
                break
        if refusal is None:
            return ranges, list(narrowed.values())
        sizes, message = refusal
        best: tuple[float, str, bool, int] | None = None
        for name, lo, hi in dims:
            value = sizes[name]
            if name == "batch" and value == lo:
                continue  # a package always takes one user
            inward = list(range(value + 1, hi + 1)) if value == lo else list(range(value - 1, lo - 1, -1))
            taken = _nearest_taken(run, schema, ranges, sizes, name, inward, seed)
            if taken is not None:
                move = abs(taken - value) / max(hi - lo, 1)
                if best is None or move < best[0]:
                    best = (move, name, value == lo, taken)
        if best is None:
            raise VerificationError(
                f"the package refuses a request inside its ranges ({describe_sizes(sizes, dims)}: {message}) and no "
                "narrower range avoids it; nothing was written")
        _, name, at_min, value = best
        narrowed[(name, at_min)] = {"feature": "batch size" if name == "batch" else name,
                                    "bound": "min" if at_min else "max", "declared": declared[(name, at_min)],
                                    "exported": value, "reason": message[:300]}
        ranges = _narrowed(schema, ranges, name, at_min, value)
    raise VerificationError(f"the package still refuses requests inside its ranges after {NARROWING_ROUNDS} "
                            "narrowings; nothing was written")


def narrowing_note(record: dict[str, Any]) -> str:
    """One line: which range was narrowed, to what, and why."""
    relation = ">=" if record["bound"] == "min" else "<="
    return (f"{record['feature']} narrowed to {relation} {record['exported']} (declared {record['declared']}): the "
            f"compiled program refuses requests beyond it ({record['reason']})")
