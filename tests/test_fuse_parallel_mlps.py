"""fuse_parallel_mlps: matching MLP chains on one input become one product per layer, with the same answers;
chains that differ, inputs that are not 2-D and modules it does not know stay as they were."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import Tensor, nn

from hstu_export.passes.fuse_parallel_mlps import fuse_parallel_mlps, fused_module


def _mlp(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


class Towers(nn.Module):
    """Three matching towers, one with another activation, one shorter, and a lone Linear of another width,
    all on ``x``; one tower's hidden value is also an output (its chain stops there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.same = nn.ModuleList(
            _mlp(nn.Linear(24, 16), nn.SiLU(), nn.Linear(16, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 1))
            for _ in range(3)
        )
        self.other_gelu = _mlp(nn.Linear(24, 16), nn.SiLU(), nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 1))
        self.short = nn.ModuleList(_mlp(nn.Linear(24, 16), nn.ReLU()) for _ in range(2))
        self.lone = nn.Linear(24, 5)
        self.shared_first = nn.Linear(24, 16)
        self.shared_rest = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        out = {f"same{i}": torch.sigmoid(tower(x).squeeze(-1)) for i, tower in enumerate(self.same)}
        out["other_gelu"] = self.other_gelu(x)
        for i, tower in enumerate(self.short):
            out[f"short{i}"] = tower(x)
        out["lone"] = self.lone(x)
        hidden = self.shared_first(x)  # two users: a chain of its own, ending here
        out["hidden"] = hidden
        out["rest"] = self.shared_rest(hidden)
        return out


def _linears(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear))


def test_matching_towers_are_fused_and_answer_the_same() -> None:
    model = Towers().eval()
    x = torch.randn(37, 24)
    gm = fused_module(model, x)
    with torch.no_grad():
        want, got = model(x), gm(x)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    # The three matching towers: one first Linear and two batched products; the two short towers: one Linear
    # (no product after it). Left alone: the other tower (3), the lone Linear, the shared one and its follower.
    code = gm.code
    assert code.count("torch.bmm") == 2 and "baddbmm" not in code  # the bias added after each, with the activation
    assert _linears(gm) == 1 + 1 + 3 + 1 + 2
    assert sorted(gm.get_submodule(f"parallel_mlp_{i}.first").out_features for i in (0, 1)) == [2 * 16, 3 * 16]
    shapes = sorted(tuple(p.shape) for n, p in gm.named_parameters() if n.startswith("parallel_mlp") and "weight_" in n)
    assert shapes == [(3, 8, 1), (3, 16, 8)]
    # The fused towers' own modules are gone (pruned), the others kept.
    names = {n for n, _ in gm.named_modules()}
    assert not {f"same.{t}.{i}" for t in range(3) for i in (0, 2, 4)} & names
    assert {"same.0.1", "same.0.3", "other_gelu.0", "lone"} <= names  # activations run once, from the first tower


def test_counts_and_what_stays() -> None:
    model = Towers().eval()
    gm = torch.fx.symbolic_trace(model)
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(torch.randn(5, 24))
    assert fuse_parallel_mlps(gm) == (2, 5)  # the three towers, the two short ones
    assert fuse_parallel_mlps(gm) == (0, 0)  # nothing left to fuse


def test_not_2d_or_no_shape_is_left_alone() -> None:
    model = Towers().eval()
    gm = fused_module(model, torch.randn(2, 5, 24))  # [B, N, D]: not fused
    assert "parallel_mlp" not in gm.code and _linears(gm) == 3 * 3 + 3 + 2 + 1 + 2
    traced = torch.fx.symbolic_trace(model)  # no shapes in the meta: nothing is assumed
    assert fuse_parallel_mlps(traced) == (0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_weights_are_the_branches(dtype: torch.dtype) -> None:
    model = Towers().to(dtype).eval()
    gm = fused_module(model, torch.randn(4, 24, dtype=dtype))
    first = gm.get_submodule("parallel_mlp_0.first")
    assert first.weight.dtype == dtype
    assert torch.equal(first.weight, torch.cat([t[0].weight for t in model.same]))
    assert torch.equal(first.bias, torch.cat([t[0].bias for t in model.same]))
    assert torch.equal(gm.get_parameter("parallel_mlp_0.weight_2")[1], model.same[1][2].weight.t())
    assert torch.equal(gm.get_parameter("parallel_mlp_0.bias_4")[2, 0], model.same[2][4].bias)
