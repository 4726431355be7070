"""Model bundles (``model.pt``): what a user hands to the exporter.

A bundle is a ``torch.save`` dict of plain data, read back with ``torch.load(weights_only=True)``:
the format name and version, where the model comes from (a registered name and its config, or a
factory import path and its JSON-able keyword arguments), its state dict, an example request (a flat
dict of named tensors) and, for models that do not describe their inputs themselves, the input
schema. Loading it runs no pickled code; building the model imports the named module, as importing
any installed dependency does. A file holding a pickled ``nn.Module`` is refused unless the caller
opts in with ``allow_pickle=True``.

Bundles carry ``content_sha256``, a sha256 over the state dict's tensors (names, dtypes, shapes, bytes),
the example batch, the input schema and the source; loading checks it once everything else has been
checked, because ``torch.load`` does not check the zip's CRCs and a flipped byte would otherwise change a
weight silently. Bundles written before
the checksum (format 1, and format 2 without the field) still load, unchecked.

Format 1 (registered name + config + example batch) is still read.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hstu_export.errors import BundleError, ConfigError, ModelRegistryError
from hstu_export.package.schema import InputSchema
from hstu_export.settings import format_bytes, machine_memory
from hstu_export.sources.registry import (
    build_model,
    call_factory,
    factory_path,
    model_class,
    registered_name,
    resolve_factory,
)
from hstu_export.version import __version__

BUNDLE_FORMAT = "hstu-export-bundle"
BUNDLE_VERSION = 2
V1_KEYS = ("format", "format_version", "model_name", "config", "state_dict", "example_batch")
V2_KEYS = ("format", "format_version", "source", "state_dict", "example_batch")
CHECKSUM_KEY = "content_sha256"


@dataclass
class ModelBundle:
    model: nn.Module
    model_name: str  # the registered name, or the factory path
    config: Any  # the registered model's config, or the factory's keyword arguments
    example_batch: dict[str, Tensor]  # a flat request
    path: Path | None = None
    pickled: bool = False
    schema: InputSchema | None = None  # stored in the bundle; else the model's own input_schema()
    source: dict[str, Any] | None = None

    @property
    def input_schema(self) -> InputSchema:
        if self.schema is not None:
            return self.schema
        fn = getattr(self.model, "input_schema", None)
        if not callable(fn):
            raise BundleError(
                f"{self.path or 'the bundle'}: model {self.model_name!r} has no input schema; re-save it with "
                "hstu_export.save_bundle(..., example_inputs=...) so the schema is inferred and stored"
            )
        return fn()

    @property
    def config_dict(self) -> dict[str, Any] | None:
        if isinstance(self.config, dict):
            return dict(self.config)
        return self.config.to_dict() if hasattr(self.config, "to_dict") else None


def save_bundle(
    model: nn.Module,
    path: str | os.PathLike[str],
    example_batch: dict[str, Tensor] | None = None,
    *,
    example_inputs: Any = None,
    factory: str | Callable[..., nn.Module] | None = None,
    factory_kwargs: dict[str, Any] | None = None,
    input_schema: InputSchema | None = None,
    ranges: dict[str, tuple[int | None, int | None]] | None = None,
    allow_pickle: bool = False,
) -> Path:
    """Writes ``model`` as a bundle.

    - A registered model (``@register_model``, the zoo) is stored as its name and config.
    - Any other ``nn.Module`` is stored with ``factory`` (``"my_pkg.models:build_ranker"`` or the
      function itself) and ``factory_kwargs`` (JSON-able), which rebuild it at load time before its
      state dict is loaded; or, only with ``allow_pickle=True``, pickled.

    The example is either ``example_batch`` (a flat request, for models whose schema is known) or
    ``example_inputs`` in the model's own format: a tuple of positional arguments, a dict of keyword
    arguments, or ``(args, kwargs)``. Without ``input_schema`` and without a model ``input_schema()``
    method, the schema is inferred from ``example_inputs``; ``ranges`` states lengths ranges
    (``{"uih_features": (1, 256)}``, see ``InputSchema.with_ranges``).
    """
    path = Path(path)
    _check_materialised(model, "save")
    source: dict[str, Any]
    if factory is not None:
        kwargs = dict(factory_kwargs or {})
        try:
            json.dumps(kwargs)
        except (TypeError, ValueError) as exc:
            raise BundleError(f"factory_kwargs must be JSON-able (numbers, strings, lists, dicts): {exc}") from None
        source = {"kind": "factory", "factory": factory_path(factory), "kwargs": kwargs}
    else:
        try:
            source = {"kind": "registered", "name": registered_name(model),
                      "config": model.config.to_dict()}  # type: ignore[union-attr,operator]
        except ModelRegistryError:
            if not allow_pickle:
                raise
            source = {"kind": "pickled"}
    schema = _schema_for(model, input_schema, example_inputs, ranges, legacy_batch=example_batch is not None)
    batch = _example_batch(model, schema, example_batch, example_inputs)
    payload: dict[str, Any] = {
        "format": BUNDLE_FORMAT,
        "format_version": BUNDLE_VERSION,
        "hstu_export_version": __version__,
        "source": source,
        "example_batch": {k: v.detach().cpu().contiguous() for k, v in batch.items()},
        "input_schema": json.dumps(schema.to_json()) if schema is not None and not _has_own_schema(model) else None,
    }
    if source["kind"] == "pickled":
        payload["module"] = model
        payload["state_dict"] = {}
    else:
        payload["state_dict"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    weights = model.state_dict() if source["kind"] == "pickled" else payload["state_dict"]
    payload[CHECKSUM_KEY] = content_sha256(source, weights, payload["example_batch"], payload["input_schema"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_bundle(path: str | os.PathLike[str], *, allow_pickle: bool = False, imports: Sequence[str] = ()) -> ModelBundle:
    """Reads a bundle written by ``save_bundle`` (or, with ``allow_pickle``, a pickled module).
    ``imports`` are modules to import first (where user models register themselves)."""
    import_modules(imports)
    path = Path(path)
    if not path.exists():
        raise BundleError(f"{path}: no such file")
    if path.is_dir():
        raise BundleError(f"{path} is a directory, not a model bundle (an exported package? use `hstu-export run`)")
    if not zipfile.is_zipfile(path):
        raise BundleError(f"{path} is not a model bundle: not a torch.save file (truncated, or some other format)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not allow_pickle:
            raise BundleError(
                f"{path} holds pickled Python objects ({_first_line(exc)}); loading it would run arbitrary code. "
                "Re-save it with hstu_export.save_bundle, or pass --allow-pickle (allow_pickle=True) if you trust it"
            ) from None
        return _load_pickled(path)
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as exc:
        raise BundleError(f"{path} is truncated or corrupt: {_first_line(exc)}") from None
    return _from_payload(data, path)


def content_sha256(source: dict[str, Any], state_dict: dict[str, Tensor], example_batch: dict[str, Tensor],
                   input_schema: str | None) -> str:
    """The sha256 a bundle carries over what it holds: the source (name and config, or factory and
    arguments), every state-dict and example tensor (name, dtype, shape and bytes) and the schema."""
    digest = hashlib.sha256()

    def field(*parts: object) -> None:
        text = "\x00".join(str(p) for p in parts).encode()
        digest.update(len(text).to_bytes(8, "little") + text)

    field("source", json.dumps(source, sort_keys=True, default=str))
    field("input_schema", input_schema)
    for section, tensors in (("state_dict", state_dict), ("example_batch", example_batch)):
        for name in sorted(tensors):
            tensor = tensors[name]
            field(section, name, tensor.dtype, tuple(tensor.shape))
            data = _tensor_bytes(tensor)
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return digest.hexdigest()


def _tensor_bytes(tensor: Tensor) -> Any:
    """The tensor's data as a buffer (no copy for a contiguous CPU tensor)."""
    tensor = tensor.detach().cpu()
    if tensor.layout == torch.strided and not tensor.is_quantized:
        return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    buffer = io.BytesIO()  # sparse or quantized: its serialised form
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _verify_checksum(data: dict[str, Any], source: dict[str, Any], state_dict: dict[str, Tensor], path: Path) -> None:
    stored = data.get(CHECKSUM_KEY)
    if stored is None:
        return  # written before bundles carried one
    if not isinstance(stored, str) or not re.fullmatch(r"[0-9a-f]{64}", stored):
        raise BundleError(f"{path}: {CHECKSUM_KEY!r} must be a sha256 (64 hex digits), got {str(stored)[:80]!r}; "
                          "re-save the bundle with hstu_export.save_bundle")
    if content_sha256(source, state_dict, data["example_batch"], data.get("input_schema")) != stored:
        raise BundleError(f"{path} changed since it was saved (checksum mismatch over its weights, example batch, "
                          "schema and source: the file is corrupt or was edited): re-save it with "
                          "hstu_export.save_bundle")


