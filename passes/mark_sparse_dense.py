"""mark_sparse_dense: find the sparse/dense boundary by itself and mark it with ``sparse_boundary``.

Models written for torchrec look their ids up in embedding modules (the default leaf list) and read
the results through torchrec's accessors: ``jt.values()``, ``jt.lengths()``, ``jt.offsets()``,
``kt["key"]``, ``kt.values()``, ``to_dict()``. The sparse region is every node that builds, holds or
reads such a structure (KeyedJaggedTensor, JaggedTensor, KeyedTensor, and containers of them, as
``observe_values`` saw them on the example batch) plus everything those nodes depend on. Every tensor
(or Python int) that leaves the region for dense code and depends on a lookup or a structure gets a
mark, named after its accessor chain (``<module>.<key>.values``); values computed from the request
alone are recomputed on the dense side instead. Ints cross as 0-d tensors.

Explicit ``sparse_boundary`` marks win: a graph that has any is left as it is.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch.fx

from hstu_export.capture import module_matches
from hstu_export.capture.graph_functions import int_to_tensor, sparse_boundary, tensor_to_int
from hstu_export.errors import PassError
from hstu_export.package.schema import graph_name

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

NAME = "mark_sparse_dense"
ACCESSORS = ("values", "lengths", "offsets", "weights", "lengths_or_none", "weights_or_none", "to_dict")
CONTAINER_KINDS = ("kjt", "other")


class MarkSparseDense:
    name = NAME
    recursive = False

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        graph = gm.graph
        explicit = [n for n in graph.nodes if n.op == "call_function" and n.target is sparse_boundary]
        if explicit:
            ctx.add_stat("explicit_marks", len(explicit))
            return gm
        if not any("value_kind" in n.meta for n in graph.nodes):
            raise PassError(f"{NAME} needs observe_values to run first (it reads what each node produced)")
        lookups = [n for n in graph.nodes if n.op == "call_module"
                   and module_matches(gm.get_submodule(str(n.target)), str(n.target), ctx.embedding_modules)]
        if not lookups:
            raise PassError(
                f"{NAME}: the graph calls no embedding module ({', '.join(c.rsplit('.', 1)[-1] for c in ctx.embedding_modules)}) "
                "and has no sparse_boundary marks; name the model's embedding modules with --leaf-module, or mark "
                "the boundary with hstu_export.capture.graph_functions.sparse_boundary"
            )
        merged = _merge_repeated_accessors(graph)
        if merged:
            ctx.add_stat("merged_repeated_accessors", merged)
        structured = {n for n in graph.nodes if n.meta.get("value_kind") == "kjt"} | set(lookups)
        region = _sparse_region(graph, structured)
        tainted = _descendants(structured)
        crossing = [n for n in graph.nodes if n in region and n in tainted
                    and any(u not in region for u in n.users)]
        used_names: set[str] = {str(n.target) for n in graph.nodes if n.op == "placeholder"}
        marked = []
        for node in crossing:
            kind = node.meta.get("value_kind")
            outside = [u for u in node.users if u not in region]
            if kind not in ("tensor", "int"):
                where = ", ".join(u.format_node() or u.name for u in outside[:2])
                raise PassError(
                    f"{NAME}: dense code uses {node.name!r}, a {kind} value from the embedding side ({where}); only "
                    "tensors and ints can cross the sparse/dense boundary. Read tensors out of it in the model "
                    "(values(), lengths(), kt[key]) or keep the consuming function opaque"
                )
            name = _unique(graph_name(_boundary_name(gm, node)), used_names)
            with graph.inserting_after(node):
                if kind == "int":
                    as_tensor = graph.call_function(int_to_tensor, (node,))
                    with graph.inserting_after(as_tensor):
                        mark = graph.call_function(sparse_boundary, (as_tensor, name, "", "none"))
                    with graph.inserting_after(mark):
                        replacement = graph.call_function(tensor_to_int, (mark,))
                    as_tensor.meta.update(value_kind="tensor", example_shape=())
                    mark.meta.update(value_kind="tensor", example_shape=())
                else:
                    jagged_by, dim0 = _dim0(node, ctx)
                    mark = graph.call_function(sparse_boundary, (node, name, jagged_by, dim0))
                    mark.meta.update({k: v for k, v in node.meta.items() if k in ("value_kind", "example_shape",
                                                                                   "example_dtype", "max_shape")})
                    replacement = mark
            for user in outside:
                user.replace_input_with(node, replacement)
            marked.append(name)
        if not marked:
            raise PassError(f"{NAME}: no tensor leaves the embedding side for the dense part; nothing to split")
        ctx.add_stat("automatic_marks", marked)
        ctx.add_stat("sparse_region_nodes", len(region))
        return gm


def _merge_repeated_accessors(graph: torch.fx.Graph) -> int:
    """``emb["k"].values()`` written twice is one crossing tensor, not two: repeated accessor calls
    (getitem by a constant key, values()/lengths()/...) on the same node become one."""
    seen: dict[tuple[Any, ...], torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        is_getitem = node.op == "call_function" and node.target is operator.getitem
        is_accessor = node.op == "call_method" and node.target in ACCESSORS
        if not (is_getitem or is_accessor) or node.kwargs:
            continue
        try:
            key = (node.op, node.target, *node.args)
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return merged


def _sparse_region(graph: torch.fx.Graph, structured: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Structured nodes, their ancestors, and (to a fixed point) every node reading a structure or a
    container that came out of the region, with its ancestors."""
    region: set[torch.fx.Node] = set()
    _add_with_ancestors(region, structured)
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            if node in region or node.op in ("output", "placeholder"):
                continue
            if any(i in region and i.meta.get("value_kind") in CONTAINER_KINDS for i in node.all_input_nodes):
                _add_with_ancestors(region, {node})
                changed = True
    return region


