"""TorchEasyRec-style models exported as they come (issue 38): ``forward(batch: Batch)`` on a dataclass of
dicts of KeyedJaggedTensors, KeyedTensors, JaggedTensors and empty fields, and the flat serving entry
(``<feature>.values`` / ``<feature>.lengths``). Records of other kinds (NamedTuple, attrs) and the ranges
stated on a KeyedJaggedTensor with contextual keys are checked here too."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import attrs
import pytest
import torch
from manifests import rewrite_manifest
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from user_models import pooled, tzrec_style

import hstu_export
from hstu_export import ExportSettings, VerifySettings
from hstu_export.capture import trace
from hstu_export.capture.graph_functions import build_jt, build_kt
from hstu_export.errors import ConfigError, PackageError
from hstu_export.exporter import export_ranges
from hstu_export.package.schema import ONE_PER_USER, ArgumentSpec, InputSchema, graph_name
from hstu_export.package.tensor_dir import load_tensors, save_tensors
from hstu_export.sources.outputs import call_model
from hstu_export.sources.schema_inference import flatten_example, infer_schema

GR_ATTENTION = "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha"
MAX_BATCH = 4
EXAMPLE = ([5, 3, 7], [2, 1, 3])  # per user: history length, number of candidates
CONTEXTUAL = "batch.sparse_features.contextual"
UIH = "batch.sparse_features.uih"
CANDIDATE = "batch.sparse_features.candidate"


def _batch_schema(ranges: dict = tzrec_style.RANGES) -> tuple[nn.Module, InputSchema, tzrec_style.Batch]:
    model = tzrec_style.build_ranker()
    batch = tzrec_style.example_batch(*EXAMPLE)
    return model, infer_schema(model, (batch,), ranges=ranges), batch


def _assert_same(got: dict[str, Tensor], expected: dict[str, Tensor], tol: float = 0.0) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=tol, atol=tol)


# ---- the Batch: schema, request names, assembly ----------------------------------------------------


def test_schema_from_a_batch_dataclass() -> None:
    model, schema, batch = _batch_schema()
    [arg] = schema.arguments
    assert (arg.name, arg.kind, arg.type) == ("batch", "record", "user_models.tzrec_style:Batch")
    fields = {f.name: f for f in arg.fields}
    assert [f.name for f in arg.fields] == [f.name for f in dataclasses.fields(tzrec_style.Batch)]
    assert fields["sparse_features"].keys == ("contextual", "uih", "candidate")
    assert [f.kind for f in fields["sparse_features"].fields] == ["kjt", "kjt", "kjt"]
    assert (fields["dense_features"].fields[0].kind, fields["dense_features"].fields[0].keys) == (
        "kt", ("user_age", "user_stats"))
    assert fields["sequence_dense_features"].fields[0].kind == "jt"
    # Empty, None and plain fields are recorded as such.
    assert [(fields[n].kind, fields[n].keys) for n in ("labels", "jagged_labels", "sample_weights")] == [("dict", ())] * 3
    assert fields["checkpoint_info"].kind == "none"
    assert [(fields[n].kind, fields[n].value) for n in ("tile_size", "dummy", "data_timestamp")] == [
        ("constant", -1), ("constant", False), ("constant", -1.0)]
    assert fields["reserves"].kind == "default"  # an empty holder of raw rows: the class makes a fresh one

    # Request names follow the path; a KeyedTensor gives one [B, dim] feature per key.
    age, stats = schema.get("batch.dense_features.user.user_age"), schema.get("batch.dense_features.user.user_stats")
    assert (age.kind, age.trailing, stats.trailing) == ("per_user", (1,), (3,))
    item = schema.get(f"{UIH}.uih_item_id.values")
    assert (item.kind, item.jagged_by, item.min_value, item.max_value) == ("jagged", f"{UIH}.uih_item_id.lengths", 0, 399)
    assert schema.get(f"{CONTEXTUAL}.user_city.values").max_value == tzrec_style.CITIES - 1
    # The dense sequence feature has the history's lengths in the example: taken to share them.
    ratio = schema.get("batch.sequence_dense_features.uih_watch_ratio.values")
    assert (ratio.dtype, ratio.trailing, ratio.jagged_by) == ("float32", (1,), f"{UIH}.uih_item_id.lengths")
    assert schema.get("batch.sequence_dense_features.uih_watch_ratio.lengths").same_as == f"{UIH}.uih_item_id.lengths"
    # Contextual ids are one per user.
    user = schema.get(f"{CONTEXTUAL}.user_id.lengths")
    assert (user.semantic, user.min_value, user.max_value) == (ONE_PER_USER, 1, 1)
    assert len(schema.features) == 16

    flat = flatten_example(schema, (batch,), None, model)
    assert flat[f"{UIH}.uih_item_id.values"].shape == (sum(EXAMPLE[0]),)
    assert flat["batch.dense_features.user.user_stats"].shape == (3, 3)
    schema.validate(flat)
    args, kwargs = schema.assemble(flat)
    rebuilt = kwargs["batch"]
    assert args == () and list(kwargs) == ["batch"] and type(rebuilt) is tzrec_style.Batch
    assert (rebuilt.labels, rebuilt.jagged_labels, rebuilt.checkpoint_info, rebuilt.tile_size, rebuilt.dummy) == (
        {}, {}, None, -1, False)
    assert type(rebuilt.reserves) is tzrec_style.RawRows and rebuilt.reserves is not batch.reserves
    assert torch.equal(rebuilt.dense_features["user"].values(), batch.dense_features["user"].values())
    with torch.no_grad():
        _assert_same(call_model(model, schema, flat), model(batch))


def test_nondefault_fields_are_rebuilt_as_they_were() -> None:
    model = tzrec_style.build_ranker()
    batch = dataclasses.replace(tzrec_style.example_batch(*EXAMPLE), tile_size=3, dummy=True)
    schema = infer_schema(model, (batch,), ranges=tzrec_style.RANGES)
    rebuilt = schema.assemble(flatten_example(schema, (batch,), None, model))[1]["batch"]
    assert (rebuilt.tile_size, rebuilt.dummy) == (3, True)
    assert InputSchema.from_json(schema.to_json()) == schema  # the manifest's form reads back the same


class BaseGroupRanker(nn.Module):
    """Every id feature in one KeyedJaggedTensor of the data group ``__BASE__``, as TorchEasyRec's data parser
    hands them to its models, with a key in camel case."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(name="item", embedding_dim=4, num_embeddings=10,
                                                              feature_names=["itemId"])], device=torch.device("cpu"))

    def forward(self, batch: tzrec_style.Batch) -> dict[str, Tensor]:
        return {"score": self.ec(batch.sparse_features["__BASE__"])["itemId"].values().sum(-1)}


