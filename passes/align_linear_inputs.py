"""align_linear_inputs: on CUDA, a ``Linear`` whose input width is not a multiple of 16 bytes reads its input
padded with zero columns.

cuBLAS picks its fast kernels only where a matrix's rows start on 16-byte boundaries. A ``Linear(1025, 512)``
(two 512-wide embeddings and a timestamp, a common way to add a scalar feature) or generative-recommenders'
``Linear(516, 512)`` (its output postprocessor's time features) fails that in bf16, and cuBLAS falls back to
kernels of an older generation that run at a fraction of the rate: on an H200 the TorchEasyRec-style test
model's 36,496-row history projection took about 0.36 ms, 107 TFLOP/s (docs/PERF.md).

Here each such module becomes an :class:`AlignedLinear`: its weight gets zero columns up to the next multiple
(8 elements in bf16 or fp16, 4 in fp32), and its forward pads the input with as many zeros before the product.
The products and sums are the model's own plus ``0 * 0`` terms, so the answer is the same up to the order in
which a kernel adds; the padding is one more elementwise step, which the compiler can fuse with the producer
of the input (a concatenation, a cast). Inductor has a pass of its own that pads products (``shape_padding``);
our compiles leave it off because it narrows the batch ranges a program is compiled for (docs/PERF.md, "CUDA
correctness"): this pass pads only a weight's own width, which no request changes.

Runs only for CUDA exports (``ctx.export_device``); ``AlignedLinear`` is a ``Linear``, so the KV delta
derivation treats it as a row-local layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from hstu_export.capture.graph_functions import to_dtype_of
from hstu_export.settings import TORCH_DTYPES

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

__all__ = ["AlignLinearInputs", "AlignedLinear", "align_linear_inputs", "alignment"]

ALIGNMENT_BYTES = 16  # what cuBLAS's tensor-core kernels want of a row's start


class AlignedLinear(nn.Linear):
    """``Linear(in_features, out)`` computed as ``Linear(in_features + pad, out)`` on its input padded with
    ``pad`` zero columns (the weight's extra columns are zeros)."""

    def __init__(self, source: nn.Linear, pad: int) -> None:
        weight = source.weight
        super().__init__(source.in_features + pad, source.out_features, bias=source.bias is not None,
                         device=weight.device, dtype=weight.dtype)
        self.pad = int(pad)
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:, :source.in_features].copy_(weight)
            if self.bias is not None and source.bias is not None:
                self.bias.copy_(source.bias)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(F.pad(input, [0, self.pad]), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, zero columns={self.pad}"


def alignment(dtype: str) -> int:
    """Elements in 16 bytes of ``dtype`` (an export dtype's name)."""
    return max(1, ALIGNMENT_BYTES // TORCH_DTYPES[dtype].itemsize)


class AlignLinearInputs:
    name = "align_linear_inputs"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        if ctx.export_device != "cuda":
            ctx.add_stat("skipped", f"a {ctx.export_device} export (cuBLAS's alignment only)")
            return gm
        aligned = align_linear_inputs(gm, alignment(ctx.export_dtype))
        ctx.add_stat("aligned", len(aligned))
        if aligned:
            ctx.add_stat("modules", [f"{name}: {width} -> {padded}" for name, (width, padded) in aligned.items()])
        return gm


def align_linear_inputs(gm: torch.fx.GraphModule, multiple: int) -> dict[str, tuple[int, int]]:
    """Each ``nn.Linear`` module ``gm.graph`` calls whose ``in_features`` is not a multiple of ``multiple``
    replaced, at its path in ``gm``, by an :class:`AlignedLinear` copy; returns {module path: (in features,
    padded)}. The replacement goes into ``gm``'s own container: a GraphModule holds copies of the model's
    containers and the model's leaf modules themselves, so the user's model (the verification's reference)
    keeps its module. A module whose parameters the graph also reads by ``get_attr`` for anything but their
    dtype or device (``to_dtype_of``, follow_parameter_dtypes' casts; ``weight.dtype`` in the model's own
    code) is left as it is: those reads expect its shape."""
    reads_of: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            reads_of.setdefault(str(n.target), []).append(n)
    aligned: dict[str, tuple[int, int]] = {}
    for node in gm.graph.nodes:
        path = str(node.target)
        if node.op != "call_module" or path in aligned:
            continue
        module = gm.get_submodule(path)
        if type(module) is not nn.Linear or module.in_features % multiple == 0:
            continue
        reads = [n for name, nodes in reads_of.items() if name.startswith(path + ".") for n in nodes]
        if not all(_reads_dtype_or_device(n, user) for n in reads for user in n.users):
            continue
        pad = -module.in_features % multiple
        owner, _, attr = path.rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, attr, AlignedLinear(module, pad))
        aligned[path] = (module.in_features, module.in_features + pad)
    if aligned:
        gm.recompile()
    return aligned


def _reads_dtype_or_device(read: torch.fx.Node, user: torch.fx.Node) -> bool:
    """Whether ``user`` takes of the parameter ``read`` only what padding keeps: its dtype, as the reference of a
    ``to_dtype_of`` cast, or its ``.dtype`` / ``.device`` attribute (generative-recommenders casts to its
    combiner's weight dtype)."""
    if user.op != "call_function":
        return False
    if user.target is to_dtype_of:
        value = user.args[0] if user.args else user.kwargs.get("value")
        return value is not read  # the cast's reference, not the value cast
    return user.target is getattr and user.args[:1] == (read,) and user.args[1:] in (("dtype",), ("device",))
