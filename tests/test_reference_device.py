"""``--reference-device cpu``: the user's model runs (while tracing, as verification's reference) on the CPU
in fp32, and the package is compiled for the export device and dtype (issue 39, item 4).

On the GPU machine the case is a model whose own code calls fbgemm's jagged ops, which only its CPU build
has there. Here the same situation is made with the export dtype: the model's attention runs in fp32 only
(as fbgemm's ops run on the CPU only), and export maps it onto our op, which runs in bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from user_models import dlrm_hstu, gr_style

import hstu_export
from hstu_export import ExportSettings, VerifySettings
from hstu_export.errors import ConfigError, HstuExportError
from hstu_export.passes import PASSES
from hstu_export.sources.outputs import call_model
from hstu_export.sources.schema_inference import flatten_example
from hstu_export.verification.packages import verify_package

pytestmark = pytest.mark.slow

_ATTENTION = dlrm_hstu.jagged_hstu_attention


def fp32_only_attention(max_seq_len, alpha, q, k, v, seq_offsets, num_targets=None):  # type: ignore[no-untyped-def]
    if q.dtype != torch.float32:
        raise RuntimeError("this attention runs in fp32 only")
    return _ATTENTION(max_seq_len, alpha, q, k, v, seq_offsets, num_targets)


@pytest.fixture
def fp32_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's attention, under its own qualified name, refusing anything but fp32."""
    fp32_only_attention.__module__, fp32_only_attention.__qualname__ = "user_models.dlrm_hstu", "jagged_hstu_attention"
    monkeypatch.setattr(dlrm_hstu, "jagged_hstu_attention", fp32_only_attention)


def settings(**kwargs) -> ExportSettings:  # type: ignore[no-untyped-def]
    return ExportSettings(backend="torchscript", dtype="bfloat16", max_batch_size=4, force=True,
                          op_mappings={gr_style.ATTENTION: gr_style.GR_ATTENTION},
                          verify=VerifySettings(num_random_batches=1), **kwargs)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hstu_export.save_bundle(
        gr_style.build_ranker(), tmp_path_factory.mktemp("reference") / "model.pt",
        example_inputs=gr_style.example_inputs([5, 3, 7], [2, 1, 3]), factory="user_models.gr_style:build_ranker",
        ranges=gr_style.RANGES)


def test_a_model_that_does_not_run_in_the_export_dtype_fails_without_it(fp32_only, bundle, tmp_path) -> None:
    with pytest.raises(HstuExportError, match="this attention runs in fp32 only"):
        hstu_export.export(bundle, tmp_path / "pkg", settings())
    assert not (tmp_path / "pkg").exists()


def test_reference_on_the_cpu_in_fp32_exports_and_verifies(fp32_only, bundle, tmp_path) -> None:
    result = hstu_export.export(bundle, tmp_path / "pkg", settings(reference_device="cpu"))
    parity = result.parity
    assert parity["passed"] and parity["reference"] == {"device": "cpu", "dtype": "float32"}
    assert result.manifest["dtype"] == "bfloat16" and result.manifest["settings"]["reference_device"] == "cpu"
    # bfloat16 against the fp32 model: visibly not exact, within the bfloat16 tolerances.
    assert 1e-4 < parity["worst"]["rel_l2"] <= parity["tolerances"]["rel_l2"] == 2e-2

    predictor = hstu_export.load(result.path)
    model = hstu_export.load_bundle(bundle).model
    request = flatten_example(predictor.input_schema, gr_style.example_inputs([1, 12], [5, 1], seed=4), None, model)
    with torch.no_grad():
        expected = call_model(model, predictor.input_schema, request)
    got = predictor(request)
    for name in expected:
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name].float(), expected[name], rtol=0, atol=3e-2)
    # `hstu-export verify` runs the model where the export ran it.
    report = verify_package(result.path, str(bundle), num_random=1)
    assert report["passed"]


def test_only_the_cpu_is_a_reference_device() -> None:
    with pytest.raises(ConfigError, match="--reference-device 'cuda': only cpu is supported"):
        ExportSettings(reference_device="cuda")


def test_layers_fed_the_tables_fp32_rows_take_their_weights_dtype_in_a_bf16_export(tmp_path) -> None:
    """A model written for autocast hands its layers the tables' fp32 rows; in a bfloat16 export
    follow_parameter_dtypes casts them where autocast would, and the package verifies."""
    bundle = hstu_export.save_bundle(
        gr_style.build_autocast_ranker(), tmp_path / "model.pt", example_inputs=gr_style.example_inputs([5, 3], [2, 1]),
        factory="user_models.gr_style:build_autocast_ranker", ranges=gr_style.RANGES)
    without = [p.name for p in PASSES if p.name != "follow_parameter_dtypes"]
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        hstu_export.export(bundle, tmp_path / "refused", settings(reference_device="cpu", passes=without))
    assert not (tmp_path / "refused").exists()

    result = hstu_export.export(bundle, tmp_path / "pkg", settings(reference_device="cpu"))
    assert result.parity["passed"]
    stats = next(p["stats"] for p in result.manifest["passes"] if p["name"] == "follow_parameter_dtypes")
    # The three input projections and both task heads' first layers.
    assert stats["casts"] >= 5
    predictor = hstu_export.load(result.path)
    request = flatten_example(predictor.input_schema, gr_style.example_inputs([2], [1], seed=3), None,
                              hstu_export.load_bundle(bundle).model)
    assert all(score.dtype == torch.bfloat16 for score in predictor(request).values())