def test_request_names_in_capitals_trace() -> None:
    # FX lowercases placeholder names and strips a dunder name's underscores: graph names must be ones it keeps.
    model = BaseGroupRanker().eval()
    ids = KeyedJaggedTensor.from_lengths_sync(["itemId"], torch.tensor([1, 2, 3, 9]), torch.tensor([3, 1]))
    batch = tzrec_style.Batch(sparse_features={"__BASE__": ids})
    schema = infer_schema(model, (batch,), ranges={"batch.sparse_features.__BASE__": (1, 4)})
    request = flatten_example(schema, (batch,), None, model)
    gm = trace(model, request, schema=schema)
    assert schema.graph_names == ["batch__sparse_features____base____itemid__lengths",
                                  "batch__sparse_features____base____itemid__values"]
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == schema.graph_names
    assert graph_name("__BASE__") == "f___base__"
    with torch.no_grad():
        _assert_same(gm(**schema.to_graph_inputs(request)), model(batch))


def test_traced_batch_model_equals_the_model() -> None:
    model, schema, batch = _batch_schema()
    gm = trace(model, flatten_example(schema, (batch,), None, model), schema=schema)
    assert gm.meta["opaque_calls"] == []
    # The KeyedTensor's and JaggedTensor's tensors are the request's own: nothing reads them off a built one.
    gm.graph.eliminate_dead_code()
    assert not [n for n in gm.graph.nodes if n.target in (build_kt, build_jt)]
    for seed, (history, candidates) in enumerate([([1], [1]), ([8, 1], [4, 1]), ([2, 6, 1, 3], [1, 3, 2, 4])]):
        example = tzrec_style.example_batch(history, candidates, seed=seed + 1)
        request = flatten_example(schema, (example,), None, model)
        with torch.no_grad():
            _assert_same(gm(**schema.to_graph_inputs(request)), model(example))


# ---- ranges on a KJT argument ----------------------------------------------------------------------


