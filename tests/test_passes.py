"""Graph passes and the pass manager: the sparse/dense split computes the model, each half holds only
its own parameters, pruning and DCE free what nothing uses, and the manager's errors name the pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from hstu_export import PassContext, PipelineResult, generate_batch, run_passes, trace
from hstu_export import passes as pass_registry
from hstu_export.capture.graph_functions import build_kjt, sparse_boundary
from hstu_export.errors import ConfigError, PassError
from hstu_export.models import build_preset
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.passes.boundary import BoundarySchema
from hstu_export.passes.manager import max_rel_error, op_histogram


@pytest.fixture(scope="module")
def tiny() -> HstuRankingModel:
    return build_preset("tiny")


@pytest.fixture(scope="module")
def split(tiny: HstuRankingModel) -> PipelineResult:
    batch = generate_batch(tiny.input_schema(), 4, seed=0)
    return run_passes(trace(tiny, batch), PassContext(example_inputs=batch, model=tiny, check_each_pass=True))


def _nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]


def _module_types(gm: torch.fx.GraphModule) -> set[type]:
    return {type(gm.get_submodule(str(n.target))) for n in gm.graph.nodes if n.op == "call_module"}


# ---- the split on the tiny preset ----------------------------------------------------------------


def _varied_batches(tiny: HstuRankingModel) -> list[dict[str, Tensor]]:
    schema, cfg = tiny.input_schema(), tiny.config
    batches = [
        generate_batch(schema, b, seed=s) for s, b in enumerate((1, 2, 3, 5, 8, 1, 13, 32, 4, 6, 1, 17))
    ]
    edge_lengths = [
        (1, {"uih_lengths": [1], "candidate_lengths": [1]}),
        (2, {"uih_lengths": [cfg.max_history_len] * 2, "candidate_lengths": [cfg.max_num_candidates] * 2}),
        (
            3,
            {"uih_lengths": [1, cfg.max_history_len, 5], "candidate_lengths": [cfg.max_num_candidates, 1, 2]},
        ),
        (4, {"uih_lengths": [2, 2, 2, 2], "candidate_lengths": [3, 1, 4, 1]}),
        (1, {"uih_lengths": [cfg.max_history_len], "candidate_lengths": [1]}),
        (5, {"uih_lengths": [9, 1, 30, 2, 46], "candidate_lengths": [16, 1, 8, 2, 5]}),
        (9, None),
        (24, None),
    ]
    for seed, (b, lengths) in enumerate(edge_lengths, start=100):
        batches.append(generate_batch(schema, b, seed=seed, lengths=lengths))
    return batches


def test_split_graphs_equal_eager_on_20_batches(tiny: HstuRankingModel, split: PipelineResult) -> None:
    batches = _varied_batches(tiny)
    assert len(batches) == 20 and min(len(b["uih_lengths"]) for b in batches) == 1
    with torch.no_grad():
        for batch in batches:
            expected = tiny(batch)
            via_halves = split.run(batch)  # dense(**sparse(batch), **passthrough)
            assert list(via_halves) == list(expected)
            error = max_rel_error(via_halves, expected)
            assert error is not None and error < 1e-6, error
            combined = split.graph(**batch)
            assert max_rel_error(combined, expected) < 1e-6  # type: ignore[operator]


def test_sparse_holds_every_lookup_and_dense_no_table(tiny: HstuRankingModel, split: PipelineResult) -> None:
    assert split.sparse is not None and split.dense is not None
    # The sparse graph is the lookup and nothing else (no STU layer, no projection, no attention), lowered to
    # one gather a feature (lower_embeddings).
    assert set(op_histogram(split.sparse)) == {
        "placeholder",
        "output",
        "get_attr",
        "torch.nn.functional.embedding",
        "method:float",
    }
    assert op_histogram(split.sparse)["torch.nn.functional.embedding"] == 5  # every lookup crosses the boundary
    assert EmbeddingCollection not in _module_types(split.dense)
    # Right after the split (before map_ops rewrites it), every attention call is on the dense side.
    assert split.report["split_sparse_dense"].ops_after["hstu_export.hstu_mha_gated.default"] == tiny.config.num_layers

    model_params = set(tiny.state_dict())
    tables = {k for k in model_params if k.startswith("sparse_arch.embedding_collection.")}
    assert tables == {
        f"sparse_arch.embedding_collection.embeddings.{t}.weight"
        for t in ("item", "action", "ctx_user_id", "ctx_user_age")
    }
    assert set(split.sparse.state_dict()) == tables
    # The task heads' modules are replaced by their fusion (fuse_parallel_mlps); the rest keep their names.
    heads = {k for k in model_params if k.startswith("task_heads.")}
    fused = {"parallel_mlp_0.first.weight", "parallel_mlp_0.first.bias", "parallel_mlp_0.weight_2",
             "parallel_mlp_0.bias_2"}
    assert set(split.dense.state_dict()) == (model_params - tables - heads) | fused
    for name, value in split.dense.state_dict().items():
        if name not in fused:
            assert torch.equal(value, tiny.state_dict()[name])
    # The top graph owns nothing but the two halves.
    assert {p for p, _ in split.graph.named_children()} == {"sparse", "dense"}


def test_boundary_schema(split: PipelineResult) -> None:
    boundary = split.boundary
    assert boundary is not None
    dense = {t.name: t for t in boundary.dense_inputs}
    assert [t.name for t in boundary.sparse_outputs] == [
        "uih_item_emb",
        "uih_action_emb",
        "candidate_item_emb",
        "user_id_emb",
        "user_age_emb",
    ]
    assert dense["uih_item_emb"].shape == ("uih_lengths.total", 32)
    assert dense["uih_item_emb"].jagged_by == "uih_lengths"
    assert dense["candidate_item_emb"].shape == ("candidate_lengths.total", 32)
    assert dense["user_id_emb"].shape == ("batch", 32) and dense["user_id_emb"].jagged_by == ""
    assert all(t.dtype == "float32" and t.source == "sparse" for t in boundary.sparse_outputs)
    assert {t.name: t.shape for t in boundary.passthrough} == {
        "uih_lengths": ("batch",),
        "candidate_lengths": ("batch",),
        "uih_timestamps": ("uih_lengths.total",),
        "query_time": ("batch",),
    }
    assert [t.name for t in boundary.sparse_inputs] == [
        "uih_lengths",
        "candidate_lengths",
        "uih_item_ids",
        "uih_action_ids",
        "candidate_item_ids",
        "user_id",
        "user_age",
    ]
    assert boundary.output_names == ("ctr", "cvr")
    # The graphs' signatures are the schema's.
    assert split.sparse is not None and split.dense is not None
    assert [n.target for n in split.dense.graph.nodes if n.op == "placeholder"] == list(dense)
    assert [n.target for n in split.sparse.graph.nodes if n.op == "placeholder"] == [
        t.name for t in boundary.sparse_inputs
    ]
    assert BoundarySchema.from_json(json.loads(json.dumps(boundary.to_json()))) == boundary


def test_report_records_every_pass(split: PipelineResult) -> None:
    report = split.report
    assert report.names == pass_registry.known_pass_names()
    json.dumps(report.to_json())  # JSON-serialisable
    assert all(r.max_rel_error is not None and r.max_rel_error < 1e-6 for r in report if r.status == "ok")
    cut = report["split_sparse_dense"]
    assert cut.stats["boundary_tensors"] == 5
    assert cut.nodes_after > cut.nodes_before  # the top graph plus two halves; shared index math twice
    assert cut.parameter_bytes_after == cut.parameter_bytes_before
    marks = report["remove_boundary_marks"]
    assert marks.stats["removed_marks"] == 5
    assert marks.ops_before["hstu_export.capture.graph_functions.sparse_boundary"] == 5
    assert "hstu_export.capture.graph_functions.sparse_boundary" not in marks.ops_after
    assert not any(n.target is sparse_boundary for n in _nodes(split.graph))
    final = report["eliminate_dead_code"]
    assert final.ops_after["module:EmbeddingCollection"] == 1


# ---- prune_unused and eliminate_dead_code ---------------------------------------------------------


def test_prune_unused_removes_a_planted_submodule(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 2, seed=0)
    gm = trace(tiny, batch)
    gm.add_submodule("planted", nn.Sequential(nn.Linear(100, 50), nn.Linear(50, 7)))
    gm.transducer.register_buffer("stale_cache", torch.zeros(10, 10, dtype=torch.float64))
    planted_bytes = (100 * 50 + 50 + 50 * 7 + 7) * 4 + 10 * 10 * 8
    result = run_passes(gm, PassContext(example_inputs=batch), passes=["prune_unused"])
    record = result.report["prune_unused"]
    assert record.stats == {"removed_tensors": 5, "removed_bytes": planted_bytes, "removed_modules": 1}
    assert record.parameter_bytes_before - record.parameter_bytes_after == planted_bytes
    assert not hasattr(result.graph, "planted") and not hasattr(result.graph.transducer, "stale_cache")
    assert hasattr(result.graph.transducer, "post_norm_weight")  # used ones stay
    assert max_rel_error(result.graph(**batch), tiny(batch)) == 0.0


def test_eliminate_dead_code_drops_dead_nodes_and_their_parameters(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 2, seed=0)
    clean = run_passes(trace(tiny, batch), PassContext(example_inputs=batch), passes=["eliminate_dead_code"])
    already_dead = clean.report["eliminate_dead_code"].stats["removed_nodes"]  # the unused half of a split op
    assert already_dead == 1 and clean.report["eliminate_dead_code"].stats["removed_bytes"] == 0
    gm = trace(tiny, batch)
    gm.register_parameter("dead_weight", nn.Parameter(torch.ones(64, 64)))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        weight = gm.graph.get_attr("dead_weight")
        gm.graph.call_function(torch.relu, (gm.graph.call_function(torch.matmul, (weight, weight)),))
    gm.recompile()
    result = run_passes(gm, PassContext(example_inputs=batch), passes=["eliminate_dead_code"])
    record = result.report["eliminate_dead_code"]
    assert record.stats["removed_nodes"] == already_dead + 3
    assert record.stats["removed_bytes"] == 64 * 64 * 4
    assert record.nodes_before - record.nodes_after == already_dead + 3
    assert not hasattr(result.graph, "dead_weight")


# ---- split errors on small models ----------------------------------------------------------------


class _ToyRanker(nn.Module):
    """An EmbeddingCollection and a linear head; ``mark`` decides whether the embeddings are marked."""

    def __init__(self, mark: bool) -> None:
        super().__init__()
        self.mark = mark
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["ids"])],
            device=torch.device("cpu"),
        )
        self.head = nn.Linear(4, 1)

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        kjt = build_kjt(["ids"], [features["ids"]], [features["lengths"]])
        emb = self.ec(kjt)["ids"].values()
        if self.mark:
            emb = sparse_boundary(emb, "ids_emb", "lengths")
        return {"score": self.head(emb).squeeze(-1) * features["weight"]}


def _toy_batch() -> dict[str, Tensor]:
    lengths = torch.tensor([2, 3])
    return {"lengths": lengths, "ids": torch.tensor([1, 2, 3, 4, 5]), "weight": torch.rand(5)}


def test_split_without_a_schema() -> None:
    model = _ToyRanker(mark=True)
    batch = _toy_batch()
    result = run_passes(
        trace(model, batch), PassContext(example_inputs=batch, model=model, check_each_pass=True)
    )
    assert result.boundary is not None
    ids_emb = result.boundary.dense_inputs[0]
    assert (ids_emb.name, ids_emb.shape, ids_emb.source) == ("ids_emb", ("lengths.total", 4), "sparse")
    assert [t.name for t in result.boundary.passthrough] == ["weight"]
    torch.testing.assert_close(result.run(batch)["score"], model(batch)["score"], rtol=0, atol=0)


def test_unmarked_embeddings_are_marked_automatically() -> None:
    model = _ToyRanker(mark=False)
    batch = _toy_batch()
    result = run_passes(trace(model, batch), PassContext(example_inputs=batch, schema=_toy_schema()))
    assert result.report["mark_sparse_dense"].stats["automatic_marks"] == ["ec__ids__values"]
    [emb] = result.boundary.sparse_outputs
    assert (emb.name, emb.shape, emb.jagged_by) == ("ec__ids__values", ("lengths.total", 4), "lengths")
    assert [t.name for t in result.boundary.passthrough] == ["weight"]
    assert not any(isinstance(m, EmbeddingCollection) for m in result.dense.modules())
    for seed in range(3):
        lengths = torch.randint(1, 5, (3,), generator=torch.Generator().manual_seed(seed))
        other = {"lengths": lengths, "ids": torch.randint(0, 10, (int(lengths.sum()),)),
                 "weight": torch.rand(int(lengths.sum()))}
        torch.testing.assert_close(result.run(other)["score"], model(other)["score"], rtol=0, atol=0)


def test_no_embedding_module_and_no_marks_is_an_error() -> None:
    class NoTables(nn.Module):
        def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
            return {"y": features["weight"] * 2}

    batch = _toy_batch()
    with pytest.raises(PassError, match="mark_sparse_dense: the graph calls no embedding module"):
        run_passes(trace(NoTables(), batch), PassContext(example_inputs=batch))


def test_embedding_output_without_mark_is_named() -> None:
    class HalfMarked(_ToyRanker):
        def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
            kjt = build_kjt(["ids"], [features["ids"]], [features["lengths"]])
            out = self.ec(kjt)
            marked = sparse_boundary(out["ids"].values(), "ids_emb", "lengths")
            return {"score": self.head(marked).squeeze(-1) + out["ids"].values().sum(-1)}

    batch = _toy_batch()
    with pytest.raises(
        PassError, match=r"embedding module 'ec' \(EmbeddingCollection\) reaches the dense side"
    ):
        run_passes(trace(HalfMarked(mark=True), batch), PassContext(example_inputs=batch))


def test_wrong_jagged_by_is_caught() -> None:
    class WrongJagged(_ToyRanker):
        def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
            kjt = build_kjt(["ids"], [features["ids"]], [features["lengths"]])
            emb = sparse_boundary(self.ec(kjt)["ids"].values(), "ids_emb", "")  # per-user? no: jagged
            return {"score": self.head(emb).squeeze(-1)}

    batch = _toy_batch()
    with pytest.raises(PassError, match=r"mark 'ids_emb' has 5 rows .* fix its jagged_by"):
        run_passes(
            trace(WrongJagged(mark=True), batch), PassContext(example_inputs=batch, schema=_toy_schema())
        )


def _toy_schema() -> Any:
    from hstu_export.package.schema import FeatureSpec, InputSchema

    return InputSchema(
        (
            FeatureSpec("lengths", "int64", "lengths"),
            FeatureSpec("ids", "int64", "jagged", "lengths"),
            FeatureSpec("weight", "float32", "jagged", "lengths"),
        )
    )


# ---- the pass manager ---------------------------------------------------------------------------


class _CountCalls:
    """A user pass: counts call_function nodes in every graph it sees."""

    name = "count_calls"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        ctx.add_stat("graphs", [ctx.current_graph])
        ctx.add_stat("calls", sum(n.op == "call_function" for n in gm.graph.nodes))
        ctx.add_stat("by_kind", {"placeholder": sum(n.op == "placeholder" for n in gm.graph.nodes), "graphs": 1})
        return gm


class _ScaleOutputs:
    """A wrong rewrite: multiplies every output by 1.01."""

    name = "scale_outputs"
    recursive = False

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):
            scaled = {
                k: gm.graph.call_function(torch.mul, (node, 1.01)) for k, node in output.args[0].items()
            }
        output.args = (scaled,)
        return gm


class _Raises:
    name = "raises"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        raise ValueError("boom")


def test_user_pass_mixed_with_names_runs_on_every_graph(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 2, seed=0)
    result = run_passes(
        trace(tiny, batch),
        PassContext(example_inputs=batch),
        passes=["split_sparse_dense", _CountCalls(), "eliminate_dead_code"],
    )
    record = result.report["count_calls"]
    assert result.report.names == ["split_sparse_dense", "count_calls", "eliminate_dead_code"]
    assert record.stats["graphs"] == ["sparse", "dense", ""] or record.stats["graphs"] == [
        "dense",
        "sparse",
        "",
    ]
    assert record.graphs[-1] == ""
    calls = sum(n.op == "call_function" for n in _nodes(result.graph))
    assert record.stats["calls"] == calls
    placeholders = sum(n.op == "placeholder" for n in _nodes(result.graph))
    assert record.stats["by_kind"] == {"placeholder": placeholders, "graphs": 3}  # dicts merge per key


def test_check_each_pass_names_the_pass_that_changed_results(tiny: HstuRankingModel, tmp_path: Path) -> None:
    batch = generate_batch(tiny.input_schema(), 2, seed=0)
    ctx = PassContext(example_inputs=batch, model=tiny, check_each_pass=True, dump_dir=tmp_path)
    with pytest.raises(PassError, match=r"pass 'scale_outputs' changed the results: max relative error 0\.01"):
        run_passes(trace(tiny, batch), ctx, passes=["prune_unused", _ScaleOutputs()])
    # The dumps up to the failure are written, the failing pass marked.
    report = (tmp_path / "report.html").read_text()
    assert '<tr class="pass ok" data-pass="prune_unused">' in report
    assert '<tr class="pass failed" data-pass="scale_outputs">' in report


def test_exception_inside_a_pass_is_a_pass_error(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 2, seed=0)
    with pytest.raises(PassError, match=r"pass 'raises' failed: ValueError: boom"):
        run_passes(trace(tiny, batch), PassContext(example_inputs=batch), passes=[_Raises()])


def test_pass_selection_errors(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 2, seed=0)
    gm = trace(tiny, batch)
    ctx = PassContext(example_inputs=batch)
    with pytest.raises(
        ConfigError, match="unknown pass 'fold_everything'; known passes: prune_unused, observe_values, mark_sparse_dense, split_sparse_dense, guard_ranges"
    ):
        run_passes(gm, ctx, passes=["prune_unused", "fold_everything"])
    with pytest.raises(ConfigError, match=r"unknown pass.*to skip.*'nope'"):
        run_passes(gm, ctx, skip=["nope"])
    with pytest.raises(ConfigError, match="neither a pass name nor a pass object"):
        run_passes(gm, ctx, passes=[42])  # type: ignore[list-item]


def test_skip_and_results_without_split(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 2, seed=0)
    # The heads' fusion left out too: it groups the heads' sums differently (last bits), and this checks that
    # the graph without a split is the model's, exactly.
    result = run_passes(trace(tiny, batch), PassContext(example_inputs=batch),
                        skip=["split_sparse_dense", "fuse_parallel_mlps"])
    assert "split_sparse_dense" not in result.report.names
    assert result.sparse is None and result.dense is None and result.boundary is None
    with pytest.raises(ConfigError, match="did not run split_sparse_dense"):
        result.run(batch)
    assert max_rel_error(result.graph(**batch), tiny(batch)) == 0.0


def _longest(jt: Any) -> int:
    """A helper reading a JaggedTensor into a Python int (kept opaque: it takes the structure itself)."""
    return int(jt.lengths().max())


class _OffsetsAndInt(nn.Module):
    """Dense code reading a lookup's offsets and an int a helper computes from the lookup's result."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["ids"])],
            device=torch.device("cpu"),
        )

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        jt = self.ec(build_kjt(["ids"], [features["ids"]], [features["lengths"]]))["ids"]
        offsets = jt.offsets()
        longest = _longest(jt)
        first = jt.values()[offsets[:-1]]  # each user's first item
        return {"score": first.sum(-1) * longest + offsets[1:].float()}


