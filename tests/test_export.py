"""End-to-end exports on CPU: backends, packages, the predictor, verification and the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torchrec.sparse.jagged_tensor import JaggedTensor

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch, save_bundle
from hstu_export.cli import main as cli_main
from hstu_export.errors import ConfigError, PackageError, RequestError, VerificationError
from hstu_export.models import build_preset

pytestmark = pytest.mark.slow

MAX_BATCH = 6


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def bundle(workdir):
    model = build_preset("tiny", seed=1)
    return save_bundle(model, workdir / "tiny.pt", generate_batch(model.input_schema(), 4, seed=2))


@pytest.fixture(scope="module")
def eager(bundle):
    return hstu_export.load_bundle(bundle).model


@pytest.fixture(scope="module")
def packages(workdir, bundle):
    """One package per backend, exported once for the module."""
    out = {}
    for backend in ("aoti", "torchscript", "onnx"):
        settings = ExportSettings(
            backend=backend, max_batch_size=MAX_BATCH, verify=VerifySettings(num_random_batches=2)
        )
        result = hstu_export.export(bundle, workdir / f"pkg-{backend}", settings)
        out[backend] = result
    return out


@pytest.mark.parametrize("backend", ["aoti", "torchscript", "onnx"])
def test_export_passes_verification(packages, backend):
    manifest = packages[backend].manifest
    parity = manifest["parity"]
    assert parity["passed"]
    assert parity["worst"]["rel_l2"] < 1e-5
    labels = [row["batch"] for row in parity["batches"]]
    assert labels[0] == "corner: B=1, uih_lengths=1 (min), candidate_lengths=1 (min)"
    assert f"corner: B={MAX_BATCH}, uih_lengths=46 (max), candidate_lengths=16 (max)" in labels
    assert any("shortest and the longest" in label for label in labels)
    # The aten target leaves nothing of ours, and the lowered lookups call no fbgemm op: no op library at all.
    assert manifest["op_target"] == "aten" and manifest["op_libraries"] == []
    for key in ("versions", "device", "input_schema", "ranges", "passes", "files", "boundary"):
        assert manifest[key]
    assert manifest["versions"]["torch"] == torch.__version__
    on_disk = json.loads((packages[backend].path / "manifest.json").read_text())
    assert on_disk["files"] == manifest["files"]


FRESH_PROCESS = textwrap.dedent("""
    import sys, torch, hstu_export
    predictor = hstu_export.load(sys.argv[1])
    batches = torch.load(sys.argv[2], weights_only=True)
    outputs = [predictor(b) for b in batches]
    torch.save(outputs, sys.argv[3])
    leaked = [m for m in ("hstu_export.models", "hstu_export.capture", "hstu_export.passes.manager") if m in sys.modules]
    print("LEAKED", leaked)
