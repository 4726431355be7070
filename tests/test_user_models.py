"""Users' own models, exported as they are written (tests/user_models): KeyedJaggedTensor inputs,
max lengths from the batch, their own attention and jagged helpers, EmbeddingBagCollection +
KeyedTensor, dict and tensor arguments. No model here knows about hstu-export."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from user_models import dlrm_hstu, grouped_ebc, pooled

import hstu_export
from hstu_export import ExportSettings, VerifySettings
from hstu_export.capture import trace
from hstu_export.errors import ConfigError, TraceError, VerificationError
from hstu_export.package.tensor_dir import load_tensors, save_tensors
from hstu_export.passes.context import PassContext
from hstu_export.passes.manager import run_passes
from hstu_export.sources.outputs import call_model
from hstu_export.sources.schema_inference import flatten_example, infer_schema

GR_ATTENTION = "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha"
USER_ATTENTION = "user_models.dlrm_hstu.jagged_hstu_attention"
RANGES_A = {"uih_features": (1, 12), "candidates_features": (1, 5)}
MAX_BATCH = 4


def _flat(model: nn.Module, example: tuple) -> tuple:
    schema = infer_schema(model, example, ranges=RANGES_A if isinstance(model, dlrm_hstu.DlrmHstu) else
                          {"sparse_features": (1, 6)})
    return schema, flatten_example(schema, example, None, model)


# ---- schema -------------------------------------------------------------------------------------


def test_schema_from_two_kjts() -> None:
    model = dlrm_hstu.build_ranker()
    uih, cand = dlrm_hstu.example_inputs(3, seed=0)
    schema, flat = _flat(model, (uih, cand))
    assert [a.name for a in schema.arguments] == ["uih_features", "candidates_features"]
    assert schema.arguments[0].keys == ("uih_item_id", "uih_action", "uih_time")
    action_len = schema.get("uih_features.uih_action.lengths")
    assert action_len.same_as == "uih_features.uih_item_id.lengths"  # the history keys share their lengths
    ids = schema.get("uih_features.uih_item_id.values")
    assert (ids.kind, ids.min_value, ids.max_value) == ("jagged", 0, 499)  # from the item table's size
    times = schema.get("uih_features.uih_time.values")
    assert times.max_value is None and times.sample_range is not None  # not embedded: no limit, a sample range
    assert schema.get("uih_features.uih_item_id.lengths").max_value == 12  # stated range
    assert flat["uih_features.uih_item_id.values"].shape[0] == int(uih["uih_item_id"].lengths().sum())
    args, kwargs = schema.assemble(flat)
    with torch.no_grad():
        expected, got = model(uih, cand), model(*args, **kwargs)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1]["click"], got[1]["click"])


def test_schema_from_kjt_and_dict_of_tensors() -> None:
    model = pooled.build_pooled()
    schema, _ = _flat(model, pooled.example_inputs(3, seed=0))
    assert [(a.name, a.kind) for a in schema.arguments] == [("sparse_features", "kjt"), ("dense_features", "dict")]
    context = schema.get("dense_features.context")
    assert (context.kind, context.trailing) == ("per_user", (4,))
    assert schema.get("sparse_features.item_tags.lengths").same_as is None
    assert schema.get("sparse_features.item_id.lengths").same_as == "sparse_features.user_id.lengths"


def test_request_validation_uses_the_schema() -> None:
    model = dlrm_hstu.build_ranker()
    schema, flat = _flat(model, dlrm_hstu.example_inputs(3, seed=0))
    schema.validate(flat)
    broken = dict(flat, **{"uih_features.uih_action.lengths": flat["uih_features.uih_item_id.lengths"] + 1})
    with pytest.raises(hstu_export.errors.RequestError, match="must equal 'uih_features.uih_item_id.lengths'"):
        schema.validate(broken)
    too_big = dict(flat, **{"uih_features.uih_item_id.values": torch.full_like(flat["uih_features.uih_item_id.values"], 500)})
    with pytest.raises(hstu_export.errors.RequestError, match="beyond the exported maximum 499"):
        schema.validate(too_big)


# ---- tracing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dlrm_hstu", "pooled"])
def test_traced_graph_equals_the_model(which: str) -> None:
    module = dlrm_hstu if which == "dlrm_hstu" else pooled
    model = dlrm_hstu.build_ranker() if which == "dlrm_hstu" else pooled.build_pooled()
    schema, flat = _flat(model, module.example_inputs(3, seed=0))
    gm = trace(model, flat, schema=schema)
    assert gm.meta["opaque_calls"] == []
    # KJT keys stay Python values while tracing: no node asks a KeyedJaggedTensor for them.
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "keys"]
    for seed in range(4):
        example = module.example_inputs(1 + seed, seed=seed + 1)
        batch = flatten_example(schema, example, None, model)
        with torch.no_grad():
            got, expected = gm(**schema.to_graph_inputs(batch)), call_model(model, schema, batch)
        assert list(got) == list(expected)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def test_data_dependent_ints_become_graph_values() -> None:
    model = dlrm_hstu.build_ranker()
    schema, flat = _flat(model, dlrm_hstu.example_inputs(3, seed=0))
    gm = trace(model, flat, schema=schema)
    ints = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is int]
    assert len(ints) == 2  # int(lengths.max().item()) for the history and the candidates
    assert all(n.args[0].op == "call_method" and n.args[0].target == "item" for n in ints)


def _untraceable_helper(x: Tensor) -> Tensor:
    # Python control flow on a traced value: symbolic tracing cannot take it, torch.export can.
    if x.dim() == 3:
        x = x.flatten(1)
    return x * 2


class WithHelper(pooled.PooledRanker):
    def forward(self, sparse_features, dense_features):  # type: ignore[no-untyped-def]
        out = super().forward(sparse_features, dense_features)
        return {**out, "ctr": _untraceable_helper(out["ctr"])}


def test_untraceable_function_is_kept_opaque_and_reported() -> None:
    model = WithHelper().eval()
    example = pooled.example_inputs(3, seed=0)
    schema, flat = _flat(model, example)
    gm = trace(model, flat, schema=schema)
    [call] = gm.meta["opaque_calls"]
    assert call["kind"] == "function" and call["name"].endswith("test_user_models._untraceable_helper")
    assert "test_user_models.py:" in call["where"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _untraceable_helper]
    assert len(calls) == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(**schema.to_graph_inputs(flat))["ctr"], call_model(model, schema, flat)["ctr"])


# ---- the boundary and the mapping ---------------------------------------------------------------


def test_boundary_is_found_and_attention_mapped() -> None:
    model = dlrm_hstu.build_ranker()
    schema, flat = _flat(model, dlrm_hstu.example_inputs(3, seed=0))
    from hstu_export.ops.mappings import function_mappings, imported_functions

    mappings = {USER_ATTENTION: GR_ATTENTION}
    gm = trace(model, flat, schema=schema, opaque_functions=imported_functions(list(function_mappings(mappings))))
    ctx = PassContext(example_inputs=schema.to_graph_inputs(flat), model=model, schema=schema, op_mappings=mappings,
                      check_each_pass=True)
    result = run_passes(gm, ctx)
    marks = result.report["mark_sparse_dense"].stats["automatic_marks"]
    assert marks == ["embedding_collection__uih_item_id__values", "embedding_collection__uih_action__values",
                     "embedding_collection__cand_item_id__values", "embedding_collection__cand_category__values"]
    # The dense half holds no embedding table; the sparse half holds all of them.
    assert not any(isinstance(m, EmbeddingCollection) for m in result.dense.modules())
    dense_params = sum(p.numel() for p in result.dense.parameters())
    table_params = sum(p.numel() for p in model.embedding_collection.parameters())
    assert dense_params == sum(p.numel() for p in model.parameters()) - table_params
    stats = result.report["map_ops"].stats
    assert stats["foreign"] == {f"{USER_ATTENTION} (generative-recommenders (declared like {GR_ATTENTION}))": 2}
    assert stats["mapped"]["hstu_export::hstu_mha -> hstu_export.ops.reference:hstu_mha_reference"] == 2
    assert all(r.max_rel_error is not None and r.max_rel_error <= 1e-6 for r in result.report)


@pytest.mark.parametrize("which", ["pooled", "grouped"])
def test_pooled_boundary_is_named_after_the_lookup_chain(which: str) -> None:
    """EmbeddingBagCollection results read as ``kt[key]``, ``kt.values()``, ``to_dict()``, through a
    KeyedTensor the model builds itself and through ``KeyedTensor.regroup_as_dict`` (TorchEasyRec's
    embedding groups) cross under the names of their lookup chain, not the graph's node names."""
    if which == "pooled":
        model, example, ranges = pooled.build_pooled(), pooled.example_inputs(3, seed=0), {"sparse_features": (1, 6)}
        expected = ["ebc__user_id", "ebc__item_id", "ebc__item_tags", "ebc__values"]
    else:
        model, example = grouped_ebc.build_grouped(), grouped_ebc.example_inputs(3, seed=0)
        ranges = {"item_features": (1, 4), "user_features": (1, 1)}
        # wide = item_id (ebc) + user_id (ebc_user, tiled); deep = item_tags + item_id (ebc alone)
        expected = ["ebc_ebc_user__item_id_user_id", "ebc__item_tags_item_id", "ebc_user__values"]
    schema = infer_schema(model, example, ranges=ranges)
    flat = flatten_example(schema, example, None, model)
    ctx = PassContext(example_inputs=schema.to_graph_inputs(flat), model=model, schema=schema, check_each_pass=True)
    result = run_passes(trace(model, flat, schema=schema), ctx)
    assert result.report["mark_sparse_dense"].stats["automatic_marks"] == expected
    assert [t.name for t in result.boundary.dense_inputs if t.name not in schema.graph_names] == expected
    assert all(r.max_rel_error is not None and r.max_rel_error <= 1e-6 for r in result.report)


