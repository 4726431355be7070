"""TorchScript backend: one scripted module combining sparse and dense, loadable from C++ with
``torch::jit::load`` (custom ops it still calls must be registered there too: see the manifest's
op libraries; with the ``aten`` op target there are none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hstu_export.errors import ExportError
from hstu_export.runtimes.base import Backend, BackendArtifacts, CompileInputs, Features, Runner
from hstu_export.runtimes.graph_io import (
    as_output_dict,
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
        scripted = script_graph_module(inputs.combined, "combined sparse+dense")
        save_script(scripted, out_dir / MODEL_FILE)
        return BackendArtifacts(files={"model": MODEL_FILE}, op_libraries=scripted_op_libraries(scripted))

    def load(self, root: Path, manifest: dict[str, Any], device: torch.device) -> Runner:
        module = torch.jit.load(str(root / manifest["backend"]["files"]["model"]), map_location=device)
        module.eval()
        output_names = manifest["output_names"]

        def run(features: Features) -> Features:
            with torch.no_grad():
                return as_output_dict(module(**features), output_names)

        return run
