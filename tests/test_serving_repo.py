"""Serving in a server: micro-batching requests into package calls, and the Triton Inference Server model
repository (config checked with Triton's own model_config protobuf; model.py run against a stand-in of the
Python-backend API it uses, down to a bad request in a batch). tests/test_triton_server.py runs the
repository in a real Triton Inference Server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from google.protobuf import text_format
from triton_stand_in import StandInTensor, initialized_model, model_config_pb2

import hstu_export
from hstu_export import generate_batch
from hstu_export.cli import main as cli_main
from hstu_export.errors import ConfigError, RequestError
from hstu_export.serving.batching import BatchingPredictor, OutputRows, output_rows, plan_groups
from hstu_export.serving.triton_repo import ServingRepoSettings, write_serving_repo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def package(tiny_serving_package: Path) -> Path:
    return tiny_serving_package


@pytest.fixture(scope="module")
def predictor(package: Path):  # type: ignore[no-untyped-def]
    return hstu_export.load(package)


class CountingPredictor:
    def __init__(self, predictor) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.calls = predictor, []

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)

    def __call__(self, batch):  # type: ignore[no-untyped-def]
        self.calls.append(int(batch["uih_lengths"].size(0)))
        return self.inner(batch)


def test_groups_fill_the_exported_batch_size_in_arrival_order() -> None:
    assert plan_groups([1, 3, 2, 4, 1], 4) == [[0, 1], [2], [3], [4]]
    assert plan_groups([2, 2, 2, 2, 2], 4) == [[0, 1], [2, 3], [4]]
    assert plan_groups([4], 4) == [[0]] and plan_groups([], 4) == []


def test_outputs_split_by_what_their_first_dim_counts(predictor) -> None:  # type: ignore[no-untyped-def]
    rows = output_rows(predictor.package_manifest)
    assert rows == {"ctr": OutputRows("ctr", "candidate_lengths"), "cvr": OutputRows("cvr", "candidate_lengths")}
    manifest = predictor.package_manifest
    manifest.artifacts["model"]["outputs"][0]["shape"] = ["batch+1"]
    try:
        assert output_rows(manifest) is None  # offsets do not concatenate: one request per call
    finally:
        manifest.artifacts["model"]["outputs"][0]["shape"] = ["candidate_lengths.total"]


def test_batched_requests_get_their_own_outputs_and_errors(predictor) -> None:  # type: ignore[no-untyped-def]
    counting = CountingPredictor(predictor)
    batcher = BatchingPredictor(counting)
    sizes = [1, 3, 2, 4, 1]
    requests = [generate_batch(predictor.input_schema, b, seed=70 + i) for i, b in enumerate(sizes)]
    bad = dict(requests[2], user_id=requests[2]["user_id"].int())
    results = batcher([*requests[:2], bad, *requests[3:]])
    assert counting.calls == [4, 4, 1]  # [1+3], [4], [1]: the bad request left out, 3 calls for 4 requests
    assert isinstance(results[2], RequestError) and "user_id" in str(results[2])
    for request, result in zip(requests, results):
        if request is requests[2]:
            continue
        alone = predictor(request)
        assert sorted(result) == sorted(alone)
        for name in alone:
            assert result[name].shape == alone[name].shape
            torch.testing.assert_close(result[name], alone[name], rtol=1e-6, atol=1e-7)


def test_a_failing_call_runs_its_requests_again_one_by_one(predictor) -> None:  # type: ignore[no-untyped-def]
    """A request that passes the schema but fails in the call (here: a ranker refusing user 13) fails alone,
    and with a ranker every call gets its requests' user ids in order."""
    seen: list[list[object]] = []

    def ranker(batch, user_ids):  # type: ignore[no-untyped-def]
        seen.append(list(user_ids))
        if 13 in user_ids:
            raise RequestError("user 13 is refused")
        return predictor(batch)

    batcher = BatchingPredictor(predictor, ranker)
    requests = [generate_batch(predictor.input_schema, b, seed=90 + i) for i, b in enumerate([1, 2, 1, 1])]
    results = batcher(requests, [[11], [12, 13], ["u"], [14, 15]])
    assert seen == [[11, 12, 13, "u"], [11], [12, 13], ["u"]]  # the call of four, then each alone
    assert isinstance(results[1], RequestError) and "user 13" in str(results[1])
    assert isinstance(results[3], RequestError) and "2 user ids for a request of 1 users" in str(results[3])
    for request, result in zip(requests[:3:2], results[:3:2]):
        torch.testing.assert_close(result, predictor(request), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="one list of ids per request"):
        batcher(requests)