# ---- describe -----------------------------------------------------------------------------------


def test_describe_lists_pooled_and_quantized_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torch.ao.quantization import PlaceholderObserver
    from torchrec.modules.embedding_configs import QuantConfig
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

    from hstu_export.cli import main as cli_main
    from hstu_export.embedding_quantization import stored_row_bytes
    from hstu_export.sources.describe import sparse_tables

    path = hstu_export.save_bundle(pooled.build_pooled(), tmp_path / "pooled.pt",
                                   example_inputs=pooled.example_inputs(3, seed=0),
                                   factory="user_models.pooled:build_pooled", ranges={"sparse_features": (1, 6)})
    assert cli_main(["describe", str(path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["user"], ["item"], ["tags"])}
    # name, rows, dim, dtype, bytes (rows x dim x 4), features
    assert rows["item"] == ["item", "200", "8", "fp32", "6.2", "KiB", "item_id"]
    assert rows["tags"][1:4] == ["50", "8", "fp32"]
    # Lengths ranges say whose they are: stated when the bundle was saved, so --max-length may widen them.
    tags = next(line.split() for line in out.splitlines() if line.startswith("sparse_features.item_tags.lengths"))
    assert tags[3:5] == ["1..6", "(stated)"]
    # A contextual key keeps the one value per user it had in the example; that range was not stated.
    user = next(line.split() for line in out.splitlines() if line.startswith("sparse_features.user_id.lengths"))
    assert user[3:7] == ["1..1", "(one", "per", "user)"]
    assert cli_main(["describe", str(path), "--quantize-embeddings", "int8"]) == 0
    assert "int8" in capsys.readouterr().out

    # torchrec's quantized collections: their tables, stored as fbgemm's rows.
    model = pooled.build_pooled()
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="seq", embedding_dim=8, num_embeddings=30,
                                                     feature_names=["seq_id"])], device=torch.device("cpu"))
    quantized = []
    for module, cls, dtype in ((model.ebc, QuantEmbeddingBagCollection, torch.qint8),
                               (ec, QuantEmbeddingCollection, torch.quint4x2)):
        module.qconfig = QuantConfig(activation=PlaceholderObserver.with_args(dtype=torch.float32),
                                     weight=PlaceholderObserver.with_args(dtype=dtype))
        quantized.append(cls.from_float(module))
    holder = nn.ModuleDict({"bags": quantized[0], "sequences": quantized[1]})
    tables = {t["name"]: t for t in sparse_tables(holder)}
    assert sorted(tables) == ["item", "seq", "tags", "user"]
    assert (tables["item"]["data_type"], tables["item"]["bytes"]) == ("int8", 200 * stored_row_bytes(8, "int8"))
    assert (tables["seq"]["data_type"], tables["seq"]["bytes"]) == ("int4", 30 * stored_row_bytes(8, "int4"))
    assert tables["seq"]["feature_names"] == ["seq_id"]


# ---- exports ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("user_models")
    return {
        "dlrm_hstu": hstu_export.save_bundle(
            dlrm_hstu.build_ranker(), root / "dlrm_hstu.pt", example_inputs=dlrm_hstu.example_inputs(3, seed=0),
            factory="user_models.dlrm_hstu:build_ranker", ranges=RANGES_A),
        "pooled": hstu_export.save_bundle(
            pooled.build_pooled(), root / "pooled.pt", example_inputs=pooled.example_inputs(3, seed=0),
            factory="user_models.pooled:build_pooled", ranges={"sparse_features": (1, 6)}),
    }


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aoti", "torchscript", "onnx"])
@pytest.mark.parametrize("which", ["dlrm_hstu", "pooled"])
def test_export_matches_the_model(bundles: dict[str, Path], tmp_path: Path, which: str, backend: str,
                                  request: pytest.FixtureRequest) -> None:
    # aoti: with the sparse half's prechecked model too (a CUDA export's default), served by both runtimes below.
    settings = ExportSettings(backend=backend, max_batch_size=MAX_BATCH, verify=VerifySettings(num_random_batches=2),
                              op_mappings={USER_ATTENTION: GR_ATTENTION} if which == "dlrm_hstu" else {},
                              prechecked_sparse="on" if backend == "aoti" else "auto")
    result = hstu_export.export(bundles[which], tmp_path / "pkg", settings)
    parity = result.parity
    assert parity["passed"] and parity["worst"]["rel_l2"] <= 1e-5
    assert {r["batch_size"] for r in parity["batches"]} >= {1, MAX_BATCH}
    manifest = result.manifest
    assert manifest["model"]["source"]["kind"] == "factory"
    passes = {p["name"]: p for p in manifest["passes"]}
    assert passes["mark_sparse_dense"]["stats"]["automatic_marks"]
    if which == "dlrm_hstu":
        assert sum(passes["map_ops"]["stats"]["foreign"].values()) == 2
    if backend == "torchscript":
        # x.norm(dim=-1) in the pooled model's dense code is not scriptable: the dense half is traced.
        assert manifest["backend"]["meta"]["method"] == ("trace" if which == "pooled" else "script")

    # A fresh predictor on a request of other sizes, against the user's own model.
    predictor = hstu_export.load(result.path)
    split = predictor.split
    assert (split.sparse_model if split else None) == {"aoti": "prechecked", "onnx": None, "torchscript": None}[backend]
    model = hstu_export.load_bundle(bundles[which]).model
    module = dlrm_hstu if which == "dlrm_hstu" else pooled
    example = module.example_inputs(2, seed=42)
    schema = predictor.input_schema
    request_batch = flatten_example(schema, example, None, model)
    with torch.no_grad():
        expected = call_model(model, schema, request_batch)
    got = predictor(request_batch)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5)

    if backend in ("aoti", "torchscript"):
        # The C++ runtime serves the user's model (KeyedJaggedTensor features, dotted request names) bit
        # for bit like the Python predictor.
        runtime = request.getfixturevalue("cpp_runtime")
        done = runtime.run(result.path, save_tensors(request_batch, tmp_path / "request"), "--out", tmp_path / "out")
        assert done.returncode == 0, done.stderr
        cpp = load_tensors(tmp_path / "out")
        assert sorted(cpp) == sorted(got) and all(torch.equal(cpp[k], got[k]) for k in got)


