"""lower_embeddings: torchrec lookups in the sparse half as plain gathers, with the modules' own numbers;
collections used another way are kept, with the reason."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from user_models import dlrm_hstu, grouped_ebc, pooled

from hstu_export.capture import trace
from hstu_export.passes.context import PassContext
from hstu_export.passes.manager import run_passes
from hstu_export.sources.schema_inference import flatten_example, infer_schema


def _collections(gm: nn.Module) -> list[nn.Module]:
    return [m for m in gm.modules() if isinstance(m, (EmbeddingCollection, EmbeddingBagCollection))]


def _both(model: nn.Module, example: Any, ranges: dict[str, tuple[int, int]], batches: list[Any]) -> Any:
    """The pipeline with and without the pass on ``model``: its report and records, and the two split
    models' outputs on ``batches`` (the example's layout) as pairs."""
    schema = infer_schema(model, example, ranges=ranges)
    flat = flatten_example(schema, example, None, model)
    results = []
    for skip in ((), ("lower_embeddings",)):
        ctx = PassContext(example_inputs=schema.to_graph_inputs(flat), model=model, schema=schema,
                          check_each_pass=True)
        results.append((run_passes(trace(model, flat, schema=schema), ctx, skip=skip), ctx))
    (lowered, ctx), (kept, _) = results
    pairs = []
    with torch.no_grad():
        for batch in batches:
            graph_batch = schema.to_graph_inputs(flatten_example(schema, batch, None, model))
            pairs.append((lowered.run(graph_batch), kept.run(graph_batch)))
    return lowered, ctx, pairs


def _assert_equal(pairs: list[tuple[dict[str, Tensor], dict[str, Tensor]]]) -> None:
    for new, old in pairs:
        assert new.keys() == old.keys()
        for name in new:
            assert torch.equal(new[name], old[name]), name


@pytest.mark.parametrize("which", ["dlrm_hstu", "pooled", "grouped"])
def test_users_lookups_become_gathers_with_the_modules_numbers(which: str) -> None:
    """A KJT the user builds (values and lengths concatenated per key, then sync()), the tracer's KJT of
    per-key features, EmbeddingCollection and EmbeddingBagCollection read by kt[key], values(), to_dict():
    every lookup is a gather and the split model's answers are the unlowered ones bit for bit, on batches
    other than the example."""
    if which == "dlrm_hstu":
        model, ranges = dlrm_hstu.build_ranker(), {"uih_features": (1, 12), "candidates_features": (1, 5)}
        example, batches = dlrm_hstu.example_inputs(3, seed=0), [dlrm_hstu.example_inputs(b, seed=b) for b in (1, 4)]
    elif which == "pooled":
        model, ranges = pooled.build_pooled(), {"sparse_features": (1, 6)}
        example, batches = pooled.example_inputs(3, seed=0), [pooled.example_inputs(b, seed=b) for b in (1, 4)]
    else:
        model, ranges = grouped_ebc.build_grouped(), {"item_features": (1, 4), "user_features": (1, 1)}
        example, batches = grouped_ebc.example_inputs(3, seed=0), [grouped_ebc.example_inputs(b, seed=b) for b in (1, 4)]
    result, ctx, pairs = _both(model, example, ranges, batches)
    _assert_equal(pairs)
    assert ctx.sparse_lowering and all(r["lowered"] for r in ctx.sparse_lowering), ctx.sparse_lowering
    assert not _collections(result.sparse)
    code = result.sparse.code
    assert "KeyedJaggedTensor" not in code and "build_kjt" not in code
    gathers = code.count("torch.nn.functional.embedding(") + code.count("torch.nn.functional.embedding_bag(")
    assert gathers == sum(len(c.feature_names) for m in _collections(model) for c in
                          (m.embedding_configs() if isinstance(m, EmbeddingCollection) else m.embedding_bag_configs()))
    # The tables keep their parameter names.
    assert {n for n, _ in result.sparse.named_parameters()} <= {n for n, _ in model.named_parameters()}
    report = result.report["lower_embeddings"]
    assert report.max_rel_error == 0.0


class SharedAndWeighted(nn.Module):
    """A feature looked up in two tables (torchrec names the outputs feature@table), a weighted
    EmbeddingBagCollection, one pooling by the mean, and a JaggedTensor whose offsets() the model reads."""

    def __init__(self, read_offsets: bool = False) -> None:
        super().__init__()
        self.read_offsets = read_offsets
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="ta", embedding_dim=4, num_embeddings=30, feature_names=["item", "tag"]),
            EmbeddingConfig(name="tb", embedding_dim=4, num_embeddings=30, feature_names=["item"]),
        ])
        self.ebc = EmbeddingBagCollection(is_weighted=True, tables=[
            EmbeddingBagConfig(name="bag_sum", embedding_dim=4, num_embeddings=30, feature_names=["item"]),
            EmbeddingBagConfig(name="bag_tag", embedding_dim=4, num_embeddings=30, feature_names=["tag"]),
        ])
        self.mean = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="bag_mean", embedding_dim=4, num_embeddings=30, feature_names=["tag"],
                               pooling=PoolingType.MEAN)])

    def forward(self, features: KeyedJaggedTensor) -> dict[str, Tensor]:
        rows = self.ec(features)
        pooled_rows = self.ebc(features)
        out = {"a": rows["item@ta"].values() * 2, "b": rows["item@tb"].values() + rows["tag"].values().sum(),
               "pooled": pooled_rows.values() * 3, "mean": self.mean(features)["tag"] - 1}
        if self.read_offsets:
            out["offsets"] = rows["tag"].offsets() * 1
        return out


def _shared_example(batch: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (2 * batch,), generator=g)
    total = int(lengths.sum())
    return KeyedJaggedTensor(keys=["item", "tag"], values=torch.randint(0, 30, (total,), generator=g),
                             lengths=lengths, weights=torch.rand(total, generator=g))


@pytest.mark.parametrize("read_offsets", [False, True])
def test_shared_features_and_weighted_bags_keep_the_modules_numbers(read_offsets: bool) -> None:
    """Also a JaggedTensor read another way than values() and lengths(): it is rebuilt from the gather."""
    model = SharedAndWeighted(read_offsets).eval()
    example = (_shared_example(3, 0),)
    result, ctx, pairs = _both(model, example, {"features": (1, 3)}, [(_shared_example(b, b),) for b in (1, 4)])
    _assert_equal(pairs)
    assert [r["lowered"] for r in ctx.sparse_lowering] == [True, True, True]
    assert not _collections(result.sparse)
    assert ("build_jt" in result.sparse.code) == read_offsets


class Permuted(nn.Module):
    """An EmbeddingCollection on a KJT the model permutes first: not one the pass reads per key."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=30, feature_names=["item", "tag"])])

    def forward(self, features: KeyedJaggedTensor) -> dict[str, Tensor]:
        rows = self.ec(features.permute([1, 0]))
        return {"a": rows["item"].values() * 2, "b": rows["tag"].values() + 1}


