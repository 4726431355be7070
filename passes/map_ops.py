"""map_ops: retarget operators to ``triton`` (CUDA), ``aten`` (portable; alias ``rtp``) or ``fbgemm``.

Reads ``ctx.op_target``, ``ctx.allow_unmapped``, ``ctx.attention_scale`` and ``ctx.op_mappings``; the
tables are in ``hstu_export/ops/mappings``. Two steps:

1. Foreign functions (generative-recommenders', TorchEasyRec's, or a user's declared one), kept as
   single calls by the tracer, are rewritten into our ops with their arguments bound by name. A call
   our ops cannot express exactly (say, an arbitrary attention mask) is kept as it is, with the reason
   in the report.
2. Ops: an ``op:`` replacement swaps the node's target; an ``fn:`` replacement is traced into the
   graph in the node's place, so the result holds plain torch ops that torch.export, ONNX and
   TorchScript all read. Ops from a custom namespace with no entry for the target fail the pass with
   their list, unless ``allow_unmapped`` keeps them (the export then records their libraries as needed
   at load time).
"""

from __future__ import annotations

import importlib
import operator
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.fx.node import map_aggregate

from hstu_export.errors import ConfigError, UnmappedOpsError
from hstu_export.ops.mappings import (
    MAPPINGS,
    FunctionMapping,
    MappingCall,
    Unmappable,
    bind_call,
    function_key,
    function_mappings,
    op_key,
)

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

TARGETS = ("triton", "aten", "fbgemm")
TARGET_ALIASES = {"rtp": "aten"}
# Namespaces whose ops every backend runs natively.
NATIVE_NAMESPACES = {"aten", "prims", "_operator", "profiler", "higher_order"}


def resolve(spec: str) -> Any:
    kind, _, rest = spec.partition(":")
    if kind == "op":
        ns, _, name = rest.partition("::")
        if ns == "hstu_export" and name.endswith("_triton"):
            importlib.import_module("hstu_export.ops._triton")  # registers the Triton ops
        return getattr(getattr(torch.ops, ns), name).default
    module, _, fn = rest.partition(":")
    return getattr(importlib.import_module(module), fn)


