"""Shared by the backends: scripting FX graphs, normalising outputs, finding op libraries."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule

from hstu_export.errors import ExportError
from hstu_export.ops.mappings import op_key

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


def op_namespaces(gm: torch.nn.Module) -> set[str]:
    """Namespaces of non-builtin torch.ops called anywhere in ``gm``."""
    return {key.partition("::")[0] for key in op_calls(gm)} - BUILTIN_NAMESPACES


def op_libraries(gm: torch.nn.Module) -> list[str]:
    """Python modules the serving process must import so that ``gm``'s custom ops resolve."""
    return sorted({OP_LIBRARY_MODULES.get(ns, ns) for ns in op_namespaces(gm)})


def scripted_op_libraries(module: torch.jit.ScriptModule) -> list[str]:
    """Op libraries a scripted module needs at load time (torchrec's scripted code calls fbgemm ops)."""
    kinds: set[str] = set()
    graph = module.inlined_graph  # keep it alive while its nodes are walked
    pending = [graph.nodes()]
    while pending:  # nested blocks (if/loop bodies) hold their own nodes
        for node in pending.pop():
            kinds.add(node.kind().split("::")[0])
            pending.extend(block.nodes() for block in node.blocks())
    return sorted({OP_LIBRARY_MODULES.get(ns, ns) for ns in kinds - BUILTIN_NAMESPACES - {"prim", "onnx"}})


def script_graph_module(gm: GraphModule, what: str) -> torch.jit.ScriptModule:
    """TorchScript of an FX GraphModule. Two spellings TorchScript cannot read are rewritten on a copy:
    node type annotations (FX renders ``from __future__`` annotations as unknown names) and op overloads
    (``torch.ops.ns.op.default`` becomes the packet ``torch.ops.ns.op``, which TorchScript resolves)."""
    gm = copy.deepcopy(gm)
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
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(module, str(path))


def as_output_dict(value: Any, names: list[str]) -> dict[str, Tensor]:
    """Graph outputs (dict, tuple or a single tensor) as a dict keyed by ``names``."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, Tensor):
        value = (value,)
    if len(value) != len(names):
        raise ExportError(f"expected {len(names)} outputs ({names}), got {len(value)}")
    return dict(zip(names, value))