""")


@pytest.mark.parametrize("backend", ["aoti", "torchscript", "onnx"])
def test_fresh_process_reproduces_eager(packages, backend, eager, tmp_path):
    schema = eager.input_schema()
    gen = torch.Generator().manual_seed(99)
    batches = []
    for i in range(20):
        b = int(torch.randint(1, MAX_BATCH + 1, (1,), generator=gen))
        batches.append(generate_batch(schema, b, seed=1000 + i))
    torch.save(batches, tmp_path / "batches.pt")
    script = tmp_path / "serve.py"
    script.write_text(FRESH_PROCESS)
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            str(packages[backend].path),
            str(tmp_path / "batches.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LEAKED []" in proc.stdout, "loading a package must not import model code"
    outputs = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        for batch, got in zip(batches, outputs):
            expected = eager(batch)
            for task in expected:
                torch.testing.assert_close(got[task], expected[task], rtol=1e-5, atol=1e-6)


def _user_batch(schema, hist, cand, batch_size):
    return generate_batch(
        schema,
        batch_size,
        seed=5,
        lengths={"uih_lengths": [hist] * batch_size, "candidate_lengths": [cand] * batch_size},
    )


@pytest.mark.parametrize("backend", ["aoti", "onnx"])
def test_dynamic_dims_not_specialised(packages, backend, eager):
    predictor = hstu_export.load(packages[backend].path)
    schema = eager.input_schema()
    cfg = eager.config
    for batch_size, hist, cand in [
        (1, 1, 1),
        (MAX_BATCH, cfg.max_history_len, cfg.max_num_candidates),
        (1, cfg.max_history_len, 1),
        (MAX_BATCH, 1, cfg.max_num_candidates),
    ]:
        batch = _user_batch(schema, hist, cand, batch_size)
        got = predictor(batch)
        with torch.no_grad():
            expected = eager(batch)
        for task in expected:
            torch.testing.assert_close(got[task], expected[task], rtol=1e-5, atol=1e-6)


def test_requests_outside_schema(packages, eager):
    predictor = hstu_export.load(packages["aoti"].path)
    schema = eager.input_schema()
    good = generate_batch(schema, 2, seed=3)
    with pytest.raises(RequestError, match="missing feature"):
        predictor({k: v for k, v in good.items() if k != "query_time"})
    with pytest.raises(RequestError, match="dtype"):
        predictor(dict(good, uih_item_ids=good["uih_item_ids"].float()))
    with pytest.raises(
        RequestError, match=f"batch size {MAX_BATCH + 1} is beyond the exported maximum {MAX_BATCH}"
    ):
        predictor(generate_batch(schema, MAX_BATCH + 1, seed=3))
    too_long = dict(good, uih_lengths=torch.tensor([1, 47]))
    with pytest.raises(RequestError, match="length 47 beyond the exported maximum 46"):
        predictor(too_long)


def test_many_threads_match_one(packages, eager):
    predictor = hstu_export.load(packages["aoti"].path)
    schema = eager.input_schema()
    batches = [generate_batch(schema, 1 + i % MAX_BATCH, seed=200 + i) for i in range(16)]
    single = [predictor(b) for b in batches]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            for i in range(tid, len(batches), 8):
                results[i] = predictor(batches[i])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, expected in enumerate(single):
        for task in expected:
            assert torch.equal(results[i][task], expected[task])


def test_existing_directory_untouched_without_force(bundle, tmp_path):
    target = tmp_path / "existing"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(PackageError, match="already exists.*--force"):
        hstu_export.export(bundle, target, ExportSettings(backend="torchscript"))
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert cli_main([str(bundle), "--backend", "torchscript", "--out", str(target), "-q"]) == 2
    assert (target / "keep.txt").read_text() == "mine"
    # --force replaces only our own packages: a user's directory is refused and left as it was.
    args = [str(bundle), "--backend", "torchscript", "--out", str(target), "--force", "-q",
            "--max-batch-size", "3", "--verify-batches", "1"]
    assert cli_main(args) == 2
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_killed_export_leaves_no_package(bundle, tmp_path):
    target = tmp_path / "killed"
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("hstu-export")), str(bundle), "--out", str(target), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".killed.partial-*")):
        time.sleep(0.05)
    assert list(tmp_path.glob(".killed.partial-*")), "the export never started staging"
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not target.exists()
    # The next export removes the dead process's staging directory.
    hstu_export.export(
        bundle,
        target,
        ExportSettings(backend="torchscript", max_batch_size=2, verify=VerifySettings(num_random_batches=0)),
    )
    assert (target / "manifest.json").exists()
    assert not list(tmp_path.glob(".killed.partial-*"))


def test_flipped_byte_fails_checksum(packages, tmp_path):
    import shutil

    copy = tmp_path / "corrupt"
    shutil.copytree(packages["torchscript"].path, copy)
    victim = copy / packages["torchscript"].manifest["backend"]["files"]["model"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="checksum mismatch"):
        hstu_export.load(copy)
    assert cli_main(["run", str(copy), "--batch", str(copy.parent / "nope.pt")]) == 2


def test_package_of_the_old_op_namespace_is_refused(packages, tmp_path, capsys):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(packages["torchscript"].path, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 1  # written before our ops moved from hstu:: to hstu_export::
    manifest.pop("op_namespace")
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="format 1 .*hstu:: namespace.*re-export"):
        hstu_export.load(old)
    assert cli_main(["verify", str(old)]) == 2
    assert "re-export the model" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["aoti", "torchscript"])
def test_stock_loaders_refuse_requests_beyond_the_exported_ranges(packages, backend):
    """The artifacts check their inputs themselves: loaded without hstu_export's predictor (as a C++ or
    stock-PyTorch server would), a history longer than exported or an id past its table is refused."""
    import torch._inductor

    result = packages[backend]
    root, manifest = result.path, result.manifest
    files = manifest["backend"]["files"]
    schema = hstu_export.InputSchema.from_json(manifest["input_schema"])
    max_history = manifest["ranges"]["lengths"]["max_lengths"]["uih_lengths"]
    if backend == "torchscript":
        module = torch.jit.load(str(root / files["model"]))
        run = lambda batch: module(**schema.to_graph_inputs(batch))  # noqa: E731
    else:
        # The sparse half of an aoti package is AOTInductor's (its lookups lowered): positional outputs in the
        # manifest's order, and a refused check named by its symbol, which the manifest maps to the feature.
        assert files["sparse"] == "sparse/sparse.pt2" and manifest["artifacts"]["sparse"]["format"] == "aoti"
        assert manifest["artifacts"]["sparse"]["returns"] == "a tuple of the outputs in this order"
        assert [o["name"] for o in manifest["artifacts"]["sparse"]["outputs"]] == manifest["sparse_output_names"]
        sparse = torch._inductor.aoti_load_package(str(root / files["sparse"]))
        dense = torch._inductor.aoti_load_package(str(root / files["dense"]))
        # Its tables are stored beside it (format 5), read here with the safetensors library as any server would,
        # and handed to it before its first call (without them the program reads null pointers).
        from safetensors.torch import load_file

        constants = manifest["artifacts"]["sparse"]["constants"]
        assert constants["file"] == "sparse/tables.safetensors" and constants["format"] == "safetensors"
        tables = load_file(str(root / constants["file"]))
        assert sorted(tables) == sorted(sparse.get_constant_fqns()) == [t["name"] for t in constants["tensors"]]
        assert all(list(tables[t["name"]].shape) == t["shape"] for t in constants["tensors"])
        assert sum(t.numel() for t in tables.values()) > 10_000  # the embedding tables, not a stray buffer
        sparse.load_constants(tables, check_full_update=True, user_managed=True)

        def run(batch):
            inputs = schema.to_graph_inputs(batch)
            returned = sparse(**{n: inputs[n] for n in manifest["sparse_input_names"]})
            boundary = dict(zip(manifest["sparse_output_names"], returned, strict=True))
            return dense(**{n: (boundary[n] if n in boundary else inputs[n]).contiguous()
                            for n in manifest["dense_input_names"]})

    checks = manifest["backend"]["meta"].get("sparse_program", {}).get("range_checks", {})
    if backend != "torchscript":  # a minimum, a maximum and (per-user features) the rows of every checked feature
        bounds = {(feature, bound) for feature, bound in checks.values()}
        assert len(bounds) == len(checks)
        assert {("uih_item_ids", "low"), ("uih_item_ids", "high"), ("uih_lengths", "rows"),
                ("candidate_item_ids", "low"), ("uih_lengths", "high")} <= bounds, checks

    def refused(batch, feature: str, bound: str) -> None:
        with pytest.raises(Exception) as info:  # stock loaders raise their own types
            run(batch)
        if backend == "torchscript":
            assert feature in str(info.value)
        else:
            symbol = re.search(r"Expected (u\d+) ", str(info.value)).group(1)
            assert checks[symbol] == [feature, bound], (symbol, checks)

    good = generate_batch(schema, 2, seed=5)
    run(good)  # within range: runs
    refused(generate_batch(schema, 2, seed=5, lengths={"uih_lengths": [max_history + 4, 3]}), "uih_lengths", "high")
    past_table = dict(good, uih_item_ids=good["uih_item_ids"].clone())
    past_table["uih_item_ids"][0] = schema.get("uih_item_ids").max_value + 1
    refused(past_table, "uih_item_ids", "high")
    below = dict(good, candidate_item_ids=good["candidate_item_ids"].clone())
    below["candidate_item_ids"][0] = -1
    refused(below, "candidate_item_ids", "low")
    if backend != "torchscript":  # more users than compiled: AOTInductor checks no input dims unless asked to
        users = max(manifest["ranges"]["max_batch_size"], 2) + 1
        refused(generate_batch(schema, users, seed=5), "uih_lengths", "rows")
    assert {p["name"]: p for p in manifest["passes"]}["guard_ranges"]["stats"]["sparse_checks"] >= 5


def test_compiled_programs_are_called_by_keyword_as_torch_calls_them(packages):
    """The loaded programs take the keyword call (their call spec read once, not on every request), with torch's
    answers; anything else still goes through torch's wrapper and its errors."""
    from hstu_export.runtimes.aoti import _hand_tables, _load_pt2

    result = packages["aoti"]
    manifest, root = result.manifest, result.path
    schema = hstu_export.InputSchema.from_json(manifest["input_schema"])
    inputs = schema.to_graph_inputs(generate_batch(schema, 3, seed=4))
    sparse, dense = (_load_pt2(root / manifest["backend"]["files"][role]) for role in ("sparse", "dense"))
    _hand_tables(sparse, root, manifest["artifacts"]["sparse"]["constants"], torch.device("cpu"))
    assert sparse._keywords == manifest["sparse_input_names"] and dense._keywords == manifest["dense_input_names"]
    features = {n: inputs[n] for n in manifest["sparse_input_names"]}
    returned = sparse(**features)
    assert isinstance(returned, tuple) and len(returned) == len(manifest["sparse_output_names"])
    for ours, torchs in zip(returned, sparse._fn(**features), strict=True):
        assert torch.equal(ours, torchs)
    boundary = dict(zip(manifest["sparse_output_names"], returned, strict=True))
    dense_inputs = {n: (boundary[n] if n in boundary else inputs[n]).contiguous() for n in manifest["dense_input_names"]}
    for ours, torchs in zip(dense(**dense_inputs), dense._fn(**dense_inputs), strict=True):
        assert torch.equal(ours, torchs)
    missing = dict(features)
    missing.pop(manifest["sparse_input_names"][0])
    with pytest.raises(ValueError, match="keyword"):
        sparse(**missing)