def test_offsets_and_ints_cross_the_boundary() -> None:
    model = _OffsetsAndInt()
    batch = _toy_batch()
    gm = trace(model, batch, opaque_functions=[_longest])
    result = run_passes(gm, PassContext(example_inputs=batch, schema=_toy_schema()))
    crossing = {t.name: t for t in result.boundary.sparse_outputs}
    assert crossing["ec__ids__offsets"].shape == ("batch+1",)
    [scalar] = [t for t in crossing.values() if t.shape == ()]  # the int, carried as a 0-d tensor
    assert scalar.dtype == "int64"
    for seed in range(3):
        lengths = torch.randint(1, 5, (2 + seed,), generator=torch.Generator().manual_seed(seed))
        other = {"lengths": lengths, "ids": torch.randint(0, 10, (int(lengths.sum()),)),
                 "weight": torch.rand(int(lengths.sum()))}
        torch.testing.assert_close(result.run(other)["score"], model(other)["score"], rtol=0, atol=0)


def _two_length_checks() -> torch.fx.GraphModule:
    """A graph as map_ops leaves one beside foreign jagged ops: two sequences' offsets checked against the
    bounds the foreign ops would cut them to, then used."""
    from hstu_export.capture.graph_functions import check_lengths_at_most

    graph = torch.fx.Graph()
    a, b, x = graph.placeholder("a_offsets"), graph.placeholder("b_offsets"), graph.placeholder("x")
    a = graph.call_function(check_lengths_at_most, (a, 4))
    b = graph.call_function(check_lengths_at_most, (b,), {"bound": 3})
    total = graph.call_function(torch.add, (graph.call_function(torch.sum, (a,)), graph.call_function(torch.sum, (b,))))
    graph.output({"y": graph.call_function(torch.mul, (x, total))})
    return torch.fx.GraphModule(nn.Module(), graph)


