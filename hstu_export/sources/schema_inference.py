"""An input schema read off one example call in the model's own format.

``infer_schema(model, args, kwargs)`` binds the example to ``model.forward``'s signature and describes
every argument: a KeyedJaggedTensor (each key's values, lengths, weights), a JaggedTensor, a KeyedTensor
(each key's ``[B, dim]`` values), a dict of tensors (per-user tensors ``[B, ...]``; ``<f>.values`` /
``<f>.lengths`` pairs, the flat form TorchEasyRec serves, are jagged features), one tensor, or a record
(a dataclass, attrs class or NamedTuple such as TorchEasyRec's ``Batch``) holding any of these, dicts of
them, None, empty dicts and plain values. Within one argument, lengths equal in the example are taken to
be shared, and lengths all 1 are taken as one value per user (``ONE_PER_USER``: contextual keys, which a
range stated on the whole argument leaves at 1).

Value ranges come from the embedding tables that look a key up (ids in ``[0, num_embeddings)``) and
otherwise from the example itself; lengths ranges must be stated (``ranges=``, or ``--max-length`` at
export), because one example cannot say how long a history may get. ``flatten_example`` turns the same
example into the flat request the schema describes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from hstu_export.errors import ConfigError
from hstu_export.package.schema import (
    ONE_PER_USER,
    ArgumentSpec,
    FeatureSpec,
    InputSchema,
    dtype_name,
    jt_feature_names,
    kjt_feature_names,
    record_class,
    record_default,
    record_fields,
)

_JAGGED_PARTS = (".values", ".weights")
_SCALARS = (bool, int, float, str)


def infer_schema(
    model: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    ranges: dict[str, tuple[int | None, int | None]] | None = None,
) -> InputSchema:
    """The input schema of ``model`` from one example call ``model(*args, **kwargs)``."""
    bound = _bind(model, args, kwargs or {})
    defaults = {name: p.default for name, p in inspect.signature(model.forward).parameters.items()}
    inference = _Inference(type(model).__name__, embedding_vocab_sizes(model), _batch_size(list(bound.values())))
    arguments: list[ArgumentSpec] = []
    for name, value in bound.items():
        if value is None or (value is defaults.get(name) and not _describable(value)):
            # A parameter left at its default (None, a device, a flag): the model's own default applies.
            arguments.append(ArgumentSpec(name, "tensor", optional_absent=True))
            continue
        inference.lengths_seen = []  # lengths are taken to be shared within one argument only
        arguments.append(inference.describe(name, name, value, top=name))
    schema = InputSchema(tuple(inference.features), tuple(arguments))
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
        _flatten(arg, arg.name, value, flat)
    missing = [n for n in schema.names if n not in flat]
    if missing:
        raise ConfigError(f"the example has no value for feature(s) {missing[:5]}")
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


# ---- describing an example ------------------------------------------------------------------------


class _Inference:
    """Walks one example argument, appending its features and returning its ``ArgumentSpec``."""

    def __init__(self, model_name: str, vocab: dict[str, int], batch_size: int | None) -> None:
        self.model_name, self.vocab, self.batch_size = model_name, vocab, batch_size
        self.features: list[FeatureSpec] = []
        self.lengths_seen: list[tuple[str, Tensor]] = []

    def describe(self, name: str, path: str, value: Any, top: str) -> ArgumentSpec:
        from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

        nested = path != top
        if isinstance(value, KeyedJaggedTensor):
            return self._kjt(name, path, value)
        if isinstance(value, JaggedTensor):
            return self._jt(name, path, value)
        if isinstance(value, KeyedTensor):
            return self._kt(name, path, value, top)
        if isinstance(value, Tensor):
            self.features.append(self._per_user(path, value, top))
            return ArgumentSpec(name, "tensor")
        if isinstance(value, dict):
            return self._dict(name, path, value, top)
        if nested and value is None:
            return ArgumentSpec(name, "none")
        if nested and isinstance(value, _SCALARS):
            return ArgumentSpec(name, "constant", value=value)
        if record_fields(type(value)) is not None:
            return self._record(name, path, value, top)
        where = f"argument {top!r} of {self.model_name}.forward" + (f" at {path!r}" if nested else "")
        raise ConfigError(
            f"{where} is a {type(value).__name__}; the schema can describe KeyedJaggedTensors, JaggedTensors, "
            "KeyedTensors, tensors, dicts of them and records (dataclasses, attrs classes, NamedTuples) holding "
            "them, None and plain values (give the schema by hand otherwise)"
        )

    def _record(self, name: str, path: str, value: Any, top: str) -> ArgumentSpec:
        cls = type(value)
        spec = f"{cls.__module__}:{cls.__qualname__}"
        if "<locals>" in cls.__qualname__:
            raise ConfigError(f"argument {top!r}: record class {spec} is defined inside a function; define it at "
                              "module level so that the request can be assembled into it")
        if record_class(ArgumentSpec(name, "record", type=spec), path) is not cls:
            raise ConfigError(f"argument {top!r}: importing {spec} gives another class than the example's; "
                              "the record class must be importable by its qualified name")
        fields = tuple(self._field(cls, attr, f"{path}.{attr}", getattr(value, attr), top)
                       for attr, _ in record_fields(cls) or ())
        return ArgumentSpec(name, "record", type=spec, fields=fields)

    def _field(self, cls: type, attr: str, path: str, value: Any, top: str) -> ArgumentSpec:
        """One field of a record: described, or (an object the schema cannot describe) left at the default
        the class makes itself, such as an empty holder of raw rows."""
        described = len(self.features)
        try:
            return self.describe(attr, path, value, top)
        except ConfigError:
            if _same_as_default(value, record_default(cls, attr)):
                del self.features[described:]
                return ArgumentSpec(attr, "default")
            raise

    def _dict(self, name: str, path: str, value: dict[Any, Any], top: str) -> ArgumentSpec:
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"argument {top!r}: dict {path!r} has key {bad[0]!r}; only string keys can be named")
        if all(isinstance(v, Tensor) for v in value.values()):
            lengths = [k for k in value if _is_lengths_entry(k, value)]  # first: the values name them
            for key in [*lengths, *(k for k in value if k not in lengths)]:
                self.features.append(self._dict_feature(f"{path}.{key}", key, value, top))
            return ArgumentSpec(name, "dict", tuple(value))
        return ArgumentSpec(name, "dict", fields=tuple(self.describe(k, f"{path}.{k}", v, top) for k, v in value.items()))

    def _dict_feature(self, name: str, key: str, entries: dict[str, Tensor], top: str) -> FeatureSpec:
        """One entry of a dict of tensors: per-user, or (TorchEasyRec's flat form) ``<f>.lengths`` and the
        ``<f>.values`` / ``<f>.weights`` jagged by them."""
        tensor = entries[key]
        base, dot, part = key.rpartition(".")
        if _is_lengths_entry(key, entries):
            return self._lengths(name, tensor)
        if dot and f".{part}" in _JAGGED_PARTS and f"{base}.lengths" in entries:
            lengths = entries[f"{base}.lengths"]
            if tensor.dim() < 1 or tensor.size(0) != int(lengths.sum()):
                raise ConfigError(f"{name!r} has {tensor.size(0) if tensor.dim() else 0} rows but its lengths "
                                  f"sum to {int(lengths.sum())}")
            vocab = base if part == "values" else None
            return self._jagged(name, tensor, self._jagged_by(name.removesuffix(f".{part}") + ".lengths"), vocab)
        return self._per_user(name, tensor, top)

    def _kjt(self, name: str, path: str, kjt: Any) -> ArgumentSpec:
        weighted = kjt.weights_or_none() is not None
        per_key = kjt.to_dict()
        for key in kjt.keys():
            jt = per_key[key]
            names = kjt_feature_names(path, key, weighted)
            self.features.append(self._lengths(names[1], jt.lengths()))
            jagged_by = self._jagged_by(names[1])
            self.features.append(self._jagged(names[0], jt.values(), jagged_by, key))
            if weighted:
                self.features.append(self._jagged(names[2], jt.weights(), jagged_by, None))
        return ArgumentSpec(name, "kjt", tuple(kjt.keys()), weighted)

    def _jt(self, name: str, path: str, jt: Any) -> ArgumentSpec:
        weighted = jt.weights_or_none() is not None
        names = jt_feature_names(path, weighted)
        self.features.append(self._lengths(names[1], jt.lengths()))
        jagged_by = self._jagged_by(names[1])
        self.features.append(self._jagged(names[0], jt.values(), jagged_by, name))
        if weighted:
            self.features.append(self._jagged(names[2], jt.weights(), jagged_by, None))
        return ArgumentSpec(name, "jt", weighted=weighted)

    def _kt(self, name: str, path: str, kt: Any, top: str) -> ArgumentSpec:
        if kt.key_dim() != 1:
            raise ConfigError(f"argument {top!r}: KeyedTensor {path!r} has its keys on dim {kt.key_dim()}; "
                              "only key dim 1 ([B, dim] per key) can be described")
        for key, tensor in kt.to_dict().items():
            self.features.append(self._per_user(f"{path}.{key}", tensor, top))
        return ArgumentSpec(name, "kt", tuple(kt.keys()))

    def _lengths(self, name: str, lengths: Tensor) -> FeatureSpec:
        same_as = next((n for n, other in self.lengths_seen if torch.equal(other, lengths)), None)
        self.lengths_seen.append((name, lengths))
        if lengths.numel() and bool((lengths == 1).all()):
            return FeatureSpec(name, dtype_name(lengths.dtype), "lengths", min_value=1, max_value=1,
                               semantic=ONE_PER_USER, same_as=same_as)
        return FeatureSpec(name, dtype_name(lengths.dtype), "lengths", min_value=0, same_as=same_as)

    def _jagged_by(self, lengths_name: str) -> str:
        return next(f.same_as or f.name for f in self.features if f.name == lengths_name)

    def _jagged(self, name: str, values: Tensor, jagged_by: str, key: str | None) -> FeatureSpec:
        limits = (0, self.vocab[key] - 1) if key in self.vocab else (None, None)
        return FeatureSpec(name, dtype_name(values.dtype), "jagged", jagged_by=jagged_by, min_value=limits[0],
                           max_value=limits[1], trailing=tuple(values.shape[1:]), sample_range=_observed_range(values))

    def _per_user(self, name: str, tensor: Any, top: str) -> FeatureSpec:
        if not isinstance(tensor, Tensor) or tensor.dim() < 1:
            raise ConfigError(f"{name!r} must be a tensor with a batch dim, got "
                              f"{'a 0-d tensor' if isinstance(tensor, Tensor) else type(tensor).__name__}")
        if self.batch_size is not None and tensor.size(0) != self.batch_size:
            raise ConfigError(
                f"{name!r} has {tensor.size(0)} rows but the batch has {self.batch_size} users; only per-user "
                f"tensors, and '<feature>.values' jagged by a '<feature>.lengths' beside them, can be inferred in "
                f"argument {top!r} (give the schema by hand otherwise)"
            )
        return FeatureSpec(name, dtype_name(tensor.dtype), "per_user", trailing=tuple(tensor.shape[1:]),
                           sample_range=_observed_range(tensor))


def _same_as_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is ``default``, or an object of its class whose attributes are the same plain values
    (None, numbers, strings): a fresh default as the class would make it."""
    if value is default:
        return True
    if type(value) is not type(default) or not hasattr(value, "__dict__") or not hasattr(default, "__dict__"):
        return False
    mine, theirs = vars(value), vars(default)
    plain = all(v is None or isinstance(v, _SCALARS) for v in (*mine.values(), *theirs.values()))
    return plain and mine == theirs


def _is_lengths_entry(key: str, entries: dict[str, Any]) -> bool:
    """Whether ``key`` of a dict is ``<f>.lengths`` beside ``<f>.values`` or ``<f>.weights``."""
    base, dot, part = key.rpartition(".")
    return bool(dot) and part == "lengths" and any(f"{base}{p}" in entries for p in _JAGGED_PARTS)


def _describable(value: Any) -> bool:
    """Whether a default value is something the request would carry (a tensor or a structure of them)."""
    return isinstance(value, (Tensor, dict)) or record_fields(type(value)) is not None or type(value).__module__.startswith(
        "torchrec.")


def _batch_size(values: list[Any]) -> int | None:
    """The number of users: from lengths where the example has any (KeyedJaggedTensors, JaggedTensors,
    ``<f>.lengths`` entries), else from the first tensor with a batch dim."""
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

    sure: list[int] = []
    first: list[int] = []

    def visit(value: Any) -> None:
        if isinstance(value, KeyedJaggedTensor):
            sure.append(int(value.stride()))
        elif isinstance(value, JaggedTensor):
            sure.append(int(value.lengths().size(0)))
        elif isinstance(value, KeyedTensor):
            first.append(int(value.values().size(0)))
        elif isinstance(value, Tensor):
            if value.dim() >= 1:
                first.append(int(value.size(0)))
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, Tensor) and item.dim() == 1 and _is_lengths_entry(str(key), value):
                    sure.append(int(item.size(0)))
                visit(item)
        elif value is not None and not isinstance(value, _SCALARS) and record_fields(type(value)) is not None:
            for attr, _ in record_fields(type(value)) or ():
                visit(getattr(value, attr))

    for value in values:
        visit(value)
    return (sure or first or [None])[0]


