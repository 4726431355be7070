"""A package's outputs named from the model (namedtuple and dataclass fields, one output per task the model
lists) or by --output-names; which of them are scores (the model's task types, --score-outputs, else
their dims); a quantized package holds the scores to the quantization tolerances and ranks only them,
the embeddings to a relative error (tests/user_models/multitask.py: DlrmHSTU's return tuple)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from user_models import multitask

import hstu_export
from hstu_export import ExportSettings, VerifySettings
from hstu_export.capture import trace
from hstu_export.cli import main as cli_main
from hstu_export.errors import ConfigError, PackageError
from hstu_export.exporter import capture
from hstu_export.package.manifest import parse_manifest
from hstu_export.settings import QUANTIZED_RELATIVE_L2, QUANTIZED_TOLERANCES, parse_output_names
from hstu_export.sources.output_plan import OutputPlan, kind_from_dims, plan_outputs
from hstu_export.sources.outputs import call_model, flatten_outputs
from hstu_export.sources.schema_inference import flatten_example, infer_schema

TASKS = ["click", "like", "watch_time"]
NAMED = ["user_embeddings", "item_embeddings", *TASKS]
RENAMES = "output_0=user_embeddings,output_1=item_embeddings"


def _bundle(tmp: Path, returns: str = "tuple", lists_tasks: bool = True) -> Path:
    return hstu_export.save_bundle(
        multitask.build_ranker(returns=returns, lists_tasks=lists_tasks), tmp / f"{returns}-{lists_tasks}.pt",
        example_inputs=multitask.example_inputs([5, 3, 7], [2, 1, 3]), factory="user_models.multitask:build_ranker",
        factory_kwargs={"returns": returns, "lists_tasks": lists_tasks}, ranges=multitask.RANGES)


@pytest.fixture(scope="module")
def tuple_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _bundle(tmp_path_factory.mktemp("multitask"))


# ---- names from the model's structure ---------------------------------------------------------------


@pytest.mark.parametrize("returns", ["namedtuple", "dataclass"])
def test_fields_name_the_outputs_in_the_graph_and_the_model(returns: str) -> None:
    model = multitask.build_ranker(returns=returns, lists_tasks=False)
    example = multitask.example_inputs([4, 2], [3, 2])
    schema = infer_schema(model, example, ranges=multitask.RANGES)
    batch = flatten_example(schema, example, None, model)
    gm = trace(model, batch, schema=schema)
    with torch.no_grad():
        got, expected = gm(**schema.to_graph_inputs(batch)), call_model(model, schema, batch)
    assert list(got) == list(expected) == ["user_embeddings", "item_embeddings", "predictions"]
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    # The class calls the traced code made are gone from the graph.
    assert not [n for n in gm.graph.nodes if n.target in (multitask.RankerOutput, multitask.RankerResult)]


def test_nested_fields_join_with_dots() -> None:
    inner = multitask.RankerResult(torch.zeros(1), torch.ones(1), torch.full((1,), 2.0))
    flat = flatten_outputs((multitask.RankerOutput(torch.zeros(2), torch.ones(2), torch.ones(3)), {"aux": inner}))
    assert list(flat) == ["output_0.user_embeddings", "output_0.item_embeddings", "output_0.predictions",
                          "output_1.aux.user_embeddings", "output_1.aux.item_embeddings", "output_1.aux.predictions"]


@pytest.mark.parametrize("returns, lists_tasks, names, kinds", [
    ("tuple", True, ["output_0", "output_1", *TASKS], ["embedding", "embedding", "probability", "probability", "score"]),
    ("namedtuple", True, NAMED, ["embedding", "embedding", "probability", "probability", "score"]),
    ("dataclass", True, NAMED, ["embedding", "embedding", "probability", "probability", "score"]),
    # No tasks listed: the predictions stay one [tasks, candidates] tensor, and no output is one score per
    # candidate.
    ("tuple", False, ["output_0", "output_1", "output_3"], ["embedding", "embedding", "other"]),
])
def test_capture_names_outputs_from_the_model(tmp_path: Path, returns: str, lists_tasks: bool, names: list[str],
                                              kinds: list[str]) -> None:
    bundle = hstu_export.load_bundle(_bundle(tmp_path, returns, lists_tasks))
    captured = capture(bundle, ExportSettings(backend="torchscript", max_batch_size=4), "aten")
    assert captured.output_plan.names == names
    assert list(captured.result.dense.graph.find_nodes(op="output")[0].args[0]) == names
    assert list(captured.reference(captured.example)) == names
    entries = {e["name"]: e for e in _describe(captured)}
    assert [entries[n]["kind"] for n in names] == kinds
    if lists_tasks:
        # Each task is its row of the model's predictions tensor, for every batch.
        source = "output_3" if returns == "tuple" else "predictions"
        assert [(entries[t]["model_output"], entries[t]["dim"], entries[t]["index"]) for t in TASKS] == \
            [(source, 0, 0), (source, 0, 1), (source, 0, 2)]
        model = bundle.model
        with torch.no_grad():
            whole = flatten_outputs(model(*multitask.example_inputs([2, 6, 1], [4, 1, 5], seed=3)))[source]
            flat = flatten_example(bundle.input_schema, multitask.example_inputs([2, 6, 1], [4, 1, 5], seed=3), None,
                                   model)
            named = call_model(model, bundle.input_schema, flat, captured.output_plan)
        assert whole.shape == (3, 10)
        assert all(torch.equal(named[t], whole[i]) for i, t in enumerate(TASKS))


def _describe(captured):  # type: ignore[no-untyped-def]
    from hstu_export.exporter import _compile_inputs, _output_shapes

    settings = ExportSettings(backend="torchscript", max_batch_size=4)
    inputs = _compile_inputs(captured.result, captured.schema.to_graph_inputs(captured.example), captured.schema,
                             captured.ranges, settings)
    dims = _output_shapes(captured.result, captured.schema, captured.ranges, inputs, settings)
    return captured.output_plan.describe(dims, inputs.example_outputs)


def test_task_axis_is_the_one_that_keeps_its_size() -> None:
    """[candidates, tasks] predictions split along dim 1; an output whose size equals the task count only
    by chance on one batch (here the embeddings' rows) is not taken for the tasks."""
    model = multitask.build_ranker()
    first = {"emb": torch.zeros(3, 8), "preds": torch.zeros(3, 3)}  # 3 candidates, 3 tasks: ambiguous alone
    other = {"emb": torch.zeros(5, 8), "preds": torch.zeros(5, 3)}
    plan = plan_outputs(model, first, other, renames={})
    assert plan.names == ["emb", *TASKS] and {o.dim for o in plan.outputs if o.index is not None} == {1}
    assert plan_outputs(model, first, None, renames={}).names == ["emb", "preds"]  # one batch: undecided


def test_a_binary_task_returning_logits_is_a_score() -> None:
    model = multitask.build_ranker()
    first, other = {"preds": torch.tensor([[3.0, -2.0], [0.2, 0.4], [9.0, 1.0]])}, {"preds": torch.zeros(3, 5)}
    assert [o.kind for o in plan_outputs(model, first, other, renames={}).outputs] == ["score", "probability", "score"]


@pytest.mark.parametrize("dims, value, kind", [
    (["candidates.total"], torch.zeros(4), "score"),
    (["candidates.total", 1], torch.zeros(4, 1), "score"),
    (["batch", "candidates.max"], torch.zeros(2, 4), "score"),
    (["batch"], torch.zeros(2), "score"),  # one value per user: a score with nothing to rank
    (["candidates.total", 8], torch.zeros(4, 8), "embedding"),
    (["candidates.total"], torch.zeros(4, dtype=torch.int64), "other"),
    ([3, "candidates.total"], torch.zeros(3, 4), "other"),
    ([], torch.zeros(()), "other"),
])
def test_kind_from_dims(dims: list[int | str], value: torch.Tensor, kind: str) -> None:
    assert kind_from_dims(dims, value, scores_declared=False) == kind
    if kind == "score":  # the model or the user said which outputs are scores: this one is not
        assert kind_from_dims(dims, value, scores_declared=True) in ("embedding", "other")


# ---- --output-names and --score-outputs -----------------------------------------------------------


def test_renames_and_score_outputs() -> None:
    model = multitask.build_ranker()
    first = {"output_0": torch.zeros(4, 8), "output_1": torch.zeros(4, 8), "output_3": torch.rand(3, 4)}
    other = {name: torch.zeros(*[6 if s == 4 else s for s in v.shape]) for name, v in first.items()}
    plan = plan_outputs(model, first, other, renames=parse_output_names(RENAMES + ",like=is_like"),
                        score_outputs=("output_0", "click"))
    assert plan.names == ["user_embeddings", "item_embeddings", "click", "is_like", "watch_time"]
    kinds = {o.name: (o.kind, o.kind_from) for o in plan.outputs}
    # --score-outputs by the model's name or the package's; a declared probability stays one.
    assert kinds["user_embeddings"] == ("score", "user") and kinds["click"] == ("probability", "user")
    assert kinds["is_like"] == ("probability", "model") and kinds["item_embeddings"] == (None, None)


@pytest.mark.parametrize("renames, scores, message", [
    ("output_9=x", (), "the model has no output 'output_9'; its outputs are output_0, output_1, click, like, watch_time"),
    ("output_0=emb,output_1=emb", (), "output name(s) 'emb' given to more than one output"),
    ("output_0=click", (), "output name(s) 'click' given to more than one output"),
    ("output_3=predictions", (), "served as one output per task (click, like, watch_time); rename those instead"),
    ("output_0=a\tb", (), "contains a control character"),
    ("output_0=" + "x" * 300, (), "is too long"),
    ("output_0=candidates_features.cand_item_id.values", (), "is a request feature's name"),
    ("", ("ctr",), "--score-outputs ctr: no output of the model is called 'ctr'"),
])
def test_bad_names_are_refused(renames: str, scores: tuple[str, ...], message: str) -> None:
    model = multitask.build_ranker()
    first = {"output_0": torch.zeros(4, 8), "output_1": torch.zeros(4, 8), "output_3": torch.rand(3, 4)}
    other = {name: torch.zeros(*[6 if s == 4 else s for s in v.shape]) for name, v in first.items()}
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_outputs(model, first, other, renames=parse_output_names(renames), score_outputs=scores,
                     reserved=("candidates_features.cand_item_id.values",))


@pytest.mark.parametrize("args, message", [
    (["--output-names", "output_9=x"], "the model has no output 'output_9'"),
    (["--output-names", "output_0=emb,output_1=emb"], "'emb' given to more than one output"),
    (["--output-names", "output_0="], "an output needs a non-empty name"),
    (["--output-names", "output_0"], "use MODEL_OUTPUT=NAME"),
    (["--output-names", "output_0=a,output_0=b"], "renamed twice"),
    (["--score-outputs", "ctr"], "--score-outputs ctr: no output of the model is called 'ctr'"),
])
def test_cli_refuses_bad_names_in_one_line(tuple_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           args: list[str], message: str) -> None:
    code = cli_main([str(tuple_bundle), "--backend", "torchscript", "-q", "--max-batch-size", "4",
                     "-o", str(tmp_path / "pkg"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "pkg").exists()


def test_kv_cache_keeps_the_models_names(tiny_zoo_bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--kv-cache serves the zoo model's outputs under the model's own names"):
        hstu_export.export(tiny_zoo_bundle, tmp_path / "pkg", ExportSettings(kv_cache=True, max_batch_size=2,
                                                                             output_names={"ctr": "click"}))


@pytest.fixture(scope="module")
def tiny_zoo_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hstu_export.models import build_preset

    model = build_preset("tiny", seed=1)
    return hstu_export.save_bundle(model, tmp_path_factory.mktemp("zoo") / "tiny.pt",
                                   hstu_export.generate_batch(model.input_schema(), 3, seed=0))


# ---- quantized: scores at the quantization tolerances, embeddings at a relative error -------------


@pytest.mark.slow
def test_int8_holds_the_scores_to_the_quantization_tolerances(tuple_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    assert cli_main([str(tuple_bundle), "--backend", "torchscript", "-q", "--max-batch-size", "4", "-o", str(out),
                     "--quantize-embeddings", "int8", "--output-names", RENAMES]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    parity = manifest["parity"]
    assert manifest["output_names"] == NAMED
    assert [(o["name"], o["kind"], o["kind_from"]) for o in manifest["outputs"]] == [
        ("user_embeddings", "embedding", "shape"), ("item_embeddings", "embedding", "shape"),
        ("click", "probability", "model"), ("like", "probability", "model"), ("watch_time", "score", "model")]
    # Default tolerances: the quantization's for the scores, a relative L2 error for the embeddings.
    assert parity["passed"] and parity["tolerances"] == QUANTIZED_TOLERANCES["int8"]
    assert parity["output_tolerances"] == {n: {"rel_l2": QUANTIZED_RELATIVE_L2["int8"]} for n in NAMED[:2]}
    worst = {n: max(row["errors"][n]["max_abs"] for row in parity["batches"]) for n in NAMED}
    # The embeddings' absolute error is beyond what a probability may have (the issue's failure), the
    # scores' within it.
    assert min(worst[n] for n in NAMED[:2]) > QUANTIZED_TOLERANCES["int8"]["max_abs"]
    assert 0 < max(worst[t] for t in TASKS) <= QUANTIZED_TOLERANCES["int8"]["max_abs"]
    # Rank agreement only for the scores.
    assert set(parity["rank_agreement"]) == set(TASKS)
    assert all(r["users"] > 10 and -1 <= r["min_tau"] <= r["mean_tau"] <= 1 for r in parity["rank_agreement"].values())
    assert all(set(row["rank_agreement"]) <= set(TASKS) for row in parity["batches"])

    # Later, hstu-export verify: the model named as the package, the same tolerances and rankings.
    report = hstu_export.verify_package(out, None, num_random=1)
    assert report["passed"] and report["output_tolerances"] == parity["output_tolerances"]
    assert set(report["rank_agreement"]) == set(TASKS)
    predictor = hstu_export.load(out)
    assert predictor.output_kinds == {o["name"]: o["kind"] for o in manifest["outputs"]}
    # --rtol holds every output, the embeddings too: tighter than quantization leaves, it fails.
    assert not hstu_export.verify_package(out, None, num_random=1, rtol=1e-4)["passed"]
    # A manifest whose outputs disagree with output_names is refused by name.
    for bad in ([dict(o, kind="banana") for o in manifest["outputs"]], manifest["outputs"][::-1]):
        with pytest.raises(PackageError, match="manifest field outputs"):
            parse_manifest(dict(manifest, outputs=bad), out)
    assert OutputPlan.from_manifest(manifest).names == NAMED


@pytest.mark.slow
def test_aoti_and_the_cpp_runtime_serve_the_named_outputs(tuple_bundle: Path, tmp_path: Path, cpp_runtime) -> None:  # type: ignore[no-untyped-def]
    from hstu_export.package.tensor_dir import load_tensors, save_tensors

    result = hstu_export.export(tuple_bundle, tmp_path / "pkg", ExportSettings(
        backend="aoti", max_batch_size=4, output_names=RENAMES, verify=VerifySettings(num_random_batches=1)))
    assert result.parity["passed"] and result.manifest["output_names"] == NAMED
    predictor = hstu_export.load(result.path)
    model = hstu_export.load_bundle(tuple_bundle).model
    batch = flatten_example(predictor.input_schema, multitask.example_inputs([3, 9], [5, 2], seed=4), None, model)
    with torch.no_grad():
        whole = model(*multitask.example_inputs([3, 9], [5, 2], seed=4))
    got = predictor(batch)
    assert list(got) == NAMED
    torch.testing.assert_close(got["user_embeddings"], whole[0], rtol=1e-5, atol=1e-5)
    for i, task in enumerate(TASKS):
        torch.testing.assert_close(got[task], whole[3][i], rtol=1e-5, atol=1e-5)
    done = cpp_runtime.run(result.path, save_tensors(batch, tmp_path / "request"), "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{n}.pt" for n in NAMED)
    cpp = load_tensors(tmp_path / "out")
    assert all(torch.equal(cpp[n], got[n]) for n in NAMED)
