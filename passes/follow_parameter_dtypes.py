"""follow_parameter_dtypes: in a reduced-precision export, a layer's floating inputs take its parameters' dtype.

Models trained under autocast (generative-recommenders' DlrmHSTU in bf16) mix dtypes: a tensor made in fp32 in
the model's code (a feature cast with ``.float()``, ``torch.zeros`` of the default dtype) meets a layer whose
weights are bf16 once the model is exported with ``--dtype bf16``, and ``linear`` refuses the pair. Autocast
casts such inputs down when it runs; this pass does it in the graph: before every call of a module with
floating parameters (``Linear``, ``LayerNorm``, a user's norm layer kept as a leaf) and every product or norm
that takes a parameter (``addmm``, ``linear``, ``matmul``, ``layer_norm``, ...), each floating input is cast to
that parameter's dtype (``to_dtype_of``, a no-op where they already match). The jagged concatenations
(``concat_2D_jagged`` after map_ops), which join rows of one dtype only, take their floating inputs in the
export dtype: a table's fp32 rows beside a layer's bf16 output. Everything else keeps the dtype the model's
code gives it, as under autocast.

Runs only when the export dtype is not fp32 (``ctx.export_dtype``): an fp32 export is traced and compiled
in fp32 throughout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.nn.functional as F

from hstu_export.capture.graph_functions import to_dtype_of, to_floating_dtype
from hstu_export.settings import TORCH_DTYPES

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

# Products and norms that take a weight: their floating inputs follow it.
WEIGHTED_FUNCTIONS = {
    torch.addmm, torch.mm, torch.matmul, torch.bmm, torch.baddbmm, torch.einsum, F.linear, F.layer_norm,
    torch.layer_norm, F.group_norm, F.embedding_bag, torch.nn.functional.bilinear,
}
WEIGHTED_METHODS = {"addmm", "mm", "matmul", "bmm", "baddbmm"}


def _maybe_floating(node: Any) -> bool:
    """A graph value that may be a floating tensor. Nodes made by earlier passes (a mapped op's outputs) carry
    no observed dtype; ``to_dtype_of`` leaves a value of another kind as it is when it runs."""
    if not isinstance(node, torch.fx.Node) or node.meta.get("value_kind", "tensor") != "tensor":
        return False
    return str(node.meta.get("example_dtype", "float32")) in ("float32", "float64", "float16", "bfloat16")


def _parameter_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    """The qualified name of a floating parameter (or buffer) ``node`` uses: the called module's first, or a
    ``get_attr`` argument of a weighted function."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if tensor.is_floating_point():
                return f"{node.target}.{name}"
        return None
    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            owner, _, attr = str(arg.target).rpartition(".")
            tensor = getattr(gm.get_submodule(owner) if owner else gm, attr, None)
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                return str(arg.target)
    return None


def _weighted(node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return True
    if node.op == "call_function":
        return node.target in WEIGHTED_FUNCTIONS
    return node.op == "call_method" and node.target in WEIGHTED_METHODS


def _cast_input(gm: torch.fx.GraphModule, node: torch.fx.Node, value: torch.fx.Node, cast: Any, to: Any) -> None:
    """``node`` takes ``cast(value, to)`` in place of ``value``."""
    with gm.graph.inserting_before(node):
        cast_node = gm.graph.call_function(cast, (value, to))
    cast_node.meta.update({k: v for k, v in value.meta.items() if k in ("value_kind", "example_shape", "max_shape")})
    node.replace_input_with(value, cast_node)


def _joins_rows(node: torch.fx.Node) -> bool:
    """A mapped jagged concatenation (any op target's variant)."""
    return node.op == "call_function" and "concat_2D_jagged" in str(node.target)


class FollowParameterDtypes:
    name = "follow_parameter_dtypes"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        if ctx.export_dtype in ("float32", "fp32"):
            return gm
        casts = 0
        export_dtype = TORCH_DTYPES[ctx.export_dtype]
        for node in list(gm.graph.nodes):
            if _joins_rows(node):
                for value in dict.fromkeys(a for a in node.args if _maybe_floating(a)):
                    _cast_input(gm, node, value, to_floating_dtype, export_dtype)
                    casts += 1
                continue
            if not _weighted(node):
                continue
            parameter = _parameter_of(gm, node)
            if parameter is None:
                continue
            inputs = [a for a in (*node.args, *node.kwargs.values()) if _maybe_floating(a)
                      and not (a.op == "get_attr" and str(a.target) == parameter)]
            if not inputs:
                continue
            with gm.graph.inserting_before(node):
                weight = gm.graph.get_attr(parameter)
            for value in dict.fromkeys(inputs):
                _cast_input(gm, node, value, to_dtype_of, weight)
                casts += 1
        ctx.add_stat("casts", casts)
        return gm

