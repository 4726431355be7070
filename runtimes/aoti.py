"""AOTInductor backend (the default): torch.export of the dense graph with named dynamic dims, compiled
by ``aoti_compile_and_package`` into one ``.pt2`` (CPU or CUDA).

The sparse graph is compiled the same way into its own ``.pt2`` when it is plain tensor code: every
torchrec lookup lowered to gathers (passes/lower_embeddings.py), its range checks read from the device
once. Its tables are not compiled into it: they are stored once beside it (``sparse/tables.safetensors``,
hstu_export/package/tables.py) and handed to the program when it is loaded. A sparse graph that still calls
torchrec (a lookup the pass kept, a KeyedJaggedTensor or KeyedTensor it builds), or that torch.export refuses,
is stored as TorchScript instead, tables inside, and the backend's manifest meta says why (``sparse_program``)."""

from __future__ import annotations

import copy
import inspect
import json
import re
import shutil
import threading
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from hstu_export.errors import ExportError, PackageError
from hstu_export.package.manifest import BackendFields, Manifest, backend_fields, resolve_inside
from hstu_export.package.tables import TABLES_FORMAT, read_tables, write_tables
from hstu_export.runtimes.base import (
    RANGE_CHECK_MESSAGES,
    Backend,
    BackendArtifacts,
    CompileInputs,
    Features,
    Runner,
    SplitRunner,
    torch_dynamic_shapes,
)
from hstu_export.runtimes.compiled_bounds import (
    KEEPING_DECLARED_RANGES,
    InputBounds,
    narrowed_dims,
    program_bounds,
    recording_input_bounds,
)
from hstu_export.runtimes.graph_io import (
    BUILTIN_NAMESPACES,
    OP_LIBRARY_MODULES,
    as_output_dict,
    data_dependent_advice,
    export_ready,
    plain_first_line,
)
from hstu_export.runtimes.residual_norms import fuse_residual_norms
from hstu_export.runtimes.sparse_torchscript import compile_sparse, load_sparse
from hstu_export.runtimes.unbacked_ranges import device_reads, unbacked_ranges_hold_at_one

DENSE_FILE = "dense/dense.pt2"
SPARSE_PROGRAM_FILE = "sparse/sparse.pt2"
TABLES_FILE = "sparse/tables.safetensors"
# The sparse program's second model, beside the checked one a stock loader takes ("model"): ids clamped, not
# checked (prechecked_sparse).
PRECHECKED_MODEL = "prechecked"
# The sparse program is compiled without its constants (its tables), which are stored in TABLES_FILE instead.
_WITHOUT_CONSTANTS = {"aot_inductor.package_constants_in_so": False}
# The helpers whose results are torchrec objects: a sparse graph that calls them is not plain tensor code.
_TORCHREC_BUILDERS = ("build_kjt", "build_weighted_kjt", "build_jt", "build_weighted_jt", "build_kt")


def export_dense(inputs: CompileInputs) -> torch.export.ExportedProgram:
    """torch.export of the dense graph with the shared named dynamic dims (non-strict: the graph is
    already an FX graph of plain calls). Sizes read from tensor data keep the ranges the dims allow down to
    1 (``runtimes/unbacked_ranges.py``); compile the program under the same context."""
    from hstu_export.capture.opaque import export_builtins

    dynamic = torch_dynamic_shapes(inputs.dense_input_names, inputs.dense_dynamic_dims)
    try:
        with torch.no_grad(), export_builtins(set(inputs.user_packages)), unbacked_ranges_hold_at_one():
            return torch.export.export(
                export_ready(inputs.dense, fold_parameters=True), args=(), kwargs=inputs.example_dense_inputs, dynamic_shapes=dynamic,
                strict=False,
            )
    except Exception as exc:
        raise ExportError(f"torch.export of the dense graph failed: {plain_first_line(exc)}"
                          f"{data_dependent_advice(exc)}") from exc


