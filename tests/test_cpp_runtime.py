"""The C++ runtime (runtimes/cpp): built here with CMake against the installed torch, it serves the tiny
model's aoti and torchscript packages bit for bit like ``hstu_export.load``, refuses requests beyond the
exported ranges and tampered packages with one clear line, and runs from several threads at once.

Needs cmake and a C++20 compiler (``make install`` puts them there when it can); without them the test
fails, it is not skipped."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from manifests import rewrite_manifest, rewrite_tables_header, write_manifest_bytes

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch, save_bundle
from hstu_export.cli import main as cli_main
from hstu_export.errors import RequestError
from hstu_export.models import build_preset
from hstu_export.package.tensor_dir import file_name, load_tensors, save_tensors, tensor_name

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpp")
    model = build_preset("tiny", seed=3)
    bundle = save_bundle(model, root / "tiny.pt", generate_batch(model.input_schema(), 4, seed=4))
    out = {}
    for backend in ("aoti", "torchscript"):
        settings = ExportSettings(backend=backend, max_batch_size=4, verify=VerifySettings(num_random_batches=1))
        out[backend] = hstu_export.export(bundle, root / f"pkg.{backend}", settings).path
    return out


@pytest.fixture(scope="module")
def runner(cpp_runtime):  # type: ignore[no-untyped-def]
    return cpp_runtime


def write_request(package: Path, directory: Path, batch_size: int, seed: int) -> Path:
    assert cli_main(["request", str(package), "--out", str(directory), "--batch-size", str(batch_size),
                     "--seed", str(seed)]) == 0
    return directory


@pytest.mark.parametrize("backend", ["aoti", "torchscript"])
@pytest.mark.parametrize(("batch_size", "seed"), [(1, 10), (4, 11), (3, 12)])
def test_cpp_matches_python_bit_for_bit(runner, packages, tmp_path, backend, batch_size, seed) -> None:
    package = packages[backend]
    request = write_request(package, tmp_path / "request", batch_size, seed)
    done = runner.run(package, request, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert f"{backend} package on cpu, batch of {batch_size} users" in done.stdout
    cpp = load_tensors(tmp_path / "out")
    python = hstu_export.load(package)(load_tensors(request))
    assert list(cpp) == sorted(python)  # the directory lists files by name
    for name, value in python.items():
        assert cpp[name].dtype == value.dtype and cpp[name].shape == value.shape
        assert torch.equal(cpp[name], value), (name, (cpp[name] - value).abs().max().item())
        assert value.numel() > 0 and not torch.equal(value, torch.zeros_like(value))


def test_python_run_writes_the_same_directory(runner, packages, tmp_path) -> None:
    package = packages["aoti"]
    request = write_request(package, tmp_path / "request", 2, 20)
    assert runner.run(package, request, "--out", tmp_path / "cpp", "-q").returncode == 0
    assert cli_main(["run", str(package), "--batch", str(request), "--output-dir", str(tmp_path / "py")]) == 0
    cpp, py = load_tensors(tmp_path / "cpp"), load_tensors(tmp_path / "py")
    assert list(cpp) == list(py) and all(torch.equal(cpp[k], py[k]) for k in cpp)


def test_a_publish_root_opens_its_current_version(runner, packages, tmp_path) -> None:
    from hstu_export.package.publish import publish, switch

    root = tmp_path / "ranker"
    publish(packages["torchscript"], root)
    publish(packages["aoti"], root)
    switch(root, 1)
    request = write_request(packages["torchscript"], tmp_path / "request", 2, 40)
    done = runner.run(root, request, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "torchscript package on cpu" in done.stdout  # version 1, not the newest
    python = hstu_export.load(packages["torchscript"])(load_tensors(request))
    assert all(torch.equal(load_tensors(tmp_path / "out")[k], v) for k, v in python.items())
    (root / "current").unlink()
    (root / "current").symlink_to("7")
    done = runner.run(root, request)
    assert done.returncode != 0 and "current points at '7', not at a published version" in done.stderr


def test_native_predictor_serves_from_python_as_the_cli(runner, packages, tmp_path) -> None:
    """hstu_export.runtimes.native: the C++ runtime called from Python answers as hstu_export.load bit for bit, in
    the package's output order, and refuses as it does, with the same exception types."""
    from hstu_export.errors import ConfigError, PackageError
    from hstu_export.runtimes.native import LIBRARY_NAME, NativePredictor

    library = runner.path.parent / LIBRARY_NAME
    for backend, package in packages.items():
        native, python = NativePredictor(package, library=library), hstu_export.load(package)
        assert native.output_names == python.output_names and native.max_batch_size == 4
        for batch_size in (1, 3):
            request = generate_batch(python.input_schema, batch_size, seed=60 + batch_size)
            answer, expected = native(request), python(request)
            assert list(answer) == python.output_names, backend
            assert all(torch.equal(answer[k], v) for k, v in expected.items()), backend
        request["candidate_item_ids"] = request["candidate_item_ids"] + 5000
        with pytest.raises(RequestError, match="beyond the exported maximum 999"):
            native(request)
    with pytest.raises(PackageError, match="no such directory"):
        NativePredictor(tmp_path / "nothing", library=library)
    with pytest.raises(ConfigError, match="is not there: build it with"):
        NativePredictor(packages["aoti"], library=tmp_path / LIBRARY_NAME)
    with pytest.raises(ConfigError, match="tables device 'gpu'"):
        NativePredictor(packages["aoti"], library=library, tables_device="gpu")
    with pytest.raises(ConfigError, match="device 'gpu7': expected cpu, cuda or cuda:N"):
        NativePredictor(packages["aoti"], library=library, device="gpu7")
    native, python = NativePredictor(packages["aoti"], library=library, device="cpu"), hstu_export.load(packages["aoti"])
    # what the serving paths read of a predictor
    assert native.input_schema == python.input_schema and native.package_manifest.raw == python.package_manifest.raw


