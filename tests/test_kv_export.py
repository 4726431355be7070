"""``--kv-cache``: a package with the delta program, served through its own cache (CPU, AOTInductor).

Every answer of the cached package is compared with the same package's no-cache path on the whole
request: after a prefill, hits, one-token and multi-page growth, a new user among cached ones,
evictions, the same user twice in a batch and two threads on one user."""

from __future__ import annotations

import functools
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from kv_requests import CONFIGS, PAGE, Users, bundle_of
from manifests import write_manifest_bytes

import hstu_export
from hstu_export import ExportSettings
from hstu_export.cli import main as cli_main
from hstu_export.errors import ConfigError, PackageError
from hstu_export.exporter import export
from hstu_export.models.ranking import HstuRankingModel

CLOSE = dict(rtol=1e-5, atol=1e-5)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **CLOSE)


@pytest.mark.slow
def test_the_package_records_a_verified_delta_program(kv_package) -> None:  # type: ignore[no-untyped-def]
    name, root, manifest = kv_package
    kv = manifest["kv_cache"]
    assert kv["program"] in manifest["files"] and (root / kv["program"]).is_file()
    assert kv["page_size"] == PAGE and kv["layout"]["num_layers"] == 2
    # On CPU the programs are compiled with Inductor's defaults but the matmul padding pass (the delta program's
    # own are CUDA's only).
    assert kv["inductor_options"] == manifest["backend"]["meta"]["inductor_options"] == {"shape_padding": False}
    # The program's exported bounds: 16 users (the export example's, above the package's 4) and their tokens,
    # and room for a shape bucket's padding user (a user, and the tokens that round the counts up).
    ranges = manifest["ranges"]["lengths"]["max_lengths"]
    assert kv["bounds"] == {"batch": 17, "new_history": 16 * ranges["uih_lengths"] + min(64, ranges["uih_lengths"]),
                            "candidates": 16 * ranges["candidate_lengths"] + min(32, ranges["candidate_lengths"])}
    assert kv["layout"]["contextual_features"] == list(CONFIGS[name].contextual_features)
    checked = manifest["parity"]["kv_cache"]
    assert checked["passed"] and len(checked["batches"]) == 4
    assert checked["cache"]["hits"] >= 3
    assert checked["worst"]["rel_l2"] <= 1e-5
    # Without contextual features a grown history reuses its prefix; with them it is recomputed (stale).
    assert (checked["cache"]["stale"] > 0) == (name == "context")
    # The export's report lists the requests served through the cache with the verification batches.
    from hstu_export.report.build import parity_record

    rows = [row.batch for row in parity_record(manifest["parity"]).batches]
    assert sum(row.startswith("KV cache: ") for row in rows) == 4 and len(rows) == 4 + len(manifest["parity"]["batches"])