def test_a_range_on_an_argument_leaves_its_one_per_user_keys() -> None:
    _, schema, _ = _batch_schema(ranges={"batch": (1, 9)})
    ranges = {f.name: (f.min_value, f.max_value) for f in schema.lengths_features()}
    assert ranges[f"{CONTEXTUAL}.user_id.lengths"] == ranges[f"{CONTEXTUAL}.user_city.lengths"] == (1, 1)
    assert ranges[f"{UIH}.uih_item_id.lengths"] == ranges[f"{CANDIDATE}.cand_item_id.lengths"] == (1, 9)
    # Naming a contextual key, or a group whose keys are all one per user, still sets it.
    _, named, _ = _batch_schema(ranges={"batch": (1, 9), f"{CONTEXTUAL}.user_city": (1, 3)})
    assert (named.get(f"{CONTEXTUAL}.user_city.lengths").max_value,
            named.get(f"{CONTEXTUAL}.user_id.lengths").max_value) == (3, 1)
    assert schema.resolve_lengths(CONTEXTUAL) == [f"{CONTEXTUAL}.user_id.lengths", f"{CONTEXTUAL}.user_city.lengths"]
    # The same at export (--max-length batch=1:6): one id per user stays one.
    planned = export_ranges(_batch_schema(ranges={})[1], ExportSettings(max_batch_size=MAX_BATCH,
                                                                          lengths={"batch": (1, 6)}))
    assert planned.max_lengths[f"{CONTEXTUAL}.user_id.lengths"] == planned.min_lengths[f"{CONTEXTUAL}.user_id.lengths"] == 1
    assert planned.max_lengths[f"{UIH}.uih_item_id.lengths"] == 6
    assert planned.max_lengths["batch.sequence_dense_features.uih_watch_ratio.lengths"] == 6  # shares the history's

    # A KJT argument (the README's form): its contextual keys stay at one, its jagged key gets the range.
    kjt_schema = infer_schema(pooled.build_pooled(), pooled.example_inputs(3, seed=0), ranges={"sparse_features": (1, 6)})
    assert kjt_schema.get("sparse_features.user_id.lengths").max_value == 1
    assert kjt_schema.get("sparse_features.item_id.lengths").max_value == 1
    assert (kjt_schema.get("sparse_features.item_tags.lengths").min_value,
            kjt_schema.get("sparse_features.item_tags.lengths").max_value) == (1, 6)


# ---- the flat entry ----------------------------------------------------------------------------------


def test_flat_dict_of_values_and_lengths_is_jagged() -> None:
    wrapper = tzrec_style.build_script_wrapper()
    batch = tzrec_style.example_batch(*EXAMPLE)
    data = tzrec_style.flat_data(batch)
    schema = infer_schema(wrapper, (data,), ranges={"data": (1, 8)})
    data_arg, device = schema.arguments
    assert (data_arg.kind, device.name, device.optional_absent) == ("dict", "device", True)
    values = schema.get("data.uih_item_id.values")  # 15 rows for 3 users: jagged, not refused
    assert (values.kind, values.jagged_by, values.max_value) == ("jagged", "data.uih_item_id.lengths", 399)
    assert schema.get("data.uih_action.lengths").same_as == "data.uih_item_id.lengths"
    assert schema.get("data.uih_watch_ratio.values").trailing == (1,)
    assert schema.get("data.user_stats.values").kind == "per_user"  # no lengths beside it: [B, 3]
    assert schema.get("data.user_id.lengths").max_value == 1  # contextual: one per user, left so by the range
    assert schema.get("data.cand_item_id.lengths").max_value == 8
    request = flatten_example(schema, (data,), None, wrapper)
    gm = trace(wrapper, request, schema=schema)
    with torch.no_grad():
        expected = wrapper(data)
        _assert_same(call_model(wrapper, schema, request), expected)
        _assert_same(gm(**schema.to_graph_inputs(request)), expected)
        _assert_same(expected, tzrec_style.build_ranker()(batch))  # the wrapper serves the Batch model's predictions


def test_flat_dict_rows_that_fit_nothing_are_refused() -> None:
    wrapper = tzrec_style.build_script_wrapper()
    data = tzrec_style.flat_data(tzrec_style.example_batch(*EXAMPLE))
    data["uih_item_id.values"] = data["uih_item_id.values"][:-1]
    with pytest.raises(ConfigError, match=r"'data.uih_item_id.values' has 14 rows but its lengths sum to 15"):
        infer_schema(wrapper, (data,))
    data = tzrec_style.flat_data(tzrec_style.example_batch(*EXAMPLE))
    data["user_stats.values"] = torch.zeros(7, 3)
    with pytest.raises(ConfigError, match=r"'data.user_stats.values' has 7 rows but the batch has 3 users"):
        infer_schema(wrapper, (data,))


