"""Loading a package and serving it: ``hstu_export.load(path)`` returns a thread-safe Predictor.

Load-time checks, in order: the manifest and every file's sha256; the package format; the torch version
(compiled artifacts are tied to it); the device and, for CUDA, the GPU architecture; then the op
libraries the graphs call are imported, and the backend loads its files. Each request is validated
against the exported input schema before it reaches the compiled code.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import PackageError
from hstu_export.package import read_manifest
from hstu_export.runtimes import get_backend
from hstu_export.runtimes.base import Runner, SplitRunner
from hstu_export.schema import InputSchema


class Predictor:
    """Callable ``predictor(batch) -> {output name: tensor}``. Safe to call from many threads: the loaded
    runners (AOTInductor's model container, TorchScript, onnxruntime) are, and the predictor keeps no
    per-call state."""

    def __init__(self, root: Path, manifest: dict[str, Any], runner: Runner, device: torch.device) -> None:
        self.root = root
        self.manifest = manifest
        self.device = device
        self.input_schema = InputSchema.from_json(manifest["input_schema"])
        self.max_batch_size: int = manifest["ranges"]["max_batch_size"]
        self.output_names: list[str] = manifest["output_names"]
        self._runner = runner

    def __call__(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        self.input_schema.validate(batch, self.max_batch_size)
        features = {name: batch[name].to(self.device, non_blocking=True) for name in self.input_schema.names}
        return self._runner(features)

    predict = __call__

    @property
    def split(self) -> SplitRunner | None:
        """The sparse and dense halves, when the backend stores them apart (to time the dense part)."""
        return self._runner if isinstance(self._runner, SplitRunner) else None

    def __repr__(self) -> str:
        b = self.manifest["backend"]["name"]
        return f"Predictor({self.root}, backend={b}, device={self.device}, dtype={self.manifest['dtype']})"


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_environment(manifest: dict[str, Any], root: Path) -> torch.device:
    """The device to load on, after checking versions and hardware against the manifest."""
    built = manifest["versions"]["torch"]
    if _major_minor(built) != _major_minor(torch.__version__):
        raise PackageError(
            f"{root} was built with torch {built} but this process has torch {torch.__version__}; "
            "compiled artifacts only load with the same torch major.minor: re-export it here"
        )
    device_meta = manifest["device"]
    if device_meta["type"] == "cuda":
        if not torch.cuda.is_available():
            raise PackageError(f"{root} is a CUDA package but this machine has no usable CUDA device")
        major, minor = torch.cuda.get_device_capability()
        here = f"sm_{major}{minor}"
        if here != device_meta["arch"]:
            raise PackageError(
                f"{root} was compiled for {device_meta['arch']} ({device_meta['name']}) but this GPU is {here} "
                f"({torch.cuda.get_device_name()}); re-export on this GPU"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_op_libraries(names: list[str], root: Path) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise PackageError(
                f"{root} needs the op library {name!r} at load time, and importing it failed ({exc}); "
                "install it in this environment"
            ) from None


def load(path: str | Path, *, verify_checksums: bool = True) -> Predictor:
    """Load a package written by ``hstu_export.export`` / ``hstu-export MODEL``."""
    root = Path(path)
    manifest = read_manifest(root, verify_checksums=verify_checksums)
    device = check_environment(manifest, root)
    load_op_libraries(manifest.get("op_libraries", []), root)
    backend = get_backend(manifest["backend"]["name"])
    runner = backend.load(root, manifest, device)
    return Predictor(root, manifest, runner, device)
