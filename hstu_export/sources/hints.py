"""Export hints a model declares in its own code, so that ``hstu-export model.pt`` needs no flags.

A model (the root module) may define ``hstu_export_hints`` as an attribute or a method returning an
:class:`ExportHints` (or a dict with the same fields)::

    class MyRanker(nn.Module):
        hstu_export_hints = ExportHints(leaf_modules=("MyFancyPooling",),
                                        opaque_functions=("my_pkg.ops.bucketize_times",))

``leaf_modules`` are added to ``--leaf-module``; ``opaque_functions`` (callables or qualified names
``module.function``) are recorded as single calls while tracing; ``mappings`` adds entries to the
foreign-operator table (``{"my_pkg.ops.my_attention": "fn:my_pkg.export:my_attention_as_hstu"}``, see
``hstu_export/ops/mappings``); ``ranges`` states lengths ranges (``{"uih_features": (1, 256)}``);
``output_names`` renames outputs (``{"output_0": "user_embeddings"}``) and ``output_kinds`` says what they
are (``{"ctr": "probability"}``: score, probability, embedding or other; see
:mod:`hstu_export.sources.output_plan`). Command-line options add to the hints; they never remove one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from hstu_export.errors import ConfigError
from hstu_export.sources.qualified_names import import_object, split_name

HINTS_ATTRIBUTE = "hstu_export_hints"


@dataclass(frozen=True)
class ExportHints:
    leaf_modules: tuple[str, ...] = ()
    opaque_functions: tuple[Any, ...] = ()
    mappings: dict[str, str] = field(default_factory=dict)
    ranges: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    output_names: dict[str, str] = field(default_factory=dict)
    output_kinds: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))
        object.__setattr__(self, "opaque_functions", tuple(self.opaque_functions))


def model_hints(model: nn.Module) -> ExportHints:
    """The hints ``model`` declares (empty when it declares none)."""
    value = getattr(model, HINTS_ATTRIBUTE, None)
    if value is None:
        return ExportHints()
    if callable(value) and not isinstance(value, (ExportHints, dict)):
        value = value()
    if isinstance(value, dict):
        known = {f.name for f in fields(ExportHints)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"{type(model).__name__}.{HINTS_ATTRIBUTE} has unknown field(s) {unknown}; known: {sorted(known)}")
        value = ExportHints(**value)
    if not isinstance(value, ExportHints):
        raise ConfigError(f"{type(model).__name__}.{HINTS_ATTRIBUTE} must be an ExportHints or a dict, "
                          f"got {type(value).__name__}")
    return value


def resolve_callable(spec: Any) -> Any:
    """A callable, or the function named by ``module.function`` / ``module:function``."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"{spec!r} is neither a callable nor a qualified function name")
    module_name, attr = split_name(spec)
    if not module_name:
        raise ConfigError(f"{spec!r} is not a qualified function name (module.function)")
    value = import_object(module_name, attr, repr(spec), ConfigError)
    if not callable(value):
        raise ConfigError(f"{spec!r} is not callable")
    return value
