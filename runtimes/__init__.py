"""Backends: compile the dense graph (AOTInductor, TorchScript, ONNX, TensorRT), load what they wrote, and
the package loader and predictor (``predictor``), KV-cached serving of a package (``kv_delta``,
``kv_graphs``), the C++ runtime called from Python (``native``). Backends by name: adding one is one file plus one line in ``_BACKENDS``."""

from __future__ import annotations

from hstu_export.errors import ConfigError
from hstu_export.runtimes.base import Backend

_BACKENDS: dict[str, str] = {
    "aoti": "hstu_export.runtimes.aoti:AotiBackend",
    "torchscript": "hstu_export.runtimes.torchscript:TorchScriptBackend",
    "onnx": "hstu_export.runtimes.onnx:OnnxBackend",
    "trt": "hstu_export.runtimes.tensorrt:TensorRTBackend",
}


def backend_names() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` (imported lazily: a missing optional library only matters when
    that backend is used)."""
    import importlib

    try:
        module_name, cls_name = _BACKENDS[name].split(":")
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(_BACKENDS)}") from None
    return getattr(importlib.import_module(module_name), cls_name)()


__all__ = ["Backend", "backend_names", "get_backend"]
