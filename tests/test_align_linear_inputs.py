"""align_linear_inputs: which Linear modules a CUDA export pads, that the answers stay the model's, and that
the user's model is left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import Tensor, nn

from hstu_export.capture.graph_functions import to_dtype_of
from hstu_export.passes.align_linear_inputs import (
    AlignedLinear,
    AlignLinearInputs,
    align_linear_inputs,
    alignment,
)
from hstu_export.passes.context import PassContext
from hstu_export.passes.prune_unused import prune_unused_attributes


class ThreeProjections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.odd = nn.Linear(33, 8)        # 33 columns: padded
        self.even = nn.Linear(32, 8)       # already a multiple of 8 (and of 4)
        self.no_bias = nn.Linear(6, 5, bias=False)

    def forward(self, x: Tensor, t: Tensor, small: Tensor) -> Tensor:
        joined = torch.cat([x, t], dim=-1)  # 32 + 1 columns, as a timestamp beside two embeddings
        return self.odd(joined) + self.even(x) + self.odd(joined * 2) + self.no_bias(small).sum(-1, keepdim=True)


def inputs() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(7, 32, generator=g), torch.randn(7, 1, generator=g), torch.randn(7, 6, generator=g)


def run(model: nn.Module, device: str, dtype: str = "bfloat16") -> tuple[torch.fx.GraphModule, PassContext]:
    gm = model if isinstance(model, torch.fx.GraphModule) else torch.fx.symbolic_trace(model)
    ctx = PassContext(example_inputs={}, export_device=device, export_dtype=dtype)
    return AlignLinearInputs().run(gm, ctx), ctx


def test_a_cuda_export_pads_the_inputs_of_unaligned_linears_and_answers_the_same() -> None:
    model = ThreeProjections().eval()
    with torch.no_grad():
        want = model(*inputs())
    gm, ctx = run(model, "cuda")
    assert ctx.stats == {"aligned": 2, "modules": ["odd: 33 -> 40", "no_bias: 6 -> 8"]}
    called = [(str(n.target), type(gm.get_submodule(str(n.target))).__name__) for n in gm.graph.nodes
              if n.op == "call_module"]
    assert called == [("odd", "AlignedLinear"), ("even", "Linear"), ("odd", "AlignedLinear"),
                      ("no_bias", "AlignedLinear")]  # both calls of one copy
    odd = gm.get_submodule("odd")
    assert isinstance(odd, AlignedLinear) and odd.weight.shape == (8, 40) and odd.pad == 7
    assert torch.equal(odd.weight[:, 33:], torch.zeros(8, 7)) and torch.equal(odd.bias, model.odd.bias)
    assert gm.get_submodule("no_bias").bias is None
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs()), want, rtol=1e-6, atol=1e-6)
    # The user's model keeps its own modules (they are the verification's reference).
    assert type(model.odd) is nn.Linear and model.odd.in_features == 33


def test_fp32_pads_to_four_columns_and_other_devices_are_left_alone() -> None:
    assert (alignment("bfloat16"), alignment("float16"), alignment("float32")) == (8, 8, 4)
    gm, ctx = run(ThreeProjections(), "cuda", "float32")
    assert ctx.stats["modules"] == ["odd: 33 -> 36", "no_bias: 6 -> 8"]
    gm, ctx = run(ThreeProjections(), "cpu")
    assert all(not isinstance(m, AlignedLinear) for m in gm.modules())
    assert ctx.stats == {"skipped": "a cpu export (cuBLAS's alignment only)"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_padded_product_is_the_linear_of_the_padded_input(dtype: torch.dtype) -> None:
    source = nn.Linear(33, 8).to(dtype)
    aligned = AlignedLinear(source, 7)
    x = torch.randn(5, 33, dtype=dtype)
    padded = torch.cat([x, torch.zeros(5, 7, dtype=dtype)], dim=-1)
    with torch.no_grad():
        assert torch.equal(aligned(x), nn.functional.linear(padded, aligned.weight, aligned.bias))
        torch.testing.assert_close(aligned(x), source(x))
    assert "zero columns=7" in repr(aligned)


def cast_input_to_weight_dtype(gm: torch.fx.GraphModule, path: str) -> None:
    """The input of the module at ``path`` cast to its weight's dtype, as follow_parameter_dtypes does: a
    ``to_dtype_of`` whose reference is a ``get_attr`` read of the weight, inserted before the call."""
    (linear,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == path]
    with gm.graph.inserting_before(linear):
        linear.args = (gm.graph.call_function(to_dtype_of, (linear.args[0], gm.graph.get_attr(f"{path}.weight"))),)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(33, 8), nn.SiLU())
        self.tied = nn.Linear(33, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x) + self.tied(x) + x[:, :8] @ self.tied.weight[:, :8]  # the weight read in the math too


def test_a_nested_module_is_replaced_in_the_graphs_own_container_and_the_model_keeps_its_parameters() -> None:
    """A GraphModule holds copies of the model's containers: the padded copy goes there, and pruning the graph
    (which drops unused tensors of the modules it keeps) leaves the user's module whole. A dtype read of the
    weight (follow_parameter_dtypes' cast) follows the copy; a module whose weight the math reads is kept."""
    model = Nested().eval()
    x = torch.randn(4, 33)
    with torch.no_grad():
        want = model(x)
    gm = torch.fx.symbolic_trace(model)
    cast_input_to_weight_dtype(gm, "block.0")
    gm.recompile()
    gm, ctx = run(gm, "cuda")
    assert ctx.stats["modules"] == ["block.0: 33 -> 40"]  # not "tied": its weight is read by the model's math
    prune_unused_attributes(gm)
    assert type(model.block[0]) is nn.Linear and model.block[0].bias is not None and model.block[0].in_features == 33
    assert isinstance(gm.get_submodule("block.0"), AlignedLinear)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)


class ReadsWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.combiner = nn.Linear(33, 8)   # its weight's dtype read by the model, as generative-recommenders does
        self.tied = nn.Linear(33, 8)       # its weight read in the math before the module is called

    def forward(self, x: Tensor) -> Tensor:
        mixed = x[:, :8] @ self.tied.weight[:, :8]
        combined = self.combiner(x.to(self.combiner.weight.dtype).to(self.combiner.weight.device))
        return combined + mixed + self.tied(x)


def test_reads_of_a_weights_dtype_or_device_allow_padding_and_every_read_of_a_weight_is_looked_at() -> None:
    """The model's own ``weight.dtype``/``.device`` reads keep working on the padded copy; a weight read twice
    (the math's read, then a cast's read inserted later in the graph) is judged by both reads; a weight that is
    itself the value of a ``to_dtype_of`` cast (not its reference) is read whole."""
    model = ReadsWeights().eval()
    x = torch.randn(4, 33)
    with torch.no_grad():
        want = model(x)
    gm = torch.fx.symbolic_trace(model)
    cast_input_to_weight_dtype(gm, "tied")
    (combined,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "combiner"]
    with gm.graph.inserting_after(combined):  # the weight itself cast: a read of its shape
        weight = gm.graph.get_attr("combiner.weight")
        weight_cast = gm.graph.call_function(to_dtype_of, (weight, combined))
    gm.recompile()
    assert [str(n.target) for n in gm.graph.nodes if n.op == "get_attr"].count("tied.weight") == 2
    assert align_linear_inputs(gm, 8) == {}  # neither: one weight is cast itself, the other read by the math
    gm.graph.erase_node(weight_cast)
    gm.graph.erase_node(weight)
    gm.recompile()
    gm, ctx = run(gm, "cuda")
    assert ctx.stats["modules"] == ["combiner: 33 -> 40"]
    assert type(gm.get_submodule("tied")) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(gm(x), want, rtol=1e-6, atol=1e-6)
