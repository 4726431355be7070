"""The package manifest as one typed object: every field the loader and the runtimes read, checked.

A package is untrusted input: it may come from anywhere, and may have been edited or damaged on the
way. ``manifest.json`` is parsed into a :class:`Manifest` right after JSON decoding; a missing field,
or one of the wrong type or value, raises PackageError naming it (``manifest field
backend.files.dense: expected a string, got int``), so no KeyError or TypeError reaches the user. What
is checked besides types:

- paths (the values of ``backend.files`` and the keys of ``files``) are plain relative POSIX paths: not
  absolute, no ``..``, ``.`` or empty part (``dense//x``, ``./dense/x``), so each file has one spelling;
  every artifact is listed in ``files`` with its sha256, and :meth:`Manifest.artifact` refuses a path
  that leaves the package through a symbolic link;
- op libraries are names from :data:`OP_LIBRARIES`, which maps each to the module the loader imports:
  a manifest never chooses what gets imported;
- the graphs' input and output names agree with the input schema and with each other, and the ranges
  cover every lengths feature.

The manifest's own integrity (``manifest.sha256``, see ``hstu_export.package.directory``) and the checksums of
the other files are checked by ``hstu_export.package.directory.load_manifest`` before and after this parsing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hstu_export.errors import ConfigError, PackageError
from hstu_export.package.schema import DTYPES, InputSchema
from hstu_export.package.tables import TABLES_FORMAT, dtype_names
from hstu_export.runtimes import backend_names
from hstu_export.settings import TORCH_DTYPES

# Op libraries a package may name, and the module the loader imports for each. Kept in step with
# runtimes/graph_io.py OP_LIBRARY_MODULES (what exports write) and the trt backend's RUNTIME_LIBRARY
# (tests/faults/test_manifest_untrusted.py checks both).
OP_LIBRARIES: dict[str, str] = {
    "hstu_export.ops": "hstu_export.ops",
    "fbgemm_gpu": "fbgemm_gpu",
    "torch_tensorrt": "torch_tensorrt",
}
OP_TARGETS = ("triton", "aten", "fbgemm")
DEVICE_TYPES = ("cpu", "cuda")
# What an artifact file is (manifest artifacts.<role>.format).
ARTIFACT_FORMATS = ("torchscript", "aoti", "onnx", "torch_tensorrt")
# What an output is (manifest outputs[i].kind): a per-candidate score ranked by, one in [0, 1], a vector
# per row, anything else. Scores are what quantized packages are held to and ranked by (docs/QUANTIZATION.md).
OUTPUT_KINDS = ("score", "probability", "embedding", "other")
SCORE_KINDS = ("score", "probability")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # kept out of the strings that are read (and printed in messages)
_MISSING: Any = object()
T = TypeVar("T")


@dataclass(frozen=True)
class BackendSection:
    name: str
    files: dict[str, str]  # role -> plain relative path, listed in Manifest.files
    meta: dict[str, Any]


@dataclass(frozen=True)
class DeviceSection:
    type: str  # "cpu" or "cuda"
    arch: str
    name: str


@dataclass(frozen=True)
class LengthRanges:
    max_batch_size: int
    max_lengths: dict[str, int]
    min_lengths: dict[str, int]


@dataclass(frozen=True)
class Ranges:
    max_batch_size: int
    lengths: LengthRanges
    dims: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class BackendFields:
    """What a backend's ``load`` reads: its files, and the names by which the runners wire the graphs."""

    backend: BackendSection
    sparse_input_names: tuple[str, ...]
    sparse_output_names: tuple[str, ...]
    dense_passthrough_inputs: tuple[str, ...]
    output_names: tuple[str, ...]

    def artifact(self, root: Path, role: str) -> Path:
        """The file ``backend.files[role]`` names, resolved, and only if it stays inside ``root``."""
        relpath = self.backend.files.get(role)
        if relpath is None:
            raise PackageError(f"{root}: manifest field backend.files.{role}: missing (the {self.backend.name} "
                               "backend loads that file)")
        path = resolve_inside(root, relpath, f"backend.files.{role}")
        if not path.is_file():
            raise PackageError(f"{root}: file {relpath} (backend.files.{role}) is missing")
        return path