# ---- other records, refusals ---------------------------------------------------------------------------


class Inputs(NamedTuple):
    ids: KeyedJaggedTensor
    dense: dict[str, Tensor]


@attrs.define
class AttrsInputs:
    _ids: KeyedJaggedTensor  # a private attribute: attrs' __init__ takes it as ``ids``
    dense: dict[str, Tensor]
    scale: float = 1.0
    raw: tzrec_style.RawRows = attrs.field(factory=tzrec_style.RawRows)


class RecordRanker(pooled.PooledRanker):
    def forward(self, inputs):  # type: ignore[no-untyped-def]
        if isinstance(inputs, AttrsInputs):
            return {k: v * inputs.scale for k, v in super().forward(inputs._ids, inputs.dense).items()}
        return super().forward(inputs.ids, inputs.dense)


@pytest.mark.parametrize("kind", ["namedtuple", "attrs"])
def test_namedtuple_and_attrs_records(kind: str) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = RecordRanker().eval()
    kjt, dense = pooled.example_inputs(3, seed=0)
    example = Inputs(kjt, dense) if kind == "namedtuple" else AttrsInputs(kjt, dense, scale=2.0)
    schema = infer_schema(model, (example,), ranges={"inputs": (1, 6)})
    assert schema.arguments[0].type == f"test_tzrec_style:{type(example).__qualname__}"
    if kind == "attrs":
        assert schema.get("inputs._ids.item_tags.lengths").max_value == 6
        assert schema.arguments[0].fields[2].value == 2.0
        assert schema.arguments[0].fields[3].kind == "default"
    request = flatten_example(schema, (example,), None, model)
    gm = trace(model, request, schema=schema)
    with torch.no_grad():
        expected = model(example)
        rebuilt = schema.assemble(request)[1]["inputs"]
        assert type(rebuilt) is type(example)
        _assert_same(call_model(model, schema, request), expected)
        _assert_same(gm(**schema.to_graph_inputs(request)), expected)


def test_record_class_that_cannot_be_imported_is_one_line() -> None:
    _, schema, _ = _batch_schema()
    data = schema.to_json()
    data["arguments"][0]["type"] = "no_such_package.batches:Batch"
    moved = InputSchema.from_json(data)  # reading a schema (a manifest) imports nothing
    request = flatten_example(schema, (tzrec_style.example_batch(*EXAMPLE),), None, tzrec_style.build_ranker())
    with pytest.raises(ConfigError) as info:
        moved.assemble(request)
    message = str(info.value)
    assert "cannot import 'no_such_package.batches'" in message and "record class" in message
    assert "\n" not in message
    data["arguments"][0]["type"] = "user_models.tzrec_style:NoSuchBatch"
    with pytest.raises(ConfigError, match="has no 'NoSuchBatch'"):
        InputSchema.from_json(data).assemble(request)
    with pytest.raises(ConfigError, match="module:QualName"):
        ArgumentSpec("batch", "record", type="Batch")


def test_local_record_class_and_unknown_fields_are_refused() -> None:
    @dataclasses.dataclass
    class LocalBatch:
        sparse_features: dict

    model = tzrec_style.build_ranker()
    example = tzrec_style.example_batch(*EXAMPLE)
    with pytest.raises(ConfigError, match="defined inside a function; define it at module level"):
        infer_schema(model, (LocalBatch(example.sparse_features),))
    odd = dataclasses.replace(example, labels={"clicks": [1, 0, 1]})
    with pytest.raises(ConfigError, match=r"argument 'batch' of TzrecStyleRanker.forward at 'batch.labels.clicks' is a list"):
        infer_schema(model, (odd,))
    # Raw rows at inference are not the class's default: nothing can carry them in a request.
    with pytest.raises(ConfigError, match=r"at 'batch.reserves' is a RawRows"):
        infer_schema(model, (dataclasses.replace(example, reserves=tzrec_style.RawRows(b"user,item\n")),))


# ---- exports -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tzrec_style")
    batch = tzrec_style.example_batch(*EXAMPLE)
    return {
        "batch": hstu_export.save_bundle(
            tzrec_style.build_ranker(), root / "batch.pt", example_inputs=(batch,),
            factory="user_models.tzrec_style:build_ranker", ranges=tzrec_style.RANGES),
        "flat": hstu_export.save_bundle(
            tzrec_style.build_script_wrapper(), root / "flat.pt", example_inputs=(tzrec_style.flat_data(batch),),
            factory="user_models.tzrec_style:build_script_wrapper",
            ranges={"data.uih_item_id": (1, 8), "data.cand_item_id": (1, 4)}),
    }


