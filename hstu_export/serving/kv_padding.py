"""Shape buckets for a derived delta program: a padding user appended to the request.

A derived program's CUDA graphs are keyed by its inputs' exact shapes (``runtimes/shape_graphs.py``), and
those follow the request's token counts: a history that grows by a different number of items on each request
would never replay a graph. A padding user, appended last, rounds each count up to a step, so that requests of
nearby sizes share a shape:

- each lengths feature's total (its jagged features' rows) to a multiple of ``HISTORY_STEP`` rows (of half the
  feature's maximum where that is less), or of ``TARGET_STEP`` for the lengths the targets are counted from (of
  their maximum where less); the padding user's rows are copies of the request's first rows, so its ids and
  values are in the ranges the package was exported for, and its per-user features are the first user's;
- the new rows (``kv_new_rows``) to a multiple of ``NEW_ROWS_STEP`` (of the fewest stored rows a padding user has,
  plus one, where less): the padding user's history is at least a step long, and all of it but what puts the new
  rows on a step is given to it as cached, so that few of its rows are computed; its page table row is the
  cache's scratch page, so that what it reads as cached and what it stores are the scratch page's, read by no
  one else;
- the page table's width to a power of two (within the widest the program takes).

The padding user attends only to itself, and its rows of the outputs are dropped (it is last: the outputs' last
rows). Whether an output's rows follow the users, one of the request's jagged features, or the targets is read
off the compiled program's output shapes at export (the manifest's ``kv_cache.padding.rows_of``), and the export
serves its verification requests padded and compares them with the model: a package whose answers change with a
padding user records no ``padding`` and runs each shape as it is. A request with no room for one more user (the
package's maximum batch) runs as it is, as does one for which no lengths in range land on a step. The C++ runtime
pads by the same rules (``runtimes/cpp/src/kv_padding.cpp``), so that both answer bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import PackageError

HISTORY_STEP = 64  # rows; the zoo's written program rounds its new history tokens to the same
TARGET_STEP = 32
NEW_ROWS_STEP = 64
# What the rows of an output follow, besides an input's name: nothing (a shape that no user changes).
UNCHANGED = ""


@dataclass(frozen=True)
class Padded:
    """A request with the padding user last: the request, how many users are real, and each feature's rows that
    belong to the padding user (by name; the per-user features have one)."""

    request: dict[str, Tensor]
    users: int
    pad_rows: dict[str, int]


class RequestPadding:
    """Pads a derived program's requests into shape buckets (module docstring). ``schema``: the package's input
    schema; ``rows_of``: the manifest's ``kv_cache.padding.rows_of``; ``target_inputs``: the graph names of the
    lengths the targets are counted from; ``max_batch``: the package's; ``max_width``: the page table's widest."""

    def __init__(self, schema: Any, rows_of: dict[str, str], target_inputs: list[str], max_batch: int,
                 max_width: int, check: Callable[[dict[str, Tensor]], dict[str, Tensor]]) -> None:
        self.schema = schema
        self.check = check  # a request validated against the schema, as plain tensors (RequestError if not)
        self.rows_of = dict(rows_of)
        self.max_batch = max_batch
        self.max_width = max_width
        lengths = schema.lengths_features()
        self._canonical = {f.name: schema.canonical_lengths(f.name) for f in lengths}
        self._groups = [f for f in lengths if self._canonical[f.name] == f.name]
        self._targets = {f.name for f in self._groups if f.graph_name in target_inputs}
        # The new rows' step: at most the fewest stored rows a padding user has, plus one, so that its cached count
        # can always take the new rows to a step (and the step is the same on every call).
        least = sum(_steps(f, False)[1] for f in self._groups if f.name not in self._targets)
        self.new_rows_step = max(1, min(NEW_ROWS_STEP, least + 1))

    @staticmethod
    def from_manifest(section: dict[str, Any], predictor: Any) -> RequestPadding | None:
        """The padding of a package's ``kv_cache`` section (``predictor``: the loaded package), None where it
        records none; PackageError naming the field where it is malformed (a package from disk is untrusted)."""
        spec = section.get("padding")
        if spec is None:
            return None
        rows_of = spec.get("rows_of") if isinstance(spec, dict) else None
        known = {UNCHANGED, "kv_cached", "kv_page_table", "kv_target_rows", *predictor.input_schema.names}
        if (not isinstance(rows_of, dict) or set(rows_of) != set(section.get("outputs", []))
                or not all(isinstance(v, str) and v in known for v in rows_of.values())):
            raise PackageError(f"{predictor.root}: manifest field kv_cache.padding.rows_of: is not an object naming, "
                               f"for each output, the request feature or cache input whose rows it follows (or \"\")")
        width = -(-int(section["max_seq_len"]) // int(section["page_size"]))
        return RequestPadding(predictor.input_schema, rows_of, list(section.get("target_inputs", [])),
                              predictor.max_batch_size, width, predictor.check_request)

    def pad(self, request: dict[str, Tensor], users: int) -> Padded | None:
        """``request`` (checked) with a padding user appended; None where it has no room for one (or is not of
        ``users`` users: refused as it is), or no lengths in range round its counts to a step."""
        if users + 1 > self.max_batch or any(request[f.name].shape[0] != users for f in self._groups):
            return None
        lengths: dict[str, int] = {}
        for f in self._groups:
            n = _pad_length(int(request[f.name].to(torch.int64).sum()), f, f.name in self._targets)
            if n is None:
                return None
            lengths[f.name] = n
        out: dict[str, Tensor] = {}
        pad_rows: dict[str, int] = {}
        for f in self.schema.features:
            value = request[f.name]
            if f.kind == "jagged":
                n = lengths[self._canonical[f.jagged_by]]
                if n and not value.shape[0]:
                    return None  # no rows to copy
                rows = value[torch.arange(n, device=value.device) % max(value.shape[0], 1)] if n else value[:0]
            elif f.kind == "lengths":
                n, rows = 1, value.new_full((1,), lengths[self._canonical[f.name]])
            else:
                n, rows = 1, value[:1]
            out[f.name] = torch.cat([value, rows])
            pad_rows[f.name] = n
        return Padded(out, users, pad_rows)

    def cached(self, seq_lengths: list[int], stored: list[int], cached: list[int]) -> int:
        """The padding user's cached count (the last of ``seq_lengths``' users): the most, of at most its stored
        rows, that puts the call's new rows on a step, so that few of its rows are computed."""
        targets = seq_lengths[-1] - stored[-1]
        new = sum(s - c for s, c in zip(seq_lengths[:-1], cached, strict=True)) + targets
        return max(0, stored[-1] - (-new) % self.new_rows_step)

    def width(self, width: int) -> int:
        """The page table's width in a bucket: a power of two, within the widest (a wider one keeps its own)."""
        return min(max(1 << (width - 1).bit_length(), width), max(self.max_width, width))

    def unpad(self, outputs: dict[str, Tensor], padded: Padded, targets: int) -> dict[str, Tensor]:
        """The real users' rows of ``outputs`` (the padding user's come last); ``targets``: the padding user's
        target count (an output whose rows follow the targets)."""
        pads = {**padded.pad_rows, "kv_cached": 1, "kv_page_table": 1, "kv_target_rows": targets}
        out = {}
        for name, value in outputs.items():
            follows = self.rows_of.get(name, UNCHANGED)
            out[name] = value if follows == UNCHANGED else value[:value.shape[0] - pads[follows]]
        return out


def _steps(f: Any, target: bool) -> tuple[int, int]:
    """(step, least length) of lengths feature ``f``'s padding: its total goes to a multiple of the step. A history
    feature's padding is at least a step long (its step is at most half its maximum), so that the padding user has
    rows to hold as cached; a target feature's, at least one row."""
    top = f.max_value
    step = TARGET_STEP if target else HISTORY_STEP
    if top is not None:
        step = max(1, min(step, top if target else (top + 1) // 2))
    return step, max(f.min_value or 0, 1 if target else step)


def _pad_length(total: int, f: Any, target: bool) -> int | None:
    """The padding user's length of lengths feature ``f`` (whose request total is ``total``): the least from
    :func:`_steps` that takes the total to a step; None where that is beyond the feature's maximum."""
    step, least = _steps(f, target)
    n = least + (-(total + least)) % step
    return None if f.max_value is not None and n > f.max_value else n