def import_modules(names: Sequence[str]) -> None:
    """Imports user modules named with ``--import`` (they register models or define factories)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # whatever the module raises while importing
            raise ConfigError(f"--import {name}: importing it failed ({type(exc).__name__}: {_first_line(exc)})") from None


def _from_payload(data: Any, path: Path) -> ModelBundle:
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        what = "a dict without our format marker" if isinstance(data, dict) else type(data).__name__
        raise BundleError(
            f"{path} is a torch file but not an hstu-export bundle ({what}); create one with "
            "hstu_export.save_bundle or examples/build_model.py"
        )
    version = data.get("format_version")
    if not isinstance(version, int) or version > BUNDLE_VERSION or version < 1:
        raise BundleError(
            f"{path} has bundle format version {version!r}; this hstu-export ({__version__}) reads 1 to "
            f"{BUNDLE_VERSION}: upgrade hstu-export"
        )
    required = V1_KEYS if version == 1 else V2_KEYS
    missing = [k for k in required if k not in data]
    if missing:
        raise BundleError(f"{path} is an incomplete bundle: missing key(s) {missing}")
    source = ({"kind": "registered", "name": data["model_name"], "config": data["config"]} if version == 1
              else data["source"])
    if not isinstance(source, dict) or source.get("kind") not in ("registered", "factory"):
        raise BundleError(f"{path}: 'source' must name a registered model or a factory, got {source!r}")
    state_dict = data["state_dict"]
    _check_state_dict(state_dict, path)
    batch = data["example_batch"]
    _check_batch(batch, path)
    if data.get("input_schema") is not None and not isinstance(data["input_schema"], str):
        raise BundleError(f"{path}: 'input_schema' must be a JSON string, got {type(data['input_schema']).__name__}")
    model, name, config = _build(source, path)
    _load_state(model, state_dict, name, path)
    schema = None
    if data.get("input_schema"):
        try:
            schema = InputSchema.from_json(json.loads(data["input_schema"]))
        except (ConfigError, ValueError) as exc:
            raise BundleError(f"{path}: malformed input schema: {exc}") from None
    # Last: a bundle whose structure is wrong gets the message that names what is wrong; one that reads
    # well but whose bytes changed (a flipped bit in a weight) is caught here.
    _verify_checksum(data, source, state_dict, path)
    return ModelBundle(model.eval(), name, config, batch, path, schema=schema, source=source)


def _build(source: dict[str, Any], path: Path) -> tuple[nn.Module, str, Any]:
    try:
        if source["kind"] == "factory":
            factory, kwargs = source.get("factory"), source.get("kwargs") or {}
            if not isinstance(factory, str) or not isinstance(kwargs, dict):
                raise BundleError(f"{path}: a factory source needs 'factory' (a string) and 'kwargs' (a dict)")
            model = call_factory(resolve_factory(factory), kwargs, factory)
            return model, factory, kwargs
        name, config = source.get("name"), source.get("config")
        if not isinstance(name, str):
            raise BundleError(f"{path}: the model name must be a string, got {name!r}")
        _check_registered_config(name, config, path)
        model = build_model(name, config)
        return model, name, getattr(model, "config", config)
    except (ModelRegistryError, ConfigError) as exc:
        raise BundleError(f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, OverflowError, MemoryError) as exc:
        # RuntimeError: torch refusing a size (a negative dimension, an allocation that failed).
        raise BundleError(f"{path}: the model's config does not build it ({type(exc).__name__}: {_first_line(exc)})") from None


def _check_registered_config(name: str, config: Any, path: Path) -> None:
    """Checks a registered model's stored config before the model is built: the config class reads it
    (its own field checks), and when the config can count the model's parameters
    (``parameter_counts()``), sizes the machine cannot hold are refused before anything is allocated."""
    try:
        cls = model_class(name)
    except ModelRegistryError:
        return  # a factory registered under a name, or an unknown name: build_model says which
    config_class = getattr(cls, "config_class", None)
    if config_class is None or isinstance(config, config_class) or not hasattr(config_class, "from_dict"):
        return
    if not isinstance(config, dict):
        raise BundleError(f"{path}: the config of model {name!r} must be a dict of settings, got {type(config).__name__}")
    typed = config_class.from_dict(config)
    counts = getattr(typed, "parameter_counts", None)
    if not callable(counts):
        return
    parts = counts()
    count = sum(parts.values())
    needed = count * 4  # built in float32
    total, available = machine_memory()
    if needed > available:
        largest = max(parts, key=lambda k: parts[k])
        raise BundleError(
            f"{path}: model {name!r} with this config has about {count:,} parameters ({format_bytes(needed)} in "
            f"float32; the largest part, {largest}, {format_bytes(parts[largest] * 4)}), more than this machine's "
            f"{format_bytes(available)} of available memory ({format_bytes(total)} in all); check the config's sizes"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_state_dict(state_dict: Any, path: Path) -> None:
    if not isinstance(state_dict, dict):
        raise BundleError(f"{path}: 'state_dict' must be a dict of tensors by parameter name, got "
                          f"{type(state_dict).__name__}")
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise BundleError(f"{path}: state_dict key {_short(key)} must be a parameter name (a string), got "
                              f"{type(key).__name__}")
        if not isinstance(value, Tensor):
            raise BundleError(f"{path}: state_dict[{key!r}]: expected a tensor, got {type(value).__name__}")


def _load_state(model: nn.Module, state_dict: dict[str, Tensor], name: str, path: Path) -> None:
    # Models that create their tables on the meta device (generative-recommenders does) get the stored
    # tensors assigned instead of copied into tensors that hold no memory.
    assign = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    expected = model.state_dict()
    for key, tensor in state_dict.items():
        if key in expected and tuple(expected[key].shape) != tuple(tensor.shape):
            raise BundleError(f"{path}: state_dict[{key!r}]: expected shape {list(expected[key].shape)}, got "
                              f"{list(tensor.shape)} (model {name!r} with this config)")
    try:
        result = model.load_state_dict(state_dict, strict=False, assign=assign)
    except RuntimeError as exc:
        raise BundleError(f"{path}: the state dict does not fit model {name!r}: {_first_line(exc)}") from None
    if result.missing_keys or result.unexpected_keys:
        raise BundleError(
            f"{path}: the state dict does not fit model {name!r} with this config "
            f"(missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]})"
        )
    _check_materialised(model, "load", path)


def _check_materialised(model: nn.Module, what: str, path: Path | None = None) -> None:
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        where = f"{path}: " if path else ""
        fix = ("materialise them first (e.g. module.to_empty(device='cpu') and initialise or load weights)"
               if what == "save" else "the bundle's state dict does not hold them")
        raise BundleError(f"{where}tensors {meta[:5]} are on the meta device (no data); {fix}")


def _has_own_schema(model: nn.Module) -> bool:
    return callable(getattr(model, "input_schema", None))


def _schema_for(model: nn.Module, schema: InputSchema | None, example_inputs: Any,
                ranges: dict[str, tuple[int | None, int | None]] | None, legacy_batch: bool) -> InputSchema | None:
    if schema is None and _has_own_schema(model):
        schema = model.input_schema()  # type: ignore[operator]
    if schema is None and example_inputs is None and legacy_batch:
        return None  # a forward(features) model: traced by the example batch's names
    if schema is None:
        if example_inputs is None:
            raise BundleError(
                f"{type(model).__name__} has no input_schema(); pass example_inputs (an example call in the "
                "model's own format) so the schema can be inferred, or input_schema"
            )
        from hstu_export.sources.schema_inference import infer_schema

        args, kwargs = _split_example(example_inputs)
        schema = infer_schema(model, args, kwargs)
    return schema.with_ranges(ranges) if ranges else schema


def _example_batch(model: nn.Module, schema: InputSchema | None, example_batch: dict[str, Tensor] | None,
                   example_inputs: Any) -> dict[str, Tensor]:
    if example_batch is not None:
        _check_batch(example_batch)
        return example_batch
    if example_inputs is None or schema is None:
        raise BundleError("save_bundle needs an example: example_batch (a flat request) or example_inputs")
    from hstu_export.sources.schema_inference import flatten_example

    args, kwargs = _split_example(example_inputs)
    return flatten_example(schema, args, kwargs, model)


def _split_example(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[1], dict) and isinstance(example[0], tuple):
        return example[0], dict(example[1])
    if isinstance(example, tuple):
        return example, {}
    return (example,), {}


def _load_pickled(path: Path) -> ModelBundle:
    warnings.warn(
        f"unpickling {path}: this runs arbitrary code from the file; only do it for files you trust",
        stacklevel=3,
    )
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # unpickling can raise anything the file's code raises
        raise BundleError(f"{path}: unpickling failed: {_first_line(exc)}") from None
    schema = None
    if isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT and "module" in data:
        module, batch = data["module"], data.get("example_batch")
        if isinstance(module, nn.Module) and isinstance(data.get("source"), dict) and CHECKSUM_KEY in data:
            _check_batch(batch, path)
            _verify_checksum(data, data["source"], module.state_dict(), path)
        if data.get("input_schema"):
            schema = InputSchema.from_json(json.loads(data["input_schema"]))
    elif isinstance(data, nn.Module):
        module, batch = data, None
    elif isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT:
        return _from_payload(data, path)
    else:
        raise BundleError(f"{path} holds a pickled {type(data).__name__}, not an nn.Module or bundle")
    if batch is None:
        if not hasattr(module, "input_schema"):
            raise BundleError(
                f"{path} holds a bare pickled module with no example batch and no input_schema(); "
                "save it with hstu_export.save_bundle(model, path, example_batch, allow_pickle=True)"
            )
        from hstu_export.verification.batch import generate_batch

        batch = generate_batch(module.input_schema(), 4, seed=0)
    _check_batch(batch, path)
    name = getattr(type(module), "registered_name", type(module).__qualname__)
    return ModelBundle(module.eval(), name, getattr(module, "config", None), batch, path, pickled=True, schema=schema,
                       source={"kind": "pickled"})


def _check_batch(batch: Any, path: Path | None = None) -> None:
    where = f"{path}: " if path else ""
    if not isinstance(batch, dict) or not batch:
        got = "an empty dict" if isinstance(batch, dict) else type(batch).__name__
        raise BundleError(f"{where}the example batch must be a non-empty dict of named tensors, got {got}")
    for key, value in batch.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise BundleError(f"{where}the example batch must be a dict of named tensors; entry {_short(key)} holds "
                              f"a {type(value).__name__}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
