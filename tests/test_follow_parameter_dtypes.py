"""follow_parameter_dtypes on small graphs: where a bf16 export casts and where it leaves values alone."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import Tensor, nn

import hstu_export.ops  # noqa: F401  (registers hstu_export::*)
from hstu_export.capture.graph_functions import to_floating_dtype
from hstu_export.passes.context import PassContext
from hstu_export.passes.follow_parameter_dtypes import FollowParameterDtypes


class TableRowsBesideALayer(nn.Module):
    """A table's fp32 rows joined, per user, with a layer's output (the join takes one dtype only)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, history: Tensor, history_offsets: Tensor, context: Tensor, context_offsets: Tensor) -> Tensor:
        projected = self.proj(history)
        joined = torch.ops.hstu_export.concat_2D_jagged(context, context_offsets, projected, history_offsets)
        return self.proj(joined.float())


def inputs() -> tuple[Tensor, ...]:
    torch.manual_seed(0)
    return torch.randn(5, 4), torch.tensor([0, 2, 5]), torch.randn(2, 4), torch.tensor([0, 1, 2])


def run_pass(dtype: str) -> tuple[torch.fx.GraphModule, PassContext]:
    gm = torch.fx.symbolic_trace(TableRowsBesideALayer())
    gm.to(getattr(torch, dtype))
    ctx = PassContext(example_inputs={}, export_dtype=dtype)
    gm = FollowParameterDtypes().run(gm, ctx)
    gm.recompile()  # as the pass manager does after each pass
    return gm, ctx


def test_bf16_graph_casts_the_layer_inputs_and_the_join() -> None:
    gm, ctx = run_pass("bfloat16")
    # One input of each proj call, and the join's four arguments: offsets carry no observed dtype in this
    # graph, and to_floating_dtype leaves their int64 as it is when it runs.
    assert ctx.stats["casts"] == 6
    join = next(n for n in gm.graph.nodes if "concat_2D_jagged" in str(n.target))
    # The table's rows and the layer's output meet in the export dtype (the Triton join takes one dtype only).
    assert all(join.args[i].target is to_floating_dtype and join.args[i].args[1] is torch.bfloat16 for i in (0, 2))
    out = gm(*inputs())
    assert out.dtype == torch.bfloat16
    reference = TableRowsBesideALayer()
    reference.load_state_dict({k: v.float() for k, v in gm.state_dict().items()})
    torch.testing.assert_close(out.float(), reference(*inputs()), rtol=0, atol=5e-2)


def test_without_the_pass_the_bf16_graph_refuses_the_fp32_rows() -> None:
    gm = torch.fx.symbolic_trace(TableRowsBesideALayer()).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        gm(*inputs())


def test_an_fp32_export_is_left_as_traced() -> None:
    gm, ctx = run_pass("float32")
    assert "casts" not in ctx.stats
    assert not any("to_dtype" in str(n.target) or "floating_dtype" in str(n.target) for n in gm.graph.nodes)