def test_load_with_runtime_native_opens_the_cpp_runtime(runner, packages, tmp_path, monkeypatch) -> None:
    """``hstu_export.load(path, runtime="native")``: the C++ runtime behind the Python API's one entry point
    (a publish root's current version, its answers bit for bit Python's, its options checked as load's), and a
    signature required of the package is checked before the C++ runtime opens it."""
    from hstu_export.errors import ConfigError, PackageError
    from hstu_export.package.publish import publish
    from hstu_export.runtimes.native import LIBRARY_NAME, NativePredictor

    monkeypatch.setenv("HSTU_EXPORT_NATIVE_LIBRARY", str(runner.path.parent / LIBRARY_NAME))
    root = tmp_path / "ranker"
    publish(packages["torchscript"], root)
    native = hstu_export.load(root, runtime="native", graph_copy_limit="1MiB", cuda_graphs=False)
    python = hstu_export.load(packages["torchscript"])
    assert isinstance(native, NativePredictor) and native.path.parent == root and not native.following
    request = generate_batch(python.input_schema, 3, seed=71)
    answer, expected = native(request), python(request)
    assert list(answer) == python.output_names and all(torch.equal(answer[k], v) for k, v in expected.items())
    with pytest.raises(ConfigError, match="runtime 'cpp': expected python or native"):
        hstu_export.load(packages["aoti"], runtime="cpp")
    with pytest.raises(ConfigError, match="graph_copy_limit"):
        hstu_export.load(packages["aoti"], runtime="native", graph_copy_limit="lots")
    key = tmp_path / "release.pub.pem"
    key.write_text("not a key")
    with pytest.raises(PackageError, match="is not signed"):
        hstu_export.load(packages["aoti"], runtime="native", require_signature=key)


