"""Sizes read from tensor data keep the range the declared dims allow, down to their minimum of 1.

torch.export traces a dynamic dim declared ``min=1`` as if it were at least 2 (its "0/1 specialisation":
the traced code is valid for 1 too, and the program's input checks accept 1). A size the graph reads from
tensor data (an unbacked size: ``int(lengths.sum().item())``, a max length) gets its range from what it is
found equal to or bounded by, and when that is a declared dim, it inherits the traced lower bound of 2
rather than the declared 1. The compiled program then checks that inherited range at run time and refuses
valid requests: one user with one candidate fails ``Expected u14 >= 2`` (docs/PACKAGE.md, "Every request
inside the ranges").

``unbacked_ranges_hold_at_one()`` corrects exactly that while a program is exported and compiled: each
time the shape environment refines the range of an unbacked size from a relation, the refinement is
recomputed with declared dims allowed down to 1, and the unbacked size keeps the wider of the two ranges.
The relations themselves (``u14 == candidates``) are still checked at run time, and declared dims are
still traced as at least 2, so no guard is added and none is dropped. Verification then runs the corner
batches (1 user, 1 item, 1 candidate) through the compiled program.

This reaches into torch's shape environment (``ShapeEnv._refine_ranges`` and ``_set_replacement``).
With a torch that lacks them the context does nothing, and the corner batches of verification find
any request the program refuses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_depth = 0
_originals: dict[str, Any] = {}


def _symbolic() -> Any | None:
    """torch's shape environment module, when it has every hook this module uses."""
    try:
        import sympy  # noqa: F401
        from torch.fx.experimental import symbolic_shapes
        from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy  # noqa: F401
    except ImportError:
        return None
    env = symbolic_shapes.ShapeEnv
    needed = (hasattr(env, "_refine_ranges") and hasattr(env, "_set_replacement") and hasattr(env, "simplify")
              and hasattr(symbolic_shapes, "try_solve") and hasattr(symbolic_shapes, "symbol_is_type")
              and hasattr(symbolic_shapes, "SymT"))
    return symbolic_shapes if needed else None


def _backed_values(env: Any) -> dict[Any, Any]:
    values = getattr(env, "backed_var_to_val", None)
    return env.var_to_val if values is None else values


def _declared_ranges(env: Any, symbolic_shapes: Any) -> dict[Any, Any]:
    """The environment's ranges with every traced dim (a backed size at the traced minimum of 2) allowed
    down to 1."""
    from torch.utils._sympy.value_ranges import ValueRanges

    backed = _backed_values(env)
    ranges = dict(env.var_to_range)
    for symbol, bounds in env.var_to_range.items():
        if (symbol in backed and bounds.lower == 2
                and symbolic_shapes.symbol_is_type(symbol, symbolic_shapes.SymT.SIZE)):
            ranges[symbol] = ValueRanges(1, bounds.upper)
    return ranges


def _widen(env: Any, symbol: Any, allowed: Any) -> None:
    from torch.utils._sympy.value_ranges import ValueRanges

    now = env.var_to_range[symbol]
    wider = ValueRanges(min(now.lower, allowed.lower), max(now.upper, allowed.upper))
    if wider != now:
        env.var_to_range[symbol] = wider
        cached = getattr(env._maybe_evaluate_static, "cache_clear", None)
        if cached is not None:
            cached()


def _refined(symbolic_shapes: Any, expr: Any, symbol: Any, old: Any, ranges: dict[Any, Any]) -> Any:
    """``old`` refined by the relation ``expr`` solved for ``symbol``, bounding the other side with
    ``ranges``: the same rule as the environment's own refinement."""
    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    solved = symbolic_shapes.try_solve(expr, symbol)
    lower, upper = old.lower, old.upper
    if solved is None or not (symbol.is_integer and solved[1].is_integer):
        return old
    relation, other = solved
    bounds = bound_sympy(other, ranges)
    if lower <= bounds.lower and isinstance(relation, (sympy.Eq, sympy.Ge, sympy.Gt)):
        lower = bounds.lower + int(isinstance(relation, sympy.Gt))
    if upper >= bounds.upper and isinstance(relation, (sympy.Eq, sympy.Le, sympy.Lt)):
        upper = bounds.upper - int(isinstance(relation, sympy.Lt))
    return ValueRanges(lower, upper)


def _install(symbolic_shapes: Any) -> None:
    from torch.utils._sympy.value_ranges import bound_sympy

    env_class = symbolic_shapes.ShapeEnv
    refine_ranges, set_replacement = env_class._refine_ranges, env_class._set_replacement
    _originals.update(_refine_ranges=refine_ranges, _set_replacement=set_replacement)

    def refine(self: Any, expr: Any) -> None:
        backed = _backed_values(self)
        before = {s: self.var_to_range[s] for s in expr.free_symbols
                  if s not in backed and s in self.var_to_range}
        refine_ranges(self, expr)
        if not before:
            return
        simplified, ranges = self.simplify(expr), _declared_ranges(self, symbolic_shapes)
        for symbol, old in before.items():
            _widen(self, symbol, _refined(symbolic_shapes, simplified, symbol, old, ranges))

    def replace(self: Any, symbol: Any, target: Any, msg: str) -> None:
        old = self.var_to_range.get(symbol)
        set_replacement(self, symbol, target, msg)
        if old is None or symbol in _backed_values(self) or symbol not in self.var_to_range:
            return
        ranges = _declared_ranges(self, symbolic_shapes)
        _widen(self, symbol, old & bound_sympy(target, {x: ranges.get(x) for x in target.free_symbols}))

    env_class._refine_ranges, env_class._set_replacement = refine, replace


@contextlib.contextmanager
def unbacked_ranges_hold_at_one() -> Iterator[None]:
    """While active (any thread; nested or concurrent uses install the hooks once), unbacked sizes take
    their ranges from declared dims allowed down to 1. See the module docstring."""
    global _depth
    symbolic_shapes = _symbolic()
    if symbolic_shapes is None:
        yield
        return
    with _lock:
        if _depth == 0:
            _install(symbolic_shapes)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, original in _originals.items():
                    setattr(symbolic_shapes.ShapeEnv, name, original)
                _originals.clear()


def device_reads(program: Any) -> int:
    """How many values an exported program reads back from its device a call: the nodes that bind a size or
    number from tensor data (an ``item``, a ``nonzero``'s count). On a GPU each is a wait for the device, and a
    program that reads cannot be replayed from a CUDA graph."""
    return sum(1 for node in program.graph.nodes if node.meta.get("unbacked_bindings"))
