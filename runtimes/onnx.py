"""ONNX backend: the dense graph through ``torch.onnx.export(dynamo=True)`` with dynamic axes, run with
onnxruntime; the sparse graph is TorchScript. ONNX has no HSTU or fbgemm ops, so the dense graph must
use the ``aten`` op target; anything else left is reported as an error before exporting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hstu_export.errors import BackendUnavailableError, ConfigError, ExportError, UnmappedOpsError
from hstu_export.runtimes.base import (
    Backend,
    BackendArtifacts,
    CompileInputs,
    Runner,
    SplitRunner,
    torch_dynamic_shapes,
)
from hstu_export.runtimes.graph_io import op_namespaces
from hstu_export.runtimes.sparse_torchscript import compile_sparse, load_sparse
from hstu_export.settings import ExportSettings

DENSE_FILE = "dense/dense.onnx"
OPSET = 18


class OnnxBackend(Backend):
    name = "onnx"
    description = "ONNX dense graph for onnxruntime (CPU)"
    devices = ("cpu",)

    def default_op_target(self, device: torch.device) -> str:
        return "aten"

    def check_available(self, settings: ExportSettings) -> None:
        if settings.dtype == "bfloat16":
            raise ConfigError("the onnx backend runs fp32 or fp16 (onnxruntime's CPU provider has no bf16 matmul); "
                              "use --dtype fp32 or another backend")
        try:
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailableError(
                f"the onnx backend needs onnx, onnxscript and onnxruntime ({exc.name} is missing): "
                "pip install onnx onnxscript onnxruntime"
            ) from None

    def compile(self, inputs: CompileInputs, out_dir: Path) -> BackendArtifacts:
        custom = sorted(op_namespaces(inputs.dense))
        if custom:
            raise UnmappedOpsError(
                f"the dense graph still calls {', '.join(ns + '::*' for ns in custom)} ops, which ONNX cannot "
                "express; export with --op-target aten"
            )
        sparse, sparse_libraries = compile_sparse(inputs, out_dir)
        path = out_dir / DENSE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        dynamic = torch_dynamic_shapes(inputs.dense_input_names, inputs.dense_dynamic_dims)
        try:
            with torch.no_grad():
                program = torch.onnx.export(
                    inputs.dense, args=(), kwargs=inputs.example_dense_inputs, f=str(path), dynamo=True,
                    dynamic_shapes=dynamic, opset_version=OPSET, input_names=inputs.dense_input_names,
                    output_names=inputs.output_names, external_data=False, verbose=False,
                )
        except Exception as exc:
            text = str(exc).strip().splitlines()
            raise ExportError(f"ONNX export of the dense graph failed: {text[0] if text else type(exc).__name__}") from exc
        del program
        return BackendArtifacts(files={"sparse": sparse, "dense": DENSE_FILE}, meta={"opset": OPSET},
                                op_libraries=sparse_libraries)

    def load(self, root: Path, manifest: dict[str, Any], device: torch.device) -> Runner:
        import onnxruntime as ort

        files = manifest["backend"]["files"]
        sparse = load_sparse(root, manifest, device)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(root / files["dense"]), options, providers=["CPUExecutionProvider"])
        input_names = [i.name for i in session.get_inputs()]
        output_names = manifest["output_names"]

        def dense(**inputs: torch.Tensor) -> dict[str, torch.Tensor]:
            feeds = {name: inputs[name].detach().cpu().numpy() for name in input_names}
            results = session.run(output_names, feeds)
            return {name: torch.from_numpy(value).to(device) for name, value in zip(output_names, results)}

        return SplitRunner(sparse, dense, manifest["dense_passthrough_inputs"], output_names)
