"""The rewrites made just before a graph is compiled (runtimes/compile_rewrites.py): which work on parameters
is folded and which is left, offsets as one scan, and that the answers stay the graph's bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from hstu_export.runtimes import compile_rewrites
from hstu_export.runtimes.compile_rewrites import fold_parameter_work, offsets, offsets_in_one_scan
from hstu_export.runtimes.graph_io import export_ready


class CastsItsWeights(nn.Module):
    """A layer as generative-recommenders writes its norms: bf16 parameters handed to an fp32 norm."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.norm_weight = nn.Parameter(torch.randn(8, generator=g).bfloat16(), requires_grad=False)
        self.norm_bias = nn.Parameter(torch.randn(8, generator=g).bfloat16(), requires_grad=False)
        self.proj = nn.Parameter(torch.randn(5, 8, generator=g).bfloat16(), requires_grad=False)
        self.scale = nn.Parameter(torch.randn(5, generator=g).bfloat16(), requires_grad=False)
        self.row = nn.Parameter(torch.randn(1, 8, generator=g).bfloat16(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(x.float(), (8,), self.norm_weight.float(), self.norm_bias.to(torch.float32) * 2)
        y = y.bfloat16() @ self.proj.t()  # a view of a parameter: no kernel, kept
        y = y * self.scale.to(torch.bfloat16)  # the dtype it has: the parameter itself, kept
        return y + (self.row.float().expand(2, 8).sum(0) @ self.proj.float().t()).bfloat16()


def traced() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(CastsItsWeights().eval())


def parameter_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The calls left whose inputs are all parameters or buffers."""
    attrs = {n for n in gm.graph.nodes if n.op == "get_attr"}
    return [n.name for n in gm.graph.nodes if n.op in ("call_method", "call_function") and n.all_input_nodes
            and all(a in attrs for a in n.all_input_nodes)]


def test_casts_of_parameters_become_buffers_and_views_of_parameters_stay() -> None:
    gm = traced()
    x = torch.randn(3, 8)
    want = gm(x)
    folded = fold_parameter_work(gm)
    # The norm's fp32 weight, its doubled fp32 bias and the fp32 projection (cast, then transposed: folded as
    # the transpose's dense result). The expanded row is not dense: the cast it reads is folded, it stays.
    assert sorted(folded) == ["float_2", "float_3", "mul", "t_1"], folded
    assert sorted(parameter_calls(gm)) == ["expand", "t", "to_1"]
    assert torch.equal(gm(x), want)
    buffers = dict(gm.named_buffers())
    assert buffers["folded_float_2"].dtype == torch.float32 and buffers["folded_mul"].dtype == torch.float32
    assert torch.equal(buffers["folded_mul"], gm.norm_bias.float() * 2)
    assert buffers["folded_t_1"].shape == (8, 5)
    # The folded work is gone from the graph: no cast of the norm's parameters runs any more.
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("float", "to")
                and n.args[0].op == "get_attr" and str(n.args[0].target).startswith("norm_")]


def test_a_call_that_fails_on_the_parameters_is_left_to_the_graph() -> None:
    gm = traced()
    norm = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "norm_weight")
    cast = next(iter(norm.users))
    cast.args = (norm, "no_such_dtype")  # raises when computed
    gm.recompile()
    folded = fold_parameter_work(gm)
    assert cast.name not in folded and cast in gm.graph.nodes and "mul" in folded


def test_results_over_the_bound_are_left_to_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_rewrites, "FOLDED_AT_MOST_BYTES", 8 * 4 - 1)  # under one 8-float vector
    gm = traced()
    want = gm(x := torch.randn(2, 8))
    assert fold_parameter_work(gm) == []
    assert torch.equal(gm(x), want)


def test_export_ready_folds_on_its_copy_only() -> None:
    gm = traced()
    ready = export_ready(gm, fold_parameters=True)
    assert any(name.startswith("folded_") for name, _ in ready.named_buffers())
    assert not any(name.startswith("folded_") for name, _ in gm.named_buffers())
    x = torch.randn(4, 8)
    assert torch.equal(ready(x)[0] if isinstance(ready(x), tuple) else ready(x), gm(x))
    assert not any(name.startswith("folded_") for name, _ in export_ready(gm).named_buffers())


class Offsets(nn.Module):
    def forward(self, lengths: Tensor, other: Tensor, grid: Tensor) -> tuple[Tensor, ...]:
        a = F.pad(torch.cumsum(lengths, dim=0), (1, 0))
        b = F.pad(torch.cumsum(lengths, 0), (1, 0), mode="constant", value=None)  # the same offsets again
        c = F.pad(other.cumsum(0, dtype=torch.int64), (1, 0))
        d = F.pad(torch.cumsum(grid, dim=0), (1, 0))  # 2-D: the pad is on the other dim, not offsets
        e = F.pad(torch.cumsum(lengths, 0), (1, 0), value=7)  # not a zero: left as it is
        return a, b, c, d, e


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_offsets_are_one_running_sum_of_the_padded_lengths(dtype: torch.dtype) -> None:
    gm = torch.fx.symbolic_trace(Offsets())
    lengths = torch.tensor([3, 0, 5, 1]).to(dtype)
    other, grid = torch.tensor([2, 2], dtype=torch.int32), torch.arange(6).reshape(2, 3).to(dtype)
    want = gm(lengths, other, grid)
    assert offsets_in_one_scan(gm.graph) == 4
    gm.recompile()
    got = gm(lengths, other, grid)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is offsets]
    assert len(calls) == 3  # a and b share one
    assert torch.equal(got[0], torch.tensor([0, 3, 3, 8, 9]).to(got[0].dtype))
    # Traced for the compiler, 1-D offsets are a pad feeding a scan: no pad after any scan of them.
    exported = torch.export.export(gm, (lengths, other, grid), strict=False).graph
    pads = (torch.ops.aten.pad.default, torch.ops.aten.constant_pad_nd.default)
    pads_of_scans = [n for n in exported.nodes if n.target in pads
                     and n.args[0].target is torch.ops.aten.cumsum.default]
    assert len(pads_of_scans) == 2  # the 2-D one and the pad by 7, as written