@pytest.mark.slow
def test_mismatch_names_output_batch_and_sizes(bundles: dict[str, Path], tmp_path: Path) -> None:
    # A rewrite of our own that scales the attention wrongly: verification must catch it and say where.
    settings = ExportSettings(backend="torchscript", max_batch_size=MAX_BATCH,
                              op_mappings={USER_ATTENTION: "fn:test_user_models:wrong_scale_attention"},
                              verify=VerifySettings(num_random_batches=1))
    with pytest.raises(VerificationError) as info:
        hstu_export.export(bundles["dlrm_hstu"], tmp_path / "pkg", settings)
    message = str(info.value)
    assert "output 'output_" in message and "(B=" in message and "uih_features.uih_item_id.lengths=" in message
    assert not (tmp_path / "pkg").exists()


def test_sizes_read_from_values_get_advice_not_a_compiler_dump(bundles: dict[str, Path], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Without the mapping of its attention function, the user model pads to a max length it reads from the
    lengths' values, and AOTInductor cannot compile the batched product over it: the error is one line that
    says what to do, the exit code is non-zero, and nothing is written."""
    from hstu_export.cli import main as cli_main

    target = tmp_path / "pkg"
    code = cli_main([str(bundles["dlrm_hstu"]), "--backend", "aoti", "--out", str(target), "--max-batch-size",
                     str(MAX_BATCH), "-q"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "AOTInductor compilation failed" in err and "read from tensor values" in err
    assert "--map-function NAME=RULE" in err and "--backend torchscript" in err
    assert not target.exists()


def test_data_dependent_advice_reads_the_cause_chain() -> None:
    from hstu_export.runtimes.graph_io import data_dependent_advice

    try:
        try:
            raise RuntimeError("GuardOnDataDependentSymNode: Could not guard on data-dependent expression Eq(u0, 1)")
        except RuntimeError as inner:
            raise ValueError("LoweringException") from inner
    except ValueError as outer:
        assert "--map-function" in data_dependent_advice(outer)
    assert data_dependent_advice(RuntimeError("out of memory")) == ""


def wrong_scale_attention(call):  # type: ignore[no-untyped-def]
    bound = call.static_bound("max_seq_len")
    return torch.ops.hstu_export.hstu_mha.default(call["q"], call["k"], call["v"], call["seq_offsets"], bound,
                                                   2 * bound, call["alpha"], True, call["num_targets"], 0, 0)


def test_fixed_scale_needs_a_function_that_can_run_with_it(bundles: dict[str, Path], tmp_path: Path) -> None:
    settings = ExportSettings(backend="torchscript", attention_scale="fixed:64",
                              op_mappings={USER_ATTENTION: GR_ATTENTION})
    with pytest.raises(ConfigError, match="cannot be run so; use --attention-scale batch"):
        hstu_export.export(bundles["dlrm_hstu"], tmp_path / "pkg", settings)


# ---- foreign libraries' functions, by qualified name ---------------------------------------------
# Stand-ins written by us from the documented semantics of generative-recommenders' and TorchEasyRec's
# pytorch attention (padding, SiLU(alpha qk) divided by the max length or an explicit scale, causal
# mask with targets); installed under those libraries' module names so map_ops matches them by name.


_USER_ATTENTION_FN = dlrm_hstu.jagged_hstu_attention  # the stand-ins replace the module's name for it


def _reference_attention(max_seq_len, alpha, q, k, v, seq_offsets, num_targets, divisor):  # type: ignore[no-untyped-def]
    return _USER_ATTENTION_FN(max_seq_len, alpha, q, k, v, seq_offsets, num_targets) * (max_seq_len / divisor)


def gr_pytorch_hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal=True, dropout_pr=0.0, training=True,  # type: ignore[no-untyped-def]
                        num_targets=None, attn_scale=None, max_attn_len=0, contextual_seq_len=0,
                        min_full_attn_seq_len=0):
    divisor = max_seq_len if attn_scale is None else 1.0 / float(attn_scale)
    return _reference_attention(max_seq_len, alpha, q, k, v, seq_offsets, num_targets, divisor)


def tzrec_pytorch_hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal=True, dropout_pr=0.0, training=True,  # type: ignore[no-untyped-def]
                           num_targets=None, max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0,
                           attn_func=None, scaling_seqlen=-1):
    divisor = max_seq_len if scaling_seqlen == -1 else scaling_seqlen
    return _reference_attention(max_seq_len, alpha, q, k, v, seq_offsets, num_targets, divisor)


@pytest.fixture
def foreign_library(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Installs one stand-in under its library's module name and points model (a)'s attention at it."""
    module_name, fn = request.param
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    fn.__module__, fn.__qualname__ = module_name, "pytorch_hstu_mha"
    monkeypatch.setattr(sys.modules[module_name], "pytorch_hstu_mha", fn, raising=False)
    monkeypatch.setattr(dlrm_hstu, "jagged_hstu_attention", fn)
    return f"{module_name}.pytorch_hstu_mha"


@pytest.mark.slow
@pytest.mark.parametrize("foreign_library", [
    ("generative_recommenders.ops.pytorch.pt_hstu_attention", gr_pytorch_hstu_mha),
    ("tzrec.ops._pytorch.pt_hstu_attention", tzrec_pytorch_hstu_mha),
], indirect=True, ids=["generative_recommenders", "torcheasyrec"])
@pytest.mark.parametrize("scale", ["batch", "fixed:40"])
def test_foreign_attention_is_mapped_by_name(foreign_library: str, scale: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = dlrm_hstu.build_ranker()
    path = hstu_export.save_bundle(model, tmp_path / "m.pt", example_inputs=dlrm_hstu.example_inputs(3, seed=0),
                                   factory="user_models.dlrm_hstu:build_ranker", ranges=RANGES_A)
    settings = ExportSettings(backend="torchscript", max_batch_size=MAX_BATCH, attention_scale=scale,
                              verify=VerifySettings(num_random_batches=2))
    result = hstu_export.export(path, tmp_path / "pkg", settings)
    foreign = {p["name"]: p for p in result.manifest["passes"]}["map_ops"]["stats"]["foreign"]
    assert sum(count for name, count in foreign.items() if name.startswith(foreign_library)) == 2
    assert result.parity["passed"] and result.parity["worst"]["rel_l2"] <= 1e-5
    # The CLI's summary names the function whole (wrapped, not cut), with what it became, in one line.
    from hstu_export.cli import _print_summary

    capsys.readouterr()
    _print_summary(result.manifest, result.path)
    shown = capsys.readouterr().out
    assert "…" not in shown
    assert (f"{foreign_library}→hstu_export::hstu_mha→hstu_export.ops.reference:hstu_mha_reference(foraten),2×"
            in re.sub(r"\s+", "", shown))
    if scale != "batch":
        # With a fixed scale, a user's scores no longer depend on who else is in the batch.
        predictor = hstu_export.load(result.path)
        schema = predictor.input_schema
        both = flatten_example(schema, dlrm_hstu.example_inputs(2, seed=5), None, model)
        first_user = _first_user(schema, both)
        scores_both, scores_alone = predictor(both)["output_1.click"], predictor(first_user)["output_1.click"]
        n = int(first_user["candidates_features.cand_item_id.lengths"][0])
        torch.testing.assert_close(scores_both[:n], scores_alone, rtol=1e-5, atol=1e-6)


@dataclasses.dataclass
class RankerConfig:
    max_seq_len: int


class ConfiguredRanker(dlrm_hstu.DlrmHstu):
    """The ranker keeping its configuration where generative-recommenders' DlrmHSTU keeps it, with the
    longest sequence it is meant for (contextual tokens + history + candidates; it has no contextual tokens)."""

    def __init__(self, max_seq_len: int) -> None:
        super().__init__()
        self._hstu_configs = RankerConfig(max_seq_len)


def build_configured(max_seq_len: int = 20) -> ConfiguredRanker:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return ConfiguredRanker(max_seq_len).eval()


def test_stated_ranges_widen_up_to_the_models_own_limits(tmp_path: Path) -> None:
    """A bundle's stated ranges (written into its schema) are defaults --max-length may widen; the limits a
    model sets itself (the zoo's own schema) are refused, naming where they come from."""
    from hstu_export.exporter import export_ranges
    from hstu_export.models import build_preset
    from hstu_export.sources.model_limits import lengths_limits

    bundle = hstu_export.load_bundle(hstu_export.save_bundle(
        build_configured(), tmp_path / "m.pt", example_inputs=dlrm_hstu.example_inputs(3, seed=0),
        factory="test_user_models:build_configured", ranges=RANGES_A))
    uih = "uih_features.uih_item_id.lengths"
    assert bundle.input_schema.get(uih).max_value == 12  # stated when saved
    assert lengths_limits(bundle.model, bundle.schema) == {}  # ... which is no limit of the model's
    wider = export_ranges(bundle.input_schema, ExportSettings(lengths={"uih_features": (1, 30)}), None,
                          lengths_limits(bundle.model, bundle.schema))
    assert wider.max_lengths[uih] == 30 and wider.max_lengths["candidates_features.cand_item_id.lengths"] == 5

    zoo = build_preset("tiny")
    limits = lengths_limits(zoo, None)
    assert limits["uih_lengths"].value == 46 and limits["uih_lengths"].source == "HstuRankingModel.input_schema()"
    with pytest.raises(ConfigError, match=r"^--max-length uih_lengths=47 exceeds the model's own limit of 46 for "
                                          r"'uih_lengths' \(HstuRankingModel.input_schema\(\)\)$"):
        export_ranges(zoo.input_schema(), ExportSettings(lengths={"uih_lengths": (1, 47)}), None, limits)
    assert export_ranges(zoo.input_schema(), ExportSettings(lengths={"uih_lengths": (1, 46)}), None,
                         limits).max_lengths["uih_lengths"] == 46


def test_model_limits_are_found_where_models_keep_them() -> None:
    from hstu_export.models import build_preset
    from hstu_export.sources.model_limits import sequence_limits

    assert [(x.value, x.source) for x in sequence_limits(build_preset("tiny"))] == [
        (64, "HstuRankingModel.config.max_seq_len"),
        (64, "the positional table transducer.positional_encoder.position_emb, 64 rows")]
    assert [(x.value, x.source) for x in sequence_limits(build_configured(20))] == [
        (20, "ConfiguredRanker._hstu_configs.max_seq_len")]

    class ProtoConfig:  # TorchEasyRec keeps a protobuf message: its int fields read as ints
        max_seq_len = 4096

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._position_embeddings_weight = nn.Parameter(torch.zeros(300, 4))
            self._timestamp_embeddings_weight = nn.Parameter(torch.zeros(9, 4))

    class TzrecLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._model_config = ProtoConfig()
            self._positional_encoder = Encoder()

    assert [(x.value, x.source) for x in sequence_limits(TzrecLike())] == [
        (300, "the positional table _positional_encoder._position_embeddings_weight, 300 rows"),
        (4096, "TzrecLike._model_config.max_seq_len")]

    class ScriptWrapper(nn.Module):  # the flat serving entry TorchEasyRec wraps its models in
        def __init__(self) -> None:
            super().__init__()
            self.model = TzrecLike()

    assert [x.source for x in sequence_limits(ScriptWrapper())] == [
        "the positional table model._positional_encoder._position_embeddings_weight, 300 rows",
        "ScriptWrapper.model._model_config.max_seq_len"]


@pytest.mark.parametrize("foreign_library", [
    ("generative_recommenders.ops.pytorch.pt_hstu_attention", gr_pytorch_hstu_mha),
], indirect=True, ids=["generative_recommenders"])
def test_sequences_beyond_the_model_or_a_fixed_scale_are_refused(foreign_library: str, tmp_path: Path) -> None:
    """The longest sequence the exported ranges allow, as the attention sees it, against the model's configured
    max_seq_len and against --attention-scale fixed:N; both refusals come before anything is compiled."""
    from hstu_export.exporter import _check_sequence_length, capture

    path = hstu_export.save_bundle(build_configured(20), tmp_path / "m.pt",
                                   example_inputs=dlrm_hstu.example_inputs(3, seed=0),
                                   factory="test_user_models:build_configured", ranges=RANGES_A)
    bundle = hstu_export.load_bundle(path)
    # 16 history items widen the stated 12, and with 5 candidates make 21 tokens, one beyond the model's 20.
    settings = ExportSettings(backend="torchscript", max_batch_size=MAX_BATCH, lengths={"uih_features": (1, 16)})
    with pytest.raises(ConfigError) as info:
        hstu_export.export(bundle, tmp_path / "pkg", settings)
    assert str(info.value).startswith("the exported ranges allow sequences of 21 tokens, beyond the model's own "
                                      "limit of 20 (ConfiguredRanker._hstu_configs.max_seq_len): lower the ranges")
    assert "uih_features.uih_item_id.lengths <= 16, candidates_features.cand_item_id.lengths <= 5" in str(info.value)
    assert not (tmp_path / "pkg").exists()

    # 15 + 5 fits; the stated ranges (12 + 5 = 17 tokens) with a fixed scale below 17 do not.
    fits = dataclasses.replace(settings, lengths={"uih_features": (1, 15)})
    captured = capture(bundle, fits, "aten")
    assert captured.result.report["observe_values"].stats["longest_sequence"] == 20
    _check_sequence_length(captured.result, captured.schema, captured.ranges, fits, bundle.model)
    fixed = ExportSettings(backend="torchscript", max_batch_size=MAX_BATCH, attention_scale="fixed:16")
    with pytest.raises(ConfigError, match=r"^--attention-scale fixed:16 is below the longest sequence the exported "
                                          r"ranges allow, 17 tokens: .* use fixed:N with N >= 17, or lower the ranges"):
        hstu_export.export(bundle, tmp_path / "pkg", fixed)
    captured = capture(bundle, dataclasses.replace(fixed, attention_scale="fixed:17"), "aten")
    _check_sequence_length(captured.result, captured.schema, captured.ranges,
                           dataclasses.replace(fixed, attention_scale="fixed:17"), bundle.model)


def _first_user(schema, batch):  # type: ignore[no-untyped-def]
    """The request of the first user of ``batch`` alone."""
    out = {}
    for f in schema.features:
        value = batch[f.name]
        if f.kind == "jagged":
            out[f.name] = value[: int(batch[f.jagged_by][0])]
        else:
            out[f.name] = value[:1]
    return out


def test_model_failing_on_the_export_device_is_said_so(tmp_path: Path) -> None:
    """TorchEasyRec's default kernel setting (TRITON) on a CPU: the model's own code fails while export runs
    it. That is one line naming the model's file and line and the likely cause, not an internal error."""
    from user_models import triton_kernel

    from hstu_export.cli import main as cli_main
    from hstu_export.errors import ModelRunError

    path = hstu_export.save_bundle(triton_kernel.build_kernel_ranker("pytorch"), tmp_path / "m.pt",
                                   example_inputs=pooled.example_inputs(3, seed=0),
                                   factory="user_models.triton_kernel:build_kernel_ranker",
                                   factory_kwargs={"kernel": "triton"}, ranges={"sparse_features": (1, 6)})
    settings = ExportSettings(backend="torchscript", max_batch_size=MAX_BATCH)
    with pytest.raises(ModelRunError) as info:
        hstu_export.export(path, tmp_path / "pkg", settings)
    message = str(info.value)
    assert message.startswith("the model fails when run on cpu (while it was traced) at ")
    assert f"{triton_kernel.__file__}:" in message and "0 active drivers" in message
    assert "likely cause: a Triton kernel launched on a CPU" in message and "kernel: PYTORCH" in message
    assert not (tmp_path / "pkg").exists()
    assert cli_main([str(path), "--backend", "torchscript", "--out", str(tmp_path / "pkg"), "-q"]) == 1

    # Built with its PyTorch kernels, the same model exports.
    fine = hstu_export.save_bundle(triton_kernel.build_kernel_ranker("pytorch"), tmp_path / "fine.pt",
                                   example_inputs=pooled.example_inputs(3, seed=0),
                                   factory="user_models.triton_kernel:build_kernel_ranker",
                                   factory_kwargs={"kernel": "pytorch"}, ranges={"sparse_features": (1, 6)})
    from hstu_export.exporter import capture

    assert capture(hstu_export.load_bundle(fine), settings, "aten").result.dense is not None


def _fails_in_user_code(x: Tensor) -> Tensor:
    return x[x.numel() + 5]  # IndexError, raised from this file: the model's code


def test_which_failures_are_the_models() -> None:
    """A failure is the model's when it came out of the model's code, directly or wrapped by the pass that
    ran the graph; a failure of ours, or a trace failure that chains the model's exception, stays as it is."""
    from hstu_export.errors import PassError
    from hstu_export.sources.model_failures import model_failure

    cpu = torch.device("cpu")
    try:
        _fails_in_user_code(torch.zeros(2))
    except IndexError as exc:
        raised = exc
    failure = model_failure(raised, cpu, "while the passes ran its graph")
    assert failure is not None and failure.exit_code == 1
    assert f"{__file__}:" in str(failure) and "IndexError: index 7 is out of bounds" in str(failure)
    assert "likely cause" not in str(failure)  # nothing known about an index error
    wrapped = PassError("observe_values: the traced graph fails on the example batch")
    wrapped.__cause__ = raised
    assert str(model_failure(wrapped, cpu, "x")) == str(model_failure(raised, cpu, "x"))
    traced = TraceError("cannot trace M")
    traced.__cause__ = raised
    assert model_failure(traced, cpu, "x") is None
    try:
        torch.nn.functional.embedding(torch.tensor([5]), torch.zeros(2, 2))
    except IndexError as exc:
        # As export's code sees a failure of torch's alone (this test's frame, the catching one, left out).
        assert model_failure(exc.with_traceback(exc.__traceback__.tb_next), cpu, "x") is None


def test_root_control_flow_names_file_and_line() -> None:
    class Branchy(pooled.PooledRanker):
        def forward(self, sparse_features, dense_features):  # type: ignore[no-untyped-def]
            out = super().forward(sparse_features, dense_features)
            if out["ctr"].sum() > 0:  # on the root: nothing to keep opaque
                return out
            return {"ctr": out["ctr"], "affinity": -out["affinity"]}

    model = Branchy().eval()
    schema, flat = _flat(model, pooled.example_inputs(3, seed=0))
    with pytest.raises(TraceError, match=r"test_user_models\.py:\d+"):
        trace(model, flat, schema=schema)


class HintedRanker(dlrm_hstu.DlrmHstu):
    """The same model with its export hints in code: its attention mapping and its lengths ranges."""

    hstu_export_hints = hstu_export.ExportHints(mappings={USER_ATTENTION: GR_ATTENTION}, ranges=RANGES_A)


def build_hinted() -> HintedRanker:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return HintedRanker().eval()


def test_hints_in_the_model_need_no_flags(tmp_path: Path) -> None:
    from hstu_export.exporter import capture

    model = build_hinted()
    path = hstu_export.save_bundle(model, tmp_path / "hinted.pt", example_inputs=dlrm_hstu.example_inputs(3, seed=0),
                                   factory="test_user_models:build_hinted")
    bundle = hstu_export.load_bundle(path)
    captured = capture(bundle, ExportSettings(max_batch_size=MAX_BATCH, check_each_pass=True), "aten")
    assert captured.ranges is not None
    assert captured.ranges.max_lengths["uih_features.uih_item_id.lengths"] == 12  # from the hints
    stats = captured.result.report["map_ops"].stats
    assert sum(stats["foreign"].values()) == 2
    assert all(r.max_rel_error is not None and r.max_rel_error <= 1e-6 for r in captured.result.report)
    # A flag adds to the hints: it narrows a range the hints stated.
    narrower = capture(bundle, ExportSettings(max_batch_size=MAX_BATCH, lengths={"uih_features": (1, 6)}), "aten")
    assert narrower.ranges.max_lengths["uih_features.uih_item_id.lengths"] == 6


def test_foreign_attention_lands_on_our_triton_kernel_for_cuda() -> None:
    """On CUDA the op target is triton: the user's attention becomes our Triton kernel's op (checked on
    the graph here; CUDA runs are in benchmarks/gpu_export_check.py)."""
    pytest.importorskip("triton")
    model = dlrm_hstu.build_ranker()
    schema, flat = _flat(model, dlrm_hstu.example_inputs(3, seed=0))
    from hstu_export.ops.mappings import function_mappings, imported_functions

    mappings = {USER_ATTENTION: GR_ATTENTION}
    gm = trace(model, flat, schema=schema, opaque_functions=imported_functions(list(function_mappings(mappings))))
    ctx = PassContext(example_inputs=schema.to_graph_inputs(flat), schema=schema, op_mappings=mappings,
                      op_target="triton")
    result = run_passes(gm, ctx, skip=["eliminate_dead_code"])
    targets = [str(n.target) for n in result.dense.graph.nodes if n.op == "call_function"]
    assert targets.count("hstu_export.hstu_mha_triton.default") == 2
    assert not [t for t in targets if t.startswith("fbgemm.")]  # fbgemm jagged ops went to our kernels too


class WithOptional(pooled.PooledRanker):
    """An optional tensor argument the serving path leaves out (a training-only label, say)."""

    def forward(self, sparse_features, dense_features, labels: Tensor | None = None):  # type: ignore[no-untyped-def]
        out = super().forward(sparse_features, dense_features)
        if labels is not None:  # a plain Python branch on an argument that is None at export
            out["loss"] = (out["ctr"] - labels).square().mean()
        return out


def test_optional_argument_left_out() -> None:
    model = WithOptional().eval()
    kjt, dense = pooled.example_inputs(3, seed=0)
    schema = infer_schema(model, (kjt, dense, None), ranges={"sparse_features": (1, 6)})
    assert schema.arguments[-1].name == "labels" and schema.arguments[-1].optional_absent
    flat = flatten_example(schema, (kjt, dense, None), None, model)
    assert not [n for n in flat if n.startswith("labels")]
    gm = trace(model, flat, schema=schema)
    with torch.no_grad():
        got, expected = gm(**schema.to_graph_inputs(flat)), call_model(model, schema, flat)
    assert sorted(got) == sorted(expected) == ["affinity", "ctr"]


torch.library.define("user_test_ops::double", "(Tensor x) -> Tensor")


@torch.library.impl("user_test_ops::double", "CompositeExplicitAutograd")
def _double(x: Tensor) -> Tensor:
    return x * 2


class WithCustomOp(pooled.PooledRanker):
    def forward(self, sparse_features, dense_features):  # type: ignore[no-untyped-def]
        out = super().forward(sparse_features, dense_features)
        return {**out, "ctr": torch.ops.user_test_ops.double(out["ctr"])}


def build_with_custom_op() -> WithCustomOp:
    return WithCustomOp().eval()


def test_unknown_op_library_is_refused_at_export(tmp_path: Path) -> None:
    """A package never imports a module it names: an op kept with --allow-unmapped whose library
    hstu-export does not know cannot be shipped, and the export says so instead of the first load."""
    path = hstu_export.save_bundle(build_with_custom_op(), tmp_path / "m.pt", example_inputs=pooled.example_inputs(3),
                                   factory="test_user_models:build_with_custom_op", ranges={"sparse_features": (1, 6)})
    with pytest.raises(hstu_export.errors.UnmappedOpsError, match="user_test_ops::double"):
        hstu_export.export(path, tmp_path / "pkg", ExportSettings(backend="torchscript", max_batch_size=3))
    with pytest.raises(hstu_export.errors.ExportError, match="user_test_ops, a library packages do not load"):
        hstu_export.export(path, tmp_path / "pkg", ExportSettings(backend="torchscript", max_batch_size=3,
                                                                  allow_unmapped=True))
    assert not (tmp_path / "pkg").exists()


# ---- foreign cached attention and jagged helpers, by qualified name ------------------------------
# Stand-ins written by us from the documented semantics (see hstu_export/ops/mappings/*): the cached
# attention is the last L // B rows of each sequence's attention; concat puts each user's left rows
# before its right rows, a side without offsets being dense (max_len rows per user); split undoes it.


def gr_pytorch_cached_hstu_mha(max_seq_len, alpha, delta_q, k, v, seq_offsets, num_targets=None,  # type: ignore[no-untyped-def]
                               max_attn_len=0, contextual_seq_len=0):
    batch = seq_offsets.size(0) - 1
    delta = delta_q.size(0) // batch
    # Full queries: the cached ones replace the last `delta` rows of each sequence.
    rows = (seq_offsets[1:].unsqueeze(1) - delta + torch.arange(delta)).reshape(-1)
    q = torch.zeros_like(k).index_copy(0, rows, delta_q)
    full = _USER_ATTENTION_FN(max_seq_len, alpha, q, k, v, seq_offsets, num_targets)
    return full[rows]


def gr_pytorch_concat_2D_jagged(values_left, values_right, max_len_left, max_len_right, offsets_left,  # type: ignore[no-untyped-def]
                                offsets_right):
    def offsets(values, given, max_len):  # type: ignore[no-untyped-def]
        if given is not None:
            return given
        return max_len * torch.arange(values.size(0) // max_len + 1)

    left, right = offsets(values_left, offsets_left, max_len_left), offsets(values_right, offsets_right, max_len_right)
    parts = []
    for b in range(left.size(0) - 1):
        parts += [values_left[left[b]:left[b + 1]], values_right[right[b]:right[b + 1]]]
    return torch.cat(parts)


def gr_pytorch_split_2D_jagged(max_seq_len, values, max_len_left, max_len_right, offsets_left, offsets_right):  # type: ignore[no-untyped-def]
    left_len = offsets_left[1:] - offsets_left[:-1]
    right_len = offsets_right[1:] - offsets_right[:-1]
    starts = offsets_left[:-1] + offsets_right[:-1]
    lefts = [values[s:s + n] for s, n in zip(starts.tolist(), left_len.tolist())]
    rights = [values[s + n:s + n + m] for s, n, m in zip(starts.tolist(), left_len.tolist(), right_len.tolist())]
    return torch.cat(lefts), torch.cat(rights)


class ForeignHelpers(nn.Module):
    """Calls the three stand-ins as a model of that library would: contextual rows (dense, 2 per user)
    before the history, then cached attention of the last candidates, then the candidates split off."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 3 * 2 * 4)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        from generative_recommenders.ops.pytorch import pt_hstu_attention, pt_jagged_tensors

        history, history_lengths = features["history"], features["history_lengths"]
        contextual, num_candidates = features["contextual"], features["num_candidates"]
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(history_lengths)
        x = pt_jagged_tensors.pytorch_concat_2D_jagged(
            values_left=contextual, values_right=history, max_len_left=2, max_len_right=None,
            offsets_left=None, offsets_right=offsets)
        seq_offsets = offsets + 2 * torch.arange(offsets.size(0))
        q, k, v = self.proj(x).split(8, dim=-1)
        max_len = int((seq_offsets[1:] - seq_offsets[:-1]).max().item())
        last = (seq_offsets[1:].unsqueeze(1) - 2 + torch.arange(2)).reshape(-1)  # 2 cached rows per user
        delta = pt_hstu_attention.pytorch_cached_hstu_mha(
            max_seq_len=max_len, alpha=0.5, delta_q=q[last].view(-1, 2, 4), k=k.view(-1, 2, 4), v=v.view(-1, 2, 4),
            seq_offsets=seq_offsets, num_targets=num_candidates)
        _, right = pt_jagged_tensors.pytorch_split_2D_jagged(
            max_seq_len=max_len, values=x, max_len_left=None, max_len_right=None,
            offsets_left=torch.ops.fbgemm.asynchronous_complete_cumsum(
                seq_offsets[1:] - seq_offsets[:-1] - num_candidates),
            offsets_right=torch.ops.fbgemm.asynchronous_complete_cumsum(num_candidates))
        return right.sum(-1) + delta.sum()


@pytest.fixture
def gr_helpers(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    package = "generative_recommenders.ops.pytorch"
    parts = package.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    functions = {
        "pt_hstu_attention": {"pytorch_cached_hstu_mha": gr_pytorch_cached_hstu_mha},
        "pt_jagged_tensors": {"pytorch_concat_2D_jagged": gr_pytorch_concat_2D_jagged,
                              "pytorch_split_2D_jagged": gr_pytorch_split_2D_jagged},
    }
    for module_name, fns in functions.items():
        module = types.ModuleType(f"{package}.{module_name}")
        for name, fn in fns.items():
            fn.__module__, fn.__qualname__ = module.__name__, name
            setattr(module, name, fn)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setattr(sys.modules[package], module_name, module, raising=False)


@pytest.mark.parametrize("op_target", ["aten", "triton"])
def test_foreign_cached_attention_and_jagged_helpers_are_mapped(gr_helpers: None, op_target: str) -> None:
    if op_target == "triton":
        pytest.importorskip("triton")
    from hstu_export.ops.mappings import function_mappings, imported_functions

    model = ForeignHelpers().eval()
    lengths = torch.tensor([5, 3, 7])
    batch = {"history": torch.randn(15, 8), "history_lengths": lengths, "contextual": torch.randn(6, 8),
             "num_candidates": torch.tensor([2, 2, 3])}
    gm = trace(model, batch, opaque_functions=imported_functions(list(function_mappings())))
    # The padding bound of the mapped attention is what observe_values sees at the maxima (8 history
    # items + 2 contextual rows here); longer sequences would be refused by the mapped graph.
    longest = {"history": torch.randn(32, 8), "history_lengths": torch.full((4,), 8),
               "contextual": torch.randn(8, 8), "num_candidates": torch.full((4,), 2)}
    result = run_passes(gm, PassContext(example_inputs=batch, op_target=op_target, probe_inputs=[longest]),
                        passes=["observe_values", "map_ops", "eliminate_dead_code"])
    foreign = result.report["map_ops"].stats["foreign"]
    assert {name.split(" ")[0].rsplit(".", 1)[1]: n for name, n in foreign.items()} == {
        "pytorch_concat_2D_jagged": 1, "pytorch_cached_hstu_mha": 1, "pytorch_split_2D_jagged": 1}
    targets = {str(n.target) for n in result.graph.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "generative_recommenders" in t or t.startswith("fbgemm.")]
    if op_target == "aten":
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            lengths = torch.randint(3, 9, (4,), generator=gen)
            other = {"history": torch.randn(int(lengths.sum()), 8, generator=gen), "history_lengths": lengths,
                     "contextual": torch.randn(8, 8, generator=gen),
                     "num_candidates": torch.randint(1, 3, (4,), generator=gen)}
            with torch.no_grad():
                torch.testing.assert_close(result.graph(**other)["output"], model(other), rtol=1e-5, atol=1e-5)
    else:
        assert {"hstu_export.cached_hstu_mha_triton.default", "hstu_export.concat_2D_jagged_triton.default",
                "hstu_export.split_2D_jagged_triton.default"} <= targets


# ---- a foreign position and time encoding, computed on the jagged rows ----------------------------


def _padded_encodings(seq_embeddings, seq_offsets, pos_embeddings, ts_embeddings, timestamps, max_seq_len,  # type: ignore[no-untyped-def]
                      max_contextual_seq_len, seq_lengths, num_targets, interleave_targets, time_bucket_fn,
                      increments, query_time, bucket):
    """The stand-ins' common part, written by us from the documented semantics: each user padded to
    ``max_seq_len`` rows, the indices computed on the padded grid, the padding cut away again (rows
    past the bound are dropped to zeros, as the padded round trip does)."""
    width = max_seq_len
    batch = seq_offsets.numel() - 1
    padded_rows = seq_embeddings.new_zeros(batch, width, seq_embeddings.size(1))
    padded_times = timestamps.new_zeros(batch, width)
    for b in range(batch):
        start, end = int(seq_offsets[b]), min(int(seq_offsets[b + 1]), int(seq_offsets[b]) + width)
        padded_rows[b, :end - start] = seq_embeddings[start:end]
        padded_times[b, :end - start] = timestamps[start:end]
    columns = torch.arange(width).expand(batch, width)
    if num_targets is None:
        positions = seq_lengths.view(-1, 1) - columns
    else:
        last = (seq_lengths - num_targets * (2 if interleave_targets else 1)).view(-1, 1)
        positions = last - torch.clamp(columns, max=last)
    positions = torch.clamp(positions + max_contextual_seq_len, max=pos_embeddings.size(0) - 1)
    positions[:, :max_contextual_seq_len] = torch.arange(max_contextual_seq_len)[:width]
    if query_time is None:
        query = torch.gather(padded_times, 1, (seq_lengths - 1).clamp(min=0).view(-1, 1))
    else:
        query = query_time.view(-1, 1).to(padded_times.dtype)
    elapsed = torch.clamp(query - padded_times, min=1e-6) / increments
    elapsed = torch.log(elapsed) if time_bucket_fn == "log" else torch.sqrt(elapsed)
    buckets = bucket(elapsed, ts_embeddings)
    # Without targets, the padding columns of a shorter user count below zero; they are cut away below.
    positions = positions.clamp(min=0)
    summed = padded_rows + (ts_embeddings[buckets] + pos_embeddings[positions]).to(seq_embeddings.dtype)
    out = seq_embeddings.new_zeros(seq_embeddings.shape)
    for b in range(batch):
        start, end = int(seq_offsets[b]), min(int(seq_offsets[b + 1]), int(seq_offsets[b]) + width)
        out[start:end] = summed[b, :end - start]
    return out


def gr_pytorch_add_timestamp_positional_embeddings(  # type: ignore[no-untyped-def]
        seq_embeddings, seq_offsets, pos_embeddings, ts_embeddings, timestamps, max_seq_len, max_contextual_seq_len,
        seq_lengths, num_targets, interleave_targets, time_bucket_fn):
    # generative-recommenders caps the bucket at the time table's width less one, not its rows.
    return _padded_encodings(
        seq_embeddings, seq_offsets, pos_embeddings, ts_embeddings, timestamps, max_seq_len, max_contextual_seq_len,
        seq_lengths, num_targets, interleave_targets, time_bucket_fn, 60.0, None,
        lambda elapsed, table: torch.clamp(elapsed.clamp(min=0).int(), 0, table.size(1) - 1))


def tzrec_pytorch_add_timestamp_positional_embeddings(  # type: ignore[no-untyped-def]
        seq_embeddings, seq_offsets, pos_embeddings, ts_embeddings, timestamps, max_seq_len, max_contextual_seq_len,
        seq_lengths, num_targets, interleave_targets, time_bucket_fn, time_bucket_increments, query_time=None):
    # TorchEasyRec scales the bucket into the time table's rows.
    def bucket(elapsed, table):  # type: ignore[no-untyped-def]
        n = table.size(0) - 1
        return ((elapsed / n).clamp(min=0, max=1) * n).int()

    return _padded_encodings(
        seq_embeddings, seq_offsets, pos_embeddings, ts_embeddings, timestamps, max_seq_len, max_contextual_seq_len,
        seq_lengths, num_targets, interleave_targets, time_bucket_fn, time_bucket_increments, query_time, bucket)


POSITION_MODULES = {"generative_recommenders": ("generative_recommenders.ops.pytorch",
                                                gr_pytorch_add_timestamp_positional_embeddings),
                    "tzrec": ("tzrec.ops._pytorch", tzrec_pytorch_add_timestamp_positional_embeddings)}


class ForeignPositions(nn.Module):
    """A ranker's input stage as generative-recommenders or TorchEasyRec write it: item rows plus their
    position and time encodings, with the settings of one case."""

    def __init__(self, library: str, targets: bool, interleave: bool, contextual: int, bucket_fn: str,
                 max_seq_len: int | None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.pos = nn.Parameter(torch.randn(9, 8))  # fewer rows than the longest user: the cap applies
        self.time = nn.Parameter(torch.randn(12, 8))  # GR's buckets capped at 7 (the width less one), tzrec's at 11
        self.library, self.targets, self.interleave, self.contextual = library, targets, interleave, contextual
        self.bucket_fn, self.max_seq_len = bucket_fn, max_seq_len

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        pt_position = sys.modules[POSITION_MODULES[self.library][0] + ".pt_position"]
        lengths = features["item_lengths"]
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        longest = int(lengths.max().item()) if self.max_seq_len is None else self.max_seq_len
        extra = {} if self.library == "generative_recommenders" else {
            "time_bucket_increments": 90.0, "query_time": features["query_time"] if self.targets else None}
        rows = pt_position.pytorch_add_timestamp_positional_embeddings(
            seq_embeddings=self.proj(features["item"]) * 2.0, seq_offsets=offsets, pos_embeddings=self.pos,
            ts_embeddings=self.time, timestamps=features["item_time"], max_seq_len=longest,
            max_contextual_seq_len=self.contextual, seq_lengths=lengths,
            num_targets=features["num_candidates"] if self.targets else None,
            interleave_targets=self.interleave, time_bucket_fn=self.bucket_fn, **extra)
        return rows.sum(-1)


def _position_batch(lengths: list[int], seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths)
    n = int(lengths_t.sum())
    # Up to 3.3 hours apart, so that the buckets (sqrt or log of minutes) span the time table and its caps.
    times = 4_000_000 - torch.randint(0, 12_000, (n,), generator=gen)
    return {"item": torch.randn(n, 4, generator=gen), "item_lengths": lengths_t, "item_time": times,
            "num_candidates": torch.clamp(lengths_t // 3, min=0),
            "query_time": torch.randint(4_000_000, 4_006_000, (len(lengths),), generator=gen)}


@pytest.fixture(params=list(POSITION_MODULES))
def foreign_positions(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The library's position module, stood in for by ours; the library's name."""
    package, fn = POSITION_MODULES[request.param]
    parts = package.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    module = types.ModuleType(f"{package}.pt_position")
    fn.__module__, fn.__qualname__ = module.__name__, "pytorch_add_timestamp_positional_embeddings"
    module.pytorch_add_timestamp_positional_embeddings = fn  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(sys.modules[package], "pt_position", module, raising=False)
    return request.param


@pytest.mark.parametrize(("targets", "interleave", "contextual", "bucket_fn"), [
    (True, False, 0, "sqrt"), (True, True, 2, "log"), (False, False, 1, "sqrt"),
], ids=["targets-sqrt", "interleaved-contextual-log", "no-targets-contextual"])
@pytest.mark.parametrize("op_target", ["aten", "triton"])
def test_foreign_position_encodings_are_computed_on_the_jagged_rows(
        foreign_positions: str, targets: bool, interleave: bool, contextual: int, bucket_fn: str,
        op_target: str) -> None:
    from hstu_export.ops.mappings import function_mappings, imported_functions

    torch.manual_seed(0)
    model = ForeignPositions(foreign_positions, targets, interleave, contextual, bucket_fn, max_seq_len=None).eval()
    batch = _position_batch([5, 3, 7], seed=0)
    gm = trace(model, batch, opaque_functions=imported_functions(list(function_mappings())))
    result = run_passes(gm, PassContext(example_inputs=batch, op_target=op_target, probe_inputs=[]),
                        passes=["observe_values", "map_ops", "eliminate_dead_code"])
    foreign = result.report["map_ops"].stats["foreign"]
    assert [name.split(" ")[0] for name in foreign] == [
        f"{POSITION_MODULES[foreign_positions][0]}.pt_position.pytorch_add_timestamp_positional_embeddings"]
    targets_seen = {str(n.target) for n in result.graph.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets_seen if "generative_recommenders" in t or "tzrec" in t or "padded" in t
                or "dense_to_jagged" in t]
    # Users longer than the position table, an empty user and one row: equal to the padded stand-in.
    for seed, lengths in enumerate([[5, 3, 7], [12, 0, 1, 4], [1], [10, 10]]):
        other = _position_batch(lengths, seed)
        with torch.no_grad():
            expected = model(other)
            got = result.graph(**{k: v for k, v in other.items() if k in batch})["output"]
        assert torch.equal(got, expected), (lengths, (got - expected).abs().max())


def test_foreign_position_encodings_refuse_rows_past_the_bound(foreign_positions: str) -> None:
    """A model with a fixed max_seq_len: the library would cut a longer user's rows, the mapped graph
    refuses the batch instead."""
    from hstu_export.ops.mappings import function_mappings, imported_functions

    model = ForeignPositions(foreign_positions, True, False, 0, "sqrt", max_seq_len=8).eval()
    batch = _position_batch([5, 3, 7], seed=0)
    gm = trace(model, batch, opaque_functions=imported_functions(list(function_mappings())))
    result = run_passes(gm, PassContext(example_inputs=batch, op_target="aten", probe_inputs=[]),
                        passes=["observe_values", "map_ops", "eliminate_dead_code"])
    with torch.no_grad():
        assert torch.equal(result.graph(**batch)["output"], model(batch))
        with pytest.raises(RuntimeError, match="beyond the exported bound of 8"):
            result.graph(**_position_batch([9, 2], seed=1))


def _stand_in_infer_max_len(lengths: Tensor) -> int:
    max_len = int(lengths.max())
    if torch.compiler.is_compiling():
        torch._check_is_size(max_len)
    return max_len


class SlicedByTheLongest(nn.Module):
    """Sizes computed from generative-recommenders' ``fx_infer_max_len``, as its own position encoding (kept as
    written with ``--map-function ...=keep``) computes them."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 4))

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        common = sys.modules["generative_recommenders.common"]
        longest = common.fx_infer_max_len(features["item_lengths"])
        return self.table[: longest + 2].sum(0) + features["item"].sum(0)


@pytest.mark.slow
def test_the_mapped_max_length_is_known_non_negative(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """generative-recommenders' ``fx_infer_max_len`` becomes a plain read of the maximum (so prove_length_reads
    can drop it), known non-negative as the library's own is: sizes computed from it compile. Without that the
    library's position encoding, kept as written, failed to compile."""
    from hstu_export.ops.mappings import function_mappings, imported_functions

    package = types.ModuleType("generative_recommenders")
    common = types.ModuleType("generative_recommenders.common")
    _stand_in_infer_max_len.__module__, _stand_in_infer_max_len.__qualname__ = common.__name__, "fx_infer_max_len"
    common.fx_infer_max_len = _stand_in_infer_max_len  # type: ignore[attr-defined]
    package.common = common  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setitem(sys.modules, common.__name__, common)
    model = SlicedByTheLongest().eval()
    batch = {"item_lengths": torch.tensor([5, 3, 7]), "item": torch.randn(15, 4)}
    gm = trace(model, batch, opaque_functions=imported_functions(list(function_mappings())))
    result = run_passes(gm, PassContext(example_inputs=batch, op_target="aten", probe_inputs=[]),
                        passes=["observe_values", "map_ops", "eliminate_dead_code"])
    assert [name.split(" ")[0] for name in result.report["map_ops"].stats["foreign"]] == [
        "generative_recommenders.common.fx_infer_max_len"]
    rows = torch.export.Dim("rows", min=1, max=64)
    program = torch.export.export(result.graph, (), batch, strict=False,
                                  dynamic_shapes={"item_lengths": None, "item": {0: rows}})
    [unbacked] = [r for s, r in program.range_constraints.items() if str(s).startswith("u")]
    assert unbacked.lower >= 0, program.range_constraints
    compiled = torch._inductor.aoti_load_package(
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "sliced.pt2")))
    other = {"item_lengths": torch.tensor([2, 9, 0]), "item": torch.randn(11, 4)}  # 11 table rows read
    with torch.no_grad():
        assert torch.allclose(compiled(**other)["output"], model(other))


