"""runtimes/residual_norms.py: a layer's residual sum (an add of a product, or an addmm) and the next layer's norm
become one ``add_layer_norm_triton`` call in an exported program, with the same values; what does not have
that form is left as exported. (The kernel itself: tests/interpreted_cases.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hstu_export.runtimes.residual_norms import fuse_residual_norms

FUSED = "hstu_export.add_layer_norm_triton.default"


class Layers(nn.Module):
    """Two layer ends as models write them: the zoo's ``x + y @ W`` then an fp32 norm cast back, and
    generative-recommenders' ``addmm(x, y, W.to(x.dtype)).to(dtype)`` then the same norm."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(2 * d, d, generator=gen) / d)
        self.w2 = nn.Parameter(torch.randn(2 * d, d, generator=gen) / d)
        self.norm_weight = nn.Parameter(torch.rand(d, generator=gen) + 0.5)
        self.norm_bias = nn.Parameter(torch.randn(d, generator=gen))

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.norm_weight.float(), self.norm_bias.float(),
                            1e-6).to(x.dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + y @ self.w1
        n = self.norm(x)
        dtype = x.dtype
        x = torch.addmm(x, torch.cat([n, n], dim=1), self.w2.to(x.dtype)).to(dtype)
        return x, self.norm(x)


def exported(model: nn.Module, dtype: torch.dtype, rows: int = 6) -> tuple[torch.export.ExportedProgram, tuple]:
    gen = torch.Generator().manual_seed(1)
    args = (torch.randn(rows, 8, generator=gen).to(dtype), torch.randn(rows, 16, generator=gen).to(dtype))
    rows_dim = torch.export.Dim("rows", min=2)
    return torch.export.export(model.to(dtype), args, dynamic_shapes=({0: rows_dim}, {0: rows_dim})), args


def reference(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """What the kernel computes: the sum in the inputs' dtype, its norm in fp32, cast back."""
    total = x + y
    return total, F.layer_norm(total.float(), (total.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def calls(program: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_spellings_become_one_call_each_with_the_same_values(dtype: torch.dtype) -> None:
    program, args = exported(Layers(), dtype)
    want = program.module()(*args)
    assert fuse_residual_norms(program, devices=("cpu",)) == 2
    found = calls(program)
    assert found.count(FUSED) == 2
    assert "aten.addmm.default" not in found and "aten.layer_norm.default" not in found
    assert found.count("aten.mm.default") == 1  # the addmm's product, alone
    for node in program.graph.nodes:  # the kernel's CPU stand-in, to run the rewritten program here
        if str(node.target) == FUSED:
            node.target = reference
    program.graph_module.recompile()
    got = program.module()(*args)  # the outputs (one of them a norm the rewrite replaced) by their new names
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        if dtype == torch.float32:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        else:  # the addmm's product is rounded to bf16 before the sum: one unit in the last place at most
            assert ((a.float() - b.float()).abs() <= a.float().abs() * 2**-7 + 2**-7).all()


def test_only_on_the_devices_asked_for() -> None:
    program, _ = exported(Layers(), torch.float32)
    before = calls(program)
    assert fuse_residual_norms(program) == 0  # CUDA by default; this program is on the CPU
    assert calls(program) == before


class NotResiduals(nn.Module):
    """Sums and norms of other forms: a vector bias, a norm without weights, a norm read in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8) / 8)
        self.b = nn.Parameter(torch.randn(8))
        self.g = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        biased = self.b + y @ self.w  # a bias broadcast over the rows, not a residual
        a = F.layer_norm(biased, (8,), self.g, self.g)
        unweighted = x + y @ self.w
        b = F.layer_norm(unweighted, (8,))  # nothing for the kernel's weight and bias
        read_in_fp32 = x + y @ self.w
        c = F.layer_norm(read_in_fp32.float(), (8,), self.g.float(), self.g.float()) * 2  # fp32 read as fp32
        return a, b, c


def test_other_forms_are_left_as_exported() -> None:
    program, _ = exported(NotResiduals(), torch.bfloat16)
    before = calls(program)
    assert fuse_residual_norms(program, devices=("cpu",)) == 0
    assert calls(program) == before
