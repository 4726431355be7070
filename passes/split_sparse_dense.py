"""split_sparse_dense: cut the model at its ``sparse_boundary`` marks into a sparse and a dense graph.

- sparse = everything the (used) marks depend on: model inputs → ``{mark name: tensor}``;
- dense = everything the outputs depend on, stopping at marks (each becomes a dense input named by the
  mark) and at model inputs (passed straight through, e.g. lengths and timestamps).
Nodes both sides need (cheap index arithmetic) are computed on both. The pass returns a graph module
that calls ``sparse`` then ``dense``, so it still computes the model and later passes rewrite both
halves; each half holds only the parameters and submodules it references. ``ctx.boundary`` gets the
``BoundarySchema`` (names, dtypes, symbolic shapes), measured by running both halves on the example.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import Tensor, nn
from torch.fx.passes.shape_prop import ShapeProp

from hstu_export.capture import module_matches
from hstu_export.capture.graph_functions import sparse_boundary
from hstu_export.errors import PassError
from hstu_export.passes.boundary import (
    BATCH_DIM,
    DENSE,
    SPARSE,
    BoundarySchema,
    BoundaryTensor,
    jagged_total_dim,
)

if TYPE_CHECKING:
    from hstu_export.package.schema import InputSchema
    from hstu_export.passes.context import PassContext

NAME = "split_sparse_dense"


class SplitSparseDense:
    name = NAME
    recursive = False  # cuts the top graph only

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        graph = gm.graph
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        marks = [n for n in graph.nodes if n.op == "call_function" and n.target is sparse_boundary]
        if not marks:
            raise PassError(
                f"{NAME}: the graph has no sparse_boundary marks; wrap every embedding tensor the dense part "
                "uses with hstu_export.capture.graph_functions.sparse_boundary(value, name, jagged_by)"
            )
        mark_info = {m: _mark_args(m) for m in marks}
        _check_mark_names(mark_info, [str(n.target) for n in inputs])

        dense_nodes, used_marks, dense_inputs = _closure([output], stop_at=set(marks))
        _check_no_embedding_module(gm, dense_nodes, ctx.embedding_modules)
        if not used_marks:
            raise PassError(f"{NAME}: no sparse_boundary mark reaches the model outputs; nothing to split")
        sparse_nodes, _, sparse_inputs = _closure(list(used_marks), stop_at=set())
        order = {n: i for i, n in enumerate(graph.nodes)}
        used = sorted(used_marks, key=order.__getitem__)
        sparse_in = [n for n in inputs if n in sparse_inputs]
        dense_in = [n for n in inputs if n in dense_inputs]
        unused = [mark_info[m][1] for m in marks if m not in used_marks]
        if unused:
            ctx.add_stat("unused_marks", unused)

        sparse_graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {n: _placeholder(sparse_graph, str(n.target), n) for n in sparse_in}
        for node in graph.nodes:
            if node in sparse_nodes and node.op != "placeholder":
                env[node] = sparse_graph.node_copy(node, env.__getitem__)
        sparse_graph.output({mark_info[m][1]: env[m] for m in used})

        dense_graph = torch.fx.Graph()
        env = {m: _placeholder(dense_graph, mark_info[m][1], m) for m in used}
        env.update({n: _placeholder(dense_graph, str(n.target), n) for n in dense_in})
        for node in graph.nodes:
            if node in dense_nodes and node.op != "output":
                env[node] = dense_graph.node_copy(node, env.__getitem__)
        dense_graph.output(torch.fx.map_arg(output.args[0], env.__getitem__))

        sparse_gm = torch.fx.GraphModule(gm, sparse_graph, class_name="SparseGraph")
        dense_gm = torch.fx.GraphModule(gm, dense_graph, class_name="DenseGraph")

        top = torch.fx.Graph()
        features = {str(n.target): _placeholder(top, str(n.target), n) for n in inputs}
        sparse_call = top.call_module(SPARSE, kwargs={str(n.target): features[str(n.target)] for n in sparse_in})
        dense_kwargs: dict[str, Any] = {
            mark_info[m][1]: top.call_function(operator.getitem, (sparse_call, mark_info[m][1])) for m in used
        }
        dense_kwargs.update({str(n.target): features[str(n.target)] for n in dense_in})
        top.output(top.call_module(DENSE, kwargs=dense_kwargs))
        root = nn.Module()
        root.add_module(SPARSE, sparse_gm)
        root.add_module(DENSE, dense_gm)
        split = torch.fx.GraphModule(root, top, class_name=type(gm).__name__)
        split.meta.update(gm.meta)

        ctx.boundary = _boundary_schema(sparse_gm, dense_gm, used, mark_info, sparse_in, dense_in, ctx)
        ctx.add_stat("boundary_tensors", len(used))
        ctx.add_stat("passthrough_inputs", [str(n.target) for n in dense_in])
        ctx.add_stat("sparse_nodes", len(sparse_graph.nodes))
        ctx.add_stat("dense_nodes", len(dense_graph.nodes))
        shared = sorted(n.name for n in sparse_nodes & dense_nodes if n.op != "placeholder")
        if shared:
            ctx.add_stat("computed_on_both_sides", shared)
        return split


def _mark_args(node: torch.fx.Node) -> tuple[torch.fx.Node, str, str, str]:
    values = dict(zip(("value", "name", "jagged_by", "dim0"), node.args))
    values.update(node.kwargs)
    name, jagged_by, dim0 = values.get("name"), values.get("jagged_by", ""), values.get("dim0", "")
    if (not isinstance(name, str) or not isinstance(jagged_by, str) or not isinstance(dim0, str)
            or not isinstance(values.get("value"), torch.fx.Node)):
        raise PassError(f"{NAME}: sparse_boundary mark {node.name!r} needs a tensor and constant string name/jagged_by")
    return values["value"], name, jagged_by, dim0  # type: ignore[return-value]


def _check_mark_names(mark_info: dict[torch.fx.Node, tuple[Any, str, str, str]], input_names: list[str]) -> None:
    seen: dict[str, torch.fx.Node] = {}
    for mark, (_, name, jagged_by, _dim0) in mark_info.items():
        if not name.isidentifier():
            raise PassError(f"{NAME}: sparse_boundary name {name!r} is not a Python identifier")
        if name in input_names:
            raise PassError(f"{NAME}: sparse_boundary name {name!r} is also a model input name; rename the mark")
        if name in seen:
            raise PassError(f"{NAME}: two sparse_boundary marks are both named {name!r}")
        if jagged_by and jagged_by not in input_names:
            raise PassError(
                f"{NAME}: mark {name!r} is jagged by {jagged_by!r}, which is not a model input ({input_names})"
            )
        seen[name] = mark


def _closure(
    roots: list[torch.fx.Node], stop_at: set[torch.fx.Node]
) -> tuple[set[torch.fx.Node], set[torch.fx.Node], set[torch.fx.Node]]:
    """(nodes ``roots`` depend on, marks in ``stop_at`` reached, placeholders reached). Traversal stops
    at ``stop_at`` nodes and placeholders; both are left out of the first set except roots."""
    nodes: set[torch.fx.Node] = set()
    stopped: set[torch.fx.Node] = set()
    placeholders: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in nodes:
            continue
        if node in stop_at:
            stopped.add(node)
            continue
        if node.op == "placeholder":
            placeholders.add(node)
            continue
        nodes.add(node)
        stack.extend(node.all_input_nodes)
    return nodes, stopped, placeholders


def _check_no_embedding_module(gm: torch.fx.GraphModule, dense_nodes: set[torch.fx.Node], classes: tuple[str, ...]) -> None:
    embedding_paths = [p for p, m in gm.named_modules() if p and module_matches(m, p, classes)]
    for node in dense_nodes:
        target = str(node.target)
        if node.op not in ("call_module", "get_attr"):
            continue
        owner = next((p for p in embedding_paths if target == p or target.startswith(p + ".")), None)
        if owner is not None:
            cls = type(gm.get_submodule(owner)).__name__
            raise PassError(
                f"{NAME}: the output of embedding module '{owner}' ({cls}) reaches the dense side without a "
                f"sparse_boundary mark (via node {node.name!r}); wrap each embedding tensor the dense part uses "
                "with hstu_export.capture.graph_functions.sparse_boundary(value, name, jagged_by)"
            )


def _placeholder(graph: torch.fx.Graph, name: str, like: torch.fx.Node) -> torch.fx.Node:
    node = graph.placeholder(name)
    if node.name != name:
        raise PassError(f"{NAME}: {name!r} cannot be a graph input name (it shadows a Python builtin)")
    if "tensor_meta" in like.meta:
        node.meta["tensor_meta"] = like.meta["tensor_meta"]
    return node


def _boundary_schema(
    sparse_gm: torch.fx.GraphModule,
    dense_gm: torch.fx.GraphModule,
    marks: list[torch.fx.Node],
    mark_info: dict[torch.fx.Node, tuple[Any, str, str, str]],
    sparse_in: list[torch.fx.Node],
    dense_in: list[torch.fx.Node],
    ctx: PassContext,
) -> BoundarySchema:
    batch = ctx.example_inputs
    sparse_args = {str(n.target): batch[str(n.target)] for n in sparse_in}
    with torch.no_grad():
        sparse_out = ShapeProp(sparse_gm).propagate(*sparse_args.values())
        dense_args = {**sparse_out, **{str(n.target): batch[str(n.target)] for n in dense_in}}
        dense_out = ShapeProp(dense_gm).propagate(*dense_args.values())
    batch_size = _batch_size(batch, ctx.schema)

    boundary = []
    for mark in marks:
        source, name, jagged_by, dim0_given = mark_info[mark]
        value = sparse_out[name]
        if not isinstance(value, Tensor):
            raise PassError(f"{NAME}: mark {name!r} must carry a tensor, got {type(value).__name__}")
        if dim0_given == "none":
            if value.dim() != 0:
                raise PassError(f"{NAME}: mark {name!r} is declared 0-d but has shape {list(value.shape)}")
            boundary.append(BoundaryTensor(name, _dtype(value), (), "", "sparse"))
            continue
        if value.dim() == 0:
            raise PassError(f"{NAME}: mark {name!r} must carry a tensor with a batch or jagged dim 0")
        max_dim0 = None
        if jagged_by:
            expected, dim0 = int(batch[jagged_by].sum()), jagged_total_dim(jagged_by)
        elif dim0_given in ("", BATCH_DIM):
            expected, dim0 = batch_size, BATCH_DIM
        elif dim0_given == f"{BATCH_DIM}+1":
            expected, dim0 = (batch_size + 1 if batch_size is not None else None), dim0_given
        else:  # a size of its own: its range is what the model produced at the export's maxima
            expected, dim0 = None, dim0_given or f"{name}.size0"
            max_dim0 = max((source.meta.get("max_shape") or value.shape)[0], value.size(0))
        if expected is not None and value.size(0) != expected:
            what = "sum(" + jagged_by + ")" if jagged_by else "the batch size" + (" + 1" if dim0.endswith("+1") else "")
            raise PassError(
                f"{NAME}: mark {name!r} has {value.size(0)} rows on the example batch but {what} is {expected}; "
                "fix its jagged_by"
            )
        boundary.append(BoundaryTensor(name, _dtype(value), (dim0, *value.shape[1:]), jagged_by, "sparse",
                                       max_dim0=max_dim0))
    passthrough = [_input_tensor(str(n.target), batch, ctx.schema) for n in dense_in]
    outputs = tuple(dense_out) if isinstance(dense_out, dict) else ()
    return BoundarySchema(
        sparse_inputs=tuple(_input_tensor(str(n.target), batch, ctx.schema) for n in sparse_in),
        dense_inputs=(*boundary, *passthrough),
        output_names=outputs,
    )


def _batch_size(batch: dict[str, Tensor], schema: InputSchema | None) -> int | None:
    if schema is None:
        return None
    for f in schema.features:
        if f.kind in ("lengths", "per_user") and f.graph_name in batch:
            return int(batch[f.graph_name].size(0))
    return None


def _input_tensor(name: str, batch: dict[str, Tensor], schema: InputSchema | None) -> BoundaryTensor:
    """A graph input (a request feature, by graph name) as the dense or sparse graph takes it."""
    value = batch[name]
    spec = None
    if schema is not None and name in schema.graph_names:
        spec = schema.get(name)
    if spec is not None and spec.kind == "jagged" and spec.jagged_by:
        jagged_by = schema.get(schema.canonical_lengths(spec.jagged_by)).graph_name  # type: ignore[union-attr]
        dim0: int | str = jagged_total_dim(jagged_by)
    elif spec is not None:
        dim0, jagged_by = BATCH_DIM, ""
    else:  # no schema: dim 0 is dynamic but unnamed by the model
        dim0, jagged_by = f"{name}.size0", ""
    shape = (dim0, *value.shape[1:]) if value.dim() else ()
    return BoundaryTensor(name, _dtype(value), shape, jagged_by, "input")


def _dtype(value: Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")
