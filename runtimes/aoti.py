"""AOTInductor backend (the default): torch.export of the dense graph with named dynamic dims, compiled
by ``aoti_compile_and_package`` into one ``.pt2`` (CPU or CUDA). The sparse graph is TorchScript."""

from __future__ import annotations

import inspect
import json
import threading
import zipfile
from pathlib import Path
from typing import Any

import torch

from hstu_export.errors import ExportError, PackageError
from hstu_export.package.manifest import BackendFields, backend_fields
from hstu_export.runtimes.base import (
    Backend,
    BackendArtifacts,
    CompileInputs,
    Runner,
    SplitRunner,
    torch_dynamic_shapes,
)
from hstu_export.runtimes.graph_io import (
    BUILTIN_NAMESPACES,
    OP_LIBRARY_MODULES,
    data_dependent_advice,
    export_ready,
    plain_first_line,
)
from hstu_export.runtimes.sparse_torchscript import compile_sparse, load_sparse
from hstu_export.runtimes.unbacked_ranges import unbacked_ranges_hold_at_one

DENSE_FILE = "dense/dense.pt2"


def export_dense(inputs: CompileInputs) -> torch.export.ExportedProgram:
    """torch.export of the dense graph with the shared named dynamic dims (non-strict: the graph is
    already an FX graph of plain calls). Sizes read from tensor data keep the ranges the dims allow down to
    1 (``runtimes/unbacked_ranges.py``); compile the program under the same context."""
    from hstu_export.capture.opaque import export_builtins

    dynamic = torch_dynamic_shapes(inputs.dense_input_names, inputs.dense_dynamic_dims)
    try:
        with torch.no_grad(), export_builtins(set(inputs.user_packages)), unbacked_ranges_hold_at_one():
            return torch.export.export(
                export_ready(inputs.dense), args=(), kwargs=inputs.example_dense_inputs, dynamic_shapes=dynamic,
                strict=False,
            )
    except Exception as exc:
        raise ExportError(f"torch.export of the dense graph failed: {plain_first_line(exc)}"
                          f"{data_dependent_advice(exc)}") from exc


class AotiBackend(Backend):
    name = "aoti"
    description = "AOTInductor package (.pt2), CPU or CUDA"

    def compile(self, inputs: CompileInputs, out_dir: Path) -> BackendArtifacts:
        sparse, sparse_libraries = compile_sparse(inputs, out_dir)
        program = export_dense(inputs)
        (out_dir / DENSE_FILE).parent.mkdir(parents=True, exist_ok=True)
        options = dict(inputs.settings.aoti_options)  # --aoti-option (a copy: the compile adds its own keys)
        try:
            with unbacked_ranges_hold_at_one():
                torch._inductor.aoti_compile_and_package(program, package_path=str(out_dir / DENSE_FILE),
                                                         inductor_configs=dict(options))
        except Exception as exc:
            raise ExportError(f"AOTInductor compilation failed: {plain_first_line(exc)}"
                              f"{data_dependent_advice(exc)}") from exc
        return BackendArtifacts(
            files={"sparse": sparse, "dense": DENSE_FILE},
            meta={"dense_exported_nodes": len(program.graph.nodes), "inductor_options": options},
            op_libraries=sorted(set(sparse_libraries) | package_op_libraries(out_dir / DENSE_FILE)),
        )

    def load(self, root: Path, manifest: BackendFields | dict[str, Any], device: torch.device) -> Runner:
        fields = backend_fields(manifest, root)
        path = fields.artifact(root, "dense")
        sparse = load_sparse(root, fields, device)
        try:
            dense = _load_pt2(path)
        except Exception as exc:
            raise PackageError(f"{root}: AOTInductor could not load {fields.backend.files['dense']}: "
                               f"{plain_first_line(exc)}") from exc
        return SplitRunner(sparse, dense, list(fields.dense_passthrough_inputs), list(fields.output_names))


def package_op_libraries(path: Path) -> set[str]:
    """Op libraries the compiled package calls at run time: the ops AOTInductor did not compile but calls
    through its proxy executor, listed in the package's ``*.wrapper.json`` (one node per call). Ops it
    compiled (``triton_op`` kernels, decomposed ops) need nothing at load time, so a ``triton`` package
    whose ops all compiled is served without our Python ops."""
    namespaces: set[str] = set()
    with zipfile.ZipFile(path) as package:
        for name in package.namelist():
            if name.endswith(".wrapper.json"):
                for node in json.loads(package.read(name)).get("nodes", []):
                    target = str(node.get("node", {}).get("target", ""))
                    if "::" in target:
                        namespaces.add(target.partition("::")[0])
    return {OP_LIBRARY_MODULES.get(ns, ns) for ns in namespaces - BUILTIN_NAMESPACES}


def _load_pt2(path: Path) -> Any:
    """The dense model, called without a host sync between calls.

    AOTInductor's default runner makes each call wait (cudaEventSynchronize) until the previous call
    has finished on the GPU before it launches anything, so back-to-back calls leave the GPU idle
    while the host launches. The single-threaded runner skips that bookkeeping; it is not safe to
    call from two threads at once, so the calls are serialised by a lock: on CUDA it is held only while
    the kernels are launched; on CPU for the whole run, as the default runner's one instance was.
    """
    from torch._inductor.package import load_package

    if "run_single_threaded" not in inspect.signature(load_package).parameters:
        return load_package(str(path))  # older torch
    return _Serialised(load_package(str(path), run_single_threaded=True))


class _Serialised:
    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._fn(*args, **kwargs)
