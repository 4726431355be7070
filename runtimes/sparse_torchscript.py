"""The sparse graph is stored as TorchScript for every backend but TensorRT's dense engine.

Why TorchScript: torchrec's EmbeddingCollection and KeyedJaggedTensor are scriptable and their
KJT→dict split uses data-dependent sizes, which torch.export (and so AOTInductor and ONNX) cannot
represent without unbacked sizes on every feature. Scripting keeps the torchrec module as it is, runs on
CPU or CUDA, and loads from C++ (``torch::jit::load``) too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hstu_export.errors import PackageError
from hstu_export.package.manifest import BackendFields, backend_fields
from hstu_export.runtimes.base import CompileInputs, Features, Runner
from hstu_export.runtimes.graph_io import (
    as_output_dict,
    plain_first_line,
    save_script,
    script_graph_module,
    scripted_op_libraries,
)

SPARSE_FILE = "sparse/sparse.ts"


def compile_sparse(inputs: CompileInputs, out_dir: Path) -> tuple[str, list[str]]:
    """Writes the scripted sparse graph; returns its path and the op libraries it needs."""
    scripted = script_graph_module(inputs.sparse, "sparse")
    save_script(scripted, out_dir / SPARSE_FILE)
    return SPARSE_FILE, scripted_op_libraries(scripted)


def load_sparse(root: Path, manifest: BackendFields | dict[str, Any], device: torch.device) -> Runner:
    """Runs the scripted sparse graph on the features it takes; returns the boundary tensors by name."""
    fields = backend_fields(manifest, root)
    path = fields.artifact(root, "sparse")
    input_names, output_names = list(fields.sparse_input_names), list(fields.sparse_output_names)
    try:
        module = torch.jit.load(str(path), map_location=device)
    except Exception as exc:
        raise PackageError(f"{root}: TorchScript could not load {fields.backend.files['sparse']}: "
                           f"{plain_first_line(exc)}") from exc
    module.eval()

    def run(features: Features) -> Features:
        with torch.no_grad():
            return as_output_dict(module(**{n: features[n] for n in input_names}), output_names)

    return run
