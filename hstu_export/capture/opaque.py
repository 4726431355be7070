"""What the tracer does about code that symbolic tracing cannot step through.

Two things, both applied only while a trace runs and undone after it:

- **Data-dependent Python values.** Real HSTU code takes ``int(lengths.max())`` or ``len(x)`` of a
  tensor for its max lengths. In the modules of the user's own packages, the names ``int``,
  ``float`` and ``len`` are shadowed by stand-ins that record a call node when given a proxy (and
  behave as the builtins otherwise, ``isinstance(x, int)`` included), so the value stays a graph
  value that torch.export later bounds (an unbacked size) instead of failing the trace.
- **Opaque calls.** A function that still cannot be traced (Python control flow on tensor values,
  iterating over ``.tolist()``) becomes one call node: the tracer finds the innermost user function
  on the failing stack, shadows it in every user module with a wrapper that records a call when a
  proxy reaches it, and traces again. Methods of submodules become ``call_method`` nodes on the
  submodule; a submodule's ``forward`` becomes a leaf. Each choice is reported
  (``gm.meta["opaque_calls"]``).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.fx
from torch import nn
from torch.fx.node import map_aggregate

# Packages whose code is never the user's: failures inside them are attributed to the user frame that
# called them, and their globals are never patched.
LIBRARY_PACKAGES = frozenset({
    "torch", "torchrec", "fbgemm_gpu", "hstu_export", "triton", "numpy", "typing", "builtins",
    "contextlib", "functools", "abc", "collections", "enum", "dataclasses", "copy", "inspect", "importlib",
    "_pytest", "pytest", "pluggy", "tensordict",
})


def find_proxy(args: Any, kwargs: Any) -> torch.fx.Proxy | None:
    found: list[torch.fx.Proxy] = []

    def visit(a: Any) -> Any:
        if isinstance(a, torch.fx.Proxy) and not found:
            found.append(a)
        return a

    map_aggregate(args, visit)
    map_aggregate(kwargs, visit)
    return found[0] if found else None


class _TracedBuiltinMeta(type):
    """Metaclass of the stand-ins for ``int``/``float``: a call with a proxy records a node; anything
    else is the builtin, and ``isinstance``/``issubclass`` answer as for the builtin."""

    _builtin: Any

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        proxy = find_proxy(args, kwargs)
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", cls._builtin, args, kwargs)
        return cls._builtin(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._builtin)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, cls._builtin)


def _traced_builtin_type(builtin: type) -> type:
    return _TracedBuiltinMeta(builtin.__name__, (), {"_builtin": builtin})


def _traced_len(obj: Any) -> Any:
    if isinstance(obj, torch.fx.Proxy) and type(obj).__len__ is torch.fx.Proxy.__len__:
        return obj.tracer.create_proxy("call_function", builtins.len, (obj,), {})
    return builtins.len(obj)


TRACED_BUILTINS: dict[str, Any] = {
    "int": _traced_builtin_type(int),
    "float": _traced_builtin_type(float),
    "len": _traced_len,
}


class _ExportIntMeta(_TracedBuiltinMeta):
    """``int``/``float`` as torch.export can run them inside user code it traces through: of a tensor or
    a symbolic number, the symbolic value (``int(lengths.max())`` becomes an unbacked size instead of
    demanding the data); of anything else, the builtin."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], (torch.Tensor, torch.SymInt, torch.SymFloat)):
            from hstu_export.runtimes.symbolic import symbolic_float, symbolic_int

            return symbolic_int(args[0]) if cls._builtin is int else symbolic_float(args[0])
        return cls._builtin(*args, **kwargs)


EXPORT_BUILTINS: dict[str, Any] = {
    "int": _ExportIntMeta("int", (), {"_builtin": int}),
    "float": _ExportIntMeta("float", (), {"_builtin": float}),
}


@contextlib.contextmanager
def export_builtins(packages: set[str]) -> Iterator[None]:
    """While torch.export runs: ``int``/``float`` in the user's modules read tensors symbolically."""
    undo: list[tuple[dict[str, Any], str]] = []
    try:
        for module in user_modules(packages):
            for name, value in EXPORT_BUILTINS.items():
                if name not in module.__dict__:
                    module.__dict__[name] = value
                    undo.append((module.__dict__, name))
        yield
    finally:
        for namespace, name in undo:
            namespace.pop(name, None)


def is_library_module(module_name: str) -> bool:
    return module_name.partition(".")[0] in LIBRARY_PACKAGES or module_name.startswith("_")


def user_packages(model: nn.Module) -> set[str]:
    """Top-level packages of the user's code: those of the model's module classes, minus libraries."""
    return {
        type(m).__module__.partition(".")[0]
        for m in model.modules()
        if not is_library_module(type(m).__module__)
    }


def user_modules(packages: set[str]) -> list[types.ModuleType]:
    return [
        m for name, m in list(sys.modules.items())
        if m is not None and name.partition(".")[0] in packages and isinstance(getattr(m, "__dict__", None), dict)
    ]  # fmt: skip


@dataclass(frozen=True)
class OpaqueCall:
    """One thing the tracer keeps opaque and why."""

    kind: str  # "function" | "method" | "module"
    name: str  # qualified name (function/method) or submodule path
    reason: str  # the trace error that made it opaque
    where: str  # file:line of the failure inside it

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "reason": self.reason, "where": self.where}


