"""prove_length_reads (passes/prove_length_reads.py): sizes and length checks a valid request decides are taken
from shapes or dropped, so the graph reads nothing back from the device for them; what it computes is unchanged,
and a check that is not proven stays and still fails."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hstu_export.capture.graph_functions import (
    check_at_most,
    check_lengths_at_most,
    check_no_length_beyond,
    length_beyond,
    tensor_to_int,
)
from hstu_export.package.ranges import ExportRanges
from hstu_export.package.schema import FeatureSpec, InputSchema
from hstu_export.passes.context import PassContext
from hstu_export.passes.manager import run_passes

SCHEMA = InputSchema((
    FeatureSpec("uih.lengths", "int64", "lengths"),
    FeatureSpec("uih.values", "int64", "jagged", jagged_by="uih.lengths"),
    FeatureSpec("cand.lengths", "int64", "lengths"),
    FeatureSpec("cand.values", "int64", "jagged", jagged_by="cand.lengths"),
    FeatureSpec("cand_time.lengths", "int64", "lengths", same_as="cand.lengths"),
))
RANGES = ExportRanges(8, {"uih.lengths": 40, "cand.lengths": 8, "cand_time.lengths": 8},
                      {"uih.lengths": 1, "cand.lengths": 1, "cand_time.lengths": 1})


def _inputs(uih: list[int], cand: list[int]) -> dict[str, Tensor]:
    return {"uih__lengths": torch.tensor(uih), "uih__values": torch.arange(sum(uih)),
            "cand__lengths": torch.tensor(cand), "cand__values": torch.arange(sum(cand)) * 3,
            "cand_time__lengths": torch.tensor(cand)}


def _offsets(graph: torch.fx.Graph, lengths: torch.fx.Node) -> torch.fx.Node:
    return graph.call_function(F.pad, (graph.call_function(torch.cumsum, (lengths,), {"dim": 0}), (1, 0)),
                               {"mode": "constant", "value": None})


def _max(graph: torch.fx.Graph, lengths: torch.fx.Node) -> torch.fx.Node:
    return graph.call_function(int, (graph.call_method("item", (graph.call_method("max", (lengths,)),)),))


def _model_like() -> torch.fx.GraphModule:
    """What map_ops leaves of a generative-recommenders-style dense half: row counts read as sums of lengths (one
    through a KeyedJaggedTensor's stacked per-key lengths, one as offsets' last value), maxima as the bounds its
    jagged ops cut at, each checked beside the op (one kept alone, the others deferred to one read)."""
    graph = torch.fx.Graph()
    uih, uih_values, cand, cand_values, cand_time = (graph.placeholder(n) for n in (
        "uih__lengths", "uih__values", "cand__lengths", "cand__values", "cand_time__lengths"))
    stacked = graph.call_method("view", (graph.call_function(torch.cat, ([cand, cand_time],)), 2, -1))
    num_candidates = graph.call_function(operator.getitem, (stacked, 0))
    total_candidates = graph.call_function(int, (graph.call_method("item", (
        graph.call_function(torch.sum, (num_candidates,)),)),))
    weights = graph.call_function(torch.ones, (total_candidates,), {"dtype": torch.int64})
    max_uih, max_cand = _max(graph, uih), _max(graph, cand)
    both = graph.call_function(operator.add, (uih, num_candidates))
    both_offsets = _offsets(graph, graph.call_function(operator.add, (both, 2)))
    bound = graph.call_function(operator.add, (graph.call_function(operator.add, (max_uih, max_cand)), 2))
    bound = graph.call_function(check_at_most, (bound, 50))
    flags = [graph.call_function(length_beyond, (_offsets(graph, uih), max_uih)),
             graph.call_function(length_beyond, (both_offsets, bound)),
             # the history's offsets as the difference of two offsets, against the history's maximum
             graph.call_function(length_beyond, (graph.call_function(operator.sub, (both_offsets, _offsets(
                 graph, graph.call_function(operator.add, (num_candidates, 2))))), max_uih))]
    alone = graph.call_function(check_lengths_at_most, (_offsets(graph, cand),), {"bound": max_cand})
    rows = graph.call_function(tensor_to_int, (graph.call_function(operator.getitem, (both_offsets, -1)),))
    graph.call_function(check_no_length_beyond, (flags,))
    y = graph.call_function(torch.add, (graph.call_function(torch.sum, (cand_values,)),
                                        graph.call_function(torch.sum, (weights,))))
    y = graph.call_function(torch.add, (y, graph.call_function(torch.sum, (uih_values,))))
    graph.output({"y": graph.call_function(operator.add, (y, rows)), "offsets": alone})
    return torch.fx.GraphModule(nn.Module(), graph)


def _run(gm: torch.fx.GraphModule, inputs: dict[str, Tensor], ranges: ExportRanges | None = RANGES) -> object:
    ctx = PassContext(example_inputs=inputs, schema=SCHEMA, ranges=ranges)
    return run_passes(gm, ctx, passes=["prove_length_reads", "eliminate_dead_code"])


def _reads(gm: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch, inputs: dict[str, Tensor]) -> tuple[dict, int]:
    count = []
    item = Tensor.item
    with monkeypatch.context() as m:
        m.setattr(Tensor, "item", lambda self: count.append(1) or item(self))
        out = gm(**inputs)
    return out, len(count)


def test_sizes_come_from_shapes_and_proven_checks_go_so_nothing_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _inputs([3, 7, 1], [2, 8, 5])
    gm = _model_like()
    want, reads_before = _reads(gm, monkeypatch, inputs)
    assert reads_before == 6  # a sum, the offsets' total, two maxima, the lone check, the deferred checks
    result = _run(gm, inputs)
    stats = result.report["prove_length_reads"].stats
    assert stats == {"sizes_from_shapes": 2, "checks_proven": 5}
    got, reads_after = _reads(result.graph, monkeypatch, inputs)
    assert reads_after == 0
    assert torch.equal(got["y"], want["y"]) and torch.equal(got["offsets"], want["offsets"])
    kept = {n.target for n in result.graph.graph.nodes if n.op in ("call_function", "call_method")}
    assert not kept & {check_at_most, check_lengths_at_most, check_no_length_beyond, length_beyond, "item", "max"}
    # the counts follow the request's shapes: another batch gives the model's own answer
    other = _inputs([40, 1], [1, 8])
    assert torch.equal(result.graph(**other)["y"], gm(**other)["y"])


def test_a_constant_bound_is_proven_only_within_the_exported_ranges() -> None:
    inputs = _inputs([3, 7], [2, 8])
    wider = ExportRanges(8, {**RANGES.max_lengths, "uih.lengths": 41}, RANGES.min_lengths)
    assert _run(_model_like(), inputs, wider).report["prove_length_reads"].stats["checks_proven"] == 4
    unknown = _run(_model_like(), inputs, None)
    assert unknown.report["prove_length_reads"].stats["checks_proven"] == 4
    assert check_at_most in {n.target for n in unknown.graph.graph.nodes}


def test_a_check_that_is_not_proven_stays_and_still_fails() -> None:
    """A sequence of history and candidates against the history's maximum alone: longer sequences exist, so the
    check is kept (and the maximum it reads) and refuses them, as it did before the pass."""
    graph = torch.fx.Graph()
    uih, _, cand = (graph.placeholder(n) for n in ("uih__lengths", "uih__values", "cand__lengths"))
    offsets = _offsets(graph, graph.call_function(operator.add, (uih, cand)))
    graph.call_function(check_no_length_beyond, ([graph.call_function(length_beyond, (offsets, _max(graph, uih))),
                                                  graph.call_function(length_beyond, (_offsets(graph, uih), 40))],))
    graph.output({"offsets": offsets})
    gm = torch.fx.GraphModule(nn.Module(), graph)
    inputs = {k: v for k, v in _inputs([3, 7], [2, 8]).items() if k in ("uih__lengths", "uih__values", "cand__lengths")}
    result = _run(gm, inputs)
    assert result.report["prove_length_reads"].stats == {"sizes_from_shapes": 0, "checks_proven": 0}
    with pytest.raises(RuntimeError, match="longer than the bound"):
        result.graph(**inputs)


def test_a_sum_without_a_tensor_of_its_rows_is_still_read() -> None:
    graph = torch.fx.Graph()
    cand = graph.placeholder("cand__lengths")  # no tensor jagged by it in this graph
    graph.output({"n": graph.call_method("item", (graph.call_function(torch.sum, (cand,)),))})
    result = _run(torch.fx.GraphModule(nn.Module(), graph), {"cand__lengths": torch.tensor([2, 3])})
    assert result.report["prove_length_reads"].stats["sizes_from_shapes"] == 0
    assert result.graph(cand__lengths=torch.tensor([2, 3]))["n"] == 5
