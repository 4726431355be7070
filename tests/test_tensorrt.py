"""The TensorRT backend, everything of it that does not need TensorRT: workspace sizes, input profiles,
the ``aten`` mapping it relies on, the missing-library error, the dry-run hook, and the dense graph it
would compile (checked through ONNX / onnxruntime against eager).

TensorRT cannot be installed in this workplace, so no test here builds or runs an engine, and none
pretends to: where torch_tensorrt is needed the test checks that we refuse to start without it.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import pytest
import torch
import torch.fx

from hstu_export import ExportSettings, VerifySettings, generate_batch, save_bundle
from hstu_export.capture import trace
from hstu_export.cli import main as cli_main
from hstu_export.errors import BackendUnavailableError, ConfigError, ExportError, UnmappedOpsError
from hstu_export.exporter import (
    BATCH_DIM,
    _compile_inputs,
    export,
    export_example_batch,
    export_ranges,
    feature_dims,
)
from hstu_export.models import build_preset
from hstu_export.passes.context import PassContext
from hstu_export.passes.manager import run_passes
from hstu_export.runtimes import get_backend
from hstu_export.runtimes import tensorrt as trt_backend
from hstu_export.runtimes.base import CompileInputs, DimSpec
from hstu_export.runtimes.onnx import OnnxBackend
from hstu_export.runtimes.tensorrt import (
    TensorRTBackend,
    dim_ranges,
    foreign_ops,
    input_profiles,
    torch_executed_op_names,
)
from hstu_export.settings import parse_size
from hstu_export.verification.corners import verification_batches

MAX_BATCH = 6
TRT_DEVICE = torch.device("cuda")  # only asked for its type: no GPU is touched


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny", seed=1).eval()


@pytest.fixture(scope="module")
def tiny_bundle(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("trt") / "tiny.pt"
    return save_bundle(tiny, path, generate_batch(tiny.input_schema(), 4, seed=2))


def _settings(**kwargs: Any) -> ExportSettings:
    return ExportSettings(backend="trt", device="cuda", max_batch_size=MAX_BATCH, **kwargs)


def _passes(model: Any, settings: ExportSettings, op_target: str, skip: tuple[str, ...] = ()):
    schema = model.input_schema()
    ranges = export_ranges(schema, settings)
    example = export_example_batch(schema, ranges, seed=settings.verify.seed)
    with torch.no_grad():
        gm = trace(model, example)
        ctx = PassContext(example_inputs=example, model=model, schema=schema, op_target=op_target)
        result = run_passes(gm, ctx, skip=skip)
    return schema, ranges, example, result


@pytest.fixture(scope="module")
def tiny_trt_inputs(tiny) -> CompileInputs:
    """What the exporter hands the trt backend for tiny: the backend's own default op target, the
    exporter's own example batch and dims (settings.device only picks names; the graph runs on CPU)."""
    settings = _settings()
    op_target = TensorRTBackend().default_op_target(TRT_DEVICE)
    schema, ranges, example, result = _passes(tiny, settings, op_target)
    return _compile_inputs(result, example, schema, ranges, settings)


# ---- --workspace sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2gib", 2 * 2**30),
        (" 64 KiB ", 64 * 2**10),
        ("1PiB", 2**50),
        ("1048576", 1_048_576),
        ("1048576B", 1_048_576),
        (4096, 4096),
    ],
)
def test_workspace_sizes(text: Any, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "4GiBs", "GiB", "-1", "0", "0MiB", "0.5", "1e9", "4 G i B", 0, -3])
def test_bad_workspace_sizes(text: Any) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


def test_cli_rejects_bad_workspace(tiny_bundle, capsys) -> None:
    code = cli_main([str(tiny_bundle), "--backend", "trt", "--device", "cuda", "--workspace", "12XB"])
    assert code == 2
    assert "cannot read size '12XB'" in capsys.readouterr().err


# ---- input profiles ------------------------------------------------------------------------------


def test_profiles_from_settings_share_named_dims(tiny) -> None:
    schema = tiny.input_schema()
    settings = _settings(max_seq_len=40, max_candidates=12)
    ranges = export_ranges(schema, settings)
    example = export_example_batch(schema, ranges, seed=3)
    dims = feature_dims(schema, ranges)
    profiles = {p.name: p for p in input_profiles(list(example), example, dims)}

    by_dim: dict[str, set[tuple[int, int, int]]] = {}
    for name, axes in dims.items():
        for axis, spec in axes.items():
            p = profiles[name]
            by_dim.setdefault(spec.name, set()).add((p.min_shape[axis], p.opt_shape[axis], p.max_shape[axis]))
    assert set(by_dim) == {BATCH_DIM, "uih_lengths.total", "candidate_lengths.total"}
    for name, triples in by_dim.items():
        assert len(triples) == 1, f"axes named {name!r} got different profiles: {triples}"
        (lo, opt, hi), = triples
        assert 1 <= lo <= opt <= hi and opt >= 2
    (b_min, b_opt, b_max), = by_dim[BATCH_DIM]
    assert (b_min, b_max) == (1, MAX_BATCH) and b_opt == len(example["uih_lengths"])
    assert {t[2] for t in by_dim["uih_lengths.total"]} == {MAX_BATCH * 40}
    assert {t[2] for t in by_dim["candidate_lengths.total"]} == {MAX_BATCH * 12}
    # opt is the example itself, so the example tensors fit the profile they define.
    for name, p in profiles.items():
        assert p.opt_shape == tuple(example[name].shape) and p.dtype == example[name].dtype


