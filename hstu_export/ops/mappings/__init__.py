"""The operator mapping tables ``passes/map_ops.py`` applies.

Two kinds of entries:

1. **Ops** (``torch.ops.<ns>.<name>`` calls), keyed ``"ns::name"``: for each target (``triton``,
   ``aten``, ``fbgemm``) a replacement written as
   - ``"op:ns::name"``: an op with the same schema (the node's target is swapped),
   - ``"fn:module:function"``: a Python function taking the source op's arguments by schema name; the
     pass traces it into the graph in place of the node, so the graph holds its plain torch ops,
   - ``"keep"``: the source op stays (its library is then needed at load time).
   Tables: ``ours.py`` (``hstu_export::*``), ``fbgemm.py``.

2. **Foreign functions** (HSTU attention and jagged helpers of other libraries), keyed by qualified
   name ``"package.module.function"``. The tracer keeps them as single calls; the pass binds the call's
   arguments by name and traces a :class:`FunctionMapping`'s ``rewrite`` in its place, which calls our
   ops, which are then mapped to the target like any other. Tables: ``generative_recommenders.py``,
   ``torcheasyrec.py``. A model or a user adds entries with ``--map-function NAME=RULE`` or the
   model's export hints, where RULE is a qualified name from these tables (the user's function takes
   the same arguments), ``fn:module:function`` (a rewrite of their own, taking a ``MappingCall``), or
   ``keep`` (a table's function is not mapped: it is traced through as its library wrote it).

Adding a mapping for another library is one table entry (plus one line in ``FUNCTION_TABLES``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from hstu_export.errors import ConfigError, UnmappedOpsError
from hstu_export.ops.mappings import fbgemm, ours
from hstu_export.sources.qualified_names import import_object, split_name

MAPPINGS: dict[str, dict[str, str]] = {**ours.OPS, **fbgemm.OPS}

KEEP = "keep"  # --map-function NAME=keep: leave a table's function unmapped

# Modules holding foreign-function tables (each defines FUNCTIONS: dict[str, FunctionMapping]).
FUNCTION_TABLES = (
    "hstu_export.ops.mappings.generative_recommenders",
    "hstu_export.ops.mappings.torcheasyrec",
)


class Unmappable(Exception):
    """Raised by a rewrite when this call uses something our ops cannot express; the call is kept."""


@dataclass(frozen=True)
class FunctionMapping:
    """How one foreign function becomes our ops.

    ``rewrite(call)`` builds the replacement (traced with FX proxies). ``defaults`` are the function's
    own parameter defaults, so a user function declared "like" it may leave parameters out.
    ``fixed_scale(original, arguments, n)`` runs the original with a fixed attention divisor ``n`` (the
    eager reference of ``--attention-scale fixed:N``); None when the function cannot do that.
    """

    library: str
    rewrite: Callable[[MappingCall], Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    fixed_scale: Callable[[Callable[..., Any], dict[str, Any], int], Any] | None = None
    description: str = ""
    attention: bool = False  # scaled by a max length: subject to --attention-scale


@dataclass
class MappingCall:
    """One foreign call being rewritten: its arguments by name (proxies, ints, None) and the settings
    that decide how."""

    name: str
    arguments: dict[str, Any]
    attention_scale: str = "batch"
    batch_scaled: bool = False  # set by scaling(): the divisor is computed from the batch

    def __getitem__(self, key: str) -> Any:
        return self.arguments[key]

    def static_bound(self, key: str) -> int:
        """An upper bound of int argument ``key``: itself when it is a constant, else the largest value
        observe_values saw at the export's maxima."""
        value = self.arguments[key]
        if isinstance(value, int):
            return value
        node = value.node if isinstance(value, torch.fx.Proxy) else value
        bound = getattr(node, "meta", {}).get("int_max")
        if bound is None:
            raise Unmappable(f"no bound is known for {key!r} (observe_values did not see it)")
        return int(bound)

    def record(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as a graph node when an argument is a proxy (``fn`` must not be traced into, as a
        check's ``torch._check`` on a proxy cannot), else called now."""
        from hstu_export.capture.opaque import find_proxy

        proxy = find_proxy(args, {})
        if proxy is None:
            return fn(*args)
        return proxy.tracer.create_proxy("call_function", fn, args, {})

    def checked_bound(self, key: str) -> tuple[int, Any]:
        """(static bound, runtime value checked against it) of int argument ``key``."""
        from hstu_export.capture.graph_functions import check_at_most

        bound = self.static_bound(key)
        return bound, self.record(check_at_most, self.arguments[key], bound)

    def scaling(self, runtime: Any) -> Any:
        """The attention divisor: ``runtime`` (the model's own, computed per batch) or the N of
        ``--attention-scale fixed:N``."""
        if self.attention_scale.startswith("fixed:"):
            return int(self.attention_scale.partition(":")[2])
        if not isinstance(runtime, int):
            self.batch_scaled = True
        return runtime


def op_key(target: Any) -> str | None:
    """``ns::name`` of an op call target, or None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        ns, _, name = target._qualified_op_name.partition("::")
        return f"{ns}::{name}"
    return None


def function_key(target: Any) -> str | None:
    """``package.module.function`` of a Python function call target, or None."""
    target = getattr(target, "__hstu_export_opaque__", target)
    if not inspect.isfunction(target):
        return None
    return f"{target.__module__}.{target.__qualname__}"


def function_mappings(extra: dict[str, str] | None = None) -> dict[str, FunctionMapping]:
    """Every foreign-function mapping: the tables plus ``extra`` (``{qualified name: rule}``)."""
    table: dict[str, FunctionMapping] = {}
    for module_name in FUNCTION_TABLES:
        table.update(importlib.import_module(module_name).FUNCTIONS)
    for name, rule in (extra or {}).items():
        if rule == KEEP:
            if name not in table:
                known = ", ".join(sorted(table))
                raise ConfigError(f"mapping for {name}: {KEEP!r} names no function we map; known: {known}")
            del table[name]  # traced through as the model's library wrote it
            continue
        table[name] = _user_rule(name, rule, table)
    return table


def _user_rule(name: str, rule: str, table: dict[str, FunctionMapping]) -> FunctionMapping:
    if rule in table:
        base = table[rule]
        return FunctionMapping(f"{base.library} (declared like {rule})", base.rewrite, base.defaults, None,
                               base.description, base.attention)
    if rule.startswith("fn:"):
        module_name, attr = split_name(rule[3:], colon_only=True)
        if not module_name:
            raise ConfigError(f"mapping for {name}: write the rewrite as fn:package.module:function, not {rule!r}")
        return FunctionMapping("user", import_object(module_name, attr, f"the rewrite of {name}", ConfigError))
    known = ", ".join(sorted(table))
    raise ConfigError(f"mapping for {name}: {rule!r} is neither a known function ({known}) nor fn:module:function")


def imported_functions(names: list[str]) -> list[Callable[..., Any]]:
    """The function objects of qualified ``names`` whose modules are already imported (the tracer keeps
    them opaque; a library the model does not use is never imported for this)."""
    found = []
    for name in names:
        module_name, _, attr = name.rpartition(".")
        while module_name and module_name not in sys.modules:
            module_name, _, head = module_name.rpartition(".")
            attr = f"{head}.{attr}"
        module = sys.modules.get(module_name)
        value: Any = module
        for part in attr.split("."):
            value = getattr(value, part, None) if value is not None else None
        value = getattr(value, "__hstu_export_opaque__", value)
        if inspect.isfunction(value) and function_key(value) == name:
            found.append(value)
    return found


def bind_call(fn: Callable[..., Any], mapping: FunctionMapping, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name, with the function's (then the mapping's) defaults."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise UnmappedOpsError(f"cannot bind the arguments of {function_key(fn)}: {exc}") from None
    bound.apply_defaults()
    return {**mapping.defaults, **bound.arguments}


@contextlib.contextmanager
def fixed_attention_scale(scale: str, functions: dict[str, FunctionMapping], model: Any) -> Iterator[None]:
    """While the block runs, the model's foreign attention functions divide by N (``scale`` is
    ``fixed:N``): the eager reference that ``--attention-scale fixed:N`` is verified against."""
    if not scale.startswith("fixed:"):
        yield
        return
    from hstu_export.capture.opaque import replaced_functions, user_packages

    n = int(scale.partition(":")[2])
    replacements: dict[Any, Any] = {}
    for name, mapping in functions.items():
        if mapping.attention and mapping.fixed_scale is not None:
            for fn in imported_functions([name]):
                replacements[fn] = _with_fixed_scale(fn, mapping, n)
    with replaced_functions(user_packages(model) | {f.__module__.partition(".")[0] for f in replacements},
                            replacements):
        yield


def _with_fixed_scale(fn: Callable[..., Any], mapping: FunctionMapping, n: int) -> Callable[..., Any]:
    fixed = mapping.fixed_scale
    assert fixed is not None

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        return fixed(fn, dict(bound.arguments), n)

    return run


def unscalable_attention(gm: torch.fx.GraphModule, functions: dict[str, FunctionMapping]) -> list[str]:
    """Foreign attention functions the traced model calls that cannot run with a fixed scale (so
    ``--attention-scale fixed:N`` could not be verified against the model)."""
    called = {function_key(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
              for n in m.graph.nodes if n.op == "call_function"}
    return sorted(name for name in called if name in functions and functions[name].attention
                  and functions[name].fixed_scale is None)
