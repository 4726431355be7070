"""Input schema: the named tensors a model (and an exported package) takes, and how they become the
model's own arguments.

A serving request is always a flat dict of named tensors. A feature is one of
- ``lengths``: per-user counts ``[B]``, each in [min_value, max_value]; ``same_as`` names another
  lengths feature it must equal (keys of one KeyedJaggedTensor that share their lengths);
- ``jagged``: values ``[sum(lengths), *trailing]`` partitioned by the ``jagged_by`` lengths feature;
- ``per_user``: one value (or one row of ``trailing`` shape) per user ``[B, *trailing]``.

The ``arguments`` say how the flat tensors are assembled into the model's ``forward`` arguments:
- no arguments (the zoo's form): ``forward(features)`` takes the flat dict itself;
- ``kjt``: a torchrec KeyedJaggedTensor; key ``k`` of argument ``a`` comes from ``a.k.values`` and
  ``a.k.lengths`` (and ``a.k.weights`` for a weighted KJT);
- ``dict``: a dict of tensors; key ``k`` of argument ``a`` is the feature ``a.k``;
- ``tensor``: one tensor, the feature named as the argument;
- ``jt``: a torchrec JaggedTensor from ``a.values`` and ``a.lengths`` (and ``a.weights``);
- ``kt``: a torchrec KeyedTensor (key dim 1); key ``k`` is the per-user feature ``a.k`` ``[B, dim]``;
- ``record``: an instance of a record class (a dataclass, an attrs class or a NamedTuple, named by
  ``type`` as ``module:QualName``) built from its ``fields``, each a nested argument whose request names
  continue the path (``batch.sparse_features.uih.item_id.values``). Nested arguments are any of these
  kinds, a ``dict`` whose entries are not all tensors (its ``fields``), ``none`` (a field that was None),
  ``constant`` (a plain value: ``value``) or ``default`` (a field left at its class's default, such as an
  empty holder of raw data: not passed, so the class makes it again). The class is imported (trusted user code, as a bundle's factory)
  only when the model's arguments are assembled, never when a package is loaded.
The same schema drives batch generation, request validation, the manifest and verification (which
calls the user's model with arguments assembled here).

Graph inputs must be Python identifiers, request names need not be: ``graph_name`` maps one to the
other (``uih_features.item_id.values`` → ``uih_features__item_id__values``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, RequestError

KINDS = ("lengths", "jagged", "per_user")
ARGUMENT_KINDS = ("kjt", "dict", "tensor", "jt", "kt", "record", "none", "constant", "default")
# Lengths with one value per user in the example (contextual keys): a range stated on the argument that
# holds them leaves them at 1 (see ``InputSchema.resolve_lengths``).
ONE_PER_USER = "one_per_user"
DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64, "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"dtype {name} is not supported in a request; use one of {', '.join(DTYPES)}")
    return name


@functools.lru_cache(maxsize=4096)  # read for every feature of every request
def graph_name(name: str) -> str:
    """The graph-input (Python identifier) spelling of a request feature name: one FX keeps as it is (FX
    lowercases placeholder names and strips a dunder name's underscores; TorchEasyRec's data group is
    ``__BASE__``)."""
    out = re.sub(r"\W", "_", name.replace(".", "__")).lower()
    dunder = out.startswith("__") and out.endswith("__")
    return out if out[:1].isalpha() or (out[:1] == "_" and not dunder) else f"f_{out}"


def kjt_feature_names(argument: str, key: str, weighted: bool = False) -> tuple[str, ...]:
    """(values, lengths[, weights]) request names of one key of a KeyedJaggedTensor argument."""
    names = (f"{argument}.{key}.values", f"{argument}.{key}.lengths")
    return (*names, f"{argument}.{key}.weights") if weighted else names


def jt_feature_names(path: str, weighted: bool = False) -> tuple[str, ...]:
    """(values, lengths[, weights]) request names of a JaggedTensor at ``path``."""
    names = (f"{path}.values", f"{path}.lengths")
    return (*names, f"{path}.weights") if weighted else names


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    dtype: str
    kind: str
    jagged_by: str | None = None
    min_value: int | None = None
    max_value: int | None = None
    # "timestamp": jagged values increase within a user; a per-user timestamp comes after them.
    # "history_length" / "candidate_count": lengths bounded by --max-seq-len / --max-candidates.
    # "one_per_user" (ONE_PER_USER): lengths that were all 1 in the example a schema was inferred from.
    semantic: str = ""
    same_as: str | None = None  # lengths only: equal to this lengths feature in every request
    trailing: tuple[int, ...] = ()  # static dims after the batch or jagged dim
    # Where generated values are drawn when no min/max limits them (seen in an example; not a limit).
    sample_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"feature {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"feature {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.kind == "jagged" and not self.jagged_by:
            raise ConfigError(f"feature {self.name!r} is jagged but names no lengths feature (jagged_by)")
        object.__setattr__(self, "trailing", tuple(int(d) for d in self.trailing))
        if self.sample_range is not None:
            object.__setattr__(self, "sample_range", (int(self.sample_range[0]), int(self.sample_range[1])))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def graph_name(self) -> str:
        return graph_name(self.name)


@dataclass(frozen=True)
class ArgumentSpec:
    """One argument of the model's ``forward``, or one part of a nested one (see the module docstring)."""

    name: str
    kind: str
    keys: tuple[str, ...] = ()
    weighted: bool = False
    optional_absent: bool = False  # a forward parameter left at its default: nothing to assemble
    type: str = ""  # record: its class, "module:QualName"
    fields: tuple[ArgumentSpec, ...] = ()  # record: its fields; dict: its entries when not all are tensors
    value: bool | int | float | str | None = None  # constant: the value

    def __post_init__(self) -> None:
        if self.kind not in ARGUMENT_KINDS:
            raise ConfigError(f"argument {self.name!r}: kind {self.kind!r} is not one of {', '.join(ARGUMENT_KINDS)}")
        fields = tuple(f if isinstance(f, ArgumentSpec) else ArgumentSpec.from_json(f) for f in self.fields)
        object.__setattr__(self, "fields", fields)
        if fields and self.kind not in ("record", "dict"):
            raise ConfigError(f"argument {self.name!r}: only a record or a dict has fields, not a {self.kind}")
        keys = tuple(f.name for f in fields) if fields and self.kind == "dict" else tuple(self.keys)
        object.__setattr__(self, "keys", keys)
        if self.kind == "record" and not self.type.count(":") == 1:
            raise ConfigError(f"argument {self.name!r}: a record names its class as module:QualName, got {self.type!r}")
        if self.kind == "constant" and not isinstance(self.value, (bool, int, float, str)):
            raise ConfigError(f"argument {self.name!r}: a constant is a bool, number or string, "
                              f"got {type(self.value).__name__}")

    def feature_names(self, path: str | None = None) -> list[str]:
        """The request names this argument is assembled from; ``path`` is its own name prefixed by the
        names of the arguments that hold it (default: its name)."""
        path = self.name if path is None else path
        if self.optional_absent or self.kind in ("none", "constant", "default"):
            return []
        if self.kind == "kjt":
            return [n for key in self.keys for n in kjt_feature_names(path, key, self.weighted)]
        if self.kind == "jt":
            return list(jt_feature_names(path, self.weighted))
        if self.fields:
            return [n for f in self.fields for n in f.feature_names(f"{path}.{f.name}")]
        if self.kind in ("dict", "kt"):
            return [f"{path}.{key}" for key in self.keys]
        return [] if self.kind == "record" else [path]

    def type_text(self) -> str:
        """What the argument is, in a line (``describe``): ``Batch(sparse_features: dict[uih:
        KeyedJaggedTensor[item_id, action]], labels: dict[], ...)``."""
        if self.kind == "kjt":
            return f"KeyedJaggedTensor[{', '.join(self.keys)}]"
        if self.kind == "kt":
            return f"KeyedTensor[{', '.join(self.keys)}]"
        if self.kind == "jt":
            return "JaggedTensor"
        if self.kind == "record":
            inner = ", ".join(f"{f.name}: {f.type_text()}" for f in self.fields)
            return f"{self.type.rpartition(':')[2]}({inner})"
        if self.kind == "dict":
            inner = ", ".join(f"{f.name}: {f.type_text()}" for f in self.fields) if self.fields else ", ".join(self.keys)
            return f"dict[{inner}]"
        if self.kind == "none":
            return "None"
        if self.kind == "constant":
            return repr(self.value)
        if self.kind == "default":
            return "(default)"
        return "Tensor"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "kind": self.kind, "keys": list(self.keys),
                                "weighted": self.weighted, "optional_absent": self.optional_absent}
        # Only where used, so the arguments of KJT/dict/tensor models read as they always have.
        if self.type:
            data["type"] = self.type
        if self.fields:
            data["fields"] = [f.to_json() for f in self.fields]
        if self.kind == "constant":
            data["value"] = self.value
        return data

    @classmethod
    def from_json(cls, data: Any) -> ArgumentSpec:
        if not isinstance(data, dict):
            raise ConfigError(f"malformed input schema: an argument is an object, got {type(data).__name__}")
        return cls(**{**data, "keys": tuple(data.get("keys", ())),
                      "fields": tuple(cls.from_json(f) for f in data.get("fields", ()))})

    def assemble(self, batch: dict[str, Tensor], path: str | None = None) -> Any:
        """This argument's value built from the flat request."""
        path = self.name if path is None else path
        if self.kind == "kjt":
            return _build_kjt(path, self, batch)
        if self.kind == "jt":
            return _build_jt(path, self.weighted, batch)
        if self.kind == "kt":
            from torchrec.sparse.jagged_tensor import KeyedTensor

            return KeyedTensor.from_tensor_list(list(self.keys), [batch[f"{path}.{k}"] for k in self.keys], key_dim=1)
        if self.kind == "record":
            values = {f.name: f.assemble(batch, f"{path}.{f.name}") for f in self.fields if f.kind != "default"}
            return make_record(record_class(self, path), values)
        if self.kind == "dict":
            if self.fields:
                return {f.name: f.assemble(batch, f"{path}.{f.name}") for f in self.fields}
            return {key: batch[f"{path}.{key}"] for key in self.keys}
        if self.kind == "none":
            return None
        if self.kind == "constant":
            return self.value
        return batch[path]