def test_a_mapped_function_can_be_kept_as_written() -> None:
    """``--map-function NAME=keep`` takes one of our mappings away (the function is traced through as
    its library wrote it); a name we do not map is refused."""
    from hstu_export.ops.mappings import function_mappings

    name = "generative_recommenders.ops.pytorch.pt_position.pytorch_add_timestamp_positional_embeddings"
    assert name in function_mappings()
    kept = function_mappings({name: "keep"})
    assert name not in kept and set(function_mappings()) - set(kept) == {name}
    with pytest.raises(ConfigError, match="my_pkg.encode: 'keep' names no function we map"):
        function_mappings({"my_pkg.encode": "keep"})


def tzrec_pytorch_add_position_embeddings(jagged, jagged_offsets, high_inds, max_seq_len, dense, scale=1.0):  # type: ignore[no-untyped-def]
    """TorchEasyRec's encoding without timestamps, stood in for by us: each user padded to ``max_seq_len``,
    ``dense[min(column, high_inds[u])]`` added to ``jagged * scale``, the padding cut away."""
    out = jagged * scale
    for b in range(jagged_offsets.numel() - 1):
        start, end = int(jagged_offsets[b]), min(int(jagged_offsets[b + 1]), int(jagged_offsets[b]) + max_seq_len)
        columns = torch.clamp(torch.arange(max_seq_len), max=int(high_inds[b]))
        out[start:end] = out[start:end] + dense[columns][:end - start].to(jagged.dtype)
    return out


class ForeignPositionsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.pos = nn.Parameter(torch.randn(12, 8))

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        pt_position = sys.modules["tzrec.ops._pytorch.pt_position"]
        lengths = features["item_lengths"]
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        rows = pt_position.pytorch_add_position_embeddings(
            jagged=self.proj(features["item"]), jagged_offsets=offsets, high_inds=lengths - features["num_candidates"],
            max_seq_len=int(lengths.max().item()), dense=self.pos, scale=2.5)
        return rows.sum(-1)


def test_foreign_position_only_encodings_are_computed_on_the_jagged_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from hstu_export.ops.mappings import function_mappings, imported_functions

    for name in ("tzrec", "tzrec.ops", "tzrec.ops._pytorch"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    module = types.ModuleType("tzrec.ops._pytorch.pt_position")
    fn = tzrec_pytorch_add_position_embeddings
    fn.__module__, fn.__qualname__ = module.__name__, "pytorch_add_position_embeddings"
    module.pytorch_add_position_embeddings = fn  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    torch.manual_seed(0)
    model = ForeignPositionsOnly().eval()
    batch = _position_batch([5, 3, 7], seed=0)
    gm = trace(model, batch, opaque_functions=imported_functions(list(function_mappings())))
    result = run_passes(gm, PassContext(example_inputs=batch, op_target="aten", probe_inputs=[]),
                        passes=["observe_values", "map_ops", "eliminate_dead_code"])
    assert list(result.report["map_ops"].stats["foreign"]) == [
        "tzrec.ops._pytorch.pt_position.pytorch_add_position_embeddings (TorchEasyRec)"]
    targets = {str(n.target) for n in result.graph.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "tzrec" in t or "fbgemm" in t or "padded" in t]
    for seed, lengths in enumerate([[5, 3, 7], [12, 0, 1, 4], [1]]):
        other = _position_batch(lengths, seed)
        with torch.no_grad():
            assert torch.equal(result.graph(**other)["output"], model(other)), lengths
