"""prove_length_reads: sizes and length checks read back from the device that a valid request already decides.

HSTU models read lengths from the data: ``int(lengths.sum().item())`` or the offsets' last value for a row
count, ``lengths.max()`` for a bound their jagged ops cut at. On a GPU each read waits for the device, which
then idles while the host launches what follows; and a program that reads cannot be replayed from a CUDA
graph. A request the package accepts has been checked against the export's ranges and its jagged features
against their lengths, so:

- the sum of a lengths feature is the rows of a tensor jagged by it: ``x.size(0)``, no read (a sum of
  features with counts, plus a constant a user, is the sum of their sizes and the batch's);
- a length check (``check_at_most``, ``check_lengths_at_most``, the flags of ``check_no_length_beyond``)
  whose bound is proven from those facts is dropped. Proven: each sequence's length, a sum of lengths
  features with non-negative counts, is at most the bound, a sum of maxima of the same kind (``max(a) +
  max(b) + 2`` bounds ``a + b + 2`` element by element); or a maximum is at most a constant, the export's
  largest lengths being the largest a request may hold.

A maximum read only by such checks is then dead, and eliminate_dead_code removes it. What a graph computes
is unchanged. Checks not proven stay, and so do their reads.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.nn.functional as F

from hstu_export.capture.graph_functions import (
    check_at_most,
    check_lengths_at_most,
    check_no_length_beyond,
    length_beyond,
    tensor_to_int,
)
from hstu_export.runtimes.symbolic import check_non_negative

if TYPE_CHECKING:
    from hstu_export.package.schema import InputSchema
    from hstu_export.passes.context import PassContext

_ADD = (operator.add, torch.add)
_SUB = (operator.sub, torch.sub)
_CASTS = ("to", "long", "int", "type")  # int casts keep a length's value


@dataclass(frozen=True)
class Lengths:
    """Per user: ``const + sum(count * lengths[feature])`` (features by canonical name)."""

    const: int = 0
    counts: tuple[tuple[str, int], ...] = ()

    def combine(self, other: Lengths, sign: int = 1) -> Lengths:
        counts = dict(self.counts)
        for name, count in other.counts:
            counts[name] = counts.get(name, 0) + sign * count
        return Lengths(self.const + sign * other.const, tuple(sorted((k, v) for k, v in counts.items() if v)))

    def scaled(self, k: int) -> Lengths:
        return Lengths(self.const * k, tuple((name, count * k) for name, count in self.counts if count * k))


@dataclass(frozen=True)
class Bound:
    """A scalar: ``const + sum(weight * max over users of lengths)``."""

    const: int = 0
    maxima: tuple[tuple[Lengths, int], ...] = ()

    def combine(self, other: Bound, sign: int = 1) -> Bound:
        maxima = dict(self.maxima)
        for lengths, weight in other.maxima:
            maxima[lengths] = maxima.get(lengths, 0) + sign * weight
        return Bound(self.const + sign * other.const, tuple((k, v) for k, v in maxima.items() if v))


@dataclass
class _Facts:
    """What a valid request guarantees about one graph's lengths inputs."""

    schema: InputSchema
    ranges: Any
    lengths: dict[str, str] = field(default_factory=dict)  # placeholder -> canonical lengths feature
    rows_of: dict[str, torch.fx.Node] = field(default_factory=dict)  # canonical lengths -> a tensor jagged by it

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, ctx: PassContext) -> _Facts:
        facts = cls(ctx.schema, ctx.ranges)  # type: ignore[arg-type]
        jagged = {t.name: t.jagged_by for t in (ctx.boundary.dense_inputs if ctx.boundary else ()) if t.jagged_by}
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            try:
                spec = facts.schema.get(str(n.target))
            except KeyError:
                spec = None
            by = jagged.get(str(n.target)) or (spec.jagged_by if spec is not None and spec.kind == "jagged" else "")
            if spec is not None and spec.kind == "lengths":
                facts.lengths[n.name] = facts.schema.canonical_lengths(spec.name)
            elif by:
                facts.rows_of.setdefault(facts.schema.canonical_lengths(by), n)
        return facts

    def largest(self, feature: str) -> int | None:
        return self.ranges.max_lengths.get(feature) if self.ranges is not None else None

    def smallest(self, feature: str) -> int | None:
        return self.ranges.min_lengths.get(feature) if self.ranges is not None else None

    # ---- per-user lengths ---------------------------------------------------------------------------

    def per_user(self, n: Any) -> Lengths | None:
        if isinstance(n, int) and not isinstance(n, bool):
            return Lengths(n)
        if not isinstance(n, torch.fx.Node):
            return None
        if n.op == "placeholder":
            feature = self.lengths.get(n.name)
            return Lengths(0, ((feature, 1),)) if feature else None
        if n.op == "call_method" and n.target in _CASTS and _int_cast(n):
            return self.per_user(n.args[0])
        if n.op == "call_function" and n.target is operator.getitem:
            return self._row_of_stacked(n)
        left, right, sign = _arithmetic(n)
        if sign:
            a, b = self.per_user(left), self.per_user(right)
            return a.combine(b, sign) if a is not None and b is not None else None
        if n.op == "call_function" and n.target in (operator.mul, torch.mul):
            a, b = n.args[:2]
            if isinstance(b, int) and not isinstance(b, bool):
                found = self.per_user(a)
                return found.scaled(b) if found is not None else None
            if isinstance(a, int) and not isinstance(a, bool):
                found = self.per_user(b)
                return found.scaled(a) if found is not None else None
        return None

    def _row_of_stacked(self, n: torch.fx.Node) -> Lengths | None:
        """``cat([l0, l1, ...]).view(k, -1)[i]``: how a KeyedJaggedTensor's per-key lengths are read."""
        source, index = n.args
        if not (isinstance(index, int) and isinstance(source, torch.fx.Node) and source.op == "call_method"
                and source.target in ("view", "reshape") and len(source.args) == 3 and source.args[2] == -1):
            return None
        cat = source.args[0]
        if not (isinstance(cat, torch.fx.Node) and cat.op == "call_function" and cat.target in (torch.cat, torch.concat)
                and not cat.kwargs.get("dim") and (len(cat.args) < 2 or cat.args[1] == 0)):
            return None
        parts = cat.args[0]
        if not isinstance(parts, (list, tuple)) or source.args[1] != len(parts) or not 0 <= index < len(parts):
            return None
        rows = [self.per_user(p) for p in parts]
        return rows[index] if all(r is not None for r in rows) else None  # all [B]: each a row of the view

    def of_offsets(self, n: Any) -> Lengths | None:
        """The lengths of offsets ``pad(cumsum(lengths), (1, 0))``, or of sums and differences of such offsets
        (the offsets of the lengths' sum or difference)."""
        if isinstance(n, torch.fx.Node) and n.op == "call_method" and n.target in _CASTS and _int_cast(n):
            return self.of_offsets(n.args[0])
        if isinstance(n, torch.fx.Node):
            left, right, sign = _arithmetic(n)
            if sign:
                a, b = self.of_offsets(left), self.of_offsets(right)
                return a.combine(b, sign) if a is not None and b is not None else None
        if not (isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is F.pad):
            return None
        source, pad = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("pad")
        value = n.args[3] if len(n.args) > 3 else n.kwargs.get("value")
        mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
        if tuple(pad or ()) != (1, 0) or mode != "constant" or value not in (None, 0, 0.0):
            return None
        if not (isinstance(source, torch.fx.Node) and source.op == "call_function" and source.target is torch.cumsum
                and (source.args[1] if len(source.args) > 1 else source.kwargs.get("dim")) in (0, -1)):
            return None
        return self.per_user(source.args[0])

    # ---- scalars ------------------------------------------------------------------------------------

    def scalar(self, n: Any) -> Bound | None:
        if isinstance(n, int) and not isinstance(n, bool):
            return Bound(n)
        if not isinstance(n, torch.fx.Node):
            return None
        if n.op == "call_function" and n.target is int and len(n.args) == 1:
            return self.scalar(n.args[0])
        if n.op == "call_function" and n.target is check_at_most:  # returns its value
            return self.scalar(_bound_arguments(n, ("value", "bound"))[0])
        if n.op == "call_function" and n.target is check_non_negative:  # returns its value
            return self.scalar(n.args[0])
        if n.op == "call_method" and n.target == "item":
            return self.scalar(n.args[0])
        if _reduction(n, ("max", "amax")):
            lengths = self.per_user(n.args[0])
            return Bound(0, ((lengths, 1),)) if lengths is not None else None
        left, right, sign = _arithmetic(n)
        if sign:
            a, b = self.scalar(left), self.scalar(right)
            return a.combine(b, sign) if a is not None and b is not None else None
        return None

    def upper(self, bound: Bound) -> int | None:
        """The largest value ``bound`` takes on a request inside the export's ranges."""
        total = bound.const
        for lengths, weight in bound.maxima:
            if weight < 0:
                return None
            most = lengths.const
            for feature, count in lengths.counts:
                limit = self.largest(feature) if count > 0 else self.smallest(feature)
                if limit is None:
                    return None
                most += count * limit
            total += weight * most
        return total

    def within(self, lengths: Lengths, bound: Bound) -> bool:
        """Whether every user's ``lengths`` is at most ``bound``: the bound is at least ``sum(weight * X) +
        const`` element by element (each maximum is at least its own users' values), and that minus
        ``lengths`` has no negative count (lengths are never negative) nor constant."""
        if any(weight < 0 for _, weight in bound.maxima):
            return False
        floor = Lengths(bound.const)
        for inner, weight in bound.maxima:
            floor = floor.combine(inner.scaled(weight))
        slack = floor.combine(lengths, -1)
        return slack.const >= 0 and all(count >= 0 for _, count in slack.counts)