def _settings(backend: str) -> ExportSettings:
    return ExportSettings(backend=backend, max_batch_size=MAX_BATCH, verify=VerifySettings(num_random_batches=2),
                          op_mappings={tzrec_style.ATTENTION: GR_ATTENTION})


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aoti", "torchscript", "onnx"])
def test_export_from_its_own_batch(bundles: dict[str, Path], tmp_path: Path, backend: str,
                                   request: pytest.FixtureRequest) -> None:
    result = hstu_export.export(bundles["batch"], tmp_path / "pkg", _settings(backend))
    parity = result.parity
    assert parity["passed"] and parity["worst"]["rel_l2"] <= 1e-5
    assert {r["batch_size"] for r in parity["batches"]} >= {1, MAX_BATCH}
    manifest = result.manifest
    [arg] = manifest["input_schema"]["arguments"]
    assert (arg["kind"], arg["type"]) == ("record", "user_models.tzrec_style:Batch")
    lengths = manifest["ranges"]["lengths"]
    assert lengths["max_lengths"][f"{CONTEXTUAL}.user_id.lengths"] == lengths["min_lengths"][f"{CONTEXTUAL}.user_id.lengths"] == 1
    assert (lengths["max_lengths"][f"{UIH}.uih_item_id.lengths"], lengths["max_lengths"][f"{CANDIDATE}.cand_item_id.lengths"]) == (8, 4)
    marks = {p["name"]: p for p in manifest["passes"]}["mark_sparse_dense"]["stats"]["automatic_marks"]
    assert marks[:2] == ["contextual_ebc__user_id", "contextual_ebc__user_city"] and len(marks) == 6

    # A fresh predictor on Batches of other sizes (down to one user with one item), against the model.
    predictor = hstu_export.load(result.path)
    model = hstu_export.load_bundle(bundles["batch"]).model
    for seed, sizes in enumerate([([1], [1]), ([8, 2], [4, 1])]):
        batch = tzrec_style.example_batch(*sizes, seed=40 + seed)
        request_batch = flatten_example(predictor.input_schema, (batch,), None, model)
        with torch.no_grad():
            expected = model(batch)
        got = predictor(request_batch)
        _assert_same(got, expected, tol=1e-5)
        assert sorted(got) == ["logits_ctr", "logits_cvr", "probs_ctr", "probs_cvr", "y_watch_time"]

    if backend in ("aoti", "torchscript"):
        # The C++ runtime takes the same flat request (it never reads the arguments) and answers bit for bit.
        runtime = request.getfixturevalue("cpp_runtime")
        done = runtime.run(result.path, save_tensors(request_batch, tmp_path / "request"), "--out", tmp_path / "out")
        assert done.returncode == 0, done.stderr
        cpp = load_tensors(tmp_path / "out")
        assert sorted(cpp) == sorted(got) and all(torch.equal(cpp[k], got[k]) for k in got)

    # A manifest's nested arguments are checked on load like the rest of it.
    def tamper(manifest: dict) -> None:
        manifest["input_schema"]["arguments"][0]["fields"][1]["fields"][0]["keys"] = 5

    rewrite_manifest(result.path, tamper)
    with pytest.raises(PackageError, match=r"input_schema\.arguments\[0\]\.fields\[1\]\.fields\[0\]\.keys"):
        hstu_export.load(result.path)


@pytest.mark.slow
def test_flat_entry_exports_and_serves_the_batch_models_predictions(bundles: dict[str, Path], tmp_path: Path) -> None:
    result = hstu_export.export(bundles["flat"], tmp_path / "pkg", _settings("torchscript"))
    assert result.parity["passed"] and result.parity["worst"]["rel_l2"] <= 1e-5
    assert [a["name"] for a in result.manifest["input_schema"]["arguments"]] == ["data", "device"]
    predictor = hstu_export.load(result.path)
    batch = tzrec_style.example_batch([6, 1, 2], [1, 4, 2], seed=7)
    data = tzrec_style.flat_data(batch)
    assert sorted(predictor.input_schema.names) == sorted(f"data.{k}" for k in data)
    got = predictor({f"data.{k}": v for k, v in data.items()})
    with torch.no_grad():
        _assert_same(got, tzrec_style.build_ranker()(batch), tol=1e-5)