def opaque_function_wrapper(fn: Any) -> Any:
    """``fn`` recorded as one call node when any argument is a proxy."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxy = find_proxy(args, kwargs)
        if proxy is None:
            return fn(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", fn, args, kwargs)

    wrapper.__hstu_export_opaque__ = fn  # type: ignore[attr-defined]
    return wrapper


def opaque_method_wrapper(name: str, fn: Any) -> Any:
    """Method ``name`` of a submodule recorded as ``call_method`` on the submodule when traced."""

    @functools.wraps(fn)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        proxy = find_proxy(args, kwargs)
        if proxy is None:
            return fn(self, *args, **kwargs)
        return proxy.tracer.create_proxy("call_method", name, (self, *args), kwargs)

    wrapper.__hstu_export_opaque__ = fn  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def patched_user_code(packages: set[str], functions: list[Any],
                      methods: list[tuple[type, str]]) -> Iterator[None]:
    """While tracing: the traced builtins in every user module, ``functions`` wrapped wherever a user
    module (or the module defining them) names them, ``methods`` wrapped on their classes."""
    undo: list[tuple[Any, str, Any]] = []  # (namespace dict or class, name, old value or _MISSING)

    def patch_dict(namespace: dict[str, Any], name: str, value: Any) -> None:
        undo.append((namespace, name, namespace.get(name, _MISSING)))
        namespace[name] = value

    try:
        modules = user_modules(packages)
        for fn in functions:
            home = sys.modules.get(getattr(fn, "__module__", ""), None)
            if home is not None and home not in modules:
                modules.append(home)
        wrappers = {id(fn): opaque_function_wrapper(fn) for fn in functions}
        for module in modules:
            namespace = module.__dict__
            for name, value in TRACED_BUILTINS.items():
                if name not in namespace:  # a module's own definition of the name wins
                    patch_dict(namespace, name, value)
            for name, value in list(namespace.items()):
                if id(value) in wrappers and value in functions:
                    patch_dict(namespace, name, wrappers[id(value)])
        for cls, name in methods:
            original = cls.__dict__[name]
            undo.append((cls, name, original))
            setattr(cls, name, opaque_method_wrapper(name, original))
        yield
    finally:
        for target, name, old in reversed(undo):
            if isinstance(target, dict):
                if old is _MISSING:
                    target.pop(name, None)
                else:
                    target[name] = old
            else:
                setattr(target, name, old)


_MISSING = object()


@contextlib.contextmanager
def replaced_functions(packages: set[str], replacements: dict[Any, Any]) -> Iterator[None]:
    """Every global name in the user's modules (and the functions' own modules) that is bound to a key
    of ``replacements`` is bound to its value until the block ends."""
    undo: list[tuple[dict[str, Any], str, Any]] = []
    try:
        modules = user_modules(packages)
        for fn in replacements:
            home = sys.modules.get(getattr(fn, "__module__", ""), None)
            if home is not None and home not in modules:
                modules.append(home)
        by_id = {id(fn): new for fn, new in replacements.items()}
        for module in modules:
            namespace = module.__dict__
            for name, value in list(namespace.items()):
                if id(value) in by_id and value in replacements:
                    undo.append((namespace, name, value))
                    namespace[name] = by_id[id(value)]
        yield
    finally:
        for namespace, name, old in reversed(undo):
            namespace[name] = old


@dataclass
class Culprit:
    """The innermost user code on a failing trace's stack."""

    kind: str  # "function" | "method" | "module" | "none"
    target: Any  # the function, (class, method name), or the module instance
    name: str
    where: str  # file:line of the innermost user frame


def find_culprit(exc: BaseException, root: nn.Module) -> Culprit:
    """Where a trace failed: the innermost frame of user code (not torch, torchrec, ours), classified
    as a module-level function, a method of a submodule, or a submodule's forward."""
    frames = list(_walk_tb(exc.__traceback__))
    user_frames = [(f, line) for f, line in frames if not is_library_module(f.f_globals.get("__name__", "_"))]
    if not user_frames:
        return Culprit("none", None, "", failure_location(exc))
    frame, line = user_frames[-1]
    where = f"{frame.f_code.co_filename}:{line}"
    code = frame.f_code
    self_obj = frame.f_locals.get("self") if code.co_varnames[:1] == ("self",) else None
    if isinstance(self_obj, nn.Module):
        cls = next((c for c in type(self_obj).__mro__ if _code_of(c.__dict__.get(code.co_name)) is code), None)
        if cls is not None:
            if code.co_name == "forward":
                return Culprit("module", self_obj, f"{type(self_obj).__qualname__}.forward", where)
            return Culprit("method", (cls, code.co_name, self_obj), f"{cls.__qualname__}.{code.co_name}", where)
    fn = frame.f_globals.get(code.co_name)
    fn = getattr(fn, "__hstu_export_opaque__", fn)
    if inspect.isfunction(fn) and fn.__code__ is code:
        return Culprit("function", fn, f"{fn.__module__}.{fn.__qualname__}", where)
    return Culprit("none", None, code.co_name, where)


def _walk_tb(tb: types.TracebackType | None) -> Iterator[tuple[types.FrameType, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _code_of(value: Any) -> Any:
    value = getattr(value, "__hstu_export_opaque__", value)
    return getattr(value, "__code__", None)


def failure_location(exc: BaseException) -> str:
    """file:line of the innermost user frame of a failure (or of the innermost frame)."""
    frames = [(f, line) for f, line in _walk_tb(exc.__traceback__)]
    user = [(f, line) for f, line in frames if not is_library_module(f.f_globals.get("__name__", "_"))]
    f, line = (user or frames or [(None, 0)])[-1]
    return f"{f.f_code.co_filename}:{line}" if f is not None else "?"
