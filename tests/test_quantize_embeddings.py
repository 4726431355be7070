"""Quantized embedding tables (--quantize-embeddings): the storage sizes, the lookup error, the rank
agreement measure, refusals, and packages (tiny and tzrec-size tables) that export, load and stay close
to the fp32 package."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from user_models import dense_only, pooled

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch, save_bundle
from hstu_export.cli import main as cli_main
from hstu_export.embedding_quantization import check_model, plan_tables, quantize_collection, stored_row_bytes
from hstu_export.errors import ConfigError
from hstu_export.models import build_preset
from hstu_export.settings import QUANTIZED_TOLERANCES, EmbeddingQuantization, parse_table_modes
from hstu_export.verification.corners import verification_batches
from hstu_export.verification.rank_agreement import kendall_tau, per_user_tau, user_rows

MODES = ("fp16", "int8", "int4")
# Max abs error on probabilities of a quantized package against the fp32 one (the acceptance).
PROBABILITY_TOLERANCE = {"fp16": 2e-3, "int8": 1e-2, "int4": 5e-2}


def _collection(names: tuple[str, ...], dim: int, rows: int = 300, seed: int = 0) -> EmbeddingCollection:
    """Sequence tables (one dim for all, as torchrec requires), rows drawn as the zoo's."""
    tables = [EmbeddingConfig(name=f"t{n}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{n}"])
              for n in names]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ec = EmbeddingCollection(tables=tables, device=torch.device("cpu"))
        for table in ec.embeddings.values():
            torch.nn.init.normal_(table.weight, std=0.05)
    return ec


def _bags(dims: tuple[int, ...], rows: int) -> EmbeddingBagCollection:
    """Pooled tables of different dims."""
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{d}", embedding_dim=d, num_embeddings=rows,
                                                             feature_names=[f"f{d}"]) for d in dims],
                                  device=torch.device("cpu"))


def _all_ids(keys: list[str], rows: int) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.arange(rows).repeat(len(keys)),
                                               torch.full((len(keys),), rows))


# ---- settings --------------------------------------------------------------------------------------


def test_table_modes_parse_and_refuse() -> None:
    assert parse_table_modes(("item=int4,action=none", " ctx=FP16 ")) == {"item": "int4", "action": "none",
                                                                        "ctx": "fp16"}
    for bad in ("item", "=int8", "item=int9"):
        with pytest.raises(ConfigError, match="--quantize-table"):
            parse_table_modes(bad)
    with pytest.raises(ConfigError, match="unknown mode"):
        EmbeddingQuantization("int2")
    assert not EmbeddingQuantization("none", {"item": "none"}).requested
    assert EmbeddingQuantization("none", {"item": "fp16"}).requested
    assert ExportSettings(quantization="int8").quantization == EmbeddingQuantization("int8")


def test_tolerances_follow_the_coarsest_mode() -> None:
    settings = ExportSettings(quantization=EmbeddingQuantization("int8", {"item": "int4"}))
    assert settings.tolerances(["int8", "int4", "none"]) == QUANTIZED_TOLERANCES["int4"]
    assert settings.tolerances(["fp16", "none"]) == QUANTIZED_TOLERANCES["fp16"]
    assert settings.tolerances(["none"]) == {"rel_l2": 1e-5, "max_abs": 1e-4}  # fp32 as before
    assert QUANTIZED_TOLERANCES["int8"]["max_abs"] == 0.01 and QUANTIZED_TOLERANCES["int4"]["max_abs"] == 0.05
    custom = ExportSettings(quantization=EmbeddingQuantization("int8", tolerances={"int8": {"max_abs": 0.002}}))
    assert custom.tolerances(["int8"]) == {"rel_l2": 0.02, "max_abs": 0.002}
    # A bf16 export is already looser than fp16 tables: the wider of the two holds.
    assert ExportSettings(dtype="bf16", quantization="fp16").tolerances(["fp16"]) == {
        "rel_l2": 2e-2, "max_abs": 5e-2}
    atol = ExportSettings(quantization="int8", verify=VerifySettings(atol=0.03))
    assert atol.tolerances(["int8"])["max_abs"] == 0.03  # --atol still overrides


