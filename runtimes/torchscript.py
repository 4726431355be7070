"""TorchScript backend: one TorchScript module combining sparse and dense, loadable from C++ with
``torch::jit::load`` (custom ops it still calls must be registered there too: see the manifest's
op libraries; with the ``aten`` op target there are none).

``torch.jit.script`` first; when the user's dense code is not scriptable, the dense half is
``torch.jit.trace``d instead (the sparse half stays scripted) and the manifest records which was used
(``backend.meta.method``)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.fx

from hstu_export.errors import ExportError, PackageError
from hstu_export.package.manifest import BackendFields, backend_fields
from hstu_export.passes.boundary import DENSE, SPARSE
from hstu_export.runtimes.base import Backend, BackendArtifacts, CompileInputs, Features, Runner
from hstu_export.runtimes.graph_io import (
    as_output_dict,
    plain_first_line,
    save_script,
    script_graph_module,
    scripted_op_libraries,
)

MODEL_FILE = "model/model.ts"


class TorchScriptBackend(Backend):
    name = "torchscript"
    description = "one TorchScript module (sparse + dense)"

    def compile(self, inputs: CompileInputs, out_dir: Path) -> BackendArtifacts:
        if inputs.combined is None:
            raise ExportError("the torchscript backend needs the combined sparse+dense graph")
        meta: dict[str, Any] = {"method": "script"}
        try:
            scripted = script_graph_module(inputs.combined, "combined sparse+dense")
        except ExportError as exc:
            # User code TorchScript cannot compile (say x.norm(dim=-1)) sits in the dense graph: trace that
            # half on the export example, script the rest (the sparse half's KeyedJaggedTensor handling
            # must stay scripted: traced, it would keep the example's lengths).
            scripted = _script_with_traced_dense(inputs)
            meta = {"method": "trace", "script_error": str(exc)}
        save_script(scripted, out_dir / MODEL_FILE)
        return BackendArtifacts(files={"model": MODEL_FILE}, meta=meta, op_libraries=scripted_op_libraries(scripted))

    def load(self, root: Path, manifest: BackendFields | dict[str, Any], device: torch.device,
             tables_device: torch.device | None = None) -> Runner:
        fields = backend_fields(manifest, root)
        path = fields.artifact(root, "model")
        try:
            module = torch.jit.load(str(path), map_location=device)
        except Exception as exc:
            raise PackageError(f"{root}: TorchScript could not load {fields.backend.files['model']}: "
                               f"{plain_first_line(exc)}") from exc
        module.eval()
        output_names = list(fields.output_names)

        def run(features: Features) -> Features:
            with torch.no_grad():
                return as_output_dict(module(**features), output_names)

        return run


def _script_with_traced_dense(inputs: CompileInputs) -> torch.jit.ScriptModule:
    """The combined module scripted with its dense half replaced by ``torch.jit.trace`` of it. Tracing
    records the example's data-dependent Python values (a max length read with ``.item()``) as
    constants; verification on other sizes then fails, naming the batch."""
    combined = copy.copy(inputs.combined)
    dense_copy = copy.deepcopy(inputs.dense)
    for tensor in (*dense_copy.parameters(), *dense_copy.buffers()):
        tensor.requires_grad_(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            dense = torch.jit.trace(dense_copy, example_kwarg_inputs=dict(inputs.example_dense_inputs),
                                    strict=False, check_trace=False)
    except Exception as exc:
        raise ExportError(f"TorchScript could neither script nor trace the dense graph: {plain_first_line(exc)}") from exc
    sparse = script_graph_module(inputs.sparse, "sparse")
    top = torch.fx.GraphModule({SPARSE: sparse, DENSE: dense}, combined.graph, class_name="Combined")
    try:
        return torch.jit.script(top)
    except Exception as exc:
        raise ExportError(f"TorchScript cannot compile the module joining the halves: {plain_first_line(exc)}") from exc