def record_class(arg: ArgumentSpec, path: str | None = None) -> type:
    """The class a record argument names, imported (trusted user code, as a bundle's factory is)."""
    from hstu_export.sources.qualified_names import import_object

    module_name, _, qualname = arg.type.partition(":")
    what = f"argument {path or arg.name!r} (record class {arg.type})"
    cls = import_object(module_name, qualname, what, ConfigError)
    if not isinstance(cls, type):
        raise ConfigError(f"{what}: {arg.type} is a {type(cls).__name__}, not a class")
    return cls


def record_fields(cls: type) -> list[tuple[str, str]] | None:
    """(attribute, constructor keyword) of each field a record class is built from, or None when ``cls``
    is no record (dataclass, attrs class, NamedTuple)."""
    if dataclasses.is_dataclass(cls):
        return [(f.name, f.name) for f in dataclasses.fields(cls) if f.init]
    attrs_fields = getattr(cls, "__attrs_attrs__", None)
    if attrs_fields is not None:
        # attrs strips a private attribute's underscore from its __init__ keyword (``alias`` says so).
        return [(a.name, getattr(a, "alias", None) or a.name.lstrip("_")) for a in attrs_fields if a.init]
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return [(name, name) for name in cls._fields]  # type: ignore[attr-defined]
    return None