# ---- storage and lookups ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_stored_bytes_are_fbgemm_rows(mode: str) -> None:
    """The byte formula (used by describe) equals what torchrec's quantized module holds."""
    ebc = _bags((32, 100, 512), rows=40)
    planned = {t.name: t.bytes for t in plan_tables({"ebc": ebc}, EmbeddingQuantization(mode))}
    _, stored = quantize_collection(ebc, dict.fromkeys(planned, mode))
    assert stored == planned
    assert planned["t512"] == 40 * {"none": 2048, "fp16": 1024, "int8": 528, "int4": 272}[mode]


def test_row_layout_ratios_at_dim_512() -> None:
    fp32 = stored_row_bytes(512, "none")
    assert fp32 == 2048
    assert fp32 / stored_row_bytes(512, "int8") >= 3.5
    assert fp32 / stored_row_bytes(512, "int4") >= 6


@pytest.mark.parametrize("mode", MODES)
def test_quantized_lookup_error_is_one_step_at_most(mode: str, tmp_path: Path) -> None:
    rows = 300
    ec = _collection(("a", "b"), 40, rows=rows)
    kjt = _all_ids(["fa", "fb"], rows)
    quantized, _ = quantize_collection(ec, {"ta": mode, "tb": mode})
    path = tmp_path / "q.ts"
    torch.jit.save(quantized, str(path))
    loaded = torch.jit.load(str(path))
    with torch.no_grad():
        expected, got = ec(kjt), loaded(kjt)
    for key, table in (("fa", "ta"), ("fb", "tb")):
        weight = ec.embeddings[table].weight.detach()
        error = (got[key].values() - expected[key].values()).abs()
        assert got[key].values().dtype == torch.float32 and error.shape == weight.shape
        if mode == "fp16":
            assert float(error.max()) <= float(weight.abs().max()) * 2**-10
        else:
            # Row-wise: one quantization step of the row's range (plus fp16 rounding of scale and bias).
            step = (weight.max(1).values - weight.min(1).values) / (2 ** {"int8": 8, "int4": 4}[mode] - 1)
            assert bool((error.max(1).values <= step * 0.5 + 1e-3 * weight.abs().max(1).values + 1e-6).all())
            assert float(error.max()) > 0  # really quantized


def test_pooled_collection_quantizes() -> None:
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="u", embedding_dim=16, num_embeddings=50,
                                                            feature_names=["uid"])], device=torch.device("cpu"))
    kjt = KeyedJaggedTensor.from_lengths_sync(["uid"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 3]))
    quantized, stored = quantize_collection(ebc, {"u": "int8"})
    with torch.no_grad():
        error = (quantized(kjt).values() - ebc(kjt).values()).abs().max()
    assert 0 < float(error) < 0.01 and stored == {"u": 50 * 32}


# ---- rank agreement --------------------------------------------------------------------------------


def test_rank_agreement_line_names_the_users_when_known() -> None:
    """The one line export, verify and describe print for each rank-agreement record."""
    from hstu_export.cli import _rank_agreement

    assert _rank_agreement({"mean_tau": 0.98765, "min_tau": 0.5, "users": 7}) == \
        "Kendall tau per user mean 0.9877, min 0.5000 (7 users)"
    assert _rank_agreement({"mean_tau": 1.0, "min_tau": 1.0}) == "Kendall tau per user mean 1.0000, min 1.0000"