def torchrec_in_graph(gm: GraphModule) -> str | None:
    """Why ``gm`` is not plain tensor code (the torchrec or scripted module it calls, the torchrec object it
    builds), or None."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        if isinstance(module, torch.jit.ScriptModule):  # torchrec's quantized collections (quantize_embeddings)
            return f"it calls the TorchScript module {node.target} ({getattr(module, 'original_name', '?')})"
        if type(module).__module__.startswith("torchrec"):
            return f"it calls torchrec's {type(module).__name__} ({node.target})"
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") in _TORCHREC_BUILDERS:
            return f"it builds a torchrec object ({node.target.__name__})"
    return None


def _outputs_in_order(gm: GraphModule, names: list[str]) -> GraphModule:
    """``gm`` (sharing its parameters) returning its dict output in the order of ``names``."""
    graph = copy.deepcopy(gm.graph)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    value = output.args[0]
    if not isinstance(value, dict) or set(value) != set(names):
        raise ExportError(f"the sparse graph returns {list(value) if isinstance(value, dict) else type(value).__name__}, "
                          f"expected a dict of {names}")
    output.args = ({n: value[n] for n in names},)
    ordered = GraphModule(gm, graph, class_name=type(gm).__name__)
    ordered.meta.update(gm.meta)
    return ordered


def export_sparse(inputs: CompileInputs, sparse: GraphModule | None = None) -> torch.export.ExportedProgram:
    """torch.export of the sparse graph (``sparse``, else ``inputs.sparse``), returning the boundary tensors in the
    artifact's output order (the manifest's ``artifacts.sparse.outputs``)."""
    from hstu_export.capture.opaque import export_builtins

    names = inputs.sparse_input_names
    graph = export_ready(_outputs_in_order(inputs.sparse if sparse is None else sparse,
                                           list(inputs.example_sparse_outputs)))
    dynamic = torch_dynamic_shapes(names, inputs.sparse_dynamic_dims)
    with torch.no_grad(), export_builtins(set(inputs.user_packages)), unbacked_ranges_hold_at_one():
        return torch.export.export(graph, args=(), kwargs={n: inputs.example_features[n] for n in names},
                                   dynamic_shapes=dynamic, strict=False)


def compiled_range_checks(program: torch.export.ExportedProgram, sparse: GraphModule) -> dict[str, list[str]]:
    """What each range check compiled into the sparse program refuses, by the symbol its error names
    (AOTInductor words a failed check "Expected u5 <= 999 but received 1000"): ``{"u5": [feature, "high"]}``,
    the bound one of "low", "high", "rows". The runtimes read this map (backend.meta.sparse_program) to name
    the feature; empty when the program's reads are not check_ranges' (then refusals name no feature)."""
    from hstu_export.capture.graph_functions import check_ranges

    check = next((n for n in sparse.graph.nodes if n.op == "call_function" and n.target is check_ranges), None)
    if check is None:
        return {}
    names = [str(n) for n in check.args[4]]
    out: dict[str, list[str]] = {}
    # check_ranges copies every feature's minimum, maximum and rows to the host in one tensor, in that order, and
    # reads those it checks: read k is bound k % 3 of feature k // 3.
    copies = set()
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.item.default:
            continue
        source, symbol = node.args[0], node.meta.get("val")
        if not (isinstance(source, torch.fx.Node) and source.target is torch.ops.aten.select.int
                and source.args[1] == 0 and isinstance(source.args[2], int) and 0 <= source.args[2] < 3 * len(names)
                and isinstance(symbol, torch.SymInt)):
            continue
        copies.add(source.args[0])
        k = source.args[2]
        out[str(symbol)] = [names[k // 3], ("low", "high", "rows")[k % 3]]
    return out if len(copies) == 1 else {}  # reads of one copy only, else not check_ranges' (name nothing)


def prechecked_sparse(sparse: GraphModule) -> tuple[GraphModule, dict[str, list[int | None]]] | None:
    """The sparse graph as the runtimes run it after checking the manifest's ranges on the host: its check_ranges
    call replaced by :func:`clamp_to_ranges` (no read from the device, so the host does not wait for the GPU before
    the dense half; ids still cannot leave the tables), and the ranges it was checked against, by feature:
    ``[low, high, rows]``, None for no bound. The runtimes run it only when the manifest's ranges lie within these.
    None when the graph checks nothing."""
    from hstu_export.capture.graph_functions import CLAMPABLE, NO_LIMIT, check_ranges, clamp_to_ranges

    # A copy of the graph only: the module's tables stay shared with ``sparse`` (a deep copy would double them).
    graph = GraphModule(sparse, copy.deepcopy(sparse.graph), class_name=type(sparse).__name__)
    graph.meta.update(sparse.meta)
    check = next((n for n in graph.graph.nodes if n.op == "call_function" and n.target is check_ranges), None)
    if check is None or CLAMPABLE not in check.meta:
        return None
    values, lows, highs, rows, names = check.args
    check.target, check.args = clamp_to_ranges, (values, lows, highs, list(check.meta[CLAMPABLE]))
    graph.recompile()

    def bound(value: int) -> int | None:
        return None if abs(value) >= NO_LIMIT else int(value)

    return graph, {str(name): [bound(low), bound(high), bound(most)]
                   for name, low, high, most in zip(names, lows, highs, rows, strict=True)}


def prechecked_applies(meta: Any, features: dict[str, tuple[float | None, float | None]], max_batch_size: int) -> str | None:
    """The model of the sparse program to run after the host has checked a request against the manifest's ranges
    (``features``: each feature's min_value and max_value; ``max_batch_size``): ``meta``'s prechecked model
    (backend.meta.sparse_program.prechecked) when every range its check was replaced for holds the manifest's,
    else None (the checked model then runs, and refuses what the manifest lets past)."""
    prechecked = meta.get("prechecked") if isinstance(meta, dict) else None
    if not isinstance(prechecked, dict) or not isinstance(prechecked.get("model"), str):
        return None
    ranges = prechecked.get("ranges")
    if not isinstance(ranges, dict):
        return None
    for feature, bounds in ranges.items():
        if feature not in features or not (isinstance(bounds, list) and len(bounds) == 3
                                           and all(b is None or type(b) is int for b in bounds)):
            return None
        (low, high, rows), (least, most) = bounds, features[feature]
        if ((low is not None and (least is None or least < low)) or (high is not None and (most is None or most > high))
                or (rows is not None and max_batch_size > rows)):
            return None
    return prechecked["model"]


def named_range_refusal(exc: BaseException, checks: dict[str, list[str]]) -> BaseException:
    """``exc`` from a compiled sparse program, as check_ranges' TorchScript assert words it when it is one of
    the range checks ``checks`` names (``compiled_range_checks``); else ``exc`` itself."""
    text = str(exc)
    found = re.search(r"Expected (u\d+) ", text)
    if found is None or found.group(1) not in checks:
        return exc
    feature, bound = checks[found.group(1)]
    suffix = next(words for words, which in RANGE_CHECK_MESSAGES if which == bound)
    return RuntimeError(f"AssertionError: {feature}{suffix}\n{text}")


def _compile(program: torch.export.ExportedProgram | dict[str, torch.export.ExportedProgram], path: Path,
             options: dict[str, Any]) -> list[InputBounds]:
    """One program into the package ``path``, or several by model name into one package (loaded by name; the stock
    loader takes the one named "model"). Returns the input bounds each compiled graph holds
    (runtimes/compiled_bounds.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with unbacked_ranges_hold_at_one(), recording_input_bounds() as bounds:
        if not isinstance(program, dict):
            torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=dict(options))
            return program_bounds(program, bounds)
        from torch._inductor.package import package_aoti

        files, held = {}, []
        for name, each in program.items():
            args, kwargs = each.example_inputs
            module = each.module(check_guards=False) if "check_guards" in inspect.signature(each.module).parameters \
                else each.module()  # torch before 2.12 has no guards to leave out
            start = len(bounds)
            files[name] = torch._inductor.aot_compile(module, args, kwargs, options={**options, "aot_inductor.package": True})
            held.extend(program_bounds(each, bounds[start:]))
        package_aoti(str(path), files)
    return held


class AotiBackend(Backend):
    name = "aoti"
    description = "AOTInductor package (.pt2), CPU or CUDA"

    def compile(self, inputs: CompileInputs, out_dir: Path) -> BackendArtifacts:
        # Every compile's, then --aoti-option's (the compile adds its own keys to this copy).
        options = {**KEEPING_DECLARED_RANGES, **inputs.settings.aoti_options}
        sparse_file, sparse_libraries, sparse_meta, tables = self._compile_sparse(inputs, out_dir, options)
        program = export_dense(inputs)
        op_target = inputs.settings.op_target or self.default_op_target(inputs.settings.torch_device)
        try:
            residual_norms = fuse_residual_norms(program) if op_target == "triton" else 0
            bounds = _compile(program, out_dir / DENSE_FILE, options)
        except Exception as exc:
            raise ExportError(f"AOTInductor compilation failed: {plain_first_line(exc)}"
                              f"{data_dependent_advice(exc)}") from exc
        narrowed = [*sparse_meta.pop("narrowed_dims", []),
                    *(d.to_json() for d in narrowed_dims("dense", bounds, inputs.dense_dynamic_dims))]
        return BackendArtifacts(
            files={"sparse": sparse_file, "dense": DENSE_FILE},
            meta={"dense_exported_nodes": len(program.graph.nodes), "dense_device_reads": device_reads(program),
                  "dense_residual_norms": residual_norms,
                  "inductor_options": options, "sparse_program": sparse_meta,
                  **({"narrowed_dims": narrowed} if narrowed else {})},
            op_libraries=sorted(set(sparse_libraries) | package_op_libraries(out_dir / DENSE_FILE)),
            formats={"sparse": sparse_meta["format"]},
            constants={"sparse": tables} if tables else {},
        )

    @staticmethod
    def _compile_sparse(inputs: CompileInputs, out_dir: Path, options: dict[str, Any]
                        ) -> tuple[str, list[str], dict[str, Any], dict[str, Any] | None]:
        """The sparse half compiled by AOTInductor with its tables stored beside it (their ``constants`` entry),
        or as TorchScript, tables inside, with the reason it was not."""
        reason = torchrec_in_graph(inputs.sparse)
        if reason is None:
            try:
                program = export_sparse(inputs)
                prechecked = prechecked_sparse(inputs.sparse) if inputs.settings.prechecked_for_device else None
                programs = program if prechecked is None else {
                    "model": program, PRECHECKED_MODEL: export_sparse(inputs, prechecked[0])}
                bounds = _compile(programs, out_dir / SPARSE_PROGRAM_FILE, {**options, **_WITHOUT_CONSTANTS})
                values = _program_tables(program, out_dir)
                if prechecked is not None:
                    _models_agree(out_dir / SPARSE_PROGRAM_FILE, values, inputs)
                tables = {"file": TABLES_FILE, "format": TABLES_FORMAT,
                          "tensors": write_tables(out_dir / TABLES_FILE, values)}
            except Exception as exc:  # a sparse graph torch.export or Inductor refuses still serves as TorchScript
                from hstu_export.package.directory import is_file_system_failure

                if is_file_system_failure(exc, out_dir):
                    raise  # a full disk is the export's failure (one line), not the graph's
                reason = f"AOTInductor could not compile it: {plain_first_line(exc)[:300]}"
                shutil.rmtree(out_dir / Path(SPARSE_PROGRAM_FILE).parent, ignore_errors=True)
            else:
                meta = {"format": "aoti", "exported_nodes": len(program.graph.nodes),
                        "range_checks": compiled_range_checks(program, inputs.sparse)}
                if prechecked is not None:
                    meta["prechecked"] = {"model": PRECHECKED_MODEL, "ranges": prechecked[1]}
                narrowed = narrowed_dims("sparse", bounds, inputs.sparse_dynamic_dims)
                if narrowed:
                    meta["narrowed_dims"] = [d.to_json() for d in narrowed]
                return (SPARSE_PROGRAM_FILE, sorted(package_op_libraries(out_dir / SPARSE_PROGRAM_FILE)), meta, tables)
        sparse_file, libraries = compile_sparse(inputs, out_dir)
        return sparse_file, libraries, {"format": "torchscript", "reason": reason}, None

    def load(self, root: Path, manifest: BackendFields | dict[str, Any], device: torch.device,
             tables_device: torch.device | None = None) -> Runner:
        fields = backend_fields(manifest, root)
        path = fields.artifact(root, "dense")
        sparse_model = None
        if fields.backend.files.get("sparse", "").endswith(".pt2"):
            meta = fields.backend.meta.get("sparse_program")
            if isinstance(manifest, Manifest):  # its ranges are what the predictor checks each request against
                limits = {f.name: (f.min_value, f.max_value) for f in manifest.input_schema.features}
                sparse_model = prechecked_applies(meta, limits, manifest.ranges.max_batch_size)
            sparse = load_sparse_program(root, fields, meta, _sparse_constants(manifest), device, tables_device,
                                         model=sparse_model)
            sparse_model = sparse_model or "model"
        else:
            sparse = load_sparse(root, fields, device)
        try:
            dense = _load_pt2(path)
        except Exception as exc:
            raise PackageError(f"{root}: AOTInductor could not load {fields.backend.files['dense']}: "
                               f"{plain_first_line(exc)}") from exc
        return SplitRunner(sparse, dense, list(fields.dense_passthrough_inputs), list(fields.output_names),
                           sparse_model=sparse_model)


def _program_tables(program: torch.export.ExportedProgram, out_dir: Path) -> dict[str, torch.Tensor]:
    """The constants the compiled sparse program asks for at load, by the names it asks for them, with the
    exported program's values (its parameters, buffers and lifted constants)."""
    compiled = _load_pt2(out_dir / SPARSE_PROGRAM_FILE)
    values = {**program.state_dict, **program.constants}
    names = compiled.constant_fqns()
    unknown = [name for name in names if not isinstance(values.get(name), torch.Tensor)]
    if unknown:
        raise ExportError(f"the compiled program takes a constant {unknown[0]!r} the exported program does not hold")
    return {name: values[name] for name in names}


def _models_agree(path: Path, tables: dict[str, torch.Tensor], inputs: CompileInputs) -> None:
    """The sparse program's two models on the export example, with its tables: the prechecked one answers as the
    checked one does, bit for bit (inside the ranges its clamps change nothing), or the export fails."""
    features = {name: inputs.example_features[name] for name in inputs.sparse_input_names}
    answers = []
    for model in ("model", PRECHECKED_MODEL):
        program = _load_pt2(path, model)
        program.use_constants(dict(tables))
        with torch.no_grad():
            answers.append(tuple(program(**features)))
    checked, prechecked = answers
    if len(checked) != len(prechecked) or not all(torch.equal(a, b) for a, b in zip(checked, prechecked, strict=False)):
        raise ExportError("the sparse half's prechecked model answers the export example differently from its checked "
                          "model; export with --prechecked-sparse off")


def _sparse_constants(manifest: BackendFields | dict[str, Any]) -> dict[str, Any] | None:
    """``artifacts.sparse.constants`` (validated when the manifest is a Manifest); None when the sparse program
    holds its tables itself (a package of format 4)."""
    artifacts = manifest.artifacts if isinstance(manifest, Manifest) else (
        manifest.get("artifacts") if isinstance(manifest, dict) else None)
    sparse = artifacts.get("sparse") if isinstance(artifacts, dict) else None
    return sparse.get("constants") if isinstance(sparse, dict) else None


def load_sparse_program(root: Path, fields: BackendFields, meta: Any, constants: dict[str, Any] | None = None,
                        device: torch.device | None = None, tables_device: torch.device | None = None,
                        model: str | None = None) -> Runner:
    """The compiled sparse half: features -> the boundary tensors by name (its outputs are in the order of
    ``sparse_output_names``). A refusal by one of its range checks is worded as the TorchScript sparse half
    words it (``meta``: the manifest's backend.meta.sparse_program, whose ``range_checks`` name them).
    ``constants`` (``artifacts.sparse.constants``): its tables, read from their file and handed to it, on
    ``device`` or, with ``tables_device`` cpu for a CUDA program, in pinned host memory. ``model``: the package's
    model to run (:func:`prechecked_applies`), else the checked one a stock loader takes."""
    checks = meta.get("range_checks") if isinstance(meta, dict) else None
    bounds = [which for _, which in RANGE_CHECK_MESSAGES]
    checks = {str(k): v for k, v in checks.items() if isinstance(v, list) and len(v) == 2
              and isinstance(v[0], str) and v[1] in bounds} if isinstance(checks, dict) else {}
    path = fields.artifact(root, "sparse")
    input_names, output_names = list(fields.sparse_input_names), list(fields.sparse_output_names)
    try:
        program = _load_pt2(path, model or "model")
    except Exception as exc:
        raise PackageError(f"{root}: AOTInductor could not load {fields.backend.files['sparse']}"
                           f"{f' (its model {model!r})' if model else ''}: {plain_first_line(exc)}") from exc
    if constants is not None:
        _hand_tables(program, root, constants, device or torch.device("cpu"), tables_device)
    return SparseProgram(program, input_names, output_names, checks)


class SparseProgram:
    """A compiled sparse half as a Runner (features -> the boundary tensors by name), with the tables handed to
    it (``tables``: by name, as the program reads them; a derived delta program with the sparse half inside it
    reads the same tensors)."""

    def __init__(self, program: _Serialised, input_names: list[str], output_names: list[str],
                 checks: dict[str, list[str]]) -> None:
        self._program, self._input_names, self._output_names, self._checks = program, input_names, output_names, checks

    @property
    def tables(self) -> dict[str, torch.Tensor]:
        return dict(self._program._constants)

    def __call__(self, features: Features) -> Features:
        try:
            with torch.no_grad():
                outputs = self._program(**{n: features[n] for n in self._input_names})
        except RuntimeError as exc:
            named = named_range_refusal(exc, self._checks)
            if named is exc:
                raise
            raise named from exc
        return as_output_dict(tuple(outputs), self._output_names)


def _hand_tables(program: _Serialised, root: Path, constants: dict[str, Any], device: torch.device,
                 tables_device: torch.device | None = None) -> None:
    """Reads the tables file (memory-mapped, its header checked against the manifest) and hands its tensors to
    ``program`` as constants it uses in place: on CPU the mapped file itself; on CUDA one copy on the device, or
    with ``tables_device`` cpu one copy in pinned host memory, which the program's gathers read over the bus
    (unified addressing), so tables larger than the device's memory serve."""
    relpath = str(constants["file"])
    path = resolve_inside(root, relpath, "artifacts.sparse.constants.file")
    tables = read_tables(path, list(constants["tensors"]), f"{root}: {relpath}")
    missing = sorted(set(program.constant_fqns()) - set(tables))
    if missing:
        raise PackageError(f"{root}: the sparse program takes the table {missing[0]!r}, which {relpath} does not "
                           "hold; re-export the package")
    if device.type != "cpu":
        on_host = tables_device is not None and tables_device.type == "cpu"
        try:
            tables = {name: _pinned_for(tensor, device) if on_host else tensor.to(device) for name, tensor in tables.items()}
        except torch.OutOfMemoryError:
            size = sum(t.numel() * t.element_size() for t in tables.values()) / (1 << 30)
            raise PackageError(f"{root}: its tables ({size:.2f} GiB) do not fit in this process's GPU memory; serve "
                               "them from host memory (tables_device='cpu', --tables-device cpu)") from None
    program.use_constants(tables)


class _PinnedBytes:
    """A pinned host copy of a tensor's bytes, offered to torch as device memory: with CUDA's unified addressing a
    pinned host page has one address on the host and the device, and a kernel reads it over the bus. (AOTInductor
    takes a CUDA program's constants only as CUDA tensors.) torch keeps this object alive with the view."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.pinned = tensor.contiguous().pin_memory()
        self.__cuda_array_interface__ = {"shape": (self.pinned.numel() * self.pinned.element_size(),),
                                         "typestr": "|u1", "data": (self.pinned.data_ptr(), False), "version": 3,
                                         "strides": None, "stream": None}


def _pinned_for(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in pinned host memory, as a CUDA tensor of ``device`` over that memory (no copy on the device)."""
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    raw = torch.as_tensor(_PinnedBytes(tensor), device=device)
    return raw.view(tensor.dtype).view(tensor.shape)


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


def _load_pt2(path: Path, model: str = "model") -> Any:
    """A compiled program (dense half, sparse half, KV-cache programs), called with keyword tensors and
    without a host sync between calls.

    AOTInductor's default runner makes each call wait (cudaEventSynchronize) until the previous call
    has finished on the GPU before it launches anything, so back-to-back calls leave the GPU idle
    while the host launches. The single-threaded runner skips that bookkeeping; it is not safe to
    call from two threads at once, so the calls are serialised by a lock: on CUDA it is held only while
    the kernels are launched; on CPU for the whole run, as the default runner's one instance was.
    """
    from torch._inductor.package import load_package

    if "run_single_threaded" not in inspect.signature(load_package).parameters:
        return _Serialised(load_package(str(path), model))  # older torch
    return _Serialised(load_package(str(path), model, run_single_threaded=True))


def _keyword_call(compiled: Any) -> tuple[list[str], list[str] | None] | None:
    """For a program that takes keyword tensors only and returns a flat tuple or a flat dict of tensors: the
    keywords in the order it takes them, and the dict's keys in the order it returns them (None: a tuple). None
    for any other program, or a torch without these internals.

    torch's wrapper reads the program's call spec, parses its two tree specs and flattens the arguments on
    every call (tens of microseconds a call from Python, paid by the sparse half, the dense half and the KV-cache
    programs of every request); read once, the call is one list and the runner's boxed call."""
    try:
        from torch.utils import _pytree as pytree

        in_spec, out_spec = (pytree.treespec_loads(text) for text in compiled.loader.get_call_spec())
        args, kwargs = (in_spec.child(0), in_spec.child(1)) if in_spec.num_children == 2 else (None, None)
        if (in_spec.type is not tuple or args is None or args.type is not tuple or args.num_children != 0
                or kwargs.type is not dict or not all(kwargs.child(i).is_leaf() for i in range(kwargs.num_children))
                or out_spec.type not in (tuple, dict)
                or not all(out_spec.child(i).is_leaf() for i in range(out_spec.num_children))
                or not callable(getattr(compiled.loader, "boxed_run", None))):
            return None
        keys = list(out_spec.context) if out_spec.type is dict else None
        return [str(name) for name in kwargs.context], keys
    except Exception:  # internals of another torch: the wrapper's own call
        return None


class _Serialised:
    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._constants: dict[str, torch.Tensor] = {}
        call = _keyword_call(fn)
        self._keywords, self._output_keys = call if call is not None else (None, None)

    def constant_fqns(self) -> list[str]:
        return list(self._fn.get_constant_fqns())

    def use_constants(self, tensors: dict[str, torch.Tensor]) -> None:
        """The program reads ``tensors`` in place from now on (AOTInductor's user-managed constants): they are
        kept alive here, as long as the program."""
        with self._lock:
            self._fn.load_constants(tensors, check_full_update=True, user_managed=True)
            self._constants = tensors

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names = self._keywords
        if names is not None and not args and len(kwargs) == len(names) and all(n in kwargs for n in names):
            inputs = [kwargs[n] for n in names]
            with self._lock:
                outputs = self._fn.loader.boxed_run(inputs)
            return tuple(outputs) if self._output_keys is None else dict(zip(self._output_keys, outputs, strict=True))
        with self._lock:  # anything else (a missing keyword: its error) through torch's wrapper
            return self._fn(*args, **kwargs)