def test_range_checks_read_the_device_once(packages):
    """The artifacts' range checks take every feature's extremes in one read: no per-feature item() (on a GPU
    each is a wait for the device and a host round trip), one aminmax per checked feature and one stack."""
    from torch.profiler import ProfilerActivity, profile

    result = packages["torchscript"]
    manifest = result.manifest
    module = torch.jit.load(str(result.path / manifest["backend"]["files"]["model"]))
    schema = hstu_export.InputSchema.from_json(manifest["input_schema"])
    inputs = schema.to_graph_inputs(generate_batch(schema, 2, seed=3))
    for _ in range(3):  # past TorchScript's profiling runs
        module(**inputs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module(**inputs)
    counts: dict[str, int] = {}
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
    checks = {p["name"]: p for p in manifest["passes"]}["guard_ranges"]["stats"]["sparse_checks"]
    assert checks >= 5 and counts.get("aten::aminmax") == checks, counts
    assert counts.get("aten::item", 0) == 0 and counts.get("aten::_local_scalar_dense", 0) == 0, counts
    # One stack of every extreme a graph (the sparse half's features, the dense half's own), not one a feature.
    assert counts.get("aten::stack") == 2, counts


def test_failed_parity_writes_nothing(bundle, tmp_path):
    class Perturb:
        name = "perturb_outputs"

        def run(self, gm, ctx):
            if ctx.current_graph != "dense":
                return gm
            out = next(n for n in gm.graph.nodes if n.op == "output")
            values = dict(out.args[0])
            with gm.graph.inserting_before(out):
                first = next(iter(values))
                values[first] = gm.graph.call_function(torch.mul, (values[first], 1.01))
            out.args = (values,)
            return gm

    target = tmp_path / "bad"
    with pytest.raises(VerificationError, match="nothing was written"):
        hstu_export.export(
            bundle, target, ExportSettings(backend="torchscript", max_batch_size=2), extra_passes=[Perturb()]
        )
    assert not target.exists() and not list(tmp_path.glob(".bad.*"))


def test_settings_errors(bundle, tmp_path):
    with pytest.raises(ConfigError, match="--max-seq-len exceeds the model.s own limit of 46"):
        hstu_export.export(bundle, tmp_path / "x", ExportSettings(max_seq_len=100))
    with pytest.raises(ConfigError, match="no usable CUDA"):
        hstu_export.export(bundle, tmp_path / "x", ExportSettings(device="cuda"))
    assert cli_main([str(bundle), "--dtype", "bf16", "--backend", "onnx", "--out", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_cli_verify_run_bench(packages, bundle, tmp_path, capsys):
    pkg = packages["aoti"].path
    assert cli_main(["verify", str(pkg), "--model", str(bundle), "--batches", "2"]) == 0
    assert "parity ok" in capsys.readouterr().out
    batch_file = tmp_path / "batch.pt"
    torch.save(generate_batch(build_preset("tiny").input_schema(), 3, seed=4), batch_file)
    assert cli_main(["run", str(pkg), "--batch", str(batch_file), "--output", str(tmp_path / "o.pt")]) == 0
    assert set(torch.load(tmp_path / "o.pt", weights_only=True)) == {"ctr", "cvr"}
    assert (
        cli_main(
            [
                "bench",
                str(pkg),
                "--model",
                str(bundle),
                "--iters",
                "5",
                "--warmup",
                "1",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "eager" in out and "exported" in out and "speed-up" in out
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["exported"]["p50_ms"] > 0 and res["eager"]["p99_ms"] >= res["eager"]["p50_ms"]


def test_cli_export_summary(bundle, tmp_path, capsys):
    target = tmp_path / "cli-pkg"
    assert (
        cli_main(
            [
                str(bundle),
                "--backend",
                "torchscript",
                "--out",
                str(target),
                "--max-batch-size",
                "2",
                "--verify-batches",
                "1",
                "--dump-graphs",
                str(tmp_path / "graphs"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "parity" in out and "passed" in out and str(target) in out.replace("\n", "")
    assert os.path.exists(target / "manifest.json")
    # The graph dumps stay beside the package, and the summary lists the artifacts only.
    manifest = json.loads((target / "manifest.json").read_text())
    assert (tmp_path / "graphs" / "report.html").is_file() and not (target / "graphs").exists()
    assert not [f for f in manifest["files"] if f.startswith("graphs/")]
    assert "graphs/" not in out.split("files", 1)[1].split("size", 1)[0]
    hstu_export.load(target)
    # Asked for, they travel inside the package, covered by the checksums.
    inside = tmp_path / "cli-pkg-graphs"
    args = [str(bundle), "--backend", "torchscript", "--out", str(inside), "--max-batch-size", "2",
            "--verify-batches", "1", "--dump-graphs", str(tmp_path / "graphs2"), "--graphs-in-package", "-q"]
    assert cli_main(args) == 0
    manifest = json.loads((inside / "manifest.json").read_text())
    assert "graphs/report.html" in manifest["files"]
    assert (inside / "graphs" / "report.html").read_text() == (tmp_path / "graphs2" / "report.html").read_text()
    hstu_export.load(inside)


class _JaggedValues(torch.nn.Module):
    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return JaggedTensor(values=values, lengths=lengths).values()


def test_scripted_code_names_the_op_libraries_of_every_compiled_method() -> None:
    """Loading TorchScript compiles every method of a scripted class, not only those forward reaches: a sparse
    half that builds a torchrec JaggedTensor needs fbgemm registered (its offsets method calls fbgemm's cumsum)
    even when forward reads only the values. TorchEasyRec's DlrmHSTU is such a model."""
    from hstu_export.runtimes.graph_io import scripted_op_libraries

    scripted = torch.jit.script(_JaggedValues())
    graph = scripted.inlined_graph
    reached = {node.kind().split("::")[0] for node in graph.nodes()}
    assert "fbgemm" not in reached  # what forward's graph alone says
    assert scripted_op_libraries(scripted) == ["fbgemm_gpu"]
    assert scripted_op_libraries(torch.jit.script(torch.nn.Linear(2, 2))) == []
