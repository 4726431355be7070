"""Model classes by name: the zoo plus user classes registered with ``register_model``.

A registrable model class takes one config object in its constructor, exposes it as ``.config``
(with ``to_dict()``), has a ``config_class`` with ``from_dict()``, and an ``input_schema()`` method.
Bundles store only the registered name, the config and tensors, so loading one runs no pickled code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from hstu_export.errors import ModelRegistryError

_MODELS: dict[str, type[nn.Module]] = {}

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
    try:
        return _MODELS[name]
    except KeyError:
        known = ", ".join(sorted(_MODELS)) or "none"
        raise ModelRegistryError(
            f"unknown model {name!r} (registered: {known}); import the module that calls "
            "hstu_export.register_model for it first"
        ) from None


def registered_name(model: nn.Module) -> str:
    _ensure_zoo()
    name = getattr(type(model), "registered_name", None)
    if name is None or _MODELS.get(name) is not type(model):
        raise ModelRegistryError(
            f"{type(model).__qualname__} is not a registered model; decorate it with "
            "@hstu_export.register_model(name, ConfigClass)"
        )
    return name


def build_model(name: str, config: Any) -> nn.Module:
    cls = model_class(name)
    if isinstance(config, dict):
        config = cls.config_class.from_dict(config)  # type: ignore[attr-defined]
    return cls(config)


def registered_models() -> list[str]:
    _ensure_zoo()
    return sorted(_MODELS)


def _ensure_zoo() -> None:
    import hstu_export.models  # noqa: F401  (registers the zoo)