def _int_cast(n: torch.fx.Node) -> bool:
    if n.target in ("long", "int"):
        return True
    dtypes = [a for a in (*n.args[1:], *n.kwargs.values()) if isinstance(a, torch.dtype)]
    return len(dtypes) == 1 and not dtypes[0].is_floating_point and dtypes[0] != torch.bool


def _arithmetic(n: torch.fx.Node) -> tuple[Any, Any, int]:
    if n.op == "call_function" and len(n.args) == 2 and not n.kwargs:
        if n.target in _ADD:
            return n.args[0], n.args[1], 1
        if n.target in _SUB:
            return n.args[0], n.args[1], -1
    if n.op == "call_method" and n.target in ("add", "sub") and len(n.args) == 2 and not n.kwargs:
        return n.args[0], n.args[1], 1 if n.target == "add" else -1
    return None, None, 0


def _reduction(n: torch.fx.Node, names: tuple[str, ...]) -> bool:
    """A reduction of a whole tensor (no dim): ``x.max()``, ``torch.max(x)``."""
    if len(n.args) != 1 or n.kwargs:
        return False
    if n.op == "call_method":
        return n.target in names
    return n.op == "call_function" and getattr(n.target, "__name__", None) in names and n.target in (
        torch.max, torch.amax, torch.sum)