@pytest.mark.slow
def test_exports_with_its_derived_kv_program_served_the_same_by_python_and_cpp(tmp_path: Path,
                                                                               cpp_runtime: object) -> None:
    """--kv-cache on the TorchEasyRec-style model (its attention's length fixed, as TorchEasyRec's): verified
    through its cache at export; a script of requests (a first one, the same again, new candidates for the same
    histories, new histories of the same lengths) served through the package's cache equals the package without
    it, with hits and stale users where they belong; the C++ runtime's cache answers bit for bit with the same
    counters."""
    import re

    bundle = hstu_export.save_bundle(
        tzrec_style.build_cacheable_ranker(), tmp_path / "cacheable.pt",
        example_inputs=(tzrec_style.example_batch(*EXAMPLE),), factory="user_models.tzrec_style:build_cacheable_ranker",
        ranges=tzrec_style.RANGES)
    result = hstu_export.export(bundle, tmp_path / "pkg", dataclasses.replace(_settings("aoti"), kv_cache=True))
    section, parity = result.manifest["kv_cache"], result.parity["kv_cache"]
    assert section["kind"] == "derived" and section["layout"]["num_layers"] == 2
    assert parity["passed"] and parity["cache"]["hits"] >= 1, parity

    predictor = hstu_export.load(result.path)
    model = hstu_export.load_bundle(bundle).model
    ranker = predictor.kv_cache()
    lengths = ([6, 2, 8], [1, 4, 2])
    first = tzrec_style.example_batch(*lengths, seed=7)
    other = tzrec_style.example_batch(*lengths, seed=8)
    new_candidates = dataclasses.replace(first, sparse_features={**first.sparse_features,
                                                                 "candidate": other.sparse_features["candidate"]})
    script = [first, first, new_candidates, tzrec_style.example_batch(*lengths, seed=9)]
    counts, expected, args = [], [], [result.path]
    for k, batch in enumerate(script):
        request = flatten_example(predictor.input_schema, (batch,), None, model)
        got, want = ranker(request, [1, 2, 3]), predictor(request)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        stats = ranker.cache.stats()
        counts.append((stats["misses"], stats["hits"], stats["stale"]))
        expected.append(got)
        args.append(save_tensors(request, tmp_path / f"request{k}"))
    assert counts == [(3, 0, 0), (3, 3, 0), (3, 6, 0), (3, 6, 3)], counts

    for _ in script:
        args += ["--user-ids", "1,2,3"]
    done = cpp_runtime.run(*args, "--kv-cache", "auto", "--out", tmp_path / "out")  # type: ignore[attr-defined]
    assert done.returncode == 0, done.stderr
    for k, want in enumerate(expected):
        got = load_tensors(tmp_path / "out" / str(k + 1))
        assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want), k
    found = re.findall(r"kv cache: (\d+) hits, (\d+) misses, (\d+) stale", done.stdout)
    assert found and tuple(map(int, found[-1])) == (stats["hits"], stats["misses"], stats["stale"]), done.stdout
    # With a padding user (shape buckets, verified at export; its counts program counts the padding user too):
    # the same answers, and the C++ runtime's bit for bit.
    assert parity["padding"]["passed"] and parity["padding"]["padded"] >= 4, parity["padding"]
    padded = predictor.kv_cache(shape_buckets=True)
    padded_answers = []
    for k, batch in enumerate(script):
        request = flatten_example(predictor.input_schema, (batch,), None, model)
        got = padded(request, [1, 2, 3])
        for name, value in expected[k].items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
        padded_answers.append(got)
    assert padded.padded_calls == len(script)
    done = cpp_runtime.run(*args, "--kv-cache", "auto", "--kv-shape-buckets", "on",  # type: ignore[attr-defined]
                           "--out", tmp_path / "padded")
    assert done.returncode == 0 and f"a padding user in {len(script)} calls" in done.stdout, done.stderr
    for k, want in enumerate(padded_answers):
        got = load_tensors(tmp_path / "padded" / str(k + 1))
        assert all(torch.equal(got[name], want[name]) for name in want), k
    # Its counts are computed on the device (not sums of request lengths): held rows, which need them before the
    # request moves, are refused in one line, with nothing written.
    held = cpp_runtime.run(*args, "--kv-cache", "auto", "--kv-held-rows", "on",  # type: ignore[attr-defined]
                           "--out", tmp_path / "held")
    assert held.returncode == 1 and held.stderr.count("\n") == 1 and not (tmp_path / "held").exists(), held.stderr
    assert "held rows need a derived program whose counts are added up on the host" in held.stderr
    assert "counts_on_host" not in result.manifest["kv_cache"]