def test_length_checks_are_read_from_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from hstu_export.capture.graph_functions import check_lengths_at_most, check_no_length_beyond

    reads = []
    item = Tensor.item
    monkeypatch.setattr(Tensor, "item", lambda self: reads.append(1) or item(self))
    inputs = {"a_offsets": torch.tensor([0, 4, 6]), "b_offsets": torch.tensor([0, 3, 3]), "x": torch.randn(5)}
    gm = _two_length_checks()
    want = gm(**inputs)["y"]
    assert len(reads) == 2  # one read per check
    result = run_passes(gm, PassContext(example_inputs=inputs), passes=["defer_length_checks", "eliminate_dead_code"])
    targets = [n.target for n in result.graph.graph.nodes if n.op == "call_function"]
    assert check_lengths_at_most not in targets and targets.count(check_no_length_beyond) == 1
    assert result.report["defer_length_checks"].stats["deferred_checks"] == 2
    reads.clear()
    assert torch.equal(result.graph(**inputs)["y"], want) and len(reads) == 1
    for too_long in ({"a_offsets": torch.tensor([0, 5, 6])}, {"b_offsets": torch.tensor([0, 1, 5])}):
        with pytest.raises(RuntimeError, match="longer than the bound the model's own op would cut it to"):
            result.graph(**{**inputs, **too_long})