def test_profiles_of_the_dense_graph(tiny, tiny_trt_inputs: CompileInputs) -> None:
    """The dense inputs mix feature inputs and sparse outputs; axes sharing a dim share one range."""
    inputs = tiny_trt_inputs
    profiles = {p.name: p for p in input_profiles(inputs.dense_input_names, inputs.example_dense_inputs,
                                                   inputs.dense_dynamic_dims)}
    assert list(profiles) == inputs.dense_input_names
    emb = profiles["uih_item_emb"]
    assert emb.min_shape[1] == emb.opt_shape[1] == emb.max_shape[1] == 32  # static: the embedding dim
    for a, b in [("uih_item_emb", "uih_timestamps"), ("uih_item_emb", "uih_action_emb"),
                 ("user_id_emb", "uih_lengths"), ("uih_lengths", "candidate_lengths")]:
        assert (profiles[a].min_shape[0], profiles[a].opt_shape[0], profiles[a].max_shape[0]) == \
               (profiles[b].min_shape[0], profiles[b].opt_shape[0], profiles[b].max_shape[0])
    ranges = export_ranges(tiny.input_schema(), inputs.settings)
    assert profiles["uih_lengths"].max_shape == (MAX_BATCH,)
    assert profiles["uih_item_emb"].max_shape[0] == MAX_BATCH * ranges.max_lengths["uih_lengths"]
    assert profiles["candidate_item_emb"].max_shape[0] == MAX_BATCH * ranges.max_lengths["candidate_lengths"]
    for p in profiles.values():
        assert all(lo >= 1 for lo in p.min_shape)


def test_profile_of_batch_size_one_keeps_opt_two(tiny) -> None:
    schema = tiny.input_schema()
    ranges = export_ranges(schema, ExportSettings(backend="trt", device="cuda", max_batch_size=1))
    example = export_example_batch(schema, ranges, seed=0)
    ranges_by_dim = dim_ranges(list(example), example, feature_dims(schema, ranges))
    assert ranges_by_dim[BATCH_DIM] == (1, 2, 2)


def test_profiles_refuse_inconsistent_shared_dims() -> None:
    a, b = torch.zeros(3, 4), torch.zeros(5, 4)
    batch = DimSpec("batch", 1, 8)
    with pytest.raises(ExportError, match="share a name"):
        dim_ranges(["a", "b"], {"a": a, "b": b}, {"a": {0: batch}, "b": {0: batch}})
    with pytest.raises(ExportError, match="share a name"):
        dim_ranges(["a", "b"], {"a": a, "b": a}, {"a": {0: batch}, "b": {0: DimSpec("batch", 1, 9)}})
    with pytest.raises(ExportError, match=">= 2"):
        dim_ranges(["a"], {"a": torch.zeros(1, 4)}, {"a": {0: batch}})
    with pytest.raises(ExportError, match="outside"):
        dim_ranges(["a"], {"a": torch.zeros(9, 4)}, {"a": {0: batch}})


def test_torch_executed_op_names() -> None:
    assert torch_executed_op_names(["aten.mm.default"]) == ["torch.ops.aten.mm.default"]
    assert torch_executed_op_names(["torch.ops.aten.sub.Tensor"]) == ["torch.ops.aten.sub.Tensor"]
    assert {"torch.ops.aten.sub.Tensor", "torch.ops.aten.sub.Scalar"} <= set(torch_executed_op_names(["aten.sub"]))
    for bad in ("mm", "aten.no_such_op", "aten.mm.no_such_overload", "aten..default"):
        with pytest.raises(ConfigError):
            torch_executed_op_names([bad])


# ---- the aten mapping leaves TensorRT nothing it cannot take ---------------------------------------


def test_backend_is_registered_and_defaults_to_aten() -> None:
    backend = get_backend("trt")  # importable without torch_tensorrt: that import is lazy
    assert isinstance(backend, TensorRTBackend)
    assert backend.devices == ("cuda",)
    assert backend.default_op_target(TRT_DEVICE) == "aten"


