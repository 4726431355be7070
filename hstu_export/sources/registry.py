"""Where models come from: the zoo, classes registered with ``register_model``, the
``hstu_export.models`` entry-point group, and factory import paths.

A registrable model class takes one config object in its constructor, exposes it as ``.config``
(with ``to_dict()``), has a ``config_class`` with ``from_dict()``, and an ``input_schema()`` method.
A factory is any importable function returning an ``nn.Module``, named ``"package.module:function"``
and called with JSON-able keyword arguments. Bundles store only a name or factory path, the config or
keyword arguments and tensors, so loading one runs no pickled code; importing the named module runs
that module's code, as installing and importing any dependency does.

An installed package makes its models known without ``--import`` through an entry point::

    [project.entry-points."hstu_export.models"]
    my_ranker = "my_pkg.models:build_ranker"     # a factory, a registrable class, or a module
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from hstu_export.errors import ModelRegistryError
from hstu_export.sources.qualified_names import import_object, split_name

ENTRY_POINT_GROUP = "hstu_export.models"

_MODELS: dict[str, type[nn.Module]] = {}
_FACTORIES: dict[str, Callable[..., nn.Module]] = {}

M = TypeVar("M", bound=type[nn.Module])


def register_model(name: str, config_class: type | None = None) -> Callable[[M], M]:
    """Class decorator: ``@register_model("my_model", MyConfig)``."""

    def decorate(cls: M) -> M:
        if name in _MODELS and _MODELS[name] is not cls:
            raise ModelRegistryError(f"model name {name!r} is already registered to {_MODELS[name].__qualname__}")
        if config_class is not None:
            cls.config_class = config_class  # type: ignore[attr-defined]
        if not hasattr(cls, "config_class"):
            raise ModelRegistryError(f"{cls.__qualname__} needs a config_class to be registered")
        cls.registered_name = name  # type: ignore[attr-defined]
        _MODELS[name] = cls
        return cls

    return decorate


def model_class(name: str) -> type[nn.Module]:
    _ensure_zoo()
    if name not in _MODELS and name not in _FACTORIES:
        _load_entry_point(name)
    try:
        return _MODELS[name]
    except KeyError:
        known = ", ".join(registered_models()) or "none"
        raise ModelRegistryError(
            f"unknown model {name!r} (known: {known}); import the module that registers it "
            f"(--import MODULE), install the package declaring it in the {ENTRY_POINT_GROUP!r} entry points, "
            "or save the bundle with a factory path"
        ) from None


def registered_name(model: nn.Module) -> str:
    _ensure_zoo()
    name = getattr(type(model), "registered_name", None)
    if name is None or _MODELS.get(name) is not type(model):
        raise ModelRegistryError(
            f"{type(model).__qualname__} is not a registered model; save it with a factory "
            "(save_bundle(model, path, factory='my_pkg.models:build', ...)) or decorate it with "
            "@hstu_export.register_model(name, ConfigClass)"
        )
    return name


def build_model(name: str, config: Any) -> nn.Module:
    _ensure_zoo()
    if name not in _MODELS and name not in _FACTORIES:
        _load_entry_point(name)
    if name in _FACTORIES:
        return call_factory(_FACTORIES[name], config if isinstance(config, dict) else {}, name)
    cls = model_class(name)
    if isinstance(config, dict):
        config = cls.config_class.from_dict(config)  # type: ignore[attr-defined]
    return cls(config)


def registered_models() -> list[str]:
    _ensure_zoo()
    return sorted({*_MODELS, *_FACTORIES, *_entry_point_names()})


# -- factories -----------------------------------------------------------------------------------

def factory_path(factory: str | Callable[..., Any]) -> str:
    """``"package.module:function"`` of a factory given as a callable or a path (checked importable)."""
    if callable(factory):
        module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
        if not module or module == "__main__" or "<" in qualname:
            raise ModelRegistryError(
                f"factory {qualname or factory!r} is not importable by name (defined in __main__, a lambda or "
                "a nested function); put it in a module and pass it or 'package.module:function'"
            )
        path = f"{module}:{qualname}"
    else:
        path = str(factory)
    resolve_factory(path)
    return path


def resolve_factory(path: str) -> Callable[..., nn.Module]:
    """The function named by ``"package.module:function"`` (the module is imported)."""
    module_name, attr = split_name(path, colon_only=True)
    if not module_name:
        raise ModelRegistryError(f"factory {path!r} must be written 'package.module:function'")
    value = import_object(module_name, attr, f"factory {path!r}", ModelRegistryError)
    if not callable(value):
        raise ModelRegistryError(f"factory {path!r} is not callable")
    return value  # type: ignore[no-any-return]


def call_factory(fn: Callable[..., Any], kwargs: dict[str, Any], what: str) -> nn.Module:
    try:
        model = fn(**kwargs)
    except TypeError as exc:
        raise ModelRegistryError(f"factory {what} does not take these arguments ({exc})") from None
    if not isinstance(model, nn.Module):
        raise ModelRegistryError(f"factory {what} returned a {type(model).__name__}, not an nn.Module")
    return model


# -- entry points --------------------------------------------------------------------------------

def _entry_points() -> list[Any]:
    from importlib import metadata

    try:
        return list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # a broken distribution's metadata must not break the zoo
        return []


def _entry_point_names() -> list[str]:
    return [ep.name for ep in _entry_points()]


def _load_entry_point(name: str) -> None:
    for ep in _entry_points():
        if ep.name != name:
            continue
        try:
            value = ep.load()
        except Exception as exc:
            raise ModelRegistryError(
                f"entry point {name!r} ({ep.value}) of group {ENTRY_POINT_GROUP!r} failed to load: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        if inspect.isclass(value) and issubclass(value, nn.Module):
            if name not in _MODELS:
                register_model(name)(value)
        elif callable(value) and not inspect.ismodule(value):
            _FACTORIES[name] = value
        return


# The zoo, by name; imported on first use (importing torchrec takes seconds).
ZOO: dict[str, str] = {"hstu_ranking": "hstu_export.models.ranking:HstuRankingModel"}


def _ensure_zoo() -> None:
    for name, path in ZOO.items():
        if name not in _MODELS:
            module_name, _, attr = path.partition(":")
            cls = getattr(importlib.import_module(module_name), attr)
            register_model(name)(cls)
