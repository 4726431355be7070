"""A layer's residual sum and the next layer's input norm as one kernel, rewritten in an exported program just
before AOTInductor compiles it (CUDA, the ``triton`` op target).

An HSTU layer ends with ``x + y @ W`` and the next begins with ``LN(x)``; the zoo writes the sum as an add,
generative-recommenders as ``addmm(x, y, W)``. Either way Inductor hands cuBLAS the residual as an addmm's 2-D
bias, and ATen's addmm first copies that bias into the output (a device copy of every row, a layer), while the
norm is a kernel of its own. Written as the unfused sum instead, Inductor recomputes the chain of sums in every
later norm (docs/PERF_INVESTIGATIONS.md). :func:`fuse_residual_norms` puts ``hstu_export::add_layer_norm_triton``
in place of the pair: the product a plain mm, then one kernel that writes the sum and its norm. The written zoo
delta program calls that kernel itself (hstu_export/kv_export.py); this gives it to every model's programs.

Matched on the exported graph's values (shapes, dtypes, devices): ``add(x, p)`` with ``p`` a matrix product, or
``addmm(x, a, b)`` with beta and alpha 1, where ``x`` is 2-D of the sum's shape and dtype, rows contiguous; then
``layer_norm`` over the last axis with a weight and a bias, on the sum or on its fp32 cast, whose result (cast
back to the sum's dtype where the norm ran in fp32) is what the graph reads. The kernel norms the sum as rounded,
in fp32, as those casts do; an addmm's sum rounds the product once more before the addition (within the
dtype's tolerance). Anything else is left as exported.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node

__all__ = ["fuse_residual_norms"]

_aten = torch.ops.aten
_PRODUCTS = (_aten.mm.default, _aten.matmul.default, _aten.linear.default)
_CASTS = (_aten.to.dtype, _aten._to_copy.default)
_ASSERT = _aten._assert_tensor_metadata.default


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _cast(node: Any) -> tuple[Node, torch.dtype] | None:
    """(source, dtype) of a dtype cast that changes nothing else (no device, layout or format)."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target in _CASTS):
        return None
    out = _val(node)
    if not isinstance(out, torch.Tensor) or set(node.kwargs) - {"dtype", "copy"} or not isinstance(node.args[0], Node):
        return None
    if node.target is _aten.to.dtype and (len(node.args) > 2 or node.kwargs.get("copy")):
        return None
    source = _val(node.args[0])
    if not isinstance(source, torch.Tensor) or source.device != out.device:
        return None
    return node.args[0], out.dtype


def _uncast(node: Any) -> Any:
    """The value ``node`` casts to its own dtype (repeatedly), or ``node``."""
    while (cast := _cast(node)) is not None and _val(cast[0]).dtype == cast[1]:
        node = cast[0]
    return node


def _readers(node: Node) -> list[Node]:
    return [u for u in node.users if u.target is not _ASSERT]


def _matrix(value: Any, like: torch.Tensor) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() == 2 and value.dtype == like.dtype
            and value.device == like.device and tuple(value.shape) == tuple(like.shape) and value.stride(-1) == 1)


def _sum(node: Node) -> tuple[Node, Node | tuple[Node, Node]] | None:
    """(x, product) of ``x + product`` or ``addmm(x, a, b)`` (product then ``(a, b)``), x a residual matrix."""
    out = _val(node)
    if node.op != "call_function" or not isinstance(out, torch.Tensor) or out.dim() != 2:
        return None
    if node.target is _aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        for x, p in (node.args, node.args[::-1]):
            if isinstance(p, Node) and p.target in _PRODUCTS and _matrix(_val(p), out) and _matrix(_val(x), out):
                return x, p
    if node.target is _aten.addmm.default and len(node.args) == 3 and not node.kwargs and _matrix(_val(node.args[0]), out):
        x, a, b = node.args
        if all(isinstance(_val(t), torch.Tensor) and _val(t).dtype == out.dtype for t in (a, b)):
            return x, (a, b)
    return None


def _defined_before(graph: Graph, nodes: list[Node], anchor: Node) -> bool:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return all(order[n] < order[anchor] for n in nodes)