class MapOps:
    name = "map_ops"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        target = TARGET_ALIASES.get(ctx.op_target, ctx.op_target)
        if target not in TARGETS:
            raise ConfigError(f"unknown op target {ctx.op_target!r}; use triton, aten (alias rtp) or fbgemm")
        functions = function_mappings(ctx.op_mappings)
        foreign: Counter[str] = Counter()
        kept_foreign: dict[str, str] = {}
        for node in list(gm.graph.nodes):
            key = function_key(node.target) if node.op == "call_function" else None
            if key in functions:
                reason = self._rewrite_function(gm, node, key, functions[key], ctx)  # type: ignore[arg-type]
                if reason is None:
                    foreign[f"{key} ({functions[key].library})"] += 1  # type: ignore[index]
                else:
                    kept_foreign[key] = reason  # type: ignore[index]
        mapped: Counter[str] = Counter()
        kept: Counter[str] = Counter()
        unmapped: Counter[str] = Counter()
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            key = op_key(node.target)
            if key is None or key.partition("::")[0] in NATIVE_NAMESPACES:
                continue
            spec = MAPPINGS.get(key, {}).get(target)
            if spec is None:
                unmapped[key] += 1
            elif spec == "keep":
                kept[key] += 1
            else:
                self._replace(gm, node, spec, key)
                mapped[f"{key} -> {spec.partition(':')[2]}"] += 1
        if unmapped and not ctx.allow_unmapped:
            listing = ", ".join(f"{k} (x{n})" for k, n in sorted(unmapped.items()))
            raise UnmappedOpsError(
                f"no {target} mapping for: {listing}; add entries to hstu_export/ops/mappings/, pick another "
                "--op-target, or pass --allow-unmapped to keep them (their library must then be loaded at serve time)"
            )
        ctx.add_stat("target", target)
        if foreign:
            ctx.add_stat("foreign", dict(foreign))
        if kept_foreign:
            ctx.add_stat("foreign_kept", kept_foreign)
        ctx.add_stat("mapped", dict(mapped))
        ctx.add_stat("kept", dict(kept | unmapped))
        gm.graph.eliminate_dead_code()
        return gm

    def _rewrite_function(self, gm: torch.fx.GraphModule, node: torch.fx.Node, key: str, mapping: FunctionMapping,
                          ctx: PassContext) -> str | None:
        """Rewrites one foreign call into our ops; returns None, or why the call is kept as it is."""
        fn = getattr(node.target, "__hstu_export_opaque__", node.target)
        arguments = bind_call(fn, mapping, node.args, dict(node.kwargs))
        tracer = torch.fx.proxy.GraphAppendingTracer(gm.graph)
        proxied = map_aggregate(arguments, lambda a: torch.fx.Proxy(a, tracer) if isinstance(a, torch.fx.Node) else a)
        before = set(gm.graph.nodes)
        call = MappingCall(key, proxied, ctx.attention_scale)
        with gm.graph.inserting_before(node):
            try:
                result = mapping.rewrite(call)
            except Unmappable as exc:
                for new in reversed([n for n in gm.graph.nodes if n not in before]):
                    gm.graph.erase_node(new)
                return str(exc)
            except Exception as exc:
                raise UnmappedOpsError(f"mapping {key} failed while tracing its rewrite: {type(exc).__name__}: {exc}") from exc
        if call.batch_scaled and ctx.batch_dependent is None:
            ctx.batch_dependent = (f"attention {key} divides by the longest sequence of the batch it is called on, so "
                                   "a user's answer depends on the other users of its call")
        _tag_new_nodes(gm, before, node, key)
        _replace_uses(node, result)
        gm.graph.erase_node(node)
        return None

    def _replace(self, gm: torch.fx.GraphModule, node: torch.fx.Node, spec: str, key: str) -> None:
        replacement = resolve(spec)
        if isinstance(replacement, torch._ops.OpOverload):
            node.target = replacement
            node.meta["mapped_from"] = key
            return
        normalized = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
        kwargs = normalized.kwargs if normalized is not None else dict(node.kwargs)
        if normalized is None and node.args:
            raise UnmappedOpsError(f"cannot match the arguments of {node.format_node()} to {key}'s schema")
        tracer = torch.fx.proxy.GraphAppendingTracer(gm.graph)
        proxied = map_aggregate(kwargs, lambda a: torch.fx.Proxy(a, tracer) if isinstance(a, torch.fx.Node) else a)
        before = set(gm.graph.nodes)
        with gm.graph.inserting_before(node):
            try:
                result = replacement(**proxied)
            except Exception as exc:
                raise UnmappedOpsError(
                    f"mapping {key} to {spec.partition(':')[2]} failed while tracing it: {exc}"
                ) from exc
        _tag_new_nodes(gm, before, node, key)
        _replace_uses(node, result)
        gm.graph.erase_node(node)


def _tag_new_nodes(gm: torch.fx.GraphModule, before: set[torch.fx.Node], node: torch.fx.Node, key: str) -> None:
    """Nodes a mapping put in ``node``'s place say what they replace (the report colours them) and keep
    its module stack (the report groups nodes by the module they came from)."""
    stack = node.meta.get("nn_module_stack")
    for new in gm.graph.nodes:
        if new not in before:
            new.meta["mapped_from"] = key
            if stack is not None and "nn_module_stack" not in new.meta:
                new.meta["nn_module_stack"] = stack


def _replace_uses(node: torch.fx.Node, result: Any) -> None:
    """Point every use of ``node`` at ``result`` (a Proxy or nested tuple/list of them); uses through
    ``getitem(node, i)`` are resolved to the i-th element."""
    if isinstance(result, torch.fx.Proxy):
        node.replace_all_uses_with(result.node)
        return
    if not isinstance(result, (tuple, list)):
        raise UnmappedOpsError(f"a mapping for {node.target} returned {type(result).__name__}")
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            _replace_uses(user, result[user.args[1]])
            user.graph.erase_node(user)
        else:
            value = map_aggregate(result, lambda p: p.node if isinstance(p, torch.fx.Proxy) else p)
            user.replace_input_with(node, value)  # type: ignore[arg-type]