def test_aten_mapping_leaves_no_custom_ops_tiny(tiny, tiny_trt_inputs: CompileInputs) -> None:
    assert not foreign_ops(tiny_trt_inputs.dense)
    # The program TensorRT would receive (after torch.export) is plain aten too.
    program = TensorRTBackend().dense_program(tiny_trt_inputs)
    assert not foreign_ops(program.graph_module)
    namespaces = {n.target.namespace for n in program.graph.nodes
                  if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    assert namespaces == {"aten"}
    # Control: without map_ops the same graph does call hstu ops, and the backend refuses it.
    *_, unmapped = _passes(tiny, _settings(), "aten", skip=("map_ops",))
    assert {k.partition("::")[0] for k in foreign_ops(unmapped.dense)} == {"hstu_export"}
    with pytest.raises(UnmappedOpsError, match=r"hstu_export::hstu_mha_gated \(x2\).*--op-target aten"):
        TensorRTBackend().dense_program(dataclasses.replace(tiny_trt_inputs, dense=unmapped.dense))


def test_aten_mapping_leaves_no_custom_ops_tzrec() -> None:
    model = build_preset("tzrec", seed=1).eval()
    # Short sequences: only the graph is inspected, and its ops do not depend on the lengths.
    settings = ExportSettings(backend="trt", device="cuda", max_batch_size=2, max_seq_len=32, max_candidates=8)
    *_, mapped = _passes(model, settings, "aten")
    assert not foreign_ops(mapped.dense)
    assert not foreign_ops(mapped.graph)  # the whole model, sparse half included
    *_, unmapped = _passes(model, settings, "aten", skip=("map_ops",))
    assert foreign_ops(unmapped.dense)["hstu_export::hstu_mha_gated"] == model.config.num_layers


def test_foreign_ops_sees_fbgemm() -> None:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    def f(lengths: torch.Tensor) -> torch.Tensor:
        return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths) + 1

    gm = torch.fx.symbolic_trace(f)
    assert foreign_ops(gm) == {"fbgemm::asynchronous_complete_cumsum": 1}


# ---- missing TensorRT / CUDA: one line, exit 2, before any work -----------------------------------


def _fake_module(monkeypatch, name: str, version: str) -> None:
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(__name__=name, __version__=version))


def _missing(monkeypatch, name: str) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _check(settings: ExportSettings | None = None) -> str:
    with pytest.raises(BackendUnavailableError) as info:
        TensorRTBackend().check_available(settings or _settings())
    message = str(info.value)
    assert "\n" not in message and message.startswith("the trt backend cannot run here: ")
    assert info.value.exit_code == 2
    return message


