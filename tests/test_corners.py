"""A package serves every request inside its exported ranges, down to their minima (issue 37).

Verification derives the corners of the ranges from the schema (every dynamic dim at its minimum and
its maximum, alone and combined); export runs the compiled program on each and narrows a bound it
refuses, saying so; a model written in generative-recommenders' manner (contextual tokens prepended,
candidates counted from the batch, padding to the batch's longest sequence) serves 1 user with 1 history
item and 1 candidate on every backend, in Python and C++.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from user_models import gr_style

import hstu_export
from hstu_export import ExportSettings, VerifySettings
from hstu_export.cli import main as cli_main
from hstu_export.errors import RequestError, VerificationError
from hstu_export.exporter import NarrowedRangeWarning
from hstu_export.models import build_preset
from hstu_export.package.ranges import ExportRanges
from hstu_export.package.tensor_dir import load_tensors, save_tensors
from hstu_export.sources.outputs import call_model
from hstu_export.sources.schema_inference import flatten_example
from hstu_export.verification.corners import corner_sizes, settle_ranges, verification_batches

RANGES = ExportRanges(4, {"uih_lengths": 46, "candidate_lengths": 16}, {"uih_lengths": 1, "candidate_lengths": 1})


@pytest.fixture(scope="module")
def tiny_schema():
    return build_preset("tiny", seed=1).input_schema()


# ---- the corners -------------------------------------------------------------------------------


def test_corners_are_every_dim_at_each_extreme_alone_and_combined(tiny_schema) -> None:
    corners = {tuple(sorted(c.items())) for c in corner_sizes(tiny_schema, RANGES)}
    expected = {(("batch", b), ("candidate_lengths", c), ("uih_lengths", u))
                for b in (1, 4) for u in (1, 46) for c in (1, 16)}
    assert corners == expected
    labels = [label for label, _ in verification_batches(tiny_schema, RANGES, seed=3, num_random=2)]
    assert labels[0] == "corner: B=1, uih_lengths=1 (min), candidate_lengths=1 (min)"
    assert "corner: B=4, uih_lengths=1 (min), candidate_lengths=1 (min)" in labels  # the max batch, every user short
    assert labels[8:10] == ["mixed: the shortest and the longest user in one batch",
                            "mixed: 4 users alternating shortest and longest"]
    assert [label.split(" (B=")[0] for label in labels[10:]] == ["random batch 1", "random batch 2"]


def test_corner_batches_have_the_sizes_their_labels_name(tiny_schema) -> None:
    for label, batch in verification_batches(tiny_schema, RANGES, seed=3, num_random=0)[:8]:
        users = batch["uih_lengths"].size(0)
        assert f"B={users}," in label
        for name in ("uih_lengths", "candidate_lengths"):
            assert batch[name].unique().tolist() == [int(label.split(f"{name}=")[1].split(" ")[0])]


def test_more_dims_than_all_combinations_allow_give_each_dim_against_the_rest(tiny_schema) -> None:
    from hstu_export.package.schema import FeatureSpec, InputSchema

    extra = tuple(FeatureSpec(f"len{i}", "int64", "lengths", min_value=1, max_value=5) for i in range(4))
    schema = InputSchema(tiny_schema.features + extra)
    ranges = ExportRanges(4, {**RANGES.max_lengths, **{f"len{i}": 5 for i in range(4)}},
                          {**RANGES.min_lengths, **{f"len{i}": 1 for i in range(4)}})
    corners = corner_sizes(schema, ranges)
    assert len(corners) == 2 * 7 + 2  # 7 dims: the batch and 6 lengths features
    assert {"batch": 1, "uih_lengths": 46, "candidate_lengths": 16, **{f"len{i}": 5 for i in range(4)}} in corners


# ---- narrowing what the program refuses ---------------------------------------------------------


def refusing(fewest_candidates: int = 1, most_users: int = 4):
    def run(batch: dict[str, torch.Tensor]) -> None:
        if int(batch["candidate_lengths"].min()) < fewest_candidates:
            raise RuntimeError(f"Expected u14 >= {fewest_candidates} but received 1")
        if batch["candidate_lengths"].size(0) > most_users:
            raise RuntimeError("Expected s0 <= 2")
    return run


def test_settle_ranges_narrows_the_refused_bound_only(tiny_schema) -> None:
    settled, narrowed = settle_ranges(refusing(fewest_candidates=3), tiny_schema, RANGES, seed=1)
    assert settled.min_lengths == {"uih_lengths": 1, "candidate_lengths": 3}
    assert settled.max_lengths == RANGES.max_lengths and settled.max_batch_size == 4
    assert narrowed == [{"feature": "candidate_lengths", "bound": "min", "declared": 1, "exported": 3,
                         "reason": "Expected u14 >= 3 but received 1"}]
    settled, narrowed = settle_ranges(refusing(most_users=2), tiny_schema, RANGES, seed=1)
    assert settled.max_batch_size == 2 and [r["feature"] for r in narrowed] == ["batch size"]
    assert settle_ranges(refusing(), tiny_schema, RANGES, seed=1) == (RANGES, [])


def test_settle_ranges_refuses_when_no_narrowing_helps(tiny_schema) -> None:
    def never(batch: dict[str, torch.Tensor]) -> None:
        raise RuntimeError("Expected nothing but received something")

    with pytest.raises(VerificationError, match=r"refuses a request inside its ranges \(B=1, uih_lengths=1 \(min\), "
                                                r"candidate_lengths=1 \(min\): Expected nothing.*no narrower range"):
        settle_ranges(never, tiny_schema, RANGES, seed=1)


@pytest.mark.slow
def test_export_narrows_a_bound_its_program_refuses_and_says_so(tmp_path, monkeypatch) -> None:
    """A program that refuses one candidate (as a compiled guard would): the package is written with
    candidate_lengths >= 2, the warning is one line, the manifest records it, and the package refuses one
    candidate with a RequestError naming the new minimum."""
    from hstu_export.runtimes.predictor import Predictor

    model = build_preset("tiny", seed=1)
    bundle = hstu_export.save_bundle(model, tmp_path / "tiny.pt", hstu_export.generate_batch(model.input_schema(), 3))
    served = Predictor.__call__

    def guarded(self, batch):  # type: ignore[no-untyped-def]
        if int(batch["candidate_lengths"].min()) < 2:
            guard = RuntimeError("Expected u3 >= 2 but received 1")
            raise self.refusal(guard, batch) from guard
        return served(self, batch)

    monkeypatch.setattr(Predictor, "__call__", guarded)
    settings = ExportSettings(backend="torchscript", max_batch_size=4, verify=VerifySettings(num_random_batches=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = hstu_export.export(bundle, tmp_path / "pkg", settings)
    notes = [str(w.message) for w in caught if issubclass(w.category, NarrowedRangeWarning)]
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert notes[0] == ("candidate_lengths narrowed to >= 2 (declared 1): the compiled program refuses requests beyond "
                        "it (Expected u3 >= 2 but received 1)")
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest["ranges"]["narrowed"][0]["feature"] == "candidate_lengths"
    assert manifest["ranges"]["lengths"]["min_lengths"]["candidate_lengths"] == 2
    assert result.parity["passed"] and all("candidate_lengths=1 " not in r["batch"] for r in result.parity["batches"])
    monkeypatch.setattr(Predictor, "__call__", served)
    predictor = hstu_export.load(result.path)
    one = hstu_export.generate_batch(predictor.input_schema, 1, seed=2, lengths={"candidate_lengths": [1]})
    with pytest.raises(RequestError, match="'candidate_lengths' has value 1 below the minimum 2"):
        predictor(one)


# ---- a model written in generative-recommenders' manner, at its corners ---------------------------

CORNERS = [([1], [1]), ([12], [1]), ([1], [5]), ([12], [5]), ([1] * 4, [1] * 4), ([12] * 4, [5] * 4), ([1, 12], [5, 1])]


@pytest.fixture(scope="module")
def gr_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hstu_export.save_bundle(
        gr_style.build_ranker(), tmp_path_factory.mktemp("gr_style") / "model.pt",
        example_inputs=gr_style.example_inputs([5, 3, 7], [2, 1, 3]), factory="user_models.gr_style:build_ranker",
        ranges=gr_style.RANGES)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aoti", "torchscript", "onnx"])
def test_gr_style_model_serves_every_corner(gr_bundle: Path, tmp_path: Path, backend: str,
                                           request: pytest.FixtureRequest) -> None:
    settings = ExportSettings(backend=backend, max_batch_size=4, verify=VerifySettings(num_random_batches=1),
                              op_mappings={gr_style.ATTENTION: gr_style.GR_ATTENTION})
    result = hstu_export.export(gr_bundle, tmp_path / "pkg", settings)
    assert result.parity["passed"] and "narrowed" not in result.manifest["ranges"]
    labels = [r["batch"] for r in result.parity["batches"]]
    assert ("corner: B=1, uih_features.uih_item_id.lengths=1 (min), candidates_features.cand_item_id.lengths=1 (min)"
            in labels)

    predictor = hstu_export.load(result.path)
    model = hstu_export.load_bundle(gr_bundle).model
    cpp = request.getfixturevalue("cpp_runtime") if backend in ("aoti", "torchscript") else None
    for i, (history, candidates) in enumerate(CORNERS):
        batch = flatten_example(predictor.input_schema, gr_style.example_inputs(history, candidates, seed=i), None,
                                model)
        with torch.no_grad():
            expected = call_model(model, predictor.input_schema, batch)
        got = predictor(batch)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5)
        if cpp is not None:
            done = cpp.run(result.path, save_tensors(batch, tmp_path / f"request{i}"), "--out", tmp_path / f"out{i}")
            assert done.returncode == 0, done.stderr
            served = load_tensors(tmp_path / f"out{i}")
            assert all(torch.equal(served[k], got[k]) for k in got), (history, candidates)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aoti", "torchscript", "onnx"])
def test_max_batch_size_1_exports_and_serves_one_user(tmp_path: Path, backend: str, capsys) -> None:
    model = build_preset("tiny", seed=1)
    bundle = hstu_export.save_bundle(model, tmp_path / "tiny.pt", hstu_export.generate_batch(model.input_schema(), 3))
    code = cli_main([str(bundle), "--backend", backend, "--max-batch-size", "1", "--out", str(tmp_path / "pkg"),
                     "--verify-batches", "1", "-q"])
    assert code == 0, capsys.readouterr().err
    predictor = hstu_export.load(tmp_path / "pkg")
    one = hstu_export.generate_batch(predictor.input_schema, 1, seed=4)
    with torch.no_grad():
        expected = call_model(model, predictor.input_schema, one)
    got = predictor(one)
    assert all(torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-5) for k in expected)
    with pytest.raises(RequestError, match="batch size 2 is beyond the exported maximum 1"):
        predictor(hstu_export.generate_batch(predictor.input_schema, 2, seed=4))


@pytest.mark.slow
def test_a_compiled_guard_is_narrowed_at_export_and_named_by_both_runtimes(gr_bundle: Path, tmp_path: Path,
                                                                          monkeypatch, cpp_runtime) -> None:
    """Without the fix that keeps data-read sizes at their declared minima, AOTInductor compiles a guard
    that refuses 1 user with 1 candidate (the bug this issue reported). Unverified, such a package refuses
    the request in both runtimes with one line naming the features at their limits; verified, export
    narrows the candidates' minimum, says so and records it. The model's sums of lengths stay reads from the
    data here (prove_length_reads left out: it would take them from shapes, and no guard would be compiled)."""
    import contextlib

    import hstu_export.runtimes.aoti as aoti

    monkeypatch.setattr(aoti, "unbacked_ranges_hold_at_one", contextlib.nullcontext)
    mappings, reads = {gr_style.ATTENTION: gr_style.GR_ATTENTION}, ("prove_length_reads",)
    unverified = hstu_export.export(gr_bundle, tmp_path / "unverified", ExportSettings(
        backend="aoti", max_batch_size=4, op_mappings=mappings, verify=VerifySettings(enabled=False),
        skip_passes=reads))
    predictor = hstu_export.load(unverified.path)
    model = hstu_export.load_bundle(gr_bundle).model
    one = flatten_example(predictor.input_schema, gr_style.example_inputs([3], [1], seed=1), None, model)
    with pytest.raises(RequestError) as info:
        predictor(one)
    message = str(info.value)
    assert "refuse this request although its manifest accepts it (Expected " in message, message
    assert "candidates_features.cand_item_id.lengths=1..1 (min)" in message and "B=1 (min)" in message
    done = cpp_runtime.run(unverified.path, save_tensors(one, tmp_path / "one"), "--out", tmp_path / "out")
    assert done.returncode != 0 and "refuse this request although its manifest accepts it (Expected " in done.stderr
    assert "candidates_features.cand_item_id.lengths=1..1 (min)" in done.stderr

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verified = hstu_export.export(gr_bundle, tmp_path / "verified", ExportSettings(
            backend="aoti", max_batch_size=4, op_mappings=mappings, verify=VerifySettings(num_random_batches=1),
            skip_passes=reads))
    notes = [str(w.message) for w in caught if issubclass(w.category, NarrowedRangeWarning)]
    assert len(notes) == 1 and notes[0].startswith("candidates_features.cand_item_id.lengths narrowed to >= 2 "
                                                   "(declared 1): the compiled program refuses"), notes
    [record] = verified.manifest["ranges"]["narrowed"]
    assert (record["bound"], record["declared"], record["exported"]) == ("min", 1, 2) and "Expected" in record["reason"]
    assert verified.parity["passed"]
    with pytest.raises(RequestError, match="below the minimum 2"):
        hstu_export.load(verified.path)(one)

    # With prove_length_reads the sums are the sizes of the request's tensors: no such guard is compiled, and the
    # same package, still without the fix, answers that request as the model does.
    proven = hstu_export.export(gr_bundle, tmp_path / "proven", ExportSettings(
        backend="aoti", max_batch_size=4, op_mappings=mappings, verify=VerifySettings(enabled=False)))
    assert proven.manifest["backend"]["meta"]["dense_device_reads"] < unverified.manifest["backend"]["meta"][
        "dense_device_reads"]
    with torch.no_grad():
        expected = call_model(model, predictor.input_schema, one)
    got = hstu_export.load(proven.path)(one)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("fixed", "processes"), [(False, False), (False, True), (True, False)],
                         ids=["batch-scaled-threads", "batch-scaled-processes", "fixed-scale-threads"])
def test_gr_style_requests_sent_together_answer_as_alone(gr_bundle: Path, tmp_path_factory, fixed, processes) -> None:  # type: ignore[no-untyped-def]
    """The model's corner requests, 1 to 4 users, sent at once to two replicas: each answer is the package's
    answer to that request alone. The model's attention divides by the batch's longest sequence, so combined
    into one call they would score otherwise (by 1e-3 here; by far more between a short and a long history):
    the export records it and says so, and the package is served one request per call. The same model
    dividing by a fixed length has its requests share calls."""
    from hstu_export.exporter import BatchDependentWarning
    from hstu_export.serving.batching import BatchingPredictor
    from hstu_export.serving.replicas import ReplicaSet

    work = tmp_path_factory.mktemp("gr_replicas")
    bundle = gr_bundle
    if fixed:
        bundle = hstu_export.save_bundle(
            gr_style.build_cacheable_ranker(), work / "model.pt", example_inputs=gr_style.example_inputs([5, 3], [2, 1]),
            factory="user_models.gr_style:build_cacheable_ranker", ranges=gr_style.RANGES)
    settings = ExportSettings(backend="torchscript", max_batch_size=4, verify=VerifySettings(num_random_batches=1),
                              op_mappings={gr_style.ATTENTION: gr_style.GR_ATTENTION})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        path = hstu_export.export(bundle, work / "pkg", settings).path
    said = [str(w.message) for w in seen if issubclass(w.category, BatchDependentWarning)]
    predictor = hstu_export.load(path)
    batcher = BatchingPredictor(predictor)
    if not fixed:
        assert "divides by the longest sequence" in predictor.manifest["batch_dependent"]
        assert len(said) == 1 and "served one request per call" in said[0], said
        assert not batcher.batches_requests
    else:
        assert "batch_dependent" not in predictor.manifest and not said
        assert batcher.batches_requests
    model = hstu_export.load_bundle(bundle).model
    requests = [flatten_example(predictor.input_schema, gr_style.example_inputs(h, c, seed=i), None, model)
                for i, (h, c) in enumerate(CORNERS * 2)]
    with ReplicaSet(path, ["cpu", "cpu"], max_queue_delay_ms=200, processes=processes) as replicas:
        futures = [replicas.submit(r) for r in requests]
        answers = [f.result(timeout=120) for f in futures]
    for request, answer in zip(requests, answers):
        expected = predictor(request)
        assert sorted(answer) == sorted(expected)
        for name in expected:
            torch.testing.assert_close(answer[name], expected[name], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_published_version_whose_answers_depend_on_the_batch_is_not_switched_to(gr_bundle: Path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A server batching version 1's requests cannot go on batching version 2's: the switch is refused."""
    from hstu_export.package.publish import publish
    from hstu_export.serving.published import PublishedPredictor

    settings = ExportSettings(backend="torchscript", max_batch_size=4, verify=VerifySettings(num_random_batches=1),
                              op_mappings={gr_style.ATTENTION: gr_style.GR_ATTENTION})
    fixed = hstu_export.save_bundle(
        gr_style.build_cacheable_ranker(), tmp_path / "model.pt", example_inputs=gr_style.example_inputs([5, 3], [2, 1]),
        factory="user_models.gr_style:build_cacheable_ranker", ranges=gr_style.RANGES)
    first = hstu_export.export(fixed, tmp_path / "v1", settings).path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = hstu_export.export(gr_bundle, tmp_path / "v2", settings).path
    root = tmp_path / "ranker"
    publish(first, root)
    served = PublishedPredictor(root, check_seconds=0.0)
    publish(second, root)
    assert served.refresh() == 1
    assert "batching (batch_dependent) differ" in served.last_error, served.last_error
