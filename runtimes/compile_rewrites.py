"""Rewrites of a graph made on its copy just before AOTInductor compiles it (``graph_io.export_ready``): the
same values, in fewer kernels a call. They run after every pass and the KV derivation, which read the graph as
the passes left it (``prove_length_reads`` and ``kv_derive`` recognise offsets written as a padded running sum).

- :func:`fold_parameter_work`: what a graph computes from its parameters and buffers alone is computed once,
  here, and read as a buffer. AOTInductor takes parameters as inputs and folds nothing, so a model that casts
  its weights where it uses them casts them on every call: generative-recommenders' layers hand each output
  norm's weight and bias to the norm in fp32, which in a bf16 export is ten cast kernels a call, each on its
  own because our gated op reads them (its cached program on an H100: 12 µs a call at 1 user,
  ``benchmarks/results/h100_compile_rewrites/gr_before/``; none in ``h100_compile_rewrites/``). A cast whose
  dtype the graph reads from an activation (``weight.to(x.dtype)``) is not folded: the dtype is known only once
  the graph runs, and its uncached program has ten such casts.
- :func:`offsets_in_one_scan`: offsets written as a running sum padded with a leading zero
  (``pad(cumsum(lengths), (1, 0))``, fbgemm's complete cumsum as mapped) become the running sum of the padded
  lengths, which Inductor computes in the scan's own kernel: the pad was a kernel of its own after each scan
  (the same program: 7 a call). Identical running sums are computed once.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

from hstu_export.capture.graph_functions import to_dtype_of, to_floating_dtype

__all__ = ["FOLDED_AT_MOST_BYTES", "fold_parameter_work", "offsets", "offsets_in_one_scan"]

# Results larger than this are left to the call: a cast of a large weight beside the weight would store both.
FOLDED_AT_MOST_BYTES = 16 << 20

# Calls whose result depends on their arguments alone (no randomness, no state, no writes to an argument).
_PURE_METHODS = frozenset({
    "to", "float", "half", "bfloat16", "double", "type", "t", "transpose", "permute", "view", "reshape", "expand",
    "unsqueeze", "squeeze", "flatten", "contiguous", "clone", "detach", "neg", "add", "sub", "mul", "div",
    "__getitem__", "__add__", "__sub__", "__mul__", "__truediv__", "__neg__"})
_PURE_FUNCTIONS = frozenset({
    torch.transpose, torch.t, torch.permute, torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten,
    torch.cat, torch.stack, torch.neg, torch.add, torch.sub, torch.mul, torch.div, operator.add, operator.sub,
    operator.mul, operator.truediv, operator.neg, operator.getitem, F.pad, to_dtype_of, to_floating_dtype})


def _attribute(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _pure(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _PURE_METHODS
    return node.op == "call_function" and node.target in _PURE_FUNCTIONS


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, Tensor) and t.device.type != "meta"}


def fold_parameter_work(gm: GraphModule) -> list[str]:
    """Computes, on ``gm``'s own parameters and buffers, each pure call that reads nothing else (a cast, a
    view, arithmetic between them), and makes each such result a later call reads a buffer of ``gm`` read by
    ``get_attr`` in its place; returns the names of the calls folded. Left to the call: results that share a
    parameter's memory (a cast to the dtype it has, a transpose: no kernel runs for them), results that are not
    dense in memory (an ``expand``: what it reads is folded instead) and results over
    :data:`FOLDED_AT_MOST_BYTES`. The calls that only folded work read are removed."""
    values: dict[Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attribute(gm, str(node.target))
            if isinstance(value, Tensor):
                values[node] = value
        elif _pure(node) and node.all_input_nodes and all(a in values for a in node.all_input_nodes):
            args = torch.fx.node.map_arg(node.args, lambda a: values[a])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: values[a])
            try:
                with torch.no_grad():
                    values[node] = (getattr(args[0], str(node.target))(*args[1:], **kwargs)
                                    if node.op == "call_method" else node.target(*args, **kwargs))  # type: ignore[operator]
            except Exception:  # not computable here (a method the value lacks): left to the call, as written
                continue
    held = _storages([*gm.parameters(), *gm.buffers()])
    folded: list[str] = []
    stays: set[Node] = set()  # parameter work left to the call (a view of a parameter, a result not dense)
    for node in reversed(list(values)):  # users first: a result read only by folded work is not needed
        read_by = [u for u in node.users if u not in values or u in stays]
        if node.op == "get_attr" or not read_by:
            continue
        value = values[node]
        if (not isinstance(value, Tensor) or value.untyped_storage().data_ptr() in held
                or value.nbytes > FOLDED_AT_MOST_BYTES or not _dense(value)):
            stays.add(node)
            continue
        name = _free_name(gm, "folded_" + node.name)
        gm.register_buffer(name, value.detach().clone(), persistent=True)
        with gm.graph.inserting_before(node):
            read = gm.graph.get_attr(name)
        read.meta.update(node.meta)
        for user in read_by:
            user.replace_input_with(node, read)
        folded.append(node.name)
    for node in reversed(list(values)):  # the folded work, now read by nothing (pure by construction)
        if not node.users:
            gm.graph.erase_node(node)
    if folded:
        gm.recompile()
    return folded


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill the memory they span once each, in some order of its dims (no ``expand``)."""
    if t.numel() == 0:
        return True
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
        return False
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) == t.numel()