def test_missing_torch_tensorrt_and_tensorrt(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _missing(monkeypatch, "torch_tensorrt")
    _missing(monkeypatch, "tensorrt")
    message = _check()
    assert "torch_tensorrt and tensorrt are not installed" in message
    assert "pip install 'hstu-export[trt]'" in message
    assert "CUDA" not in message


def test_missing_tensorrt_only(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fake_module(monkeypatch, "torch_tensorrt", f"{_torch_minor()}.0")
    _missing(monkeypatch, "tensorrt")
    message = _check()
    assert "tensorrt is not installed (pip install 'hstu-export[trt]')" in message
    assert "torch_tensorrt" not in message and "CUDA" not in message


def test_missing_cuda_only(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fake_module(monkeypatch, "torch_tensorrt", f"{_torch_minor()}.0")
    _fake_module(monkeypatch, "tensorrt", "11.0.0")
    message = _check()
    assert "no CUDA device" in message and "NVIDIA GPU" in message
    assert "not installed" not in message and "pip install" not in message


def test_torch_tensorrt_for_another_torch(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fake_module(monkeypatch, "torch_tensorrt", "1.4.0")
    _fake_module(monkeypatch, "tensorrt", "11.0.0")
    message = _check()
    assert f"torch_tensorrt 1.4.0 does not match torch {torch.__version__}" in message


def test_torch_tensorrt_that_fails_to_import(monkeypatch) -> None:
    real_import = trt_backend.importlib.import_module

    def broken(name: str) -> Any:
        if name == "torch_tensorrt":
            raise OSError("libnvinfer.so.11: cannot open shared object file")
        return real_import(name)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trt_backend.importlib, "import_module", broken)
    _fake_module(monkeypatch, "tensorrt", "11.0.0")
    message = _check()
    assert "torch_tensorrt fails to import (libnvinfer.so.11: cannot open shared object file)" in message


def test_check_passes_when_everything_is_there(monkeypatch) -> None:
    """Only the availability check: the libraries here are stand-ins and nothing is compiled."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fake_module(monkeypatch, "torch_tensorrt", f"{_torch_minor()}.1")
    _fake_module(monkeypatch, "tensorrt", "11.0.0")
    TensorRTBackend().check_available(_settings())
    with pytest.raises(ConfigError, match="no such op"):  # a typo in --torch-executed-op fails here too
        TensorRTBackend().check_available(_settings(torch_executed_ops=("aten.no_such_op",)))


def test_cli_without_tensorrt_or_cuda(monkeypatch, tiny_bundle, capsys) -> None:
    """`hstu-export model.pt --backend trt` in an environment like this one: exit 2, one line naming both."""
    _missing(monkeypatch, "torch_tensorrt")
    _missing(monkeypatch, "tensorrt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tiny_bundle.parent / "tiny.trt"
    for extra in ([], ["--device", "cuda", "--workspace", "4GiB"]):
        assert cli_main([str(tiny_bundle), "--backend", "trt", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "torch_tensorrt and tensorrt are not installed" in err
        assert "pip install 'hstu-export[trt]'" in err and "no CUDA device" in err
    assert not out.exists()


def test_unavailable_before_any_work(monkeypatch, tmp_path) -> None:
    """The check runs before the bundle is even read: a missing bundle is not what gets reported."""
    _missing(monkeypatch, "torch_tensorrt")
    with pytest.raises(BackendUnavailableError):
        export(tmp_path / "does-not-exist.pt", tmp_path / "pkg", _settings())
    assert list(tmp_path.iterdir()) == []


# ---- the dry-run hook in the exporter -------------------------------------------------------------


class _ReportingBackend(OnnxBackend):
    """A stand-in with a dryrun hook, to test the exporter's dry-run path (this is not TensorRT)."""

    name = "reporting-stand-in"
    supports_dryrun = True
    seen: list[CompileInputs] = []  # noqa: RUF012

    def dryrun(self, inputs: CompileInputs) -> str:
        self.seen.append(inputs)
        return "report: " + ", ".join(inputs.dense_input_names)

    def compile(self, inputs: CompileInputs, out_dir: Any) -> Any:
        raise AssertionError("a dry run must not compile")


def test_dryrun_reports_and_writes_nothing(monkeypatch, tiny_bundle, tmp_path) -> None:
    import hstu_export.exporter as exporter

    monkeypatch.setattr(exporter, "get_backend", lambda name: _ReportingBackend())
    target = tmp_path / "existing"
    target.mkdir()  # an existing target is no obstacle: nothing is written to it
    settings = ExportSettings(backend="onnx", dryrun=True, max_batch_size=MAX_BATCH)
    result = export(tiny_bundle, target, settings)
    assert result.dryrun_report is not None and result.dryrun_report.startswith("report: uih_item_emb")
    assert _ReportingBackend.seen[-1].dense_input_names[0] == "uih_item_emb"
    assert list(target.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["existing"]


def test_dryrun_needs_a_backend_that_has_one(tiny_bundle, tmp_path, capsys) -> None:
    code = cli_main([str(tiny_bundle), "--backend", "onnx", "--dryrun", "-o", str(tmp_path / "pkg")])
    assert code == 2
    assert "the onnx backend has no dry run" in capsys.readouterr().err
    assert not (tmp_path / "pkg").exists()


# ---- the graph TensorRT would compile, checked through ONNX ----------------------------------------


@pytest.mark.slow
def test_trt_dense_graph_through_onnx_matches_eager(tiny, tiny_trt_inputs: CompileInputs, tmp_path) -> None:
    """The ExportedProgram the trt backend hands to TensorRT, exported by the ONNX backend and run in
    onnxruntime, reproduces eager on batch sizes 1..max and the longest sequences. This checks the graph
    and its dynamic dims (TensorRT's ONNX path would take the same graph), not TensorRT."""
    inputs = tiny_trt_inputs
    program = TensorRTBackend().dense_program(inputs)
    onnx = OnnxBackend()
    artifacts = onnx.compile(dataclasses.replace(inputs, dense=program.module()), tmp_path)
    schema = tiny.input_schema()
    manifest = {
        "backend": {"name": onnx.name, "files": artifacts.files, "meta": artifacts.meta},
        "sparse_input_names": inputs.sparse_input_names,
        "sparse_output_names": [n for n in inputs.dense_input_names if n not in schema.names],
        "dense_passthrough_inputs": [n for n in inputs.dense_input_names if n in schema.names],
        "output_names": inputs.output_names,
    }
    run = onnx.load(tmp_path, manifest, torch.device("cpu"))
    ranges = export_ranges(schema, _settings(verify=VerifySettings(num_random_batches=3)))
    batches = verification_batches(schema, ranges, seed=21, num_random=3)
    assert {b["uih_lengths"].numel() for _, b in batches} >= {1, MAX_BATCH}
    for label, batch in batches:
        got = run(batch)
        with torch.no_grad():
            expected = tiny(batch)
        assert set(got) == set(expected), label
        for task in expected:
            torch.testing.assert_close(got[task], expected[task], rtol=1e-5, atol=1e-6, msg=label)