def _add_with_ancestors(region: set[torch.fx.Node], roots: set[torch.fx.Node]) -> None:
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in region or node.op == "placeholder":
            continue
        region.add(node)
        stack.extend(node.all_input_nodes)


def _descendants(roots: set[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.users)
    return seen


def _boundary_name(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """``<embedding module>.<key>.<accessor>`` for an accessor chain on a lookup, else the node name."""
    parts: list[str] = []
    current: Any = node
    for _ in range(4):
        if not isinstance(current, torch.fx.Node):
            break
        if current.op == "call_module":
            parts.append(str(current.target))
            return ".".join(reversed(parts))
        if current.op == "call_method" and current.target in ACCESSORS and current.args:
            parts.append(str(current.target))
            current = current.args[0]
        elif current.op == "call_function" and getattr(current.target, "__name__", "") == "getitem" and len(current.args) == 2:
            parts.append(str(current.args[1]))
            current = current.args[0]
        else:
            break
    return node.name


def _unique(name: str, used: set[str]) -> str:
    candidate, i = name, 1
    while candidate in used:
        i += 1
        candidate = f"{name}_{i}"
    used.add(candidate)
    return candidate


def _dim0(node: torch.fx.Node, ctx: PassContext) -> tuple[str, str]:
    """(jagged_by, dim0) of a crossing tensor, told apart by its size on the example batch (whose batch
    size and per-feature totals are pairwise distinct)."""
    shape = node.meta.get("example_shape")
    if shape is None:
        return "", ""
    if len(shape) == 0:
        return "", "none"
    size = shape[0]
    batch = ctx.example_inputs
    schema = ctx.schema
    if schema is not None:
        batch_size = next((int(batch[f.graph_name].size(0)) for f in schema.features
                           if f.kind in ("lengths", "per_user") and f.graph_name in batch), None)
        for f in schema.lengths_features():
            if f.same_as or f.graph_name not in batch:
                continue
            if int(batch[f.graph_name].sum()) == size:
                return f.graph_name, ""
        if batch_size is not None and size == batch_size:
            return "", "batch"
        if batch_size is not None and size == batch_size + 1:
            return "", "batch+1"
    return "", ""