def record_default(cls: type, attribute: str) -> Any:
    """The value a record class gives field ``attribute`` when it is not passed (a fresh one from a default
    factory); ``dataclasses.MISSING`` when it has no default."""
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.name == attribute:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
        return dataclasses.MISSING
    for a in getattr(cls, "__attrs_attrs__", None) or ():
        if a.name == attribute:
            import attr  # an attrs class: attrs is there

            if a.default is attr.NOTHING:
                return dataclasses.MISSING
            if isinstance(a.default, attr.Factory):  # type: ignore[arg-type]
                return a.default.factory(cls) if a.default.takes_self else a.default.factory()
            return a.default
    return getattr(cls, "_field_defaults", {}).get(attribute, dataclasses.MISSING)


def make_record(cls: type, values: dict[str, Any]) -> Any:
    """An instance of record class ``cls`` from its fields' values by attribute name."""
    keywords = dict(record_fields(cls) or [])
    unknown = sorted(set(values) - set(keywords))
    if unknown:
        raise ConfigError(f"record class {cls.__module__}.{cls.__qualname__} has no field(s) {unknown}; the input "
                          "schema was made for another version of it")
    try:
        return cls(**{keywords[name]: value for name, value in values.items()})
    except Exception as exc:  # the class's own __init__/__post_init__ refusing the values
        raise ConfigError(f"building {cls.__qualname__} from the request failed: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class InputSchema:
    features: tuple[FeatureSpec, ...]
    arguments: tuple[ArgumentSpec, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        object.__setattr__(self, "arguments", tuple(self.arguments))
        names = [f.name for f in self.features]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"input schema names feature(s) {dup} twice")
        graph = [graph_name(n) for n in names]
        clash = sorted({n for n, g in zip(names, graph) if graph.count(g) > 1})
        if clash:
            raise ConfigError(f"feature names {clash} map to the same graph input name; rename one of them")
        for f in self.features:
            for ref in (f.jagged_by, f.same_as):
                if ref and (ref not in names or self.get(ref).kind != "lengths"):
                    raise ConfigError(f"feature {f.name!r} refers to {ref!r}, which is not a lengths feature")
        for arg in self.arguments:
            missing = [n for n in arg.feature_names() if n not in names] if not arg.optional_absent else []
            if missing:
                raise ConfigError(f"argument {arg.name!r} needs feature(s) {missing}, which the schema lacks")

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.features]

    @property
    def graph_names(self) -> list[str]:
        return [f.graph_name for f in self.features]

    def get(self, name: str) -> FeatureSpec:
        for f in self.features:
            if f.name == name or f.graph_name == name:
                return f
        raise KeyError(name)

    def lengths_features(self) -> list[FeatureSpec]:
        return [f for f in self.features if f.kind == "lengths"]

    def canonical_lengths(self, name: str) -> str:
        """The lengths feature that ``name`` (a lengths feature) must equal: itself unless ``same_as``."""
        seen = set()
        while True:
            spec = self.get(name)
            if not spec.same_as or spec.same_as in seen:
                return spec.name
            seen.add(spec.name)
            name = spec.same_as

    # -- serialisation ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "features": [_feature_json(f) for f in self.features],
            "arguments": [a.to_json() for a in self.arguments],
        }

    @classmethod
    def from_json(cls, data: Any) -> InputSchema:
        """Reads ``to_json()`` output (or the plain feature list older packages and bundles hold)."""
        try:
            if isinstance(data, list):
                data = {"features": data, "arguments": []}
            features = tuple(
                FeatureSpec(**{**f, "trailing": tuple(f.get("trailing", ())),
                               "sample_range": tuple(f["sample_range"]) if f.get("sample_range") else None})
                for f in data["features"]
            )
            arguments = tuple(ArgumentSpec.from_json(a) for a in data.get("arguments", []))
        except (TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(f"malformed input schema: {type(exc).__name__}: {exc}") from None
        return cls(features, arguments)

    def with_ranges(self, ranges: dict[str, tuple[int | None, int | None]]) -> InputSchema:
        """A copy whose lengths features get (min, max) from ``ranges``, keyed by any name
        :meth:`resolve_lengths` accepts."""
        chosen: dict[str, tuple[int | None, int | None]] = {}
        for key, value in ranges.items():
            for name in self.resolve_lengths(key):
                chosen[name] = value
        features = tuple(
            dataclasses.replace(
                f,
                min_value=chosen[f.name][0] if chosen[f.name][0] is not None else f.min_value,
                max_value=chosen[f.name][1] if chosen[f.name][1] is not None else f.max_value,
            ) if f.name in chosen else f
            for f in self.features
        )  # fmt: skip
        return InputSchema(features, self.arguments)

    def resolve_lengths(self, key: str) -> list[str]:
        """Lengths features named by ``key``: a lengths feature itself, a KJT key ``arg.key``, a
        feature partitioned by lengths, or a whole argument or part of one ``arg`` (all its lengths but
        those with one value per user, ``ONE_PER_USER``: a history's range does not make a contextual
        key jagged; when every lengths feature under ``arg`` has one value per user, all of them)."""
        names = self.names
        if key in names or key in self.graph_names:
            spec = self.get(key)
            return [spec.name] if spec.kind == "lengths" else [spec.jagged_by] if spec.jagged_by else []
        if f"{key}.lengths" in names:
            return [f"{key}.lengths"]
        under = [f for f in self.lengths_features() if f.name.startswith(f"{key}.")]
        if not under:
            known = ", ".join(f.name for f in self.lengths_features()) or "none"
            raise ConfigError(f"{key!r} names no lengths feature of this model (lengths features: {known})")
        jagged = [f.name for f in under if f.semantic != ONE_PER_USER]
        return jagged or [f.name for f in under]

    # -- requests ---------------------------------------------------------------------------------

    def validate(self, batch: dict[str, Tensor], max_batch_size: int | None = None, *, values: bool = True) -> int:
        """Checks a request; returns its batch size. Raises RequestError naming the first problem.
        ``values=False`` checks its layout only (names, dtypes, shapes, users, lengths and their ranges against
        the values), not whether the other features' values are within the exported ranges: what requests
        need before they are concatenated into one, whose values are then checked together (a value's range
        does not depend on its place)."""
        if not isinstance(batch, dict):
            raise RequestError(f"a request is a dict of named tensors, got {type(batch).__name__}")
        missing = [n for n in self.names if n not in batch]
        if missing:
            raise RequestError(f"request is missing feature(s) {missing}; the package expects {self.names}")
        extra = sorted(set(batch) - set(self.names))
        if extra:
            raise RequestError(f"request has unknown feature(s) {extra}; the package expects {self.names}")
        batch_size: int | None = None
        bounded: list[tuple[FeatureSpec, Tensor]] = []  # features whose values have bounds, checked below
        for f in self.features:
            t = batch[f.name]
            if not isinstance(t, Tensor):
                raise RequestError(f"feature {f.name!r} must be a tensor, got {type(t).__name__}")
            if t.dtype != f.torch_dtype:
                raise RequestError(f"feature {f.name!r} has dtype {t.dtype}, expected {f.torch_dtype}")
            if t.dim() != 1 + len(f.trailing) or tuple(t.shape[1:]) != f.trailing:
                expected = "[n" + "".join(f", {d}" for d in f.trailing) + "]"
                raise RequestError(f"feature {f.name!r} must have shape {expected}, got {list(t.shape)}")
            if f.kind in ("lengths", "per_user"):
                if batch_size is None:
                    batch_size = t.size(0)
                elif t.size(0) != batch_size:
                    raise RequestError(
                        f"feature {f.name!r} has {t.size(0)} entries but the batch has {batch_size} users")
            if (values or f.kind == "lengths") and t.numel() and (f.min_value is not None or f.max_value is not None):
                bounded.append((f, t))
        # Every value the checks read, in one transfer per device (a request on the GPU would otherwise wait
        # for the device at each read): each bounded feature's least and greatest value, each jagged
        # feature's total length.
        jagged = [f for f in self.features if f.kind == "jagged"]
        extremes, totals = _read_all([t for _, t in bounded], [batch[f.jagged_by] for f in jagged])  # type: ignore[index]
        for (f, _), (least, greatest) in zip(bounded, extremes):
            if f.min_value is not None and least < f.min_value:
                raise RequestError(f"feature {f.name!r} has value {least} below the minimum {f.min_value}")
            if f.max_value is not None and greatest > f.max_value:
                what = "length" if f.kind == "lengths" else "value"
                raise RequestError(
                    f"feature {f.name!r} has {what} {greatest} beyond the exported maximum {f.max_value}")
        if batch_size is None or batch_size < 1:
            raise RequestError("request has no users (batch size 0)")
        if max_batch_size is not None and batch_size > max_batch_size:
            raise RequestError(f"batch size {batch_size} is beyond the exported maximum {max_batch_size}")
        jagged_totals = dict(zip((f.name for f in jagged), totals))
        for f in self.features:
            if f.kind == "lengths" and f.same_as and not torch.equal(batch[f.name], batch[f.same_as]):
                raise RequestError(f"feature {f.name!r} must equal {f.same_as!r} (the model reads them as one length)")
            if f.kind == "jagged":
                total = jagged_totals[f.name]
                if batch[f.name].size(0) != total:
                    raise RequestError(
                        f"feature {f.name!r} has {batch[f.name].size(0)} values but {f.jagged_by!r} sums to {total}")
        return batch_size

    def validate_each(self, requests: Sequence[Any], max_batch_size: int | None = None) -> list[int | RequestError]:
        """``validate(request, max_batch_size, values=False)`` of each of ``requests``: its batch size, or the
        RequestError that refuses it, in the same words. What a server's batching needs of the many small
        requests it combines into one call, at a fraction of the cost: the layout is checked in Python per
        request, and the values those checks read (lengths' ranges, jagged totals, equal lengths) are read
        for all of them at once, one concatenation and one read per lengths feature. A request any check
        doubts, or all of them when a joint check fails, is validated alone, which words the refusal."""
        out: list[int | RequestError] = [RequestError("not checked")] * len(requests)
        names = set(self.names)
        passed: list[int] = []
        sizes: list[int] = []
        for index, request in enumerate(requests):
            size = self._layout_size(request, names)
            if size is not None and (max_batch_size is None or size <= max_batch_size):
                passed.append(index)
                sizes.append(size)
        if passed and not self._values_hold([requests[i] for i in passed], sizes):
            passed, sizes = [], []  # some request's values are wrong: each is validated alone below
        for index, size in zip(passed, sizes):
            out[index] = size
        checked = set(passed)
        for index, request in enumerate(requests):
            if index not in checked:
                try:
                    out[index] = self.validate(request, max_batch_size, values=False)
                except RequestError as exc:
                    out[index] = exc
        return out

    def _layout_size(self, request: Any, names: set[str]) -> int | None:
        """The batch size of ``request`` if its names, tensors, dtypes, shapes and users are right, else None."""
        if not isinstance(request, dict) or request.keys() != names:
            return None
        size: int | None = None
        for f in self.features:
            t = request[f.name]
            if (not isinstance(t, Tensor) or t.dtype != f.torch_dtype or t.dim() != 1 + len(f.trailing)
                    or tuple(t.shape[1:]) != f.trailing):
                return None
            if f.kind in ("lengths", "per_user"):
                if size is None:
                    size = t.size(0)
                elif t.size(0) != size:
                    return None
        return size if size is not None and size >= 1 else None

    def _values_hold(self, requests: list[dict[str, Tensor]], sizes: list[int]) -> bool:
        """Whether the lengths of ``requests`` (each of the right layout, ``sizes`` users) are within their
        ranges, equal where the schema says so, and sum to each jagged feature's values, request by request."""
        columns: dict[str, Tensor] = {}
        try:
            ends = torch.tensor(sizes).cumsum(0) - 1
            for f in self.features:
                if f.kind != "lengths":
                    continue
                column = columns[f.name] = torch.cat([r[f.name] for r in requests])
                at = column.to(torch.int64).cumsum(0)[ends.to(column.device)]
                read = torch.cat([at, column.min().view(1).to(at.dtype), column.max().view(1).to(at.dtype)]).tolist()
                least, greatest = read[-2], read[-1]
                if ((f.min_value is not None and least < f.min_value)
                        or (f.max_value is not None and greatest > f.max_value)):
                    return False
                totals = [b - a for a, b in zip([0, *read[:-3]], read[:-2])]
                for feature in self.features:
                    if feature.kind == "jagged" and feature.jagged_by == f.name:
                        if any(r[feature.name].size(0) != total for r, total in zip(requests, totals)):
                            return False
            return all(torch.equal(columns[f.name], columns[f.same_as])
                       for f in self.features if f.kind == "lengths" and f.same_as)
        except RuntimeError:  # tensors on several devices, say: validated one by one
            return False

    def to_graph_inputs(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The request keyed by graph-input names, in schema order."""
        return {f.graph_name: batch[f.name] for f in self.features}

    def assemble(self, batch: dict[str, Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) for the model's ``forward`` from a flat request (see the module docstring)."""
        if not self.arguments:
            return (dict(batch),), {}
        return (), {arg.name: arg.assemble(batch) for arg in self.arguments if not arg.optional_absent}


def _build_kjt(path: str, arg: ArgumentSpec, batch: dict[str, Tensor]) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    names = [kjt_feature_names(path, key, arg.weighted) for key in arg.keys]
    return KeyedJaggedTensor(
        keys=list(arg.keys),
        values=torch.cat([batch[n[0]] for n in names]),
        lengths=torch.cat([batch[n[1]] for n in names]),
        weights=torch.cat([batch[n[2]] for n in names]) if arg.weighted else None,
    )


def _build_jt(path: str, weighted: bool, batch: dict[str, Tensor]) -> Any:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    names = jt_feature_names(path, weighted)
    return JaggedTensor(values=batch[names[0]], lengths=batch[names[1]], weights=batch[names[2]] if weighted else None)


def _feature_json(f: FeatureSpec) -> dict[str, Any]:
    data = asdict(f)
    data["trailing"] = list(f.trailing)
    data["sample_range"] = list(f.sample_range) if f.sample_range else None
    return data


# Host tensors of whole numbers up to this many values are read as Python lists; longer ones by a tensor reduction
# (a 4096-id history: 3.9 µs by aminmax, 164 µs through a list, 2-core VM).
_LISTED = 64


def _read_all(bounded: list[Tensor], lengths: list[Tensor], *, together: bool | None = None
              ) -> tuple[list[tuple[Any, Any]], list[int]]:
    """(least, greatest) of each tensor of ``bounded`` (none empty) and the sum of each of ``lengths``, as
    Python numbers. A value on the CPU is read at once; values on a device are read back together, one
    transfer per device and kind (whole numbers as int64, others as float64), so that a request on the GPU
    waits for the device once, not once a value. ``together`` forces either way (tests)."""
    numbers: list[Any] = []
    pending: dict[tuple[torch.device, bool], list[tuple[int, Tensor]]] = {}
    listed: dict[int, list[int]] = {}  # a small host tensor of whole numbers, read once (by id: lengths recur)

    def add(value: Tensor, floating: bool) -> None:
        pending.setdefault((value.device, floating), []).append(
            (len(numbers), value.to(torch.float64 if floating else torch.int64)))
        numbers.append(None)

    def at_once(t: Tensor) -> bool:
        return t.is_cpu if together is None else not together

    def small(t: Tensor) -> list[int] | None:
        # Per-user features and lengths are a few numbers: one read and Python's min/max/sum cost less than
        # a tensor reduction each.
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.numel() > _LISTED:
            return None
        if id(t) not in listed:
            listed[id(t)] = t.reshape(-1).tolist()
        return listed[id(t)]

    for t in bounded:
        floating = t.dtype.is_floating_point
        if at_once(t):
            values = small(t)
            if values is not None:
                numbers += [min(values), max(values)]
                continue
            least_t, greatest_t = torch.aminmax(t) if t.dtype != torch.bool else (t.min(), t.max())
            least, greatest = least_t.item(), greatest_t.item()
            numbers += [least, greatest] if floating else [int(least), int(greatest)]
        else:
            least_t, greatest_t = torch.aminmax(t)
            add(least_t, floating)
            add(greatest_t, floating)
    for t in lengths:
        if at_once(t):
            values = small(t)
            numbers.append(sum(values) if values is not None else int(t.sum()))
        else:
            add(t.sum(), False)
    for items in pending.values():
        for (index, _), number in zip(items, torch.stack([value for _, value in items]).tolist()):
            numbers[index] = number
    extremes = [(numbers[2 * i], numbers[2 * i + 1]) for i in range(len(bounded))]
    return extremes, [int(n) for n in numbers[2 * len(bounded):]]
