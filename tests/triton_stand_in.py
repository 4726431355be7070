"""Triton's Python-backend API as model.py uses it, stood in for (tests/test_serving_repo.py, tests/test_tables.py):
model.py loaded and initialised on a repository without a server. tests/test_triton_server.py runs the real one."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from google.protobuf import json_format, text_format


class StandInTensor:
    """The part of triton_python_backend_utils.Tensor model.py uses (a test double, not Triton)."""

    def __init__(self, name: str, value: torch.Tensor) -> None:
        self._name, self.value = name, value

    def name(self) -> str:
        return self._name

    def to_dlpack(self):  # type: ignore[no-untyped-def]
        return torch.utils.dlpack.to_dlpack(self.value)

    @classmethod
    def from_dlpack(cls, name, capsule):  # type: ignore[no-untyped-def]
        return cls(name, torch.utils.dlpack.from_dlpack(capsule))


def stand_in_backend_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):  # type: ignore[no-untyped-def]
            self.output_tensors, self.error = output_tensors, error

    class TritonError(Exception):
        pass

    class MetricFamily:
        COUNTER, GAUGE = "counter", "gauge"

        def __init__(self, name, description, kind):  # type: ignore[no-untyped-def]
            self.name, self.kind = name, kind

        def Metric(self, labels):  # type: ignore[no-untyped-def]
            return types.SimpleNamespace(labels=labels, increment=lambda by: None, set=lambda value: None)

    module.MetricFamily = MetricFamily  # type: ignore[attr-defined]
    module.Tensor = StandInTensor  # type: ignore[attr-defined]
    module.InferenceResponse = InferenceResponse  # type: ignore[attr-defined]
    module.TritonError = TritonError  # type: ignore[attr-defined]
    module.get_input_tensor_by_name = lambda request, name: request.get(name)  # type: ignore[attr-defined]
    return module


def model_config_pb2():  # type: ignore[no-untyped-def]
    import tritonclient

    path = Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location("tritonmodel_config_pb2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def initialized_model(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The repository's model.py, loaded against the stand-in and initialised as a CPU instance of version 1."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in_backend_utils())
    spec = importlib.util.spec_from_file_location("triton_model_under_test", model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2().ModelConfig())
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)),
                      "model_repository": str(model_dir), "model_version": "1", "model_instance_kind": "CPU",
                      "model_name": model_dir.name, "model_instance_name": f"{model_dir.name}_0_0"})
    return model