def test_kendall_tau_values() -> None:
    x = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert kendall_tau(x, x) == pytest.approx(1.0)
    assert kendall_tau(x, x.flip(0)) == pytest.approx(-1.0)
    assert kendall_tau(x, torch.tensor([0.1, 0.3, 0.2, 0.4])) == pytest.approx(4 / 6)  # one swapped pair
    # tau-b with a tie in x: (1 + 1) / sqrt(2 * 3)
    assert kendall_tau(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(2 / 6**0.5)
    assert kendall_tau(torch.tensor([1.0]), torch.tensor([1.0])) is None
    assert kendall_tau(torch.ones(3), x[:3]) is None


def test_kendall_tau_in_blocks_equals_all_pairs() -> None:
    """Users with more candidates than one block of rows: same tau-b as all pairs at once."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 40, (1100,), generator=gen).double()  # many ties
    y = x + 8 * torch.randn(1100, generator=gen, dtype=torch.float64)
    upper = torch.triu(torch.ones(1100, 1100, dtype=torch.bool), diagonal=1)
    dx, dy = torch.sign(x[:, None] - x[None, :])[upper], torch.sign(y[:, None] - y[None, :])[upper]
    expected = float((dx * dy).sum()) / (float((dx != 0).sum()) * float((dy != 0).sum())) ** 0.5
    assert 0.3 < expected < 0.95
    assert kendall_tau(x, y) == pytest.approx(expected, rel=1e-12)


def test_per_user_rows_from_named_dims() -> None:
    batch = {"candidate_lengths": torch.tensor([3, 1, 2])}
    scores = torch.tensor([0.3, 0.2, 0.1, 0.9, 0.5, 0.6], dtype=torch.float64)
    rows = user_rows(scores, ["candidate_lengths.total"], batch)
    assert [r.tolist() for r in rows] == [[0.3, 0.2, 0.1], [0.9], [0.5, 0.6]]
    assert user_rows(scores[:3], ["batch"], batch) is None  # one score per user: nothing to rank
    assert len(user_rows(torch.zeros(3, 4), ["batch", 4], batch)) == 3
    flipped = torch.tensor([0.1, 0.2, 0.3, 0.9, 0.5, 0.6], dtype=torch.float64)
    report = per_user_tau({"ctr": flipped}, {"ctr": scores}, batch, {"ctr": ["candidate_lengths.total"]})
    assert report == {"ctr": {"users": 2, "mean": pytest.approx(0.0), "min": pytest.approx(-1.0)}}


def test_verification_batches_stay_inside_narrowed_ranges() -> None:
    """Found with the tzrec preset's --max-seq-len below its own limit: the batch-size-1 case drew lengths
    from the model's range and the package refused it."""
    from hstu_export.package.ranges import ExportRanges

    schema = build_preset("tiny", seed=1).input_schema()
    ranges = ExportRanges(3, {"uih_lengths": 5, "candidate_lengths": 2}, {"uih_lengths": 1, "candidate_lengths": 1})
    for label, batch in verification_batches(schema, ranges, seed=3, num_random=3):
        assert int(batch["uih_lengths"].max()) <= 5 and int(batch["candidate_lengths"].max()) <= 2, label
        schema.validate(batch)


# ---- refusals --------------------------------------------------------------------------------------


def test_check_model_refuses_what_it_cannot_do() -> None:
    tiny = build_preset("tiny", seed=1)
    with pytest.raises(ConfigError, match=r"names bogus.*its tables: action, ctx_user_age, ctx_user_id, item"):
        check_model(tiny, EmbeddingQuantization("int8", {"bogus": "int4"}))
    with pytest.raises(ConfigError, match="no torchrec EmbeddingCollection"):
        check_model(dense_only.build_dense_only(), EmbeddingQuantization("int8"))
    assert check_model(dense_only.build_dense_only(), EmbeddingQuantization("none")) == []

    class CountingCollection(EmbeddingCollection):  # a subclass adds behaviour the swap would drop
        pass

    holder = torch.nn.Module()
    holder.ec = CountingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=5,
                                                           feature_names=["f"])], device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"ec \(CountingCollection\) cannot be quantized"):
        check_model(holder, EmbeddingQuantization("fp16"))
    plan = {t.name: t.mode for t in check_model(tiny, EmbeddingQuantization("int8", {"item": "int4"}))}
    assert plan == {"item": "int4", "action": "int8", "ctx_user_id": "int8", "ctx_user_age": "int8"}


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_preset("tiny", seed=1)
    return save_bundle(model, tmp_path_factory.mktemp("quant") / "tiny.pt",
                       generate_batch(model.input_schema(), 4, seed=2))


