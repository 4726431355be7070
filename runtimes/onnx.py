"""ONNX backend: the dense graph through ``torch.onnx.export(dynamo=True)`` with dynamic axes, run with
onnxruntime; the sparse graph is TorchScript. ONNX has no HSTU or fbgemm ops, so the dense graph must
use the ``aten`` op target; anything else left is reported as an error before exporting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hstu_export.errors import (
    BackendUnavailableError,
    ConfigError,
    ExportError,
    PackageError,
    UnmappedOpsError,
)
from hstu_export.package.manifest import BackendFields, backend_fields
from hstu_export.runtimes.aoti import export_dense
from hstu_export.runtimes.base import (
    Backend,
    BackendArtifacts,
    CompileInputs,
    Runner,
    SplitRunner,
)
from hstu_export.runtimes.graph_io import (
    BUILTIN_NAMESPACES,
    data_dependent_advice,
    op_calls,
    plain_first_line,
)
from hstu_export.runtimes.sparse_torchscript import compile_sparse, load_sparse
from hstu_export.settings import ExportSettings

DENSE_FILE = "dense/dense.onnx"
OPSET = 18


def _repeat_interleave_indices(repeats: torch.Tensor, output_size: int | None = None) -> torch.Tensor:
    """``repeat_interleave(repeats)`` (index i repeated repeats[i] times) as a histogram and a cumsum:
    onnxscript has no translation of the ``output_size`` form that jagged code uses."""
    if output_size is None:
        output_size = int(repeats.sum())
    ends = torch.cumsum(repeats, 0)
    counts = torch.zeros(output_size + 1, dtype=ends.dtype, device=repeats.device)
    counts = counts.scatter_add(0, ends.clamp(max=output_size), torch.ones_like(ends))
    return torch.cumsum(counts[:output_size], 0)


def _repeat_interleave_self(self: torch.Tensor, repeats: torch.Tensor, dim: int | None = None,
                            output_size: int | None = None) -> torch.Tensor:
    if dim is None:
        self, dim = self.flatten(), 0
    if repeats.dim() == 0 or repeats.numel() == 1:
        repeats = repeats.reshape(1).expand(self.size(dim))
    return self.index_select(dim, _repeat_interleave_indices(repeats, output_size))


# aten ops onnxscript cannot translate, decomposed into ops it can before the ONNX conversion.
ONNX_DECOMPOSITIONS = {
    torch.ops.aten.repeat_interleave.Tensor: _repeat_interleave_indices,
    torch.ops.aten.repeat_interleave.self_Tensor: _repeat_interleave_self,
}


def _check_onnx_ops(gm: torch.nn.Module, what: str) -> None:
    custom = sorted(op_calls(gm))
    foreign = [key for key in custom if key.partition("::")[0] not in BUILTIN_NAMESPACES]
    if foreign:
        raise UnmappedOpsError(
            f"{what} still calls {', '.join(foreign)}, which ONNX cannot express; export with --op-target aten, "
            "or map the function that calls it (--map-function)"
        )


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
        _check_onnx_ops(inputs.dense, "the dense graph")
        # Exported first, so that ops hidden inside opaque calls (a user function kept whole) are seen too.
        program = export_dense(inputs)
        _check_onnx_ops(program.graph_module, "the dense graph (inside opaque calls)")
        if any(n.op == "call_function" and n.target in ONNX_DECOMPOSITIONS for n in program.graph.nodes):
            program = program.run_decompositions(ONNX_DECOMPOSITIONS)
        sparse, sparse_libraries = compile_sparse(inputs, out_dir)
        path = out_dir / DENSE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with torch.no_grad():
                onnx_program = torch.onnx.export(
                    program, f=str(path), dynamo=True, opset_version=OPSET, input_names=inputs.dense_input_names,
                    output_names=inputs.output_names, external_data=False, verbose=False,
                )
        except Exception as exc:
            raise ExportError(f"ONNX export of the dense graph failed: {plain_first_line(exc)}"
                              f"{data_dependent_advice(exc)}") from exc
        del onnx_program
        return BackendArtifacts(files={"sparse": sparse, "dense": DENSE_FILE}, meta={"opset": OPSET},
                                op_libraries=sparse_libraries)

    def load(self, root: Path, manifest: BackendFields | dict[str, Any], device: torch.device,
             tables_device: torch.device | None = None) -> Runner:
        import onnxruntime as ort

        fields = backend_fields(manifest, root)
        path = fields.artifact(root, "dense")
        sparse = load_sparse(root, fields, device)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        try:
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise PackageError(f"{root}: onnxruntime could not load {fields.backend.files['dense']}: "
                               f"{plain_first_line(exc)}") from exc
        input_names = [i.name for i in session.get_inputs()]
        output_names = list(fields.output_names)

        def dense(**inputs: torch.Tensor) -> dict[str, torch.Tensor]:
            feeds = {name: inputs[name].detach().cpu().numpy() for name in input_names}
            results = session.run(output_names, feeds)
            return {name: torch.from_numpy(value).to(device) for name, value in zip(output_names, results)}

        return SplitRunner(sparse, dense, list(fields.dense_passthrough_inputs), output_names)