def _sum_of_lengths(facts: _Facts, n: torch.fx.Node) -> Lengths | None:
    """``lengths.sum().item()`` or ``offsets[-1].item()`` (``tensor_to_int`` too): the per-user lengths it adds up."""
    if not ((n.op == "call_method" and n.target == "item") or (n.op == "call_function" and n.target is tensor_to_int)):
        return None
    total = n.args[0]
    if not isinstance(total, torch.fx.Node):
        return None
    if _reduction(total, ("sum",)):
        return facts.per_user(total.args[0])
    if total.op == "call_function" and total.target is operator.getitem and total.args[1] == -1:
        return facts.of_offsets(total.args[0])
    return None


class ProveLengthReads:
    name = "prove_length_reads"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        if ctx.schema is None:
            return gm
        facts = _Facts.of(gm, ctx)
        graph = gm.graph
        sizes = checks = 0
        for n in list(graph.nodes):
            lengths = _sum_of_lengths(facts, n)
            if lengths is not None:
                size = self._rows(graph, facts, n, lengths)
                if size is not None:
                    n.replace_all_uses_with(size)
                    sizes += 1
            elif n.op == "call_function" and n.target is check_at_most:
                value, bound = _bound_arguments(n, ("value", "bound"))
                found = facts.scalar(value)
                most = facts.upper(found) if found is not None else None
                if isinstance(bound, int) and most is not None and most <= bound:
                    n.replace_all_uses_with(value)
                    graph.erase_node(n)
                    checks += 1
            elif n.op == "call_function" and n.target is check_lengths_at_most:
                offsets, bound = _bound_arguments(n, ("offsets", "bound"))
                if _proven(facts, offsets, bound):
                    n.replace_all_uses_with(offsets)
                    graph.erase_node(n)
                    checks += 1
            elif n.op == "call_function" and n.target is check_no_length_beyond:
                flags = list(n.args[0])
                kept = [f for f in flags if not (isinstance(f, torch.fx.Node) and f.target is length_beyond
                                                 and _proven(facts, *_bound_arguments(f, ("offsets", "bound"))))]
                checks += len(flags) - len(kept)
                if kept:
                    n.args = (kept, *n.args[1:])
                else:
                    graph.erase_node(n)
        if sizes or checks:
            gm.recompile()
        ctx.add_stat("sizes_from_shapes", sizes)
        ctx.add_stat("checks_proven", checks)
        return gm

    @staticmethod
    def _rows(graph: torch.fx.Graph, facts: _Facts, at: torch.fx.Node, lengths: Lengths) -> torch.fx.Node | None:
        """``lengths`` summed over users as sizes of the tensors they partition (and the batch size for a
        constant), or None when a feature has no such tensor here or a count is negative."""
        if lengths.const < 0 or any(count < 0 for _, count in lengths.counts) or not lengths.counts:
            return None
        rows = [(facts.rows_of.get(feature), count) for feature, count in lengths.counts]
        if any(tensor is None for tensor, _ in rows):
            return None
        with graph.inserting_before(at):
            total: Any = None
            for tensor, count in rows:
                size = graph.call_method("size", (tensor, 0))
                term = size if count == 1 else graph.call_function(operator.mul, (size, count))
                total = term if total is None else graph.call_function(operator.add, (total, term))
            if lengths.const:
                users = next(p for p in graph.nodes if p.op == "placeholder" and p.name in facts.lengths)
                batch = graph.call_method("size", (users, 0))
                total = graph.call_function(operator.add, (total, graph.call_function(operator.mul,
                                                                                      (batch, lengths.const))))
        return total


def _bound_arguments(n: torch.fx.Node, names: tuple[str, str]) -> tuple[Any, Any]:
    values = dict(zip(names, n.args, strict=False)) | {k: v for k, v in n.kwargs.items() if k in names}
    return values.get(names[0]), values.get(names[1])


def _proven(facts: _Facts, offsets: Any, bound: Any) -> bool:
    lengths, limit = facts.of_offsets(offsets), facts.scalar(bound)
    return lengths is not None and limit is not None and facts.within(lengths, limit)
