"""mark_sparse_dense: find the sparse/dense boundary by itself and mark it with ``sparse_boundary``.

Models written for torchrec look their ids up in embedding modules (the default leaf list) and read
the results through torchrec's accessors: ``jt.values()``, ``jt.lengths()``, ``jt.offsets()``,
``kt["key"]``, ``kt.values()``, ``to_dict()``. The sparse region is every node that builds, holds or
reads such a structure (KeyedJaggedTensor, JaggedTensor, KeyedTensor, and containers of them, as
``observe_values`` saw them on the example batch) plus everything those nodes depend on. Every tensor
(or Python int) that leaves the region for dense code and depends on a lookup or a structure gets a
mark, named after its accessor chain back to the lookup (``<module>.<key>.values``, ``<module>.<key>`` for
``kt["key"]``, a regrouped KeyedTensor by its group's keys); values computed from the request
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
MAX_CHAIN = 6  # accessor steps followed back to a lookup
SIZE_METHODS = ("size", "dim", "numel")


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
            name = _unique(graph_name(_boundary_name(gm, node, lookups)), used_names)
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


def _boundary_name(gm: torch.fx.GraphModule, node: torch.fx.Node, lookups: list[torch.fx.Node]) -> str:
    """``<embedding module>.<key>.<accessor>`` along the accessor chain back to a lookup: ``kt["key"]``,
    ``values()``, ``to_dict()["key"]``; a group of a KeyedTensor regroup (``KeyedTensor.regroup_as_dict``,
    ``regroup``) is named by its keys. When the chain reaches something else (a KeyedTensor built in the
    model, a ``tile``), the lookups it comes from name it."""
    parts: list[str] = []
    current: Any = node
    sources: list[torch.fx.Node] | None = None  # where the lookups are looked for, when not ``current``
    for _ in range(MAX_CHAIN):
        if not isinstance(current, torch.fx.Node):
            return node.name
        if current.op == "call_module":
            return ".".join([str(current.target), *reversed(parts)])
        if current.op == "call_method" and current.target in ACCESSORS and current.args:
            parts.append(str(current.target))
            current = current.args[0]
            continue
        if not (current.op == "call_function" and current.target is operator.getitem and len(current.args) == 2):
            break
        base, key = current.args
        if not isinstance(base, torch.fx.Node):
            break
        groups = _regroup_keys(base)
        if groups is not None and isinstance(key, int) and -len(groups) <= key < len(groups):
            parts.append(_keys_name(groups[key]))
            # The lookups behind this group are those of the KeyedTensors holding its keys.
            sources = _holders(gm, base, groups[key])
            current = base
            break
        parts.append(str(key))
        current = base
    prefix = _lookup_path(sources or [current], lookups)
    if not prefix:
        return node.name
    return ".".join([prefix, *reversed(parts or [node.name])])


def _regroup_keys(node: torch.fx.Node) -> list[list[str]] | None:
    """The groups of a regroup call (KeyedTensors and a list of key lists in, one tensor per group out)."""
    if node.op != "call_function" or len(node.args) < 2:
        return None
    groups = node.args[1]
    if (isinstance(groups, (list, tuple)) and groups
            and all(isinstance(g, (list, tuple)) and g and all(isinstance(k, str) for k in g) for g in groups)):
        return [list(g) for g in groups]
    return None


def _holders(gm: torch.fx.GraphModule, regroup: torch.fx.Node, keys: list[str]) -> list[torch.fx.Node] | None:
    """The KeyedTensors given to ``regroup`` that hold one of ``keys`` (None when their keys are not known)."""
    inputs = regroup.args[0]
    if not isinstance(inputs, (list, tuple)):
        return None
    holders = []
    for kt in inputs:
        held = _kt_keys(gm, kt) if isinstance(kt, torch.fx.Node) else None
        if held is None:
            return None
        if set(held) & set(keys):
            holders.append(kt)
    return holders or None


def _kt_keys(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[str] | None:
    """The keys of a KeyedTensor: an EmbeddingBagCollection's features, or a KeyedTensor built with
    constant keys."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        configs = getattr(module, "embedding_bag_configs", None)
        return [f for c in configs() for f in c.feature_names] if callable(configs) else None
    keys = node.kwargs.get("keys", node.args[0] if node.op == "call_function" and node.args else None)
    if isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys):
        return list(keys)
    return None


def _keys_name(keys: list[str]) -> str:
    return "_".join(keys) if len(keys) <= 3 else f"{keys[0]}_and_{len(keys) - 1}_more"


def _lookup_path(nodes: list[torch.fx.Node], lookups: list[torch.fx.Node]) -> str:
    """The embedding module(s) whose values ``nodes`` read (sizes taken of a lookup do not count): one
    module's path, else the path they share, else their names joined."""
    ancestors: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        current = stack.pop()
        if current not in ancestors:
            ancestors.add(current)
            if not (current.op == "call_method" and current.target in SIZE_METHODS):
                stack.extend(current.all_input_nodes)
    paths = [str(n.target) for n in lookups if n in ancestors]
    if len(paths) <= 1:
        return paths[0] if paths else ""
    split = [p.split(".") for p in paths]
    shared = []
    for level in zip(*split):
        if len(set(level)) != 1:
            break
        shared.append(level[0])
    return ".".join(shared) if shared else "_".join(p[-1] for p in split)


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