def test_a_collection_on_a_kjt_the_pass_cannot_read_is_kept_with_the_reason() -> None:
    model = Permuted().eval()
    result, ctx, pairs = _both(model, (_shared_example(3, 0),), {"features": (1, 3)}, [(_shared_example(2, 5),)])
    _assert_equal(pairs)
    assert ctx.sparse_lowering == [{"module": "ec", "lowered": False,
                                    "reason": "its KeyedJaggedTensor does not come from a constructor the pass reads"}]
    assert [type(m).__name__ for m in _collections(result.sparse)] == ["EmbeddingCollection"]


def test_zoo_package_records_the_lowering_and_scripts_no_torchrec(tmp_path: Path) -> None:
    """The exported sparse half of the zoo model: gathers only, recorded in the manifest, and it loads and
    answers as the package's verification checked."""
    from tiny_packages import export_tiny

    import hstu_export

    root = export_tiny(tmp_path, seed=3)
    package = hstu_export.load(root)
    assert package.manifest["sparse_lowering"] == [{"module": "sparse_arch.embedding_collection", "lowered": True}]
    assert package.manifest["parity"]["passed"]
    with zipfile.ZipFile(root / package.manifest["backend"]["files"]["model"]) as archive:
        code = {name: archive.read(name).decode() for name in archive.namelist() if name.endswith(".py")}
    assert not [name for name, text in code.items() if "torchrec" in name or "torchrec" in text]
    assert any("torch.embedding(" in text for text in code.values())
