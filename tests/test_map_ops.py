"""map_ops: every target's rewrites, the report, unmapped ops, and fbgemm ops from user models."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import Tensor

import hstu_export
from hstu_export.errors import UnmappedOpsError
from hstu_export.models import build_preset
from hstu_export.ops import lengths_to_offsets
from hstu_export.passes.context import PassContext
from hstu_export.passes.manager import run_passes
from hstu_export.runtimes.graph_io import op_calls
from hstu_export.settings import ExportSettings
from passes.map_ops import MapOps

HSTU_OPS = {"hstu_export::hstu_mha_gated", "hstu_export::concat_2D_jagged", "hstu_export::split_2D_jagged", "hstu_export::jagged_positions"}


@pytest.fixture(scope="module")
def tiny():
    model = build_preset("tiny", seed=4)
    batch = hstu_export.generate_batch(model.input_schema(), 3, seed=1)
    return model, batch


def _pipeline(model, batch, target, **kw):
    gm = hstu_export.trace(model, batch)
    ctx = PassContext(example_inputs=batch, model=model, op_target=target, **kw)
    return run_passes(gm, ctx)


def test_aten_target_leaves_plain_ops_and_reports_mappings(tiny):
    model, batch = tiny
    result = _pipeline(model, batch, "aten")
    calls = op_calls(result.dense)
    assert not [k for k in calls if k.startswith(("hstu_export::", "fbgemm::"))]
    stats = result.report["map_ops"].stats
    assert stats["target"] == "aten"
    mapped = stats["mapped"]
    # Two STU layers -> two attention calls; the preprocessor concatenates twice; one split; the
    # positional encoder locates the tokens of the whole sequences and of the histories.
    assert mapped["hstu_export::hstu_mha_gated -> hstu_export.ops.reference:hstu_mha_gated_reference"] == 2
    assert mapped["hstu_export::jagged_positions -> hstu_export.ops.reference:jagged_positions_reference"] == 2
    assert mapped["hstu_export::concat_2D_jagged -> hstu_export.ops.reference:concat_2D_jagged_reference"] == 2
    assert mapped["hstu_export::split_2D_jagged -> hstu_export.ops.reference:split_2D_jagged_reference"] == 1
    for b in (1, 2, 7):  # any batch size, including 1
        fresh = hstu_export.generate_batch(model.input_schema(), b, seed=10 + b)
        with torch.no_grad():
            got, ref = result.run(fresh), model(fresh)
        for task in ref:
            torch.testing.assert_close(got[task], ref[task], rtol=1e-5, atol=1e-6)


def test_rtp_is_an_alias_of_aten(tiny):
    model, batch = tiny
    assert ExportSettings(op_target="rtp").op_target == "aten"
    result = _pipeline(model, batch, "rtp")
    assert result.report["map_ops"].stats["target"] == "aten"
    assert not [k for k in op_calls(result.dense) if k.startswith("hstu_export::")]


def test_triton_target_swaps_to_triton_ops(tiny):
    model, batch = tiny
    gm = hstu_export.trace(model, batch)
    ctx = PassContext(example_inputs=batch, model=model, op_target="triton")
    # Run up to the split (graphs only: the Triton kernels need CUDA), then map.
    result = run_passes(gm, ctx, passes=["prune_unused", "split_sparse_dense", "remove_boundary_marks"])
    dense = MapOps().run(result.dense, ctx)
    calls = op_calls(dense)
    assert calls["hstu_export::hstu_mha_gated_triton"] == 2
    assert calls["hstu_export::concat_2D_jagged_triton"] == 2 and calls["hstu_export::split_2D_jagged_triton"] == 1
    # jagged_positions becomes a parallel search (torch.searchsorted traced into the graph).
    assert sum(node.target is torch.searchsorted for node in dense.graph.nodes) == 2
    assert not HSTU_OPS & set(calls)


def test_fbgemm_target_keeps_jagged_ops_in_fbgemm(tiny):
    pytest.importorskip("fbgemm_gpu")
    model, batch = tiny
    gm = hstu_export.trace(model, batch)
    ctx = PassContext(example_inputs=batch, model=model, op_target="fbgemm")
    result = run_passes(gm, ctx)
    calls = op_calls(result.dense)
    assert not [k for k in calls if k.startswith("hstu_export::")]  # attention and concat/split become plain ops
    with torch.no_grad():
        got, ref = result.run(batch), model(batch)
    for task in ref:
        torch.testing.assert_close(got[task], ref[task], rtol=1e-5, atol=1e-6)


torch.library.define("hstu_test::mystery", "(Tensor x) -> Tensor")


@torch.library.impl("hstu_test::mystery", "CompositeExplicitAutograd")
def _mystery(x: Tensor) -> Tensor:
    return x * 2


class UsesUnknownOp(torch.nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.hstu_test.mystery(x) + 1


def test_unmapped_ops_fail_with_their_list_unless_allowed():
    gm = torch.fx.symbolic_trace(UsesUnknownOp())
    with pytest.raises(UnmappedOpsError, match=r"no aten mapping for: hstu_test::mystery \(x1\).*--allow-unmapped"):
        MapOps().run(gm, PassContext(example_inputs={"x": torch.ones(2)}))
    ctx = PassContext(example_inputs={"x": torch.ones(2)}, allow_unmapped=True)
    kept = MapOps().run(gm, ctx)
    assert op_calls(kept)["hstu_test::mystery"] == 1
    assert ctx.stats["kept"] == {"hstu_test::mystery": 1}


class UsesFbgemm(torch.nn.Module):
    """A user model written against fbgemm's jagged ops."""

    def forward(self, values: Tensor, lengths: Tensor, dense: Tensor) -> Tensor:
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        padded = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [6], 0.0)
        back = torch.ops.fbgemm.dense_to_jagged(padded * 2, [offsets], values.size(0))[0]
        added = torch.ops.fbgemm.jagged_dense_elementwise_add_jagged_output(back, [offsets], dense)[0]
        return added.sum(-1)


@pytest.mark.parametrize("lengths", [[3], [1, 4, 6, 2], [6, 6]])
def test_fbgemm_ops_from_user_models_map_to_aten(lengths):
    pytest.importorskip("fbgemm_gpu")
    module = UsesFbgemm()
    lengths_t = torch.tensor(lengths)
    values = torch.randn(int(lengths_t.sum()), 5)
    dense = torch.randn(len(lengths), 6, 5)
    gm = torch.fx.symbolic_trace(module)
    ctx = PassContext(example_inputs={"values": values, "lengths": lengths_t, "dense": dense}, op_target="aten")
    mapped = MapOps().run(gm, ctx)
    mapped.recompile()
    assert not [k for k in op_calls(mapped) if k.startswith("fbgemm::")]
    assert sum(ctx.stats["mapped"].values()) == 4
    torch.testing.assert_close(mapped(values, lengths_t, dense), module(values, lengths_t, dense))
    # The fbgemm target keeps them (their library is then needed at load time).
    kept_ctx = PassContext(example_inputs={}, op_target="fbgemm")
    MapOps().run(torch.fx.symbolic_trace(module), kept_ctx)
    assert sum(kept_ctx.stats["kept"].values()) == 4
    assert lengths_to_offsets(lengths_t).tolist() == [0, *torch.cumsum(lengths_t, 0).tolist()]