@pytest.mark.parametrize("args, message", [
    (["--quantize-embeddings", "int9"], "Invalid value for '--quantize-embeddings'"),
    (["--quantize-embeddings", "int8", "--quantize-table", "itemz=int4"], "names itemz"),
    (["--quantize-table", "item"], "use TABLE=MODE"),
    (["--quantize-embeddings", "int8", "--skip-pass", "quantize_embeddings"], "needs the quantize_embeddings pass"),
])
def test_cli_refuses_in_one_line(tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 args: list[str], message: str) -> None:
    code = cli_main([str(tiny_bundle), "--backend", "torchscript", "-q", "-o", str(tmp_path / "pkg"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0] and err[0].startswith("error:")
    assert not (tmp_path / "pkg").exists()


def test_cli_refuses_a_model_without_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = save_bundle(dense_only.build_dense_only(), tmp_path / "dense.pt", example_inputs=(torch.randn(3, 4),),
                         factory="user_models.dense_only:build_dense_only")
    code = cli_main([str(bundle), "--backend", "torchscript", "-q", "--quantize-embeddings", "int4",
                     "-o", str(tmp_path / "pkg")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has no torchrec EmbeddingCollection" in err[0]


def test_describe_shows_bytes_saved(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["describe", str(tiny_bundle), "--quantize-embeddings", "int8",
                     "--quantize-table", "action=none"]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    # item: 1000 x 32 fp32 = 125.0 KiB; int8 rows of 32 + 4 bytes padded to 48: 46.9 KiB; saved 78.1 KiB.
    assert lines["item"][3:12] == ["fp32", "125.0", "KiB", "int8", "46.9", "KiB", "78.1", "KiB", "uih_item_ids,"]
    assert lines["action"][6:9] == ["none", "2.0", "KiB"]


def test_check_each_pass_records_the_quantization_error(tiny_bundle: Path) -> None:
    from hstu_export.exporter import capture

    bundle = hstu_export.load_bundle(tiny_bundle)
    settings = ExportSettings(backend="torchscript", max_batch_size=4, check_each_pass=True, quantization="int4")
    captured = capture(bundle, settings, "aten")
    records = {r.name: r for r in captured.result.report}
    quantized = records["quantize_embeddings"]
    assert quantized.status == "ok" and quantized.max_rel_error is not None and quantized.max_rel_error > 1e-5
    assert all(r.max_rel_error <= 1e-5 for r in captured.result.report if r.name != "quantize_embeddings")
    assert {t["name"]: t["mode"] for t in captured.quantized_tables} == dict.fromkeys(
        ["item", "action", "ctx_user_id", "ctx_user_age"], "int4")
    # The quantized collection stays torchrec's module; lower_embeddings says so.
    [record] = captured.sparse_lowering
    assert record["module"] == "sparse_arch.embedding_collection" and record["lowered"] is False
    assert record["reason"].startswith("its tables are quantized")


# ---- packages --------------------------------------------------------------------------------------


def _export(bundle: Path, out: Path, mode: str, **kwargs: object) -> hstu_export.ExportResult:
    tables = kwargs.pop("tables", {})
    settings = ExportSettings(backend="torchscript", verify=VerifySettings(num_random_batches=2),
                              quantization=EmbeddingQuantization(mode, tables), **kwargs)  # type: ignore[arg-type]
    return hstu_export.export(bundle, out, settings)


def _max_probability_gap(fp32: Path, quantized: Path, num_random: int = 2) -> float:
    """Max abs difference of every output between two packages on the verification batches."""
    reference, predictor = hstu_export.load(fp32), hstu_export.load(quantized)
    ranges = predictor.manifest["ranges"]["lengths"]
    from hstu_export.package.ranges import ExportRanges

    batches = verification_batches(predictor.input_schema, ExportRanges(
        ranges["max_batch_size"], ranges["max_lengths"], ranges["min_lengths"]), 1234, num_random)
    gap = 0.0
    for _, batch in batches:
        expected, got = reference(batch), predictor(batch)
        for name, value in expected.items():
            assert 0 <= float(got[name].min()) and float(got[name].max()) <= 1  # probabilities
            gap = max(gap, float((got[name] - value).abs().max()))
    return gap


@pytest.mark.slow
def test_tiny_packages_in_every_mode(tiny_bundle: Path, tmp_path: Path) -> None:
    fp32 = _export(tiny_bundle, tmp_path / "fp32", "none", max_batch_size=6)
    assert "embedding_quantization" not in fp32.manifest
    for mode in MODES:
        result = _export(tiny_bundle, tmp_path / mode, mode, max_batch_size=6)
        manifest, parity = result.manifest, result.parity
        assert parity["passed"] and parity["tolerances"] == QUANTIZED_TOLERANCES[mode]
        tables = {t["name"]: t for t in manifest["embedding_quantization"]["tables"]}
        assert {t["mode"] for t in tables.values()} == {mode}
        assert tables["item"]["fp32_bytes"] == 1000 * 32 * 4
        assert tables["item"]["bytes"] == 1000 * {"fp16": 64, "int8": 48, "int4": 32}[mode]
        ranking = parity["rank_agreement"]
        assert set(ranking) == {"ctr", "cvr"} and all(r["users"] > 10 for r in ranking.values())
        assert all(-1 <= r["min_tau"] <= r["mean_tau"] <= 1 for r in ranking.values())
        assert all("rank_agreement" in row for row in parity["batches"])
        gap = _max_probability_gap(fp32.path, result.path)
        assert 0 < gap <= PROBABILITY_TOLERANCE[mode]
        assert hstu_export.load(result.path).manifest["op_libraries"] == ["fbgemm_gpu"]


@pytest.mark.slow
def test_cpp_runtime_serves_a_quantized_package(cpp_runtime, tiny_bundle: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The C++ runtime loads the fbgemm libraries the quantized lookups live in, and matches Python."""
    from hstu_export.package.tensor_dir import load_tensors

    package = _export(tiny_bundle, tmp_path / "pkg", "int4", max_batch_size=4).path
    request = tmp_path / "request"
    assert cli_main(["request", str(package), "--out", str(request), "--batch-size", "3", "--seed", "5"]) == 0
    done = cpp_runtime.run(package, request, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    cpp, python = load_tensors(tmp_path / "out"), hstu_export.load(package)(load_tensors(request))
    assert sorted(cpp) == sorted(python)
    for name, value in python.items():
        assert torch.equal(cpp[name], value), name


@pytest.mark.slow
def test_aoti_package_carries_the_quantized_sparse_half(tiny_bundle: Path, tmp_path: Path) -> None:
    """AOTInductor compiles the dense half; the sparse artifact (sparse/sparse.ts) holds the int8 tables: the
    quantized collection is kept as torchrec's module, so the sparse half stays TorchScript, and says why."""
    result = _export(tiny_bundle, tmp_path / "pkg", "int8", max_batch_size=4)
    aoti = hstu_export.export(tiny_bundle, tmp_path / "aoti", ExportSettings(
        backend="aoti", max_batch_size=4, verify=VerifySettings(num_random_batches=1), quantization="int8"))
    assert aoti.parity["passed"] and set(aoti.parity["rank_agreement"]) == {"ctr", "cvr"}
    backend = aoti.manifest["backend"]
    assert backend["files"]["sparse"] == "sparse/sparse.ts" and aoti.manifest["artifacts"]["sparse"]["format"] == "torchscript"
    assert backend["meta"]["sparse_program"]["format"] == "torchscript"
    assert backend["meta"]["sparse_program"]["reason"].startswith("it calls the TorchScript module "), backend["meta"]
    sparse = aoti.path / aoti.manifest["backend"]["files"]["sparse"]
    # Smaller than the tables alone would be in fp32 (code and all).
    assert sparse.stat().st_size < sum(t["fp32_bytes"] for t in aoti.manifest["embedding_quantization"]["tables"])
    # The same quantized lookups as the torchscript package: identical outputs on a fresh batch.
    batch = generate_batch(hstu_export.load(aoti.path).input_schema, 3, seed=8)
    got, expected = hstu_export.load(aoti.path)(batch), hstu_export.load(result.path)(batch)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_per_table_override(tiny_bundle: Path, tmp_path: Path) -> None:
    result = _export(tiny_bundle, tmp_path / "mixed", "none", max_batch_size=4, tables={"item": "int4"})
    tables = {t["name"]: (t["mode"], t["bytes"]) for t in result.manifest["embedding_quantization"]["tables"]}
    assert tables == {"item": ("int4", 32_000), "action": ("none", 2048), "ctx_user_id": ("none", 128_000),
                      "ctx_user_age": ("none", 1280)}
    assert result.parity["tolerances"] == QUANTIZED_TOLERANCES["int4"]
    # hstu-export verify on the package later: the export's tolerances and the rank agreement again.
    report = hstu_export.verify_package(result.path, None, num_random=1)
    assert report["passed"] and report["tolerances"] == QUANTIZED_TOLERANCES["int4"]
    assert set(report["rank_agreement"]) == {"ctr", "cvr"}


@pytest.mark.slow
def test_pooled_user_model_quantized(tmp_path: Path) -> None:
    """An EmbeddingBagCollection in a user's own model (not the zoo) is swapped too."""
    bundle = save_bundle(pooled.build_pooled(), tmp_path / "pooled.pt", example_inputs=pooled.example_inputs(3, seed=0),
                         factory="user_models.pooled:build_pooled", ranges={"sparse_features": (1, 6)})
    result = _export(bundle, tmp_path / "pkg", "fp16", max_batch_size=4)
    assert result.parity["passed"] and result.parity["worst"]["max_abs"] > 0
    assert {t["name"] for t in result.manifest["embedding_quantization"]["tables"]} == {"user", "item", "tags"}


@pytest.fixture(scope="module")
def tzrec_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tzrec preset with its full tables (item and user 100k x 512, 195 MiB each in fp32, action and
    age tables as well) and dense shapes, but short sequences (24 history, 8 candidates): on CPU the
    aten attention pads every user to the model's static max length, and the tables are the subject."""
    from hstu_export.models.config import preset_config
    from hstu_export.models.ranking import HstuRankingModel

    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = HstuRankingModel(preset_config("tzrec").replace(max_history_len=24, max_num_candidates=8)).eval()
    return save_bundle(model, tmp_path_factory.mktemp("tzrec") / "tzrec.pt",
                       generate_batch(model.input_schema(), 3, seed=2))


TZREC_LIMITS = {"max_batch_size": 4}


@pytest.mark.slow
def test_tzrec_sparse_artifact_shrinks(tzrec_bundle: Path, tmp_path: Path) -> None:
    """The sparse artifact the aoti/onnx/trt backends write, in fp32, int8 and int4."""
    from hstu_export.exporter import _compile_inputs, capture
    from hstu_export.runtimes.sparse_torchscript import compile_sparse

    bundle = hstu_export.load_bundle(tzrec_bundle)
    sizes = {}
    for mode in ("none", "int8", "int4"):
        settings = ExportSettings(backend="aoti", quantization=mode, **TZREC_LIMITS)  # type: ignore[arg-type]
        captured = capture(bundle, settings, "aten")
        inputs = _compile_inputs(captured.result, captured.schema.to_graph_inputs(captured.example), captured.schema,
                                 captured.ranges, settings)
        relpath, _ = compile_sparse(inputs, tmp_path / mode)
        sizes[mode] = (tmp_path / mode / relpath).stat().st_size
    assert sizes["none"] > 400e6  # the tables really are full size
    assert sizes["none"] / sizes["int8"] >= 3.5
    assert sizes["none"] / sizes["int4"] >= 6


@pytest.mark.slow
def test_tzrec_packages_stay_close_to_fp32(tzrec_bundle: Path, tmp_path: Path) -> None:
    fp32 = _export(tzrec_bundle, tmp_path / "fp32", "none", **TZREC_LIMITS)
    for mode in MODES:
        result = _export(tzrec_bundle, tmp_path / mode, mode, **TZREC_LIMITS)
        assert result.parity["passed"]
        assert _max_probability_gap(fp32.path, result.path) <= PROBABILITY_TOLERANCE[mode]
        ranking = result.parity["rank_agreement"]
        assert set(ranking) == {"ctr", "cvr"} and all(r["users"] > 0 for r in ranking.values())
        saved = sum(t["fp32_bytes"] - t["bytes"] for t in result.manifest["embedding_quantization"]["tables"])
        assert saved > {"fp16": 200e6, "int8": 300e6, "int4": 350e6}[mode]
