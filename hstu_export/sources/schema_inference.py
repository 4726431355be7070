"""An input schema read off one example call in the model's own format.

``infer_schema(model, args, kwargs)`` binds the example to ``model.forward``'s signature and describes
every argument: a KeyedJaggedTensor (each key's values, lengths, weights; keys whose lengths are equal
in the example are taken to share them), a dict of tensors (per-user tensors ``[B, ...]``), or one
tensor. Value ranges come from the embedding tables that look a key up (ids in
``[0, num_embeddings)``) and otherwise from the example itself; lengths ranges must be stated
(``ranges=``, or ``--max-length`` at export), because one example cannot say how long a history may
get. ``flatten_example`` turns the same example into the flat request the schema describes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from hstu_export.errors import ConfigError
from hstu_export.package.schema import ArgumentSpec, FeatureSpec, InputSchema, dtype_name, kjt_feature_names


def infer_schema(
    model: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    ranges: dict[str, tuple[int | None, int | None]] | None = None,
) -> InputSchema:
    """The input schema of ``model`` from one example call ``model(*args, **kwargs)``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    bound = _bind(model, args, kwargs or {})
    vocab = embedding_vocab_sizes(model)
    batch_size = _batch_size(bound)
    features: list[FeatureSpec] = []
    arguments: list[ArgumentSpec] = []
    for name, value in bound.items():
        if value is None:
            arguments.append(ArgumentSpec(name, "tensor", optional_absent=True))
        elif isinstance(value, KeyedJaggedTensor):
            arguments.append(_kjt_argument(name, value, vocab, features))
        elif isinstance(value, dict):
            for key, tensor in value.items():
                features.append(_dense_feature(f"{name}.{key}", tensor, batch_size, name))
            arguments.append(ArgumentSpec(name, "dict", tuple(value)))
        elif isinstance(value, Tensor):
            features.append(_dense_feature(name, value, batch_size, name))
            arguments.append(ArgumentSpec(name, "tensor"))
        else:
            raise ConfigError(
                f"argument {name!r} of {type(model).__name__}.forward is a {type(value).__name__}; the schema "
                "can describe KeyedJaggedTensors, dicts of tensors and tensors (give the schema by hand otherwise)"
            )
    schema = InputSchema(tuple(features), tuple(arguments))
    return schema.with_ranges(ranges) if ranges else schema


def flatten_example(schema: InputSchema, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                    model: nn.Module | None = None) -> dict[str, Tensor]:
    """The flat request (``{feature name: tensor}``) that ``schema.assemble`` turns back into the
    example call."""
    if not schema.arguments:
        value = args[0] if args else next(iter((kwargs or {}).values()), None)
        if not isinstance(value, dict):
            raise ConfigError("this schema takes one dict of named tensors as the model's input")
        return {n: value[n] for n in schema.names}
    bound = _bind(model, args, kwargs or {}) if model is not None else dict(kwargs or {})
    flat: dict[str, Tensor] = {}
    for arg in schema.arguments:
        if arg.optional_absent:
            continue
        value = bound.get(arg.name)
        if value is None:
            raise ConfigError(f"the example has no value for argument {arg.name!r}")
        if arg.kind == "kjt":
            per_key = value.to_dict()
            for key in arg.keys:
                names = kjt_feature_names(arg.name, key, arg.weighted)
                flat[names[0]] = per_key[key].values()
                flat[names[1]] = per_key[key].lengths()
                if arg.weighted:
                    flat[names[2]] = per_key[key].weights()
        elif arg.kind == "dict":
            for key in arg.keys:
                flat[f"{arg.name}.{key}"] = value[key]
        else:
            flat[arg.name] = value
    return {n: flat[n].detach() for n in schema.names}


def embedding_vocab_sizes(model: nn.Module) -> dict[str, int]:
    """Feature name -> rows of the table that looks it up, over every torchrec embedding module."""
    sizes: dict[str, int] = {}
    for module in model.modules():
        configs = None
        for getter in ("embedding_configs", "embedding_bag_configs"):
            fn = getattr(module, getter, None)
            if callable(fn):
                try:
                    configs = fn()
                except Exception:  # a module with the method but no configs of that kind
                    configs = None
                if configs:
                    break
        for config in configs or ():
            for feature in getattr(config, "feature_names", ()) or ():
                sizes[feature] = int(config.num_embeddings)
    return sizes


def _bind(model: nn.Module | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if model is None:
        raise ConfigError("binding an example needs the model")
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"the example does not fit {type(model).__name__}.forward: {exc}") from None
    bound.apply_defaults()
    params = inspect.signature(model.forward).parameters
    return {name: value for name, value in bound.arguments.items()
            if params[name].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def _batch_size(bound: dict[str, Any]) -> int | None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    for value in bound.values():
        if isinstance(value, KeyedJaggedTensor):
            return int(value.stride())
    for value in bound.values():
        if isinstance(value, Tensor) and value.dim() >= 1:
            return int(value.size(0))
        if isinstance(value, dict):
            for tensor in value.values():
                if isinstance(tensor, Tensor) and tensor.dim() >= 1:
                    return int(tensor.size(0))
    return None


def _kjt_argument(name: str, kjt: Any, vocab: dict[str, int], features: list[FeatureSpec]) -> ArgumentSpec:
    weighted = kjt.weights_or_none() is not None
    per_key = kjt.to_dict()
    seen_lengths: list[tuple[str, Tensor]] = []
    for key in kjt.keys():
        jt = per_key[key]
        values, lengths = jt.values(), jt.lengths()
        names = kjt_feature_names(name, key, weighted)
        same_as = next((n for n, other in seen_lengths if torch.equal(other, lengths)), None)
        features.append(FeatureSpec(names[1], dtype_name(lengths.dtype), "lengths", min_value=0, same_as=same_as))
        seen_lengths.append((names[1], lengths))
        jagged_by = same_as or names[1]
        limits = (0, vocab[key] - 1) if key in vocab else (None, None)
        features.append(FeatureSpec(names[0], dtype_name(values.dtype), "jagged", jagged_by=jagged_by,
                                    min_value=limits[0], max_value=limits[1], trailing=tuple(values.shape[1:]),
                                    sample_range=_observed_range(values)))
        if weighted:
            w = jt.weights()
            features.append(FeatureSpec(names[2], dtype_name(w.dtype), "jagged", jagged_by=jagged_by,
                                        trailing=tuple(w.shape[1:])))
    return ArgumentSpec(name, "kjt", tuple(kjt.keys()), weighted)


def _dense_feature(name: str, tensor: Any, batch_size: int | None, argument: str) -> FeatureSpec:
    if not isinstance(tensor, Tensor) or tensor.dim() < 1:
        raise ConfigError(f"{name!r} must be a tensor with a batch dim, got {type(tensor).__name__}")
    if batch_size is not None and tensor.size(0) != batch_size:
        raise ConfigError(
            f"{name!r} has {tensor.size(0)} rows but the batch has {batch_size} users; only per-user tensors "
            f"can be inferred in argument {argument!r} (give the schema by hand for jagged ones)"
        )
    return FeatureSpec(name, dtype_name(tensor.dtype), "per_user", trailing=tuple(tensor.shape[1:]),
                       sample_range=_observed_range(tensor))


def _observed_range(values: Tensor) -> tuple[int, int] | None:
    """[min, max] of integer example values (where generated values are drawn, not a request limit);
    None for floats."""
    if values.dtype.is_floating_point or values.dtype == torch.bool or values.numel() == 0:
        return None
    return int(values.min()), int(values.max())
