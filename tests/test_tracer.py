"""The FX tracer: flat named inputs, leaf decisions, clear errors for untraceable modules."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor, nn
from torchrec.modules.embedding_modules import EmbeddingCollection

from hstu_export import generate_batch
from hstu_export.capture import trace
from hstu_export.errors import ConfigError, TraceError
from hstu_export.models import STULayer, build_preset
from hstu_export.models.ranking import HstuRankingModel


@pytest.fixture(scope="module")
def tiny() -> HstuRankingModel:
    return build_preset("tiny")


def _call_modules(gm: torch.fx.GraphModule) -> dict[str, type]:
    return {
        str(n.target): type(gm.get_submodule(str(n.target))) for n in gm.graph.nodes if n.op == "call_module"
    }


def _max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).detach().abs().max()) for k in a)


def test_inputs_are_one_placeholder_per_feature_in_schema_order(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 4, seed=1)
    shuffled = dict(reversed(list(batch.items())))  # the schema, not the dict order, decides
    gm = trace(tiny, shuffled)
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == tiny.input_schema().names
    out = gm(**batch)
    assert isinstance(out, dict) and list(out) == ["ctr", "cvr"]
    assert _max_abs_diff(out, tiny(batch)) == 0.0


def test_trace_is_not_specialised_to_the_example_batch(tiny: HstuRankingModel) -> None:
    gm = trace(tiny, generate_batch(tiny.input_schema(), 4, seed=0))
    for batch_size, seed in ((1, 1), (7, 2), (2, 3)):
        batch = generate_batch(tiny.input_schema(), batch_size, seed=seed)
        out = gm(**batch)
        assert out["ctr"].shape == (int(batch["candidate_lengths"].sum()),)
        assert _max_abs_diff(out, tiny(batch)) == 0.0


class _SumModel(nn.Module):
    """No input_schema(): inputs follow the example batch's key order; ``unused`` is never read."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"y": self.proj(features["x"]) * features["scale"].unsqueeze(-1)}


def test_unused_features_stay_inputs_and_batch_order_is_used_without_a_schema() -> None:
    model = _SumModel()
    batch = {"scale": torch.rand(4), "unused": torch.zeros(1), "x": torch.rand(4, 3)}
    gm = trace(model, batch)
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["scale", "unused", "x"]
    torch.testing.assert_close(gm(**batch)["y"], model(batch)["y"], rtol=0, atol=0)


def test_embedding_collection_is_a_leaf_by_default(tiny: HstuRankingModel) -> None:
    gm = trace(tiny, generate_batch(tiny.input_schema(), 2, seed=0))
    modules = _call_modules(gm)
    assert modules["sparse_arch.embedding_collection"] is EmbeddingCollection
    assert not any(issubclass(cls, STULayer) for cls in modules.values())  # traced through


@pytest.mark.parametrize("spec", ["STULayer", "hstu_export.models.stu.STULayer"])
def test_user_leaf_by_class_name(tiny: HstuRankingModel, spec: str) -> None:
    batch = generate_batch(tiny.input_schema(), 3, seed=0)
    gm = trace(tiny, batch, leaf_modules=[spec])
    stu_calls = [t for t, cls in _call_modules(gm).items() if cls is STULayer]
    assert stu_calls == ["transducer.stu.layers.0", "transducer.stu.layers.1"]
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "hstu_export.hstu_mha_gated.default" not in ops  # the attention now sits inside the opaque layers
    assert _max_abs_diff(gm(**batch), tiny(batch)) == 0.0


def test_user_leaf_by_submodule_path(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 3, seed=0)
    gm = trace(tiny, batch, leaf_modules=["transducer.stu.layers.1"])
    stu_calls = [t for t, cls in _call_modules(gm).items() if cls is STULayer]
    assert stu_calls == ["transducer.stu.layers.1"]
    mha = [n for n in gm.graph.nodes if str(n.target) == "hstu_export.hstu_mha_gated.default"]
    assert len(mha) == 1  # layer 0 is still traced through


def test_unknown_leaf_module_is_a_config_error(tiny: HstuRankingModel) -> None:
    with pytest.raises(ConfigError, match="NoSuchBlock"):
        trace(tiny, generate_batch(tiny.input_schema(), 2, seed=0), leaf_modules=["NoSuchBlock"])


class DataDependentGate(nn.Module):
    """Python control flow on tensor values: FX cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            return x * self.scale
        return x


class _GatedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(3, 3))
        self.block = nn.ModuleDict({"gate": DataDependentGate()})

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"y": self.block["gate"](self.encoder(features["x"]))}


def test_untraceable_submodule_becomes_an_opaque_leaf() -> None:
    model = _GatedModel()
    batch = {"x": torch.randn(4, 3)}
    gm = trace(model, batch)
    assert _call_modules(gm)["block.gate"] is DataDependentGate
    [call] = gm.meta["opaque_calls"]
    assert call["kind"] == "module" and call["name"] == "block.gate"
    line = inspect.getsourcelines(DataDependentGate.forward)[1] + 1  # the `if` on a tensor value
    assert call["where"].endswith(f"test_tracer.py:{line}")
    for sign in (1.0, -1.0):  # both branches still run, eagerly, inside the leaf
        batch = {"x": sign * torch.ones(4, 3)}
        torch.testing.assert_close(gm(**batch)["y"], model(batch)["y"], rtol=0, atol=0)


class RootGate(nn.Module):
    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        x = features["x"]
        if x.sum() > 0:
            x = x * 2
        return {"y": x}


def test_untraceable_root_names_file_and_line() -> None:
    with pytest.raises(TraceError) as info:
        trace(RootGate(), {"x": torch.randn(4, 3)})
    line = inspect.getsourcelines(RootGate.forward)[1] + 2
    message = str(info.value)
    assert f"test_tracer.py:{line}" in message
    assert "the forward of RootGate itself" in message
    assert info.value.exit_code == 2


def test_forward_must_take_one_dict() -> None:
    class TwoArgs(nn.Module):
        def forward(self, a: Tensor, b: Tensor) -> Tensor:
            return a + b

    with pytest.raises(TraceError, match="give its input schema"):
        trace(TwoArgs(), {"a": torch.zeros(1), "b": torch.zeros(1)})


def test_example_batch_must_fit_the_schema(tiny: HstuRankingModel) -> None:
    batch = generate_batch(tiny.input_schema(), 2, seed=0)
    del batch["query_time"]
    with pytest.raises(TraceError, match=r"missing \['query_time'\]"):
        trace(tiny, batch)
