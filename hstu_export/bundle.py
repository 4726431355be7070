"""Model bundles (``model.pt``): what a user hands to the exporter.

A bundle is a ``torch.save`` dict of plain data, read back with ``torch.load(weights_only=True)``:
the format name and version, where the model comes from (a registered name and its config, or a
factory import path and its JSON-able keyword arguments), its state dict, an example request (a flat
dict of named tensors) and, for models that do not describe their inputs themselves, the input
schema. Loading it runs no pickled code; building the model imports the named module, as importing
any installed dependency does. A file holding a pickled ``nn.Module`` is refused unless the caller
opts in with ``allow_pickle=True``.

Format 1 (registered name + config + example batch) is still read.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hstu_export import __version__
from hstu_export.errors import BundleError, ConfigError, ModelRegistryError
from hstu_export.registry import build_model, call_factory, factory_path, registered_name, resolve_factory
from hstu_export.schema import InputSchema

BUNDLE_FORMAT = "hstu-export-bundle"
BUNDLE_VERSION = 2
V1_KEYS = ("format", "format_version", "model_name", "config", "state_dict", "example_batch")
V2_KEYS = ("format", "format_version", "source", "state_dict", "example_batch")


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
    if not isinstance(state_dict, dict) or not all(isinstance(k, str) and isinstance(v, Tensor)
                                                   for k, v in state_dict.items()):
        raise BundleError(f"{path}: 'state_dict' must be a dict of named tensors")
    model, name, config = _build(source, path)
    _load_state(model, state_dict, name, path)
    batch = data["example_batch"]
    _check_batch(batch, path)
    schema = None
    if data.get("input_schema"):
        try:
            schema = InputSchema.from_json(json.loads(data["input_schema"]))
        except (ConfigError, ValueError) as exc:
            raise BundleError(f"{path}: malformed input schema: {exc}") from None
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
        model = build_model(name, config)
        return model, name, getattr(model, "config", config)
    except ModelRegistryError as exc:
        raise BundleError(f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise BundleError(f"{path}: the model's config does not build it ({type(exc).__name__}: {_first_line(exc)})") from None


def _load_state(model: nn.Module, state_dict: dict[str, Tensor], name: str, path: Path) -> None:
    # Models that create their tables on the meta device (generative-recommenders does) get the stored
    # tensors assigned instead of copied into tensors that hold no memory.
    assign = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
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
        from hstu_export.schema_inference import infer_schema

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
    from hstu_export.schema_inference import flatten_example

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
        from hstu_export.batch import generate_batch

        batch = generate_batch(module.input_schema(), 4, seed=0)
    _check_batch(batch, path)
    name = getattr(type(module), "registered_name", type(module).__qualname__)
    return ModelBundle(module.eval(), name, getattr(module, "config", None), batch, path, pickled=True, schema=schema,
                       source={"kind": "pickled"})


def _check_batch(batch: Any, path: Path | None = None) -> None:
    where = f"{path}: " if path else ""
    if not isinstance(batch, dict) or not batch or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in batch.items()
    ):
        raise BundleError(f"{where}the example batch must be a non-empty dict of named tensors")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