@pytest.mark.slow
@pytest.mark.parametrize("bucketed", [False, True, "buffers"], ids=["as-is", "padded-to-buckets", "bucket-buffers"])
def test_cached_package_answers_as_the_package_without_cache(kv_package, bucketed: bool | str) -> None:  # type: ignore[no-untyped-def]
    """``padded-to-buckets``: every delta run padded with a padding user to its shape bucket.
    ``bucket-buffers``: requests run as on CUDA with graphs, written into their bucket's buffers (which
    keep an earlier request's padding rows) and the program run on those (the graphs need a GPU)."""
    from hstu_export.runtimes.kv_graphs import GraphCache

    name, root, _ = kv_package
    predictor = hstu_export.load(root)
    ranker = predictor.kv_cache(budget_bytes=1 << 20)
    runner = ranker.runner
    if bucketed is True:
        runner.run_program = functools.partial(runner.run_program, bucketed=True)  # type: ignore[method-assign]
    elif bucketed == "buffers":
        runner.graphs = GraphCache(runner._run, runner._buckets, runner.layout.contextual_seq_len, capture=False)
    users = Users(CONFIGS[name], seed=3)
    users.grow("a", 20)
    users.grow("b", 5)
    steps = [
        (["a", "b"], [3, 2]),  # prefill
        (["b", "a"], [1, 4]),  # hits: new candidates only (b: one new token)
    ]
    for names, candidates in steps:
        request = users.request(names, candidates)
        _same(ranker(request, names), predictor(request))
    users.grow("a", 1)  # one token
    users.grow("b", 2 * PAGE + 3)  # across pages
    users.grow("c", 7)
    for names, candidates in ((["a", "b"], [2, 2]), (["c", "a", "b"], [1, 3, 2])):
        request = users.request(names, candidates)
        _same(ranker(request, names), predictor(request))
    # Requests of one bucket: new candidates only, split differently between the users: the second is
    # captured into the bucket's buffers, the later ones written over it.
    for candidates in ([2, 3], [2, 3], [4, 1], [1, 4]):
        request = users.request(["a", "b"], candidates)
        _same(ranker(request, ["a", "b"]), predictor(request))
    if bucketed == "buffers":
        assert runner.graphs is not None and runner.graphs.counts["replays"] >= 3
    stats = ranker.cache.stats()
    assert stats["misses"] == 3 and stats["users"] == 3
    if name == "no-context":
        assert stats["hits"] == 14 and stats["stale"] == 0
    else:  # contextual tokens see the whole history: a grown history is recomputed
        assert stats["hits"] == 12 and stats["stale"] == 2
    # New users whose tokens fill the buckets exactly: the padding user then has no history token and no
    # candidate (without contextual features, no token at all). Three requests: eager, captured, replayed.
    step_h, step_c = runner._buckets.history, runner._buckets.candidates
    replays = runner.graphs.counts["replays"] if runner.graphs is not None else 0
    for pair in (["d", "e"], ["f", "g"], ["h", "i"]):
        users.grow(pair[0], step_h // 2)
        users.grow(pair[1], step_h - step_h // 2)
        request = users.request(pair, [step_c // 2, step_c - step_c // 2])
        _same(ranker(request, pair), predictor(request))
    if bucketed == "buffers":
        assert runner.graphs is not None and runner.graphs.counts["replays"] >= replays + 2
    assert ranker.cache.stats()["misses"] == 9


@pytest.mark.slow
def test_the_delta_program_takes_the_keyword_call(kv_package) -> None:  # type: ignore[no-untyped-def]
    """The delta program returns a dict of its outputs: it takes the keyword call as the halves do (its call spec
    read once, not flattened on every request), answering torch's wrapper's dict, keys in the same order."""
    name, root, manifest = kv_package
    ranker = hstu_export.load(root).kv_cache(budget_bytes=1 << 20)
    program = ranker.runner._program
    assert program._keywords == manifest["kv_cache"]["inputs"]
    assert program._output_keys == manifest["kv_cache"]["outputs"]
    seen: dict[str, torch.Tensor] = {}
    run = ranker.runner._run

    def spy(**inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.update(inputs)
        return run(**inputs)

    ranker.runner._run = spy  # type: ignore[method-assign]
    users = Users(CONFIGS[name], seed=4)
    users.grow("a", 9)
    ranker(users.request(["a"], [3]), ["a"])
    ours, torchs = program(**seen), program._fn(**seen)  # the same K/V written into the pages again
    assert isinstance(ours, dict) and list(ours) == list(torchs) == manifest["kv_cache"]["outputs"]
    for key in torchs:
        assert torch.equal(ours[key], torchs[key])


@pytest.mark.slow
def test_eviction_same_user_twice_and_threads(kv_package) -> None:  # type: ignore[no-untyped-def]
    name, root, manifest = kv_package
    predictor = hstu_export.load(root)
    layout = manifest["kv_cache"]["layout"]
    page_bytes = layout["num_layers"] * PAGE * layout["num_heads"] * (layout["attention_dim"] + layout["linear_dim"]) * 4
    ranker = predictor.kv_cache(budget_bytes=4 * page_bytes)  # room for about one user, and the scratch page
    users = Users(CONFIGS[name], seed=5)
    for user in ("a", "b", "c"):
        users.grow(user, 2 * PAGE + 1)
    for names in (["a"], ["b"], ["c"], ["a"]):
        request = users.request(names, [2])
        _same(ranker(request, names), predictor(request))
    assert ranker.cache.stats()["evictions"] >= 2
    twice = users.request(["a", "a"], [2, 3])
    _same(ranker(twice, ["a", "a"]), predictor(twice))
    assert ranker.cache.stats()["bypassed"] == 2

    roomy = predictor.kv_cache(budget_bytes=1 << 20)
    request = users.request(["b"], [4])
    want = predictor(request)
    answers: list[dict[str, torch.Tensor]] = []
    threads = [threading.Thread(target=lambda: answers.append(roomy(request, ["b"]))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4
    for got in answers:
        _same(got, want)
    assert roomy.cache.stats()["hits"] == 3 and roomy.cache.stats()["misses"] == 1


@pytest.mark.slow
def test_a_tampered_kv_section_is_refused(kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, root, _ = kv_package
    copy = tmp_path / "pkg"
    shutil.copytree(root, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["kv_cache"]["fits_counts"] is True
    for edit, problem in (({"page_size": 24}, "power of two"), ({"program": "../outside.pt2"}, "kv_cache.program"),
                          ({"fits_counts": "yes"}, "kv_cache.fits_counts"),
                          ({"bounds": {"batch": 0, "new_history": 5, "candidates": 5}}, "kv_cache.bounds.batch"),
                          ({"bounds": [17]}, "kv_cache.bounds")):
        changed = {**manifest, "kv_cache": {**manifest["kv_cache"], **edit}}
        write_manifest_bytes(copy, json.dumps(changed).encode())
        with pytest.raises(PackageError, match=problem):
            hstu_export.load(copy)
    # A package whose delta program returns the new K/V (exported before the program wrote them into the
    # pages) loads, but is refused for cached serving: its cache would never be filled.
    old = {**manifest, "kv_cache": {**manifest["kv_cache"],
                                    "outputs": [*manifest["kv_cache"]["outputs"], "kv_new_k", "kv_new_v"]}}
    write_manifest_bytes(copy, json.dumps(old).encode())
    with pytest.raises(PackageError, match="older hstu-export.*export it again with --kv-cache"):
        hstu_export.load(copy).kv_cache(budget_bytes=1 << 20)


def test_kv_cache_refuses_what_it_cannot_build(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    bundle = bundle_of(CONFIGS["context"], tmp_path / "model.pt")
    assert cli_main([str(bundle), "--backend", "torchscript", "--kv-cache", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --kv-cache builds an AOTInductor delta program; use --backend aoti (not torchscript)"
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match="power of two"):
        ExportSettings(kv_cache=True, kv_page_size=24)

    class NotTheZoo(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x * 2}

    # A model with no attention we know has nothing to cache: its delta program cannot be derived.
    from hstu_export.kv_derive import derive_delta

    with pytest.raises(ConfigError, match="no HSTU attention"):
        derive_delta(torch.fx.symbolic_trace(NotTheZoo()), {"x": torch.ones(3)})


def test_aoti_options_reach_both_compiles_and_bad_ones_are_refused(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """--aoti-option goes to AOTInductor for the dense program and the delta program (which adds its own
    defaults on CUDA only, under the user's). The compiles are stood in for: the dense one writes an empty
    package, the delta one stops the export, which then writes nothing."""
    import zipfile

    from hstu_export.kv_export import DELTA_INDUCTOR_OPTIONS, delta_inductor_options

    seen: dict[str, dict] = {}

    def compile_(program, package_path, inductor_configs=None):  # type: ignore[no-untyped-def]
        role = Path(package_path).stem  # sparse, dense or delta (kv/delta.pt2)
        seen[role] = dict(inductor_configs)
        if role == "delta":
            raise RuntimeError("stopped here by the test")
        zipfile.ZipFile(package_path, "w").close()
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_)
    bundle = bundle_of(CONFIGS["no-context"], tmp_path / "model.pt")
    options = ["--aoti-option", "max_fusion_size=32", "--aoti-option", "combo_kernels=false"]
    assert cli_main([str(bundle), "--kv-cache", "--max-batch-size", "2", *options, "-o", str(tmp_path / "o")]) == 1
    assert "AOTInductor compilation of the KV-cache delta program failed: stopped here by the test" in capsys.readouterr().err
    ours = {"shape_padding": False, "max_fusion_size": 32, "combo_kernels": False}  # every compile's, then the user's
    assert seen == {"sparse": {**ours, "aot_inductor.package_constants_in_so": False},  # its tables are stored beside it
                    "dense": ours, "delta": ours}
    assert not (tmp_path / "o").exists()

    # The delta program's defaults: CUDA only, the user's options over them.
    assert DELTA_INDUCTOR_OPTIONS == {"combo_kernels": True}
    kept = {"shape_padding": False}  # every compile's (runtimes/compiled_bounds.py)
    assert delta_inductor_options(torch.device("cuda"), {}) == {**kept, "combo_kernels": True}
    assert delta_inductor_options(torch.device("cuda"), {"combo_kernels": False, "x": 1}) == {
        **kept, "combo_kernels": False, "x": 1}
    assert delta_inductor_options(torch.device("cpu"), {}) == kept
    assert delta_inductor_options(torch.device("cpu"), {"shape_padding": True}) == {"shape_padding": True}
    # The derived program's (any model but the zoo's): tuned on its example run once, the user's options over it.
    from hstu_export.kv_derived_export import DERIVED_CUDA_OPTIONS

    assert DERIVED_CUDA_OPTIONS == {"triton.autotune_at_compile_time": False}
    assert delta_inductor_options(torch.device("cuda"), {}, DERIVED_CUDA_OPTIONS) == {**kept, **DERIVED_CUDA_OPTIONS}
    assert delta_inductor_options(torch.device("cuda"), {"triton.autotune_at_compile_time": True, "x": 1},
                                  DERIVED_CUDA_OPTIONS) == {**kept, "triton.autotune_at_compile_time": True, "x": 1}
    assert delta_inductor_options(torch.device("cpu"), {"x": 1}, DERIVED_CUDA_OPTIONS) == {**kept, "x": 1}

    # Options Inductor does not have, values of the wrong type, and the wrong backend: one line, exit code 2.
    for bad, message in [
        (["--aoti-option", "no_such_option=1"], "has no Inductor config of that name"),
        (["--aoti-option", "combo_kernels"], "use KEY=VALUE"),
        (["--aoti-option", "combo_kernels=3"], "expected true or false"),
        (["--aoti-option", "max_fusion_size=many"], "expected a number"),
        (["--aoti-option", "combo_kernels=true", "--backend", "torchscript"], "needs --backend aoti"),
    ]:
        assert cli_main([str(bundle), *bad, "-o", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "o").exists()


def test_inductor_option_values_are_parsed_by_kind() -> None:
    from hstu_export.settings import checked_inductor_options, parse_inductor_option

    assert parse_inductor_option("combo_kernels=True") == ("combo_kernels", True)
    assert parse_inductor_option(" max_fusion_size = 16 ") == ("max_fusion_size", 16)
    assert parse_inductor_option("a=0.5") == ("a", 0.5)
    assert parse_inductor_option("a=b=c") == ("a", "b=c")
    assert checked_inductor_options({"triton.cudagraphs": False}) == {"triton.cudagraphs": False}
    assert ExportSettings(aoti_options={"max_fusion_size": 8}).to_json()["aoti_options"] == {"max_fusion_size": 8}
    with pytest.raises(ConfigError, match="a dict"):
        ExportSettings(aoti_options=["combo_kernels=true"])  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_package_without_the_program_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bundle = bundle_of(CONFIGS["no-context"], tmp_path / "model.pt")
    result = export(bundle, tmp_path / "plain", ExportSettings(backend="torchscript", max_batch_size=4))
    with pytest.raises(PackageError, match="--kv-cache"):
        hstu_export.load(result.path).kv_cache(budget_bytes=1 << 20)


@pytest.mark.parametrize("max_hist,max_cand", [(1, 1), (3, 1), (46, 16)])
def test_the_delta_program_exports_for_any_length_ranges(max_hist: int, max_cand: int) -> None:
    """torch.export of the program (no compilation): the example's sizes stay distinct even when a user may
    have a single history token or candidate, and the exported program answers as the eager one."""
    from hstu_export.kv_export import attention_for, dynamic_shapes, example_inputs
    from hstu_export.models.cached import PROGRAM_INPUTS, DeltaProgram
    from hstu_export.package.ranges import ExportRanges

    torch.manual_seed(0)
    model = HstuRankingModel(CONFIGS["context"]).eval()
    ranges = ExportRanges(2, {"uih_lengths": max_hist, "candidate_lengths": max_cand},
                          {"uih_lengths": 1, "candidate_lengths": 1})
    example = example_inputs(model, ranges, PAGE, torch.device("cpu"), seed=1)
    sizes = [example["kv_cached"].numel(), example["contextual_emb"].shape[0], example["uih_item_emb"].shape[0],
             example["candidate_item_emb"].shape[0], example["kv_k_pages"].shape[1], example["kv_page_table"].shape[1]]
    assert len(set(sizes)) == len(sizes) and min(sizes) >= 2
    bound = 2 + max_hist + max_cand
    program = DeltaProgram(model, attention_for("aten"), bound, bound).eval()
    with torch.no_grad():
        exported = torch.export.export(program, (), kwargs=example, strict=False,
                                       dynamic_shapes=dynamic_shapes(model, ranges, PAGE, list(PROGRAM_INPUTS)))
        want = program(**example)
        got = exported.module()(**example)
    _same(got, want)


def test_counts_are_fitted_to_their_tables() -> None:
    from hstu_export.models.cached import fit_counts

    def fitted(counts: list[int], rows: int) -> list[int]:
        return fit_counts(torch.tensor(counts), rows).tolist()

    assert fitted([3, 2, 5], 10) == [3, 2, 5] and fitted([3, 2], 9) == [3, 2]  # within the table: as given
    assert fitted([3, 2, 10], 7) == [3, 2, 2]  # the last takes what the others leave
    assert fitted([9, 1, 4], 4) == [4, 0, 0] and fitted([0, 0, 6], 0) == [0, 0, 0]


@pytest.mark.parametrize("config", ["context", "no-context"])
def test_a_padding_user_given_the_buckets_rows_answers_as_one_given_the_rest(config: str) -> None:
    """A package's program fits each user's counts to its tables (``kv_cache.fits_counts``), so a shape bucket
    gives its padding user the bucket's rows once, instead of what the real users leave at each call: the
    answers are those of the exact counts, bit for bit, eager and exported. Two requests of one bucket: the
    second written into the first's buffers (whose padding rows then hold the first request's values, so
    only the real users' rows are compared there)."""
    from hstu_export.kv_export import attention_for, dynamic_shapes, example_inputs
    from hstu_export.models.cached import PROGRAM_INPUTS, DeltaProgram
    from hstu_export.package.ranges import ExportRanges
    from hstu_export.runtimes.kv_graphs import Buckets, fill_bucket, pad_to_bucket

    torch.manual_seed(0)
    model = HstuRankingModel(CONFIGS[config]).eval()
    c = model.config.contextual_seq_len
    ranges = ExportRanges(2, {"uih_lengths": 9, "candidate_lengths": 5}, {"uih_lengths": 1, "candidate_lengths": 1})
    example = example_inputs(model, ranges, PAGE, torch.device("cpu"), seed=1)
    program = DeltaProgram(model, attention_for("aten"), 64, 64).eval()
    dims = dynamic_shapes(model, ranges, PAGE, list(PROGRAM_INPUTS))
    with torch.no_grad():
        exported = torch.export.export(program, (), kwargs=example, strict=False, dynamic_shapes=dims).module()
    exact, fitted = (Buckets(history=8, candidates=8, max_width=64, fitted_counts=f) for f in (False, True))
    first, _ = pad_to_bucket(example, exact, c)
    buffers, _ = pad_to_bucket(example, fitted, c)
    rows = (buffers["uih_item_emb"].shape[0], buffers["candidate_item_emb"].shape[0])
    assert (int(buffers["uih_lengths"][-1]), int(buffers["candidate_lengths"][-1])) == rows
    assert first["uih_lengths"][-1] < rows[0] and first["candidate_lengths"][-1] < rows[1]
    # A later request of the same bucket: fewer history tokens for its first user, more candidates.
    hist, cand = example["uih_lengths"].clone(), example["candidate_lengths"].clone()
    hist[0] -= 1
    cand[0] += 1
    later = {**example, "uih_lengths": hist, "candidate_lengths": cand,
             **{name: example[name][1:] for name in ("uih_item_emb", "uih_action_emb", "uih_timestamps")},
             "candidate_item_emb": torch.cat([example["candidate_item_emb"], example["candidate_item_emb"][:1]])}
    second, _ = pad_to_bucket(later, exact, c)
    assert second["uih_item_emb"].shape == buffers["uih_item_emb"].shape
    for want_inputs, request, compared in ((first, example, rows[1]), (second, later, int(cand.sum()))):
        fill_bucket(buffers, request)
        assert (int(buffers["uih_lengths"][-1]), int(buffers["candidate_lengths"][-1])) == rows  # left as they were
        with torch.no_grad():
            want = program(**{**want_inputs, **{n: buffers[n] for n in ("kv_k_pages", "kv_v_pages")}})
            for run in (program, exported):
                got = run(**buffers)
                for key in want:
                    assert got[key].shape == want[key].shape and want[key].shape[0] == rows[1]
                    assert torch.equal(got[key][:compared], want[key][:compared]), key


@pytest.mark.slow
def test_verify_serves_the_package_through_its_cache(kv_package, capsys) -> None:  # type: ignore[no-untyped-def]
    _, root, _ = kv_package
    assert cli_main(["verify", str(root), "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "requests through its KV cache" in out and out.count("KV cache") >= 2


def test_padding_to_a_bucket_appends_one_user_and_is_dropped_again() -> None:
    from hstu_export.runtimes import kv_graphs
    from hstu_export.runtimes.kv_graphs import Buckets, bucket_key, fill_bucket, pad_to_bucket, unpad

    d, layers, c = 4, 2, 2
    inputs = {
        "uih_item_emb": torch.randn(5, d), "uih_action_emb": torch.randn(5, d), "uih_timestamps": torch.arange(5),
        "candidate_item_emb": torch.randn(3, d), "contextual_emb": torch.randn(1, c, d),
        "uih_lengths": torch.tensor([2, 3]), "candidate_lengths": torch.tensor([1, 2]),
        "query_time": torch.tensor([9, 9]), "kv_cached": torch.tensor([0, 7]),
        "kv_page_table": torch.tensor([[9, 9, 9], [1, 2, 3]], dtype=torch.int32),
        "kv_k_pages": torch.zeros(layers, 10, 16, 1, 1),  # page 9: the scratch page
    }
    padded, candidates = pad_to_bucket(inputs, Buckets(history=8, candidates=4, max_width=64), c)
    assert candidates == 3
    assert padded["uih_lengths"].tolist() == [2, 3, 3] and padded["uih_item_emb"].shape[0] == 8
    assert padded["candidate_lengths"].tolist() == [1, 2, 1] and padded["candidate_item_emb"].shape[0] == 4
    assert padded["kv_cached"].tolist() == [0, 7, 0] and padded["contextual_emb"].shape[0] == 2
    # Padded columns and the padding user's row point at the scratch page only (its K/V are written there).
    assert padded["kv_page_table"].tolist() == [[9, 9, 9, 9], [1, 2, 3, 9], [9, 9, 9, 9]]
    torch.testing.assert_close(padded["uih_item_emb"][:5], inputs["uih_item_emb"])
    trimmed = unpad({"ctr": torch.arange(4.0), "cvr": torch.arange(4.0) + 1}, candidates)
    assert trimmed["ctr"].tolist() == [0.0, 1.0, 2.0] and trimmed["cvr"].tolist() == [1.0, 2.0, 3.0]
    # Another request of the same bucket, written into those buffers: its rows, the padding user's counts.
    later = {**inputs, "uih_item_emb": torch.randn(6, d), "uih_action_emb": torch.randn(6, d),
             "uih_timestamps": torch.arange(6) + 100, "candidate_item_emb": torch.randn(2, d),
             "uih_lengths": torch.tensor([6, 0]), "candidate_lengths": torch.tensor([0, 2]),
             "kv_cached": torch.tensor([0, 9]), "kv_page_table": torch.tensor([[4, 9, 9, 9], [5, 6, 7, 8]], dtype=torch.int32)}
    buckets = Buckets(history=8, candidates=4, max_width=64)
    assert bucket_key(later, buckets, c) == bucket_key(inputs, buckets, c)
    assert bucket_key({**later, "candidate_item_emb": torch.randn(5, d)}, buckets, c) != bucket_key(inputs, buckets, c)
    assert fill_bucket(padded, later) == 2
    assert padded["uih_lengths"].tolist() == [6, 0, 3] and padded["candidate_lengths"].tolist() == [0, 2, 1]
    kv_graphs.padding_counts(padded, 2)  # what the replay does first: the padding user's counts fill the bucket
    assert padded["uih_lengths"].tolist() == [6, 0, 2] and padded["candidate_lengths"].tolist() == [0, 2, 2]
    # For a program that fits the counts to its tables, the padding user is given the bucket's rows, once.
    fitted, _ = pad_to_bucket(inputs, Buckets(history=8, candidates=4, max_width=64, fitted_counts=True), c)
    assert fitted["uih_lengths"].tolist() == [2, 3, 8] and fitted["candidate_lengths"].tolist() == [1, 2, 4]
    assert fill_bucket(fitted, later) == 2
    assert fitted["uih_lengths"].tolist() == [6, 0, 8] and fitted["candidate_lengths"].tolist() == [0, 2, 4]
    assert padded["kv_cached"].tolist() == [0, 9, 0]
    assert padded["kv_page_table"].tolist() == [[4, 9, 9, 9], [5, 6, 7, 8], [9, 9, 9, 9]]
    # A narrower table of the same bucket: the column the earlier request left (page 8) now points at the
    # scratch page, so that no write of this request can land in another user's page.
    narrower = {**later, "kv_page_table": torch.tensor([[4, 9, 9], [5, 6, 7]], dtype=torch.int32)}
    assert bucket_key(narrower, buckets, c) == bucket_key(inputs, buckets, c)
    fill_bucket(padded, narrower)
    assert padded["kv_page_table"].tolist() == [[4, 9, 9, 9], [5, 6, 7, 9], [9, 9, 9, 9]]
    torch.testing.assert_close(padded["uih_item_emb"][:6], later["uih_item_emb"])
    assert padded["uih_timestamps"][:6].tolist() == list(range(100, 106))
    # Counts already on the bucket's multiples: the padding user has no tokens (only a contextual row); with
    # no history at all it has one block of it, so that the history input is never empty.
    exact = {**later, "uih_item_emb": torch.randn(8, d), "uih_action_emb": torch.randn(8, d),
             "uih_timestamps": torch.arange(8), "uih_lengths": torch.tensor([5, 3]),
             "candidate_item_emb": torch.randn(4, d), "candidate_lengths": torch.tensor([1, 3])}
    padded_exact, _ = pad_to_bucket(exact, buckets, c)
    assert padded_exact["uih_lengths"].tolist() == [5, 3, 0] and padded_exact["uih_item_emb"].shape[0] == 8
    assert padded_exact["candidate_lengths"].tolist() == [1, 3, 0] and padded_exact["contextual_emb"].shape[0] == 2
    no_history = {**exact, "uih_item_emb": torch.randn(0, d), "uih_action_emb": torch.randn(0, d),
                  "uih_timestamps": torch.arange(0), "uih_lengths": torch.tensor([0, 0])}
    padded_empty, _ = pad_to_bucket(no_history, buckets, c)
    assert padded_empty["uih_lengths"].tolist() == [0, 0, 8] and padded_empty["uih_item_emb"].shape[0] == 8
    # Within the program's bounds only: the padding user is one user more (and a contextual row), and
    # rounding adds tokens; a bucket beyond a bound is not used.
    from hstu_export.runtimes.kv_graphs import fits_bucket

    def bounded(**bounds: int) -> Buckets:
        return Buckets(history=8, candidates=4, max_width=64, **bounds)

    assert fits_bucket(inputs, buckets, c) and fits_bucket(inputs, bounded(max_batch=3), c)
    assert not fits_bucket(inputs, bounded(max_batch=2), c)  # 2 users + the padding user
    assert fits_bucket(inputs, bounded(max_history=8, max_candidates=4), c)  # 5 -> 8 tokens, 3 -> 4 candidates
    assert not fits_bucket(inputs, bounded(max_history=7), c) and not fits_bucket(inputs, bounded(max_candidates=3), c)
    calls: list[int] = []
    graphs = kv_graphs.GraphCache(lambda **kw: calls.append(kw["kv_cached"].shape[0]) or {"ctr": kw["uih_item_emb"]},
                                  bounded(max_batch=2), c, capture=False)
    for _ in range(3):
        graphs(inputs)
    assert calls == [2, 2, 2] and graphs.counts == {"replays": 0, "captures": 0, "eager": 3, "copying": 0,
                                                    "repointed": 0}  # never padded


def test_a_replays_rows_are_copied_out_of_the_buffers() -> None:
    from hstu_export.runtimes.kv_graphs import first_rows, unpad

    buffers = {"ctr": torch.rand(6, dtype=torch.bfloat16), "cvr": torch.rand(6, 2), "ids": torch.arange(6)}
    rows = first_rows(unpad(buffers, 4))
    expected = {name: value[:4].clone() for name, value in buffers.items()}
    for value in buffers.values():  # the next replay writes the buffers
        value.zero_()
    assert list(rows) == ["ctr", "cvr", "ids"]
    for name, value in rows.items():
        assert value.dtype == expected[name].dtype and value.shape == expected[name].shape
        assert torch.equal(value, expected[name]), name
    assert first_rows(unpad(buffers, 0))["cvr"].shape == (0, 2)


def test_embeddings_are_copied_into_a_bucket_each_on_its_own() -> None:
    from hstu_export.runtimes.kv_graphs import Buckets, copies_into, fill_bucket, pad_to_bucket

    d, c = 4, 1
    inputs = {
        "uih_item_emb": torch.randn(4, d), "uih_action_emb": torch.randn(4, d)[:3], "uih_timestamps": torch.arange(3),
        "candidate_item_emb": torch.randn(3, d), "contextual_emb": torch.randn(0, c, d),
        "uih_lengths": torch.tensor([3]), "candidate_lengths": torch.tensor([3]),
        "query_time": torch.tensor([9]), "kv_cached": torch.tensor([5]),
        "kv_page_table": torch.tensor([[1, 2]], dtype=torch.int32), "kv_k_pages": torch.zeros(1, 4, 16, 1, 1),
    }
    inputs["uih_item_emb"] = inputs["uih_item_emb"][:3]
    padded, _ = pad_to_bucket(inputs, Buckets(history=8, candidates=4, max_width=64), c)
    copies = copies_into(padded, inputs)
    # The embeddings alone (an empty one not at all), the integers together.
    assert [name for _, name in copies.singles] == ["uih_item_emb", "uih_action_emb", "candidate_item_emb"]
    assert [names for _, names in copies.groups] == [("uih_timestamps", "uih_lengths", "candidate_lengths",
                                                      "query_time", "kv_cached")]
    later = {**inputs, "uih_item_emb": torch.randn(3, d), "uih_action_emb": torch.randn(3, d),
             "candidate_item_emb": torch.randn(3, d), "query_time": torch.tensor([11])}
    assert fill_bucket(padded, later, copies) == 3
    for name in ("uih_item_emb", "uih_action_emb", "candidate_item_emb"):
        torch.testing.assert_close(padded[name][:3], later[name])
    assert padded["query_time"].tolist() == [11, 0]  # the padding user's entry is left as it was


@pytest.mark.parametrize("max_batch", [4, 32])
def test_a_request_at_the_packages_maximum_has_a_bucket(max_batch: int) -> None:
    """The delta program is exported with room for a bucket's padding user: a request of the package's
    largest batch, every user at its longest, fits its bucket; under the legacy bounds (no room) it does
    not, and runs without a graph."""
    from types import SimpleNamespace

    from hstu_export.kv_export import bucket_steps, legacy_program_bounds, program_bounds
    from hstu_export.runtimes.kv_graphs import Buckets, bucket_key

    ranges = SimpleNamespace(max_batch_size=max_batch, max_lengths={"uih_lengths": 101, "candidate_lengths": 45})
    users = max(max_batch, 16)  # the program takes at least the export example's 16 users
    step_h, step_c = bucket_steps(ranges)
    assert (step_h, step_c) == (64, 32)
    inputs = {"uih_item_emb": torch.zeros(users * 101, 2), "candidate_item_emb": torch.zeros(users * 45, 2),
              "contextual_emb": torch.zeros(users, 1, 2), "kv_cached": torch.zeros(users, dtype=torch.int64),
              "kv_page_table": torch.zeros(users, 3, dtype=torch.int32)}

    def buckets(bounds: dict[str, int]) -> Buckets:
        return Buckets(history=step_h, candidates=step_c, max_width=64, max_batch=bounds["batch"],
                       max_history=bounds["new_history"], max_candidates=bounds["candidates"])

    bounds = program_bounds(ranges)
    assert bounds == {"batch": users + 1, "new_history": users * 101 + 64, "candidates": users * 45 + 32}
    key = bucket_key(inputs, buckets(bounds), contextual=1)
    assert key is not None and key[:4] == (users, -(-users * 101 // 64) * 64, -(-users * 45 // 32) * 32, users + 1)
    assert bucket_key(inputs, buckets(legacy_program_bounds(ranges)), contextual=1) is None
    # One user more than the package's maximum is beyond even the new bounds.
    more = {**inputs, "kv_cached": torch.zeros(users + 1, dtype=torch.int64)}
    assert bucket_key(more, buckets(bounds), contextual=1) is None


@pytest.mark.slow
def test_cuda_graphs_and_other_page_sizes_are_refused(kv_package) -> None:  # type: ignore[no-untyped-def]
    _, root, _ = kv_package
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA package"):
        hstu_export.load(root).kv_cache(budget_bytes=1 << 20, cuda_graphs=True)
    from hstu_export.runtimes.kv_delta import PackageDelta
    from hstu_export.serving.kv_cache import CachedRanker

    with pytest.raises(ConfigError, match=f"reads pages of {PAGE} tokens"):
        CachedRanker(PackageDelta(hstu_export.load(root)), budget_bytes=1 << 20, page_size=2 * PAGE)