def test_kv_cache_repository_needs_a_kv_package_and_a_budget(package: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "repo"
    assert cli_main(["serving-repo", str(package), "--out", str(out), "--kv-cache", "64MiB"]) == 2
    error = capsys.readouterr().err.strip()
    assert "exported without --kv-cache" in error and len(error.splitlines()) == 1, error
    assert cli_main(["serving-repo", str(package), "--out", str(out), "--kv-cache", "lots"]) == 2
    error = capsys.readouterr().err.strip()
    assert "cannot read size 'lots'" in error and len(error.splitlines()) == 1, error
    assert cli_main(["serving-repo", str(package), "--out", str(out), "--max-sequences", "8"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--max-sequences applies to a KV-cached repository only" in error and len(error.splitlines()) == 1, error
    assert cli_main(["serving-repo", str(package), "--out", str(out), "--kv-max-time-drift", "600",
                     "--kv-cuda-graphs", "off"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--kv-max-time-drift and --kv-cuda-graphs apply to a KV-cached repository only" in error, error
    assert not out.exists()


@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_a_kv_repository_passes_the_caches_settings_to_its_instances(kv_package, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                     monkeypatch) -> None:
    package = kv_package[1]
    for extra, drift, graphs in (([], 0, None), (["--kv-max-time-drift", "600", "--kv-cuda-graphs", "off"], 600, "off")):
        out = tmp_path / f"repo-{drift}"
        assert cli_main(["serving-repo", str(package), "--out", str(out), "--name", "ranker", "--kv-cache", "8MiB",
                         *extra]) == 0
        config = text_format.Parse((out / "ranker" / "config.pbtxt").read_text(), model_config_pb2().ModelConfig())
        parameters = {k: v.string_value for k, v in config.parameters.items()}
        assert parameters.get("kv_max_time_drift") == (str(drift) if drift else None), parameters
        assert parameters.get("kv_cuda_graphs") == graphs, parameters
        model = initialized_model(out / "ranker", monkeypatch)
        assert model.ranker.max_time_drift == drift
    with pytest.raises(ConfigError, match="max time drift must be a whole number"):
        write_serving_repo(package, tmp_path / "bad", ServingRepoSettings(kv_cache_budget="8MiB", kv_max_time_drift=-1))
    with pytest.raises(ConfigError, match="kv_cuda_graphs must be one of auto, on, off"):
        write_serving_repo(package, tmp_path / "bad", ServingRepoSettings(kv_cache_budget="8MiB", kv_cuda_graphs="yes"))
    assert not (tmp_path / "bad").exists()


def test_a_repository_of_a_publish_root_follows_it(package: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from hstu_export.package.publish import publish

    root = tmp_path / "ranker"
    publish(package, root)
    model_dir = write_serving_repo(root, tmp_path / "repo", ServingRepoSettings(follow_seconds=0.5))
    config = model_config_pb2().ModelConfig()
    text_format.Parse((model_dir / "config.pbtxt").read_text(), config)
    assert config.parameters["package"].string_value == str(root.resolve())
    assert config.parameters["follow_seconds"].string_value == "0.5"
    assert not (model_dir / "1" / "package").exists()  # nothing copied: the instances read the root
    assert json.loads((tmp_path / "repo" / "serving.json").read_text())["follows_published_versions"] is True
    assert cli_main(["serving-repo", str(root), "--out", str(tmp_path / "kv"), "--kv-cache", "64MiB"]) == 2
    error = capsys.readouterr().err.strip()
    assert "serves one version" in error and len(error.splitlines()) == 1, error
    assert cli_main(["serving-repo", str(package), "--out", str(tmp_path / "x"), "--follow-seconds", "2"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--follow-seconds applies when PACKAGE is a directory hstu-export publish writes" in error, error
    assert not (tmp_path / "kv").exists() and not (tmp_path / "x").exists()


def test_config_parses_with_tritons_protobuf_and_matches_the_manifest(package: Path, tmp_path: Path) -> None:
    settings = ServingRepoSettings(max_requests_per_batch=16, max_queue_delay_us=250, instances=2)
    model_dir = write_serving_repo(package, tmp_path / "repo", settings)
    assert model_dir.name == "ranker"
    pb2 = model_config_pb2()
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), pb2.ModelConfig())
    manifest = json.loads((package / "manifest.json").read_text())
    assert config.name == "ranker" and config.backend == "python" and config.max_batch_size == 16
    assert config.dynamic_batching.max_queue_delay_microseconds == 250
    types_ = {v: k for k, v in pb2.DataType.items()}
    features = manifest["input_schema"]["features"]
    assert [i.name for i in config.input] == [f["name"] for f in features]
    assert [types_[i.data_type] for i in config.input] == ["TYPE_INT64"] * len(features)
    assert all(list(i.dims) == [-1] and i.allow_ragged_batch for i in config.input)
    outputs = manifest["artifacts"]["model"]["outputs"]
    assert [o.name for o in config.output] == manifest["output_names"] == [o["name"] for o in outputs]
    assert all(types_[o.data_type] == "TYPE_FP32" and list(o.dims) == [-1] for o in config.output)
    assert config.instance_group[0].kind == pb2.ModelInstanceGroup.Kind.Value("KIND_CPU")
    assert config.instance_group[0].count == 2
    assert config.parameters["package"].string_value == "package"
    # The package travels unchanged, and still loads.
    copied = model_dir / "1" / "package"
    assert (copied / "manifest.json").read_bytes() == (package / "manifest.json").read_bytes()
    hstu_export.load(copied)
    marker = json.loads((tmp_path / "repo" / "serving.json").read_text())
    assert marker["triton_server"] == "2.73.0" and marker["batches_requests"] is True


def test_instances_get_their_host_threads(package: Path, tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from hstu_export.package.directory import load_manifest
    from hstu_export.serving.triton_repo import config_text

    def threads_parameter(model_dir: Path) -> str | None:
        config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2().ModelConfig())
        return config.parameters["host_threads"].string_value if "host_threads" in config.parameters else None

    assert threads_parameter(write_serving_repo(package, tmp_path / "cpu", ServingRepoSettings())) is None
    manifest = load_manifest(package)
    on_cuda = dataclasses.replace(manifest, device=dataclasses.replace(manifest.device, type="cuda"))
    assert 'key: "host_threads" value: { string_value: "1" }' in config_text(on_cuda, "m", ServingRepoSettings())
    assert 'key: "host_threads" value: { string_value: "3" }' in config_text(on_cuda, "m", ServingRepoSettings(host_threads=3))
    assert cli_main(["serving-repo", str(package), "--out", str(tmp_path / "two"), "--name", "r", "--host-threads", "2"]) == 0
    assert threads_parameter(tmp_path / "two" / "r") == "2"
    before = torch.get_num_threads()
    try:
        initialized_model(tmp_path / "two" / "r", monkeypatch)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="host_threads must be a whole number, 1 or more"):
        write_serving_repo(package, tmp_path / "bad", ServingRepoSettings(host_threads=0))
    assert cli_main(["serving-repo", str(package), "--out", str(tmp_path / "bad"), "--host-threads", "0"]) == 2
    assert "--host-threads" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_model_py_serves_a_dynamic_batch(package: Path, predictor, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model_dir = write_serving_repo(package, tmp_path / "repo", ServingRepoSettings(name="hstu"))
    model = initialized_model(model_dir, monkeypatch)
    batches = [generate_batch(predictor.input_schema, b, seed=90 + b) for b in (2, 1, 3)]
    requests = [{n: StandInTensor(n, t.unsqueeze(0)) for n, t in b.items()} for b in batches]
    requests[1]["uih_lengths"] = StandInTensor("uih_lengths", torch.full((1, 1), 99))  # beyond 46
    responses = model.execute(requests)
    assert len(responses) == 3
    assert responses[1].error is not None and "beyond the exported maximum" in str(responses[1].error)
    for index in (0, 2):
        assert responses[index].error is None
        got = {t.name(): t.value for t in responses[index].output_tensors}
        expected = predictor(batches[index])
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            assert got[name].shape == (1, *value.shape)
            torch.testing.assert_close(got[name][0], value, rtol=1e-6, atol=1e-7)


def test_a_native_repository_serves_with_the_cpp_runtime(package: Path, predictor, tmp_path: Path, monkeypatch,  # type: ignore[no-untyped-def]
                                                          cpp_runtime, capsys) -> None:
    """``--runtime native``: the config names the C++ runtime's library, found when the repository is written,
    and model.py serves a dynamic batch through it, each request as the package answers it, a bad one refused
    alone; a publish root's repository follows it through the C++ runtime. No library: refused in one line and
    nothing is written."""
    from hstu_export.package.publish import publish
    from hstu_export.runtimes.native import LIBRARY_NAME

    library = cpp_runtime.path.parent / LIBRARY_NAME
    monkeypatch.setenv("HSTU_EXPORT_NATIVE_LIBRARY", str(library))
    assert cli_main(["serving-repo", str(package), "--out", str(tmp_path / "repo"), "--runtime", "native"]) == 0
    model_dir = tmp_path / "repo" / "ranker"
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2().ModelConfig())
    assert config.parameters["native_library"].string_value == str(library.resolve())
    assert json.loads((tmp_path / "repo" / "serving.json").read_text())["runtime"] == "native"
    model = initialized_model(model_dir, monkeypatch)
    assert type(model.batcher.predictor).__name__ == "NativePredictor"
    batches = [generate_batch(predictor.input_schema, 1, seed=70 + i) for i in range(3)]
    requests = [{n: StandInTensor(n, t.unsqueeze(0)) for n, t in b.items()} for b in batches]
    requests[1]["candidate_item_ids"] = StandInTensor("candidate_item_ids", requests[1]["candidate_item_ids"].value + 10**9)
    responses = model.execute(requests)
    assert responses[1].error is not None and "candidate_item_ids" in str(responses[1].error)
    for index in (0, 2):
        got = {t.name(): t.value for t in responses[index].output_tensors}
        for name, value in predictor(batches[index]).items():
            torch.testing.assert_close(got[name][0], value, rtol=1e-6, atol=1e-7)
    capsys.readouterr()
    root = tmp_path / "ranker"  # a publish root: followed by the C++ runtime's PublishedPackage
    publish(package, root)
    assert cli_main(["serving-repo", str(root), "--out", str(tmp_path / "followed"), "--runtime", "native"]) == 0
    model = initialized_model(tmp_path / "followed" / "ranker", monkeypatch)
    assert model.batcher.predictor.version == 1
    monkeypatch.setenv("HSTU_EXPORT_NATIVE_LIBRARY", str(tmp_path / "nowhere.so"))
    assert cli_main(["serving-repo", str(package), "--out", str(tmp_path / "missing"), "--runtime", "native"]) == 2
    error = capsys.readouterr().err.strip()
    assert "is not there: build it with `bash runtimes/cpp/build.sh`" in error and len(error.splitlines()) == 1, error
    assert not (tmp_path / "missing").exists()


def test_repository_targets_are_checked(package: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a serving repository hstu-export wrote"):
        write_serving_repo(package, foreign, force=True)
    assert (foreign / "notes.txt").read_text() == "keep me"
    repo = tmp_path / "repo"
    assert cli_main(["serving-repo", str(package), "--out", str(repo), "--name", "first"]) == 0
    assert "tritonserver --model-repository" in capsys.readouterr().out
    assert cli_main(["serving-repo", str(package), "--out", str(repo), "--name", "second"]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert cli_main(["serving-repo", str(package), "--out", str(repo), "--name", "second", "--force"]) == 0
    assert (repo / "second" / "config.pbtxt").is_file() and not (repo / "first").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or old copies left
    assert cli_main(["serving-repo", str(package), "--out", str(tmp_path / "r2"), "--name", "bad/name"]) == 2
    # --emit-serving-repo is refused before the export starts.
    assert cli_main([str(package.parent / "tiny.pt"), "--backend", "torchscript", "--out", str(tmp_path / "pkg"),
                     "--emit-serving-repo", str(foreign)]) == 2
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("name", ['plain', 'uih.item.values', 'with "quotes"', "back\\slash"])
def test_names_are_quoted_for_the_config(name: str) -> None:
    from hstu_export.serving.triton_repo import _quoted

    parsed = text_format.Parse(f"name: {_quoted(name)}", model_config_pb2().ModelConfig())
    assert parsed.name == name