def _free_name(gm: GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


def offsets(lengths: Tensor, dim: int, dtype: torch.dtype | None) -> Tensor:
    """``pad(cumsum(lengths, dim, dtype), (1, 0))``, computed for 1-D lengths as the running sum of the lengths
    after a leading zero: the same values (the zero adds nothing to any sum), one scan."""
    if lengths.dim() == 1 and dim in (0, -1):
        return torch.cumsum(F.pad(lengths, (1, 0)), 0, dtype=dtype)
    return F.pad(torch.cumsum(lengths, dim, dtype=dtype), (1, 0))


def _running_sum(node: Node) -> tuple[Node, Any, Any] | None:
    """(lengths, dim, dtype) of a ``torch.cumsum`` call (function or method) with a constant dim, else None."""
    if not ((node.op == "call_function" and node.target is torch.cumsum)
            or (node.op == "call_method" and node.target == "cumsum")) or set(node.kwargs) - {"input", "dim", "dtype"}:
        return None
    args = {**dict(zip(("input", "dim"), node.args)), **node.kwargs}
    if not isinstance(args.get("input"), Node) or not isinstance(args.get("dim"), int):
        return None
    return args["input"], args["dim"], args.get("dtype")


def _padded_in_front(node: Node) -> Node | None:
    """The tensor ``node`` pads with one zero in front of its last dim (``F.pad(x, (1, 0))``), else None."""
    if node.op != "call_function" or node.target is not F.pad:
        return None
    args = dict(zip(("input", "pad", "mode", "value"), node.args))
    args.update(node.kwargs)
    if set(args) - {"input", "pad", "mode", "value"} or tuple(args.get("pad", ())) != (1, 0):
        return None
    if args.get("mode", "constant") != "constant" or args.get("value") not in (None, 0, 0.0):
        return None
    return args["input"] if isinstance(args["input"], Node) else None


def offsets_in_one_scan(graph: Graph) -> int:
    """Each ``pad(cumsum(lengths, dim, dtype), (1, 0))`` in ``graph`` as one :func:`offsets` call, the same
    call once for the same (lengths, dim, dtype); returns how many pads were rewritten."""
    made: dict[tuple[Node, Any, Any], Node] = {}
    rewritten = 0
    for node in list(graph.nodes):
        source = _padded_in_front(node)
        key = _running_sum(source) if source is not None else None
        if source is None or key is None:
            continue
        if key not in made:
            with graph.inserting_before(node):
                made[key] = graph.call_function(offsets, key)
            made[key].meta.update(node.meta)
        node.replace_all_uses_with(made[key])
        graph.erase_node(node)
        if not source.users:
            graph.erase_node(source)
        rewritten += 1
    return rewritten