def _flatten(arg: ArgumentSpec, path: str, value: Any, flat: dict[str, Tensor]) -> None:
    """Adds the request tensors of ``value`` (described by ``arg``) to ``flat``."""
    if arg.kind in ("none", "constant", "default"):
        return
    if arg.kind == "kjt":
        per_key = value.to_dict()
        for key in arg.keys:
            jt = _entry(per_key, key, path)
            names = kjt_feature_names(path, key, arg.weighted)
            flat[names[0]], flat[names[1]] = jt.values(), jt.lengths()
            if arg.weighted:
                flat[names[2]] = jt.weights()
    elif arg.kind == "jt":
        names = jt_feature_names(path, arg.weighted)
        flat[names[0]], flat[names[1]] = value.values(), value.lengths()
        if arg.weighted:
            flat[names[2]] = value.weights()
    elif arg.kind == "kt":
        per_key = value.to_dict()
        for key in arg.keys:
            flat[f"{path}.{key}"] = _entry(per_key, key, path)
    elif arg.kind == "record":
        for field in arg.fields:
            _flatten(field, f"{path}.{field.name}", getattr(value, field.name), flat)
    elif arg.kind == "dict" and arg.fields:
        for field in arg.fields:
            _flatten(field, f"{path}.{field.name}", _entry(value, field.name, path), flat)
    elif arg.kind == "dict":
        for key in arg.keys:
            flat[f"{path}.{key}"] = _entry(value, key, path)
    else:
        flat[path] = value


def _entry(mapping: dict[str, Any], key: str, path: str) -> Any:
    if key not in mapping:
        raise ConfigError(f"the example has no {key!r} in {path!r} (it has {sorted(mapping)[:8]})")
    return mapping[key]


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


def _observed_range(values: Tensor) -> tuple[int, int] | None:
    """[min, max] of integer example values (where generated values are drawn, not a request limit);
    None for floats."""
    if values.dtype.is_floating_point or values.dtype == torch.bool or values.numel() == 0:
        return None
    return int(values.min()), int(values.max())