def _match(graph: Graph, norm: Node) -> dict[str, Any] | None:
    args = list(norm.args) + [None] * (6 - len(norm.args))
    source, shape, weight, bias = args[0], args[1], args[2], args[3]
    eps = norm.kwargs.get("eps", args[4] if args[4] is not None else 1e-5)
    if not isinstance(source, Node) or not isinstance(weight, Node) or not isinstance(bias, Node):
        return None
    upcast = _cast(source)
    total = _uncast(upcast[0] if upcast is not None else source)
    found = _sum(total) if isinstance(total, Node) else None
    value = _val(total)
    if found is None or not isinstance(eps, float) or list(shape or ()) != [value.shape[-1]]:
        return None
    if upcast is not None and upcast[1] != torch.float32 and upcast[1] != value.dtype:
        return None
    # What the graph reads of the norm: its result in the sum's dtype (the casts back from fp32, or the norm).
    outputs = [norm] if _val(norm).dtype == value.dtype else _readers(norm)
    if not outputs or any(o is not norm and (_cast(o) is None or _cast(o)[1] != value.dtype) for o in outputs):
        return None
    # The norm's parameters as the graph holds them (the kernel reads them in fp32 itself): defined before the sum.
    weight, bias = _uncast_all(weight), _uncast_all(bias)
    d = value.shape[-1]
    if not all(isinstance(_val(p), torch.Tensor) and tuple(_val(p).shape) == (d,) and _val(p).is_floating_point()
               for p in (weight, bias)) or not _defined_before(graph, [weight, bias], total):
        return None
    return {"sum": total, "x": found[0], "product": found[1], "weight": weight, "bias": bias, "eps": eps,
            "outputs": outputs, "norm": norm}


def _uncast_all(node: Node) -> Node:
    """The value ``node`` casts to fp32 or to its own dtype (repeatedly): what the kernel reads in fp32 itself."""
    while (cast := _cast(node)) is not None and cast[1] in (torch.float32, _val(cast[0]).dtype):
        node = cast[0]
    return node


def _fake_mode(graph: Graph) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode([_val(n) for n in graph.nodes if isinstance(_val(n), torch.Tensor)])


def fuse_residual_norms(program: ExportedProgram, *, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Rewrites ``program`` in place (see the module's text); returns how many pairs became one kernel. Only
    values on ``devices``: the kernel is Triton's, and a CPU program keeps Inductor's own."""
    import hstu_export.ops._triton  # noqa: F401  (registers hstu_export::add_layer_norm_triton)

    gm = program.graph_module
    graph = gm.graph
    fused = 0
    for norm in [n for n in graph.nodes if n.op == "call_function" and n.target is _aten.layer_norm.default]:
        found = _match(graph, norm)
        if found is None or _val(found["sum"]).device.type not in devices:
            continue
        total: Node = found["sum"]
        product, anchor = found["product"], total
        if isinstance(product, tuple):  # addmm(x, a, b): the product alone, the sum in the kernel
            with graph.inserting_after(total):
                anchor = product = graph.call_function(_aten.mm.default, product)
            with _fake_mode(graph) or contextlib.nullcontext():
                product.meta["val"] = _aten.mm.default(*(_val(t) for t in found["product"]))
        with graph.inserting_after(anchor):  # after the sum: what the sum reads, and the norm's parameters, are
            call = graph.call_function(torch.ops.hstu_export.add_layer_norm_triton.default,
                                       (found["x"], product, found["weight"], found["bias"], found["eps"]))
        with graph.inserting_after(call):
            new_sum = graph.call_function(operator.getitem, (call, 0))
        with graph.inserting_after(new_sum):
            normed = graph.call_function(operator.getitem, (call, 1))
        out_val = _val(found["outputs"][0])
        new_sum.meta["val"], normed.meta["val"] = _val(total), out_val
        call.meta["val"] = (_val(total), out_val)
        for meta in (call.meta, new_sum.meta, normed.meta):
            meta.update({k: v for k, v in total.meta.items() if k in ("stack_trace", "nn_module_stack")})
        renamed = {}
        for out in found["outputs"]:
            out.replace_all_uses_with(normed)
            renamed[out.name] = normed.name
        total.replace_all_uses_with(new_sum)
        _drop_unread(graph, [*found["outputs"], found["norm"], total])
        _rename_outputs(program, renamed)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def _drop_unread(graph: Graph, nodes: list[Node]) -> None:
    """Erases ``nodes`` and the casts and metadata asserts only they read, where nothing else reads them."""
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if getattr(node, "_erased", False) or node.op != "call_function" or _readers(node):
            continue
        for check in [u for u in node.users if u.target is _ASSERT]:
            graph.erase_node(check)
        inputs = node.all_input_nodes
        graph.erase_node(node)
        pending.extend(n for n in inputs if n.op == "call_function" and (n.target in _CASTS or n.target is _aten.layer_norm.default))


def _rename_outputs(program: ExportedProgram, renamed: dict[str, str]) -> None:
    """The signature's output names follow a replaced output node."""
    from torch.export.graph_signature import TensorArgument

    for spec in program.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            spec.arg = TensorArgument(name=renamed[spec.arg.name])