@dataclass(frozen=True)
class Manifest(BackendFields):
    """A validated manifest. ``raw`` is the decoded JSON it was read from (``Predictor.manifest``)."""

    format_version: int
    op_namespace: str
    versions: dict[str, str | None]
    device: DeviceSection
    dtype: str
    op_target: str
    op_libraries: tuple[str, ...]
    input_schema: InputSchema
    ranges: Ranges
    dense_input_names: tuple[str, ...]
    files: dict[str, str]  # plain relative path -> sha256 (hex); backend.files are all listed here
    parity: dict[str, Any]
    model_bundle: str | None
    # Per role of backend.files: file, format, inputs/outputs in positional order (docs/PACKAGE.md).
    artifacts: dict[str, dict[str, Any]]
    raw: dict[str, Any] = field(repr=False, compare=False)
    # Each output's kind (manifest outputs); empty for packages written before kinds were recorded.
    output_kinds: dict[str, str] = field(default_factory=dict)

    @property
    def torch_version(self) -> str:
        return self.versions["torch"]  # type: ignore[return-value]  # checked to be a string


def as_manifest(manifest: Manifest | dict[str, Any], root: Path) -> Manifest:
    """``manifest`` as a Manifest: a decoded dict is validated whole."""
    return manifest if isinstance(manifest, Manifest) else parse_manifest(manifest, root)


def backend_fields(manifest: BackendFields | dict[str, Any], root: Path) -> BackendFields:
    """What a backend's ``load`` reads, validated. A package's manifest arrives as a Manifest (validated
    whole by ``load_manifest``); code may hand a backend a dict of just these fields, whose types and
    paths are checked here (and their listing in ``files`` when it has one)."""
    if isinstance(manifest, BackendFields):
        return manifest
    try:
        top = _object(manifest, "(top level)")
        files = _files(top["files"]) if "files" in top else None
        names = {key: _strings(_get(top, key, ""), key, nonempty=key == "output_names") for key in _BACKEND_NAMES}
        return BackendFields(backend=_backend(_get(top, "backend", ""), files), **names)
    except _FieldError as exc:
        raise PackageError(f"{root}: manifest field {exc.name}: {exc.problem}") from None


def resolve_inside(root: Path, relpath: str, field: str | None = None) -> Path:
    """``root / relpath`` with symbolic links resolved; PackageError (naming the manifest ``field`` that
    holds the path, if any) when that leaves ``root``."""
    base = Path(root).resolve()
    path = (base / relpath).resolve()
    if not path.is_relative_to(base):
        named = f"manifest field {field}: " if field else ""
        raise PackageError(f"{root}: {named}{relpath} leaves the package (it resolves to {path}); a package "
                           "only reads files inside its directory")
    return path


def parse_manifest(data: Any, source: str | Path) -> Manifest:
    """The typed manifest of decoded ``manifest.json`` ``data``; ``source`` (the package) starts messages."""
    try:
        return _parse(data)
    except _FieldError as exc:
        raise PackageError(f"{source}: manifest field {exc.name}: {exc.problem}") from None


# -- field readers: each raises _FieldError naming the field by its path ---------------------------

class _FieldError(Exception):
    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name}: {problem}")
        self.name, self.problem = name, problem


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__  # int, float


def _wrong(name: str, expected: str, value: Any) -> _FieldError:
    return _FieldError(name, f"expected {expected}, got {_json_kind(value)}")