def _follow(runner, root: Path, request: Path, *args: object) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    """hstu-export-run serving ``root`` with --follow 0, once it has opened the current version."""
    process = subprocess.Popen([str(runner.path), root, request, "--follow", "0", *map(str, args)], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("serving version 1 of "), line + process.communicate()[1]
    return process


def test_follow_moves_to_a_published_version_between_requests(runner, packages, tiny_serving_package,
                                                               tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hstu_export.package.publish import publish

    root = tmp_path / "ranker"
    old, new = Path(tiny_serving_package), packages["aoti"]  # one schema, other weights and backends
    publish(old, root)
    request = write_request(old, tmp_path / "request", 2, 41)
    process = _follow(runner, root, request, "--repeat", 3000, "--threads", 2, "--out", tmp_path / "out")
    publish(new, root)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    # Every run equal to its version's first answer, and each version's answer to Python's on that package.
    assert "every output equal to its version's first bit for bit" in out
    served = re.search(r"versions served: 1 \((\d+) runs\), 2 \((\d+) runs\); 1 switch\(es\)", out)
    assert served and int(served[1]) > 0 and int(served[2]) > 0, out
    for version, package in (("1", old), ("2", new)):
        python = hstu_export.load(package)(load_tensors(request))
        cpp = load_tensors(tmp_path / "out" / version)
        assert all(torch.equal(cpp[k], v) for k, v in python.items()), version
    assert not all(torch.equal(load_tensors(tmp_path / "out" / "1")[k], v)
                   for k, v in load_tensors(tmp_path / "out" / "2").items())


def test_follow_keeps_serving_when_a_version_takes_other_requests(runner, packages, tmp_path) -> None:
    from hstu_export.package.publish import publish, switch

    root = tmp_path / "ranker"
    publish(packages["torchscript"], root)
    shutil.copytree(packages["torchscript"], root / "2")  # as published, but said to take at most 2 users
    rewrite_manifest(root / "2", lambda m: [m["ranges"].update(max_batch_size=2),
                                            m["ranges"]["lengths"].update(max_batch_size=2)])
    request = write_request(packages["torchscript"], tmp_path / "request", 3, 42)
    process = _follow(runner, root, request, "--repeat", 3000)
    switch(root, 2)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    assert re.search(r"versions served: 1 \(\d+ runs\); 0 switch\(es\)", out), out
    assert f"version 2 of {root} is not served: its maximum batch size differs from version 1's" in out
    done = runner.run(root, request, "--follow", "0", "--kv-cache", "auto", "--user-ids", "1,2,3")
    assert done.returncode == 2 and "--follow serves without --kv-cache" in done.stderr
    done = runner.run(root, request, "--follow", "soon")
    assert done.returncode == 2 and "--follow needs seconds" in done.stderr
    done = runner.run(packages["torchscript"], request, "--follow", "1")
    assert done.returncode == 1 and "holds no published versions" in done.stderr and done.stderr.count("\n") == 1


def test_many_threads_get_the_same_outputs(runner, packages, tmp_path) -> None:
    for backend, package in packages.items():
        request = write_request(package, tmp_path / backend, 4, 30)
        done = runner.run(package, request, "--threads", 4, "--repeat", 5, "--warmup", 2)
        assert done.returncode == 0, done.stderr
        assert "latency over 20 runs on 4 thread(s)" in done.stdout and "all outputs equal" in done.stdout


PHASES = re.compile(r"request (\d+) phases \(device synchronised between them\), p50: before the dense half "
                    r"([\d.]+) ms, dense half ([\d.]+) ms, after it ([\d.]+) ms; the dense half's launch returned "
                    r"after ([\d.]+) ms; before the dense half, the request to the device ([\d.]+) ms and the sparse half "
                    r"([\d.]+) ms")
LATENCY = re.compile(r"latency over \d+ runs on 1 thread\(s\): p50 ([\d.]+) ms")


def test_phase_times(runner, packages, tmp_path) -> None:
    """--phase-times splits each timed request into three phases; together they take about the request's
    time (each phase is timed on its own, so the medians need not add up exactly), and the host's part of the
    dense half is within it. Before the dense half it also times the request's move to the device and the
    sparse half (none for TorchScript, whose one module is the whole model). Only on one thread."""
    for backend, package in packages.items():
        request = write_request(package, tmp_path / backend, 4, 30)
        done = runner.run(package, request, "--repeat", 7, "--phase-times")
        assert done.returncode == 0, done.stderr
        (found,) = PHASES.findall(done.stdout)
        before, dense, after, launch, to_device, sparse = map(float, found[1:])
        whole = float(LATENCY.search(done.stdout)[1])
        assert found[0] == "1" and dense > 0 and before > 0 and after >= 0 and 0 < launch <= dense, done.stdout
        assert 0 <= to_device and (sparse == 0) == (backend == "torchscript"), done.stdout
        assert to_device + sparse <= 1.5 * before + 0.01, done.stdout  # medians of parts of it
        assert 0.3 * whole <= before + dense + after <= 3 * whole + 1, done.stdout
    done = runner.run(packages["aoti"], request, "--repeat", 2, "--threads", 2, "--phase-times")
    assert done.returncode == 2 and "--phase-times goes with --repeat, on one thread" in done.stderr
    done = runner.run(packages["aoti"], request, "--phase-times")
    assert done.returncode == 2 and "--phase-times goes with --repeat" in done.stderr


def test_build_with_the_compiler_alone(runner, packages, tmp_path) -> None:
    """The fallback of build.sh for machines where torch's CMake config cannot be used (a pip CUDA torch
    without a CUDA toolkit): the same runtime built by the compiler alone gives the same outputs."""
    done = subprocess.run(["bash", str(Path(__file__).resolve().parent.parent / "runtimes" / "cpp" / "build.sh"), str(tmp_path / "build")],
                          env={**os.environ, "PYTHON": sys.executable, "HSTU_EXPORT_BUILD": "compiler"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "building with the compiler alone" in done.stdout
    package = packages["aoti"]
    request = write_request(package, tmp_path / "request", 3, 40)
    plain = runner.__class__(tmp_path / "build" / "hstu-export-run")
    for name, built in (("plain", plain), ("cmake", runner)):
        assert built.run(package, request, "--out", tmp_path / name, "-q").returncode == 0
    plain_out, cmake_out = load_tensors(tmp_path / "plain"), load_tensors(tmp_path / "cmake")
    assert list(plain_out) == list(cmake_out) and all(torch.equal(plain_out[k], cmake_out[k]) for k in cmake_out)


def _edited_request(package: Path, directory: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    request = load_tensors(write_request(package, directory.with_name(directory.name + "-base"), 2, 40))
    edit(request)
    return save_tensors(request, directory)


def _too_long(request: dict[str, torch.Tensor]) -> None:
    extra = 47 - int(request["uih_lengths"][0])
    request["uih_lengths"][0] = 47
    for name in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
        request[name] = torch.cat([request[name], request[name][:1].repeat(extra)])


def _too_many_users(request: dict[str, torch.Tensor]) -> None:
    for name in ("uih_lengths", "candidate_lengths", "query_time", "user_id", "user_age"):
        request[name] = request[name].repeat(3)
    for name in ("uih_item_ids", "uih_action_ids", "uih_timestamps", "candidate_item_ids"):
        request[name] = request[name].repeat(3)


@pytest.mark.parametrize(("edit", "message"), [
    (_too_long, "feature 'uih_lengths' has length 47 beyond the exported maximum 46"),
    (_too_many_users, "batch size 6 is beyond the exported maximum 4"),
    (lambda r: r.update(user_id=r["user_id"].int()), "feature 'user_id' has dtype int32, expected int64"),
    (lambda r: r.pop("query_time"), "request is missing feature(s) [query_time]"),
    (lambda r: r.update({"a/b c": torch.zeros(1)}), "request has unknown feature(s) [a/b c]"),
    (lambda r: r.update(uih_item_ids=r["uih_item_ids"][1:]), "values but 'uih_lengths' sums to"),
    (lambda r: r.update(candidate_item_ids=r["candidate_item_ids"] + 5000), "beyond the exported maximum 999"),
])
def test_bad_requests_are_refused_in_one_line(runner, packages, tmp_path, edit, message) -> None:
    package = packages["aoti"]
    request = _edited_request(package, tmp_path / "request", edit)
    done = runner.run(package, request, "--out", tmp_path / "out")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("hstu-export-run: error: ") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    # Python refuses the same request for the same reason.
    with pytest.raises(RequestError):
        hstu_export.load(package)(load_tensors(request))


def _set_path(manifest: dict, value: str) -> None:
    digest = manifest["files"].pop("sparse/sparse.pt2")
    manifest["files"][value] = digest
    manifest["backend"]["files"]["sparse"] = manifest["artifacts"]["sparse"]["file"] = value


@pytest.mark.parametrize(("tamper", "message"), [
    (lambda p: (p / "sparse" / "sparse.pt2").write_bytes((p / "sparse" / "sparse.pt2").read_bytes()[:-1] + b"x"),
     "sparse/sparse.pt2 does not match its checksum in the manifest"),
    (lambda p: (p / "manifest.json").write_text((p / "manifest.json").read_text().replace('"ctr"', '"CTR"', 1)),
     "manifest.json does not match manifest.sha256"),
    (lambda p: (p / "manifest.sha256").unlink(), "manifest.sha256 is missing"),
    (lambda p: rewrite_manifest(p, lambda m: m.update(format_version=3)),
     "is package format 3; this runtime reads formats 4 to 5"),
    (lambda p: rewrite_tables_header(p, lambda h: h[next(k for k in h if k.endswith("item.weight"))].update(
        shape=[999, 32])), "of another shape than the manifest's [1000, 32] (the shape its program was compiled for)"),
    (lambda p: rewrite_tables_header(p, lambda h: h[next(k for k in h if k.endswith("item.weight"))].update(
        data_offsets=[0, 8])), "whose bytes are not 32000 aligned values inside the file"),
    (lambda p: rewrite_manifest(p, lambda m: m["artifacts"]["sparse"].pop("constants")),
     "'artifacts.sparse.constants' is missing"),
    (lambda p: rewrite_manifest(p, lambda m: m["artifacts"]["sparse"]["constants"]["tensors"].pop()),
     "which the manifest does not list"),
    (lambda p: rewrite_manifest(p, lambda m: _set_path(m, "../sparse.pt2")), "is not a plain relative path"),
    (lambda p: rewrite_manifest(p, lambda m: m.update(op_libraries=["os"])), "names the op library 'os'"),
    (lambda p: rewrite_manifest(p, lambda m: m.update(op_libraries=["hstu_export.ops"])),
     "defined in Python only; re-export with --op-target aten"),
    (lambda p: rewrite_manifest(p, lambda m: m["versions"].update(torch="1.13.1")), "was built with torch 1.13.1"),
    (lambda p: rewrite_manifest(p, lambda m: m["backend"].update(name="onnx")), "the C++ runtime serves aoti"),
    (lambda p: write_manifest_bytes(p, b'{"format": "hstu-export-package", "format_version": 5,'), "is not valid JSON"),
    (lambda p: write_manifest_bytes(p, b'[' * 100000), "nested deeper than 64 levels"),
])
def test_bad_packages_are_refused_in_one_line(runner, packages, tmp_path, tamper, message) -> None:
    package = tmp_path / "pkg"
    shutil.copytree(packages["aoti"], package)
    request = write_request(packages["aoti"], tmp_path / "request", 1, 50)
    tamper(package)
    done = runner.run(package, request)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("hstu-export-run: error: ") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


def test_usage_errors(runner, packages, tmp_path) -> None:
    done = runner.run(packages["aoti"])
    assert done.returncode == 2 and "expected PACKAGE and REQUEST_DIR" in done.stderr
    done = runner.run(packages["aoti"], tmp_path, "--repeat", "0")
    assert done.returncode == 2 and "--repeat needs a positive integer" in done.stderr
    done = runner.run("--help")
    assert done.returncode == 0 and "usage: hstu-export-run PACKAGE REQUEST_DIR" in done.stdout
    done = runner.run(packages["aoti"], tmp_path, "--tables-device", "gpu")
    assert done.returncode == 2 and "--tables-device needs cpu or cuda" in done.stderr
    done = runner.run(packages["aoti"], tmp_path, "--device", "gpu:1")
    assert done.returncode == 2 and "--device needs cuda:N, got 'gpu:1'" in done.stderr
    done = runner.run(packages["aoti"], tmp_path, "--device", "cuda:x")
    assert done.returncode == 2 and "--device needs an integer of 0 or more, got 'x'" in done.stderr
    request = write_request(packages["aoti"], tmp_path / "request", 1, 50)
    done = runner.run(packages["aoti"], request, "--tables-device", "cuda")
    assert done.returncode == 1 and "is a cpu package: its tables cannot live on cuda" in done.stderr
    done = runner.run(packages["aoti"], request, "--tables-device", "cpu", "--out", tmp_path / "out")
    assert done.returncode == 0 and (tmp_path / "out").is_dir()
    done = runner.run(packages["aoti"], tmp_path / "nothing")
    assert done.returncode == 1 and "no such directory of tensors" in done.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.pt").write_bytes(b"not a tensor")
    done = runner.run(packages["aoti"], tmp_path / "bad")
    assert done.returncode == 1 and "is not a torch.save'd tensor" in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.parametrize("name", ["uih_lengths", "features.item.values", "a/b c", ".hidden", "naïve", "%", "x.pt"])
def test_tensor_file_names_round_trip(name: str) -> None:
    encoded = file_name(name)
    assert "/" not in encoded and not encoded.startswith(".") and encoded.endswith(".pt")
    assert tensor_name(encoded) == name
