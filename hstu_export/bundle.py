"""Model bundles (``model.pt``): what a user hands to the exporter.

A bundle is a ``torch.save`` dict of plain data, read back with ``torch.load(weights_only=True)``:
the format name and version, the model's registered name and config, its state dict and an example
batch. Loading it runs no pickled code; the model class comes from the registry. A file holding a
pickled ``nn.Module`` is refused unless the caller opts in with ``allow_pickle=True``.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hstu_export import __version__
from hstu_export.errors import BundleError, ModelRegistryError
from hstu_export.registry import build_model, registered_name
from hstu_export.schema import InputSchema

BUNDLE_FORMAT = "hstu-export-bundle"
BUNDLE_VERSION = 1
REQUIRED_KEYS = ("format", "format_version", "model_name", "config", "state_dict", "example_batch")


@dataclass
class ModelBundle:
    model: nn.Module
    model_name: str
    config: Any
    example_batch: dict[str, Tensor]
    path: Path | None = None
    pickled: bool = False

    @property
    def input_schema(self) -> InputSchema:
        return self.model.input_schema()  # type: ignore[operator]


def save_bundle(
    model: nn.Module,
    path: str | os.PathLike[str],
    example_batch: dict[str, Tensor],
    *,
    allow_pickle: bool = False,
) -> Path:
    """Writes ``model`` as a bundle. Registered models are stored as name + config + state dict; other
    models only with ``allow_pickle=True`` (stored pickled; loading them then needs the flag too)."""
    path = Path(path)
    _check_batch(example_batch)
    batch = {k: v.detach().cpu() for k, v in example_batch.items()}
    try:
        name = registered_name(model)
    except ModelRegistryError:
        if not allow_pickle:
            raise
        payload: dict[str, Any] = {"format": BUNDLE_FORMAT, "format_version": BUNDLE_VERSION,
                                   "module": model, "example_batch": batch}
    else:
        payload = {
            "format": BUNDLE_FORMAT,
            "format_version": BUNDLE_VERSION,
            "hstu_export_version": __version__,
            "model_name": name,
            "config": model.config.to_dict(),  # type: ignore[union-attr,operator]
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "example_batch": batch,
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_bundle(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> ModelBundle:
    """Reads a bundle written by ``save_bundle`` (or, with ``allow_pickle``, a pickled module)."""
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


def _from_payload(data: Any, path: Path) -> ModelBundle:
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        what = "a dict without our format marker" if isinstance(data, dict) else type(data).__name__
        raise BundleError(
            f"{path} is a torch file but not an hstu-export bundle ({what}); create one with "
            "hstu_export.save_bundle or examples/build_model.py"
        )
    version = data.get("format_version")
    if not isinstance(version, int) or version > BUNDLE_VERSION:
        raise BundleError(
            f"{path} has bundle format version {version!r}; this hstu-export ({__version__}) reads up to "
            f"{BUNDLE_VERSION}: upgrade hstu-export"
        )
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise BundleError(f"{path} is an incomplete bundle: missing key(s) {missing}")
    model = build_model(data["model_name"], data["config"])
    result = model.load_state_dict(data["state_dict"], strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise BundleError(
            f"{path}: the state dict does not fit model {data['model_name']!r} with this config "
            f"(missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]})"
        )
    batch = data["example_batch"]
    _check_batch(batch, path)
    return ModelBundle(model.eval(), data["model_name"], model.config, batch, path)  # type: ignore[arg-type]


def _load_pickled(path: Path) -> ModelBundle:
    warnings.warn(
        f"unpickling {path}: this runs arbitrary code from the file; only do it for files you trust",
        stacklevel=3,
    )
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # unpickling can raise anything the file's code raises
        raise BundleError(f"{path}: unpickling failed: {_first_line(exc)}") from None
    if isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT and "module" in data:
        module, batch = data["module"], data.get("example_batch")
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
    return ModelBundle(module.eval(), name, getattr(module, "config", None), batch, path, pickled=True)


def _check_batch(batch: Any, path: Path | None = None) -> None:
    where = f"{path}: " if path else ""
    if not isinstance(batch, dict) or not batch or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in batch.items()
    ):
        raise BundleError(f"{where}the example batch must be a non-empty dict of named tensors")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