def _child(name: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{name}[{key}]"
    if _IDENTIFIER.fullmatch(key):
        return f"{name}.{key}" if name else key
    return f"{name}[{key!r}]"


def _get(obj: dict[str, Any], key: str, name: str, required: bool = True) -> Any:
    if key in obj:
        return obj[key]
    if required:
        raise _FieldError(_child(name, key), "missing")
    return _MISSING


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _wrong(name, "an object", value)
    return value


def _string(value: Any, name: str, choices: tuple[str, ...] | list[str] | None = None) -> str:
    if not isinstance(value, str):
        raise _wrong(name, "a string", value)
    if _CONTROL.search(value):
        raise _FieldError(name, f"{value[:80]!r} contains a control character")
    if choices is not None and value not in choices:
        raise _FieldError(name, f"{value[:80]!r} is not one of {', '.join(choices)}")
    return value


def _optional_string(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _wrong(name, "a string or null", value)
    return _string(value, name)


def _integer(value: Any, name: str, minimum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong(name, "an int", value)
    if minimum is not None and value < minimum:
        raise _FieldError(name, f"{value} is below the minimum {minimum}")
    return value


def _number(value: Any, name: str, minimum: float | None = None) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _wrong(name, "a number", value)
    if not math.isfinite(value):
        raise _FieldError(name, f"{value} is not a finite number")
    if minimum is not None and value < minimum:
        raise _FieldError(name, f"{value} is below the minimum {minimum}")
    return value


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong(name, "a boolean", value)
    return value


def _array(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise _wrong(name, "an array", value)
    return value


def _strings(value: Any, name: str, nonempty: bool = False) -> tuple[str, ...]:
    items = tuple(_string(v, _child(name, i)) for i, v in enumerate(_array(value, name)))
    dup = sorted({v for v in items if items.count(v) > 1})
    if dup:
        raise _FieldError(name, f"names {dup} twice")
    if nonempty and not items:
        raise _FieldError(name, "is empty")
    return items


def _mapping(value: Any, name: str, read: Callable[[Any, str], T]) -> dict[str, T]:
    return {key: read(item, _child(name, key)) for key, item in _object(value, name).items()}


def _relpath(value: Any, name: str) -> str:
    """A plain relative POSIX path: one spelling per file, nothing outside the package."""
    path = _string(value, name)
    if path.startswith("/"):
        raise _FieldError(name, f"{path!r} is an absolute path; paths in a package are relative to its directory")
    if "\\" in path or any(part in ("", ".", "..") for part in path.split("/")):
        raise _FieldError(name, f"{path!r} is not a plain relative path (parts separated by single '/', no "
                                "'.', '..' or empty parts)")
    return path


def _optional(obj: dict[str, Any], key: str, name: str, read: Callable[[Any, str], T]) -> T | None:
    value = _get(obj, key, name, required=False)
    return None if value is _MISSING else read(value, _child(name, key))


# -- sections -------------------------------------------------------------------------------------

_BACKEND_NAMES = ("sparse_input_names", "sparse_output_names", "dense_passthrough_inputs", "output_names")


def _parse(data: Any) -> Manifest:
    top = _object(data, "(top level)")

    def get(key: str) -> Any:
        return _get(top, key, "")

    files = _files(get("files"))
    backend = _backend(get("backend"), files)
    schema = _input_schema(get("input_schema"))
    names = {key: _strings(get(key), key, nonempty=key == "output_names")
             for key in ("sparse_input_names", "sparse_output_names", "dense_input_names",
                         "dense_passthrough_inputs", "output_names")}
    _check_graph_names(names, schema)
    model = _object(get("model"), "model")
    for key, read in _OPTIONAL_TOP.items():
        _optional(top, key, "", read)
    _optional(top, "kv_cache", "", lambda v, n: _kv_cache(v, files))
    kinds = _optional(top, "outputs", "", lambda v, n: _output_kinds(v, n, names["output_names"])) or {}
    return Manifest(
        format_version=_integer(get("format_version"), "format_version", minimum=1),
        op_namespace=_string(get("op_namespace"), "op_namespace"),
        versions=_versions(get("versions")),
        backend=backend,
        device=_device(get("device")),
        dtype=_string(get("dtype"), "dtype", list(TORCH_DTYPES)),
        op_target=_string(get("op_target"), "op_target", OP_TARGETS),
        op_libraries=_op_libraries(get("op_libraries")),
        input_schema=schema,
        ranges=_ranges(get("ranges"), schema),
        sparse_input_names=names["sparse_input_names"],
        sparse_output_names=names["sparse_output_names"],
        dense_input_names=names["dense_input_names"],
        dense_passthrough_inputs=names["dense_passthrough_inputs"],
        output_names=names["output_names"],
        files=files,
        parity=_parity(get("parity")),
        model_bundle=_optional(model, "bundle", "model", _optional_string),
        artifacts=_check_artifact_io(_artifacts(get("artifacts"), backend, schema, files,
                                                _integer(get("format_version"), "format_version", minimum=1)),
                                     schema, names["output_names"]),
        raw=top,
        output_kinds=kinds,
    )


def _output_kinds(value: Any, name: str, output_names: tuple[str, ...]) -> dict[str, str]:
    """``outputs``: one entry per output, in ``output_names``' order, with its kind and the model output it
    is taken from (whole, or one ``index`` along ``dim``)."""
    entries = _array(value, name)
    kinds: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = _child(name, i)
        entry = _object(entry, where)
        kinds[_string(_get(entry, "name", where), _child(where, "name"))] = _string(
            _get(entry, "kind", where), _child(where, "kind"), OUTPUT_KINDS)
        _string(_get(entry, "model_output", where), _child(where, "model_output"))
        _optional(entry, "kind_from", where, _string)
        for key in ("dim", "index"):
            _optional(entry, key, where, lambda v, n: _integer(v, n, minimum=0))
    if tuple(kinds) != output_names or len(entries) != len(output_names):
        raise _FieldError(name, f"names {list(kinds)}, not the package's outputs {list(output_names)} in their order")
    return kinds


def _check_artifact_io(artifacts: dict[str, dict[str, Any]], schema: InputSchema,
                       output_names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The artifacts' own inputs and outputs agree with what the loaders read from the rest of the
    manifest: a request feature an artifact takes has the dtype the input schema gives it (requests are
    checked against the schema), and the artifact whose outputs are the package's (``model``, else
    ``dense``) returns them in ``output_names``' order (outputs are named by that list)."""
    dtypes = {f.name: f.dtype for f in schema.features}
    for role, entry in artifacts.items():
        for i, tensor in enumerate(entry["inputs"]):
            feature = tensor.get("feature")
            if feature is not None and tensor["dtype"] != dtypes[feature]:
                raise _FieldError(f"input_schema.features.{feature}.dtype",
                                  f"is {dtypes[feature]!r} but artifacts.{role}.inputs[{i}] takes {tensor['dtype']!r}")
    final = artifacts.get("model") or artifacts.get("dense")
    if final is not None:
        returned = tuple(tensor["name"] for tensor in final["outputs"])
        if returned != tuple(output_names):
            role = "model" if "model" in artifacts else "dense"
            raise _FieldError("output_names", f"{list(output_names)} is not what artifacts.{role} returns, in its order "
                                              f"({list(returned)})")
    return artifacts


def _kv_cache(value: Any, files: dict[str, str]) -> dict[str, Any]:
    """The ``--kv-cache`` section: the delta program's file (listed in ``files``), its page size and bounds,
    and the layout of the cache it reads (docs/PACKAGE.md)."""
    section = _object(value, "kv_cache")
    kind = _get(section, "kind", "kv_cache", required=False)
    if kind is not _MISSING:
        _string(kind, "kv_cache.kind", ("derived",))
        return _derived_kv_cache(section, files)
    program = _relpath(_get(section, "program", "kv_cache"), "kv_cache.program")
    if program not in files:
        raise _FieldError("kv_cache.program", f"{program!r} is not listed in files (every artifact has a sha256 there)")
    _strings(_get(section, "inputs", "kv_cache"), "kv_cache.inputs", nonempty=True)
    _strings(_get(section, "outputs", "kv_cache"), "kv_cache.outputs", nonempty=True)
    page = _integer(_get(section, "page_size", "kv_cache"), "kv_cache.page_size", minimum=16)
    if page & (page - 1):
        raise _FieldError("kv_cache.page_size", f"expected a power of two, got {page}")
    for key in ("max_seq_len", "max_query_len"):
        _integer(_get(section, key, "kv_cache"), f"kv_cache.{key}", minimum=1)
    _integer(_get(section, "splits", "kv_cache"), "kv_cache.splits", minimum=0)  # 0: chosen per call
    bounds = _get(section, "bounds", "kv_cache", required=False)
    if bounds is not _MISSING and bounds is not None:  # absent or null: written before they were recorded
        bounds = _object(bounds, "kv_cache.bounds")
        for key in ("batch", "new_history", "candidates"):
            _integer(_get(bounds, key, "kv_cache.bounds"), f"kv_cache.bounds.{key}", minimum=1)
    _optional(section, "fits_counts", "kv_cache", _boolean)  # absent: written before the program fitted them
    _optional(section, "inductor_options", "kv_cache", _object)  # what the program was compiled with (a record)
    layout = _object(_get(section, "layout", "kv_cache"), "kv_cache.layout")
    for key in ("num_layers", "num_heads", "attention_dim", "linear_dim", "num_time_buckets"):
        _integer(_get(layout, key, "kv_cache.layout"), f"kv_cache.layout.{key}", minimum=1)
    _number(_get(layout, "time_bucket_base", "kv_cache.layout"), "kv_cache.layout.time_bucket_base", minimum=0)
    _strings(_get(layout, "contextual_features", "kv_cache.layout"), "kv_cache.layout.contextual_features")
    return section


def _derived_kv_cache(section: dict[str, Any], files: dict[str, str]) -> dict[str, Any]:
    """A delta program derived from the model's graph (``kind: derived``, hstu_export/kv_derive.py): the
    program and the counts program (both AOTInductor packages listed in ``files``), their inputs, and the
    pages' layout."""
    if "counts_program" not in section and "counts" in section:
        raise _FieldError("kv_cache.counts", "is a torch.export counts program of an older hstu-export; re-export the "
                                             "model with --kv-cache")
    for key in ("program", "counts_program"):
        path = _relpath(_get(section, key, "kv_cache"), f"kv_cache.{key}")
        if path not in files:
            raise _FieldError(f"kv_cache.{key}", f"{path!r} is not listed in files (every artifact has a sha256 there)")
    for key in ("inputs", "counts_inputs", "outputs"):
        _strings(_get(section, key, "kv_cache"), f"kv_cache.{key}", nonempty=True)
    _strings(_get(section, "target_inputs", "kv_cache"), "kv_cache.target_inputs")
    page = _integer(_get(section, "page_size", "kv_cache"), "kv_cache.page_size", minimum=16)
    if page & (page - 1):
        raise _FieldError("kv_cache.page_size", f"expected a power of two, got {page}")
    _integer(_get(section, "max_seq_len", "kv_cache"), "kv_cache.max_seq_len", minimum=1)
    _optional(section, "inductor_options", "kv_cache", _object)
    layout = _object(_get(section, "layout", "kv_cache"), "kv_cache.layout")
    for key in ("num_layers", "num_heads", "attention_dim", "linear_dim", "row_width", "max_seq_len"):
        _integer(_get(layout, key, "kv_cache.layout"), f"kv_cache.layout.{key}", minimum=1)
    _string(_get(layout, "row_dtype", "kv_cache.layout"), "kv_cache.layout.row_dtype", ("float32", "bfloat16", "float16"))
    _optional(section, "counts_on_host", "kv_cache", lambda v, n: _counts_on_host(v, n, section["counts_inputs"]))
    return section


def _counts_on_host(value: Any, name: str, counts_inputs: list[str]) -> dict[str, Any]:
    """``kv_cache.counts_on_host``: each user's sequence length and target count as a constant plus integer
    multiples of counts inputs (kv_derive.host_counts)."""
    sums = _object(value, name)
    for part in ("seq_lengths", "num_targets"):
        where = f"{name}.{part}"
        entry = _object(_get(sums, part, name), where)
        _integer(_get(entry, "constant", where), f"{where}.constant")
        for input_name, k in _object(_get(entry, "terms", where), f"{where}.terms").items():
            if input_name not in counts_inputs:
                raise _FieldError(f"{where}.terms", f"names {input_name[:80]!r}, which is not one of counts_inputs")
            _integer(k, _child(f"{where}.terms", input_name))
    if not _object(sums["seq_lengths"]["terms"], name):
        raise _FieldError(f"{name}.seq_lengths.terms", "is empty: the lengths read no input")
    return sums


def _files(value: Any) -> dict[str, str]:
    checked = {}
    for path, digest in _object(value, "files").items():
        name = _child("files", path)
        _relpath(path, name)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise _FieldError(name, f"expected a sha256 (64 lowercase hex digits), got {_json_kind(digest)}"
                                    + (f" {digest[:70]!r}" if isinstance(digest, str) else ""))
        checked[path] = digest
    return checked


def _backend(value: Any, files: dict[str, str] | None) -> BackendSection:
    """``files``: the manifest's listing, which every artifact must be in (None: no listing to check)."""
    section = _object(value, "backend")
    name = _string(_get(section, "name", "backend"), "backend.name", backend_names())
    roles = _mapping(_get(section, "files", "backend"), "backend.files", _relpath)
    seen: dict[str, str] = {}
    for role, path in roles.items():
        if files is not None and path not in files:
            raise _FieldError(f"backend.files.{role}", f"{path} is not listed in the manifest's files (with its "
                                                       "sha256); a package only loads files it lists")
        if path in seen:
            raise _FieldError(f"backend.files.{role}", f"{path} is also backend.files.{seen[path]}")
        seen[path] = role
    meta = _object(_get(section, "meta", "backend"), "backend.meta")
    return BackendSection(name, roles, meta)


def _versions(value: Any) -> dict[str, str | None]:
    versions = _mapping(value, "versions", _optional_string)
    _string(_get(versions, "torch", "versions"), "versions.torch")
    return versions


def _device(value: Any) -> DeviceSection:
    section = _object(value, "device")
    _optional(section, "cuda", "device", _optional_string)
    return DeviceSection(
        type=_string(_get(section, "type", "device"), "device.type", DEVICE_TYPES),
        arch=_string(_get(section, "arch", "device"), "device.arch"),
        name=_string(_get(section, "name", "device"), "device.name"),
    )


def _op_libraries(value: Any) -> tuple[str, ...]:
    names = _strings(value, "op_libraries")
    for i, name in enumerate(names):
        if name not in OP_LIBRARIES:
            raise _FieldError(f"op_libraries[{i}]", f"{name!r} is not an op library hstu-export loads (it loads "
                                                    f"{', '.join(OP_LIBRARIES)}); a package cannot name other modules")
    return names


# Keys of one input_schema feature / argument and how each is read (to_json writes them all).
_FEATURE_KEYS: dict[str, Callable[[Any, str], Any]] = {
    "name": _string,
    "dtype": _string,
    "kind": _string,
    "jagged_by": _optional_string,
    "min_value": lambda v, n: None if v is None else _number(v, n),
    "max_value": lambda v, n: None if v is None else _number(v, n),
    "semantic": _string,
    "same_as": _optional_string,
    "trailing": lambda v, n: [_integer(d, _child(n, i), minimum=0) for i, d in enumerate(_array(v, n))],
    "sample_range": lambda v, n: None if v is None else _pair(v, n),
}
_ARGUMENT_KEYS: dict[str, Callable[[Any, str], Any]] = {
    "name": _string,
    "kind": _string,
    "keys": _strings,
    "weighted": _boolean,
    "optional_absent": _boolean,
    "type": _string,  # a record's class: read by nothing that loads a package (only to call the user's model)
    "fields": lambda v, n: [_argument(a, _child(n, i)) for i, a in enumerate(_array(v, n))],
    "value": lambda v, n: v if isinstance(v, (bool, int, float)) else _string(v, n),
}


def _argument(value: Any, name: str) -> None:
    """One input_schema argument, with its nested fields (records, dicts of structures)."""
    _record(value, name, _ARGUMENT_KEYS, ("name", "kind"))


def _pair(value: Any, name: str) -> tuple[int, int]:
    items = _array(value, name)
    if len(items) != 2:
        raise _FieldError(name, f"expected [min, max], got an array of {len(items)}")
    low, high = (_integer(v, _child(name, i)) for i, v in enumerate(items))
    if low > high:
        raise _FieldError(name, f"[{low}, {high}]: min is above max")
    return low, high


def _record(value: Any, name: str, keys: dict[str, Callable[[Any, str], Any]], required: tuple[str, ...]) -> None:
    obj = _object(value, name)
    for key in required:
        _get(obj, key, name)
    for key, item in obj.items():
        if key not in keys:
            raise _FieldError(_child(name, key), f"unknown key (known: {', '.join(keys)})")
        keys[key](item, _child(name, key))


def _input_schema(value: Any) -> InputSchema:
    section = _object(value, "input_schema")
    features = _array(_get(section, "features", "input_schema"), "input_schema.features")
    for i, feature in enumerate(features):
        name = f"input_schema.features[{i}]"
        _record(feature, name, _FEATURE_KEYS, ("name", "dtype", "kind"))
        if feature["kind"] == "lengths":  # lengths bound sizes: whole numbers
            for key in ("min_value", "max_value"):
                if feature.get(key) is not None:
                    _integer(feature[key], _child(name, key))
    for i, argument in enumerate(_array(_get(section, "arguments", "input_schema"), "input_schema.arguments")):
        _argument(argument, f"input_schema.arguments[{i}]")
    unknown = sorted(set(section) - {"features", "arguments"})
    if unknown:
        raise _FieldError(_child("input_schema", unknown[0]), "unknown key (known: features, arguments)")
    try:
        return InputSchema.from_json(section)
    except ConfigError as exc:
        raise _FieldError("input_schema", str(exc)) from None


def _check_graph_names(names: dict[str, tuple[str, ...]], schema: InputSchema) -> None:
    """The graphs' inputs and outputs as the runners wire them: the sparse graph reads request features,
    the dense graph reads the sparse graph's outputs plus features passed through."""
    features = set(schema.graph_names)
    for key in ("sparse_input_names", "dense_passthrough_inputs"):
        for i, name in enumerate(names[key]):
            if name not in features:
                raise _FieldError(f"{key}[{i}]", f"{name!r} is not a feature of input_schema")
    for i, name in enumerate(names["sparse_output_names"]):
        if name in features:
            raise _FieldError(f"sparse_output_names[{i}]", f"{name!r} is a feature of input_schema, not a sparse output")
    dense = set(names["dense_input_names"])
    expected = set(names["sparse_output_names"]) | set(names["dense_passthrough_inputs"])
    if dense != expected:
        raise _FieldError("dense_input_names", f"expected the sparse outputs and the passed-through features "
                                               f"({sorted(expected)}), got {sorted(dense)}")


def _ranges(value: Any, schema: InputSchema) -> Ranges:
    section = _object(value, "ranges")
    max_batch = _integer(_get(section, "max_batch_size", "ranges"), "ranges.max_batch_size", minimum=1)
    lengths = _object(_get(section, "lengths", "ranges"), "ranges.lengths")
    lengths_batch = _integer(_get(lengths, "max_batch_size", "ranges.lengths"), "ranges.lengths.max_batch_size",
                             minimum=1)
    if lengths_batch != max_batch:
        raise _FieldError("ranges.lengths.max_batch_size", f"{lengths_batch} differs from ranges.max_batch_size "
                                                           f"{max_batch}")
    bounds = {}
    for key in ("max_lengths", "min_lengths"):
        name = f"ranges.lengths.{key}"
        bounds[key] = _mapping(_get(lengths, key, "ranges.lengths"), name,
                               lambda v, n: _integer(v, n, minimum=0))
        for f in schema.lengths_features():
            _get(bounds[key], f.name, name)
    for f in schema.lengths_features():
        if bounds["min_lengths"][f.name] > bounds["max_lengths"][f.name]:
            raise _FieldError(_child("ranges.lengths.min_lengths", f.name), "is above its maximum")
    dims = _mapping(_get(section, "dims", "ranges"), "ranges.dims", _pair)
    return Ranges(max_batch, LengthRanges(lengths_batch, bounds["max_lengths"], bounds["min_lengths"]), dims)


def _parity(value: Any) -> dict[str, Any]:
    section = _object(value, "parity")
    for key in ("passed", "skipped"):
        _optional(section, key, "parity", _boolean)
    tolerances = _get(section, "tolerances", "parity", required=False)
    if tolerances not in (_MISSING, None):
        _object(tolerances, "parity.tolerances")
        for key in ("rel_l2", "max_abs"):
            _number(_get(tolerances, key, "parity.tolerances"), f"parity.tolerances.{key}", minimum=0)
    return section


_TENSOR_KEYS: dict[str, Callable[[Any, str], Any]] = {
    "name": _string,
    "dtype": lambda v, n: _string(v, n, list(DTYPES)),
    "shape": lambda v, n: [d if isinstance(d, str) else _integer(d, n, minimum=0) for d in _array(v, n)],
    "feature": _string,
}
_ARTIFACT_KEYS: dict[str, Callable[[Any, str], Any]] = {
    "file": _relpath,
    "format": lambda v, n: _string(v, n, ARTIFACT_FORMATS),
    "inputs": _array,
    "outputs": _array,
    "returns": _string,
    "constants": _object,  # checked by _constants
}
_CONSTANTS_KEYS: dict[str, Callable[[Any, str], Any]] = {
    "file": _relpath,
    "format": lambda v, n: _string(v, n, (TABLES_FORMAT,)),
    "tensors": _array,
}
_CONSTANT_KEYS: dict[str, Callable[[Any, str], Any]] = {
    "name": _string,
    "dtype": lambda v, n: _string(v, n, dtype_names()),
    "shape": lambda v, n: [_integer(d, n, minimum=0) for d in _array(v, n)],
}
# From this format on, a compiled (aoti) sparse program holds no tables: artifacts.sparse.constants must give them.
TABLES_OUTSIDE_FROM = 5


def _constants(value: Any, name: str, files: dict[str, str], used: dict[str, str]) -> None:
    """A program's tables stored outside it: a listed safetensors file no artifact is, and the tensors it holds,
    each named once with its dtype and static shape."""
    _record(value, name, _CONSTANTS_KEYS, tuple(_CONSTANTS_KEYS))
    if value["file"] not in files:
        raise _FieldError(_child(name, "file"), f"{value['file']} is not listed in the manifest's files (with its "
                                                "sha256); a package only loads files it lists")
    if value["file"] in used:
        raise _FieldError(_child(name, "file"), f"{value['file']} is also backend.files.{used[value['file']]}")
    seen: set[str] = set()
    for i, tensor in enumerate(value["tensors"]):
        where = _child(_child(name, "tensors"), i)
        _record(tensor, where, _CONSTANT_KEYS, tuple(_CONSTANT_KEYS))
        if tensor["name"] in seen:
            raise _FieldError(_child(where, "name"), f"{tensor['name'][:80]!r} is listed twice")
        seen.add(tensor["name"])


def _artifacts(value: Any, backend: BackendSection, schema: InputSchema, files: dict[str, str],
               format_version: int) -> dict[str, dict[str, Any]]:
    """One description per role of ``backend.files``, naming the same file; inputs fed from the request
    name a feature of the input schema; tables stored outside a program (``constants``) where the format
    says a compiled sparse program has them there."""
    section = _object(value, "artifacts")
    for role in backend.files:
        _get(section, role, "artifacts")
    for role in section:
        if role not in backend.files:
            raise _FieldError(f"backend.files.{role}", f"missing (artifacts.{role} describes it)")
    features = set(schema.names)
    for role, entry in section.items():
        name = _child("artifacts", role)
        _record(entry, name, _ARTIFACT_KEYS, ("file", "format", "inputs", "outputs", "returns"))
        if entry["file"] != backend.files[role]:
            raise _FieldError(_child(name, "file"), f"{entry['file']} is not backend.files.{role}")
        for key in ("inputs", "outputs"):
            for i, tensor in enumerate(entry[key]):
                where = _child(_child(name, key), i)
                _record(tensor, where, _TENSOR_KEYS, ("name", "dtype", "shape"))
                if "feature" in tensor and tensor["feature"] not in features:
                    raise _FieldError(_child(where, "feature"), f"{tensor['feature'][:80]!r} is not a feature of input_schema")
        if "constants" in entry:
            _constants(entry["constants"], _child(name, "constants"), files,
                       {path: other for other, path in backend.files.items()})
        elif role == "sparse" and entry["format"] == "aoti" and format_version >= TABLES_OUTSIDE_FROM:
            raise _FieldError(_child(name, "constants"), "missing (a compiled sparse program of this format holds no "
                                                         "tables: they are stored beside it)")
    return section


# Top-level fields no load reads; their JSON type is still checked (reports and tools read them).
_OPTIONAL_TOP: dict[str, Callable[[Any, str], Any]] = {
    "created": _string,
    "triton_configs": _object,
    "boundary": _object,
    "passes": _array,
    "capture": _object,
    "settings": _object,
    "timings": lambda v, n: _mapping(v, n, _number),
    "op_library_files": _object,
    "embedding_quantization": _object,
    "batch_dependent": _string,  # why a user's answer depends on the other users of its call
    "sparse_lowering": _array,  # each embedding collection of the sparse half: lowered to gathers, or kept and why
}
