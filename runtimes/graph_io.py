"""Shared by the backends: scripting FX graphs, normalising outputs, finding op libraries."""

from __future__ import annotations

import copy
import io
import re
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule

from hstu_export.errors import ExportError
from hstu_export.ops.mappings import op_key
from hstu_export.runtimes.symbolic import check_non_negative, symbolic_float, symbolic_int

# Namespaces of ops that need a library loaded in the serving process, and the module that loads it.
OP_LIBRARY_MODULES = {"hstu_export": "hstu_export.ops", "fbgemm": "fbgemm_gpu"}
BUILTIN_NAMESPACES = {"aten", "prims", "_assert", "higher_order", "_operator", "profiler"}


def op_calls(module: torch.nn.Module) -> Counter[str]:
    """``ns::op`` -> number of calls, over every FX graph in ``module`` (nested GraphModules too)."""
    found: Counter[str] = Counter()
    for gm in module.modules():
        if isinstance(gm, GraphModule):
            found.update(key for node in gm.graph.nodes
                         if node.op == "call_function" and (key := op_key(node.target)) is not None)
    return found


def scripted_op_libraries(module: torch.jit.ScriptModule) -> list[str]:
    """Op libraries a scripted module needs at load time (torchrec's scripted code calls fbgemm ops).

    Loading compiles every function and method of the archive's code, not only those ``forward`` reaches: a
    scripted torchrec class (JaggedTensor) brings all its methods, and an op one of them names must be registered
    even if no request ever calls it. So the namespaces are read from the serialised code too, beside the
    graph's own nodes."""
    kinds: set[str] = set()
    graph = module.inlined_graph  # keep it alive while its nodes are walked
    pending = [graph.nodes()]
    while pending:  # nested blocks (if/loop bodies) hold their own nodes
        for node in pending.pop():
            kinds.add(node.kind().split("::")[0])
            pending.extend(block.nodes() for block in node.blocks())
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    with zipfile.ZipFile(buffer) as archive:
        for name in archive.namelist():
            if "/code/" in name and name.endswith(".py"):
                kinds.update(_SERIALISED_OP.findall(archive.read(name).decode("utf-8", "replace")))
    return sorted({OP_LIBRARY_MODULES.get(ns, ns) for ns in kinds - BUILTIN_NAMESPACES - {"prim", "onnx"}})


# How TorchScript's serialised code calls an operator: ``ops.<namespace>.<name>(...)``.
_SERIALISED_OP = re.compile(r"\bops\.([A-Za-z_][A-Za-z0-9_]*)\.[A-Za-z_]")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain_first_line(exc: BaseException) -> str:
    """The first line of a library's error without terminal colour codes (the ONNX exporter colours)."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# What torch.export and Inductor say when a size read from tensor values must be compared with a number.
_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "data-dependent expression")


def data_dependent_advice(exc: BaseException) -> str:
    """What to do, as a clause to append to a compiler's error (empty for other errors), when ``exc`` (or its
    cause) is a guard on a size the dense graph reads from tensor values: typically a max length taken with
    ``.max()``/``.item()`` inside a model's own attention function, which a fixed shape compiler cannot
    always handle."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if any(marker in str(link) for marker in _DATA_DEPENDENT):
            return ("; a size in the dense graph is read from tensor values (a max length taken with .max() or "
                    ".item(), often in the model's own attention function): map that function onto a known one "
                    "with --map-function NAME=RULE (README, 'Your own model'), or export with --backend torchscript")
        link = link.__cause__ or link.__context__
    return ""


def export_ready(gm: GraphModule, *, fold_parameters: bool = False) -> GraphModule:
    """``gm`` (sharing its parameters) with the spellings torch.export cannot trace replaced: ``int()``
    and ``float()`` of tensor data become their symbolic forms, and ints read from tensor data
    (``x.item()``, ``int(x)``) that were never negative on the batches ``observe_values`` ran are
    declared non-negative, so they can be sizes; a dict output becomes a tuple in its key order.
    TorchScript keeps the original spellings. Offsets are rewritten to compile as one scan each, and with
    ``fold_parameters`` the work on parameters alone is done here, once (``runtimes/compile_rewrites.py``)."""
    # Here, not at the top: loading a package imports this module, and must not import the capture's code.
    from hstu_export.runtimes.compile_rewrites import fold_parameter_work, offsets_in_one_scan

    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is int:
            node.target = symbolic_int
        elif node.op == "call_function" and node.target is float:
            node.target = symbolic_float
        else:
            continue
    for node in list(graph.nodes):
        reads_data = (node.op == "call_method" and node.target == "item") or (
            node.op == "call_function" and node.target is symbolic_int)
        if reads_data and node.meta.get("value_kind") == "int" and node.meta.get("int_min", -1) >= 0:
            with graph.inserting_after(node):
                checked = graph.call_function(check_non_negative, (node,))
            for user in [u for u in node.users if u is not checked]:
                user.replace_input_with(node, checked)
    # Plain positional outputs (the manifest's output_names order): stock loaders then get a tuple, not
    # the fx immutable_dict a dict output becomes, and C++ gets the same order.
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    if isinstance(output.args[0], dict):
        output.args = (tuple(output.args[0].values()),)
    offsets_in_one_scan(graph)
    ready = GraphModule(gm, graph, class_name=type(gm).__name__)
    ready.meta.update(gm.meta)
    if fold_parameters:
        fold_parameter_work(ready)
    return ready


def script_graph_module(gm: GraphModule, what: str) -> torch.jit.ScriptModule:
    """TorchScript of an FX GraphModule. Two spellings TorchScript cannot read are rewritten on a copy:
    node type annotations (FX renders ``from __future__`` annotations as unknown names) and op overloads
    (``torch.ops.ns.op.default`` becomes the packet ``torch.ops.ns.op``, which TorchScript resolves)."""
    gm = copy.deepcopy(gm)
    # Inference artifacts: nothing in them requires grad (a C++ caller without a no-grad guard would
    # otherwise get outputs that do).
    for tensor in (*gm.parameters(), *gm.buffers()):
        tensor.requires_grad_(False)
    for module in gm.modules():
        if isinstance(module, GraphModule):
            for node in module.graph.nodes:
                node.type = None
                if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                    node.target = node.target.overloadpacket
            module.recompile()
    try:
        return torch.jit.script(gm)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"TorchScript cannot compile the {what} graph: {first}") from exc


def save_script(module: torch.jit.ScriptModule, path: Path) -> None:
    """Serialised in memory, then written from Python: torch.jit.save's own file writer aborts the
    process from C++ when the disk fills up, where a Python write raises an OSError we report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


def as_output_dict(value: Any, names: list[str]) -> dict[str, Tensor]:
    """Graph outputs (dict, tuple or a single tensor) as a dict keyed by ``names``."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, Tensor):
        value = (value,)
    if len(value) != len(names):
        raise ExportError(f"expected {len(names)} outputs ({names}), got {len(value)}")
    return dict(zip(names, value))
