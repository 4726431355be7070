"""Model bundles: round trip, pickled modules, truncated/foreign files, CLI exit codes."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hstu_export
from hstu_export import generate_batch, load_bundle, save_bundle
from hstu_export.cli import main as cli_main
from hstu_export.errors import BundleError, ModelRegistryError
from hstu_export.models import build_preset


@pytest.fixture(scope="module")
def tiny():
    model = build_preset("tiny", seed=3)
    return model, generate_batch(model.input_schema(), 4, seed=5)


@pytest.fixture()
def bundle_path(tmp_path, tiny):
    model, batch = tiny
    return save_bundle(model, tmp_path / "model.pt", batch)


def test_round_trip_gives_identical_outputs(bundle_path, tiny):
    model, batch = tiny
    loaded = load_bundle(bundle_path)
    assert loaded.model_name == "hstu_ranking"
    assert loaded.config == model.config
    assert set(loaded.example_batch) == set(batch)
    for name in batch:
        assert torch.equal(loaded.example_batch[name], batch[name])
    with torch.no_grad():
        fresh = generate_batch(model.input_schema(), 3, seed=9)
        expected, got = model(fresh), loaded.model(fresh)
    for task in expected:
        assert torch.equal(expected[task], got[task])


def test_bundle_is_plain_data(bundle_path):
    data = torch.load(bundle_path, weights_only=True)
    assert data["format"] == "hstu-export-bundle"
    assert data["format_version"] == 2
    assert data["source"]["kind"] == "registered" and isinstance(data["source"]["config"], dict)


def test_format_1_bundles_still_load(bundle_path, tmp_path):
    data = torch.load(bundle_path, weights_only=True)
    old = {"format": data["format"], "format_version": 1, "model_name": data["source"]["name"],
           "config": data["source"]["config"], "state_dict": data["state_dict"], "example_batch": data["example_batch"]}
    torch.save(old, tmp_path / "v1.pt")
    loaded = load_bundle(tmp_path / "v1.pt")
    assert loaded.model_name == "hstu_ranking"
    assert torch.equal(loaded.model.state_dict()["transducer.post_norm_weight"], data["state_dict"]["transducer.post_norm_weight"])


class Unregistered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, features):
        return {"y": self.lin(features["x"])}


def test_unregistered_model_needs_allow_pickle(tmp_path):
    model = Unregistered()
    batch = {"x": torch.randn(3, 2)}
    with pytest.raises(ModelRegistryError, match="not a registered model"):
        save_bundle(model, tmp_path / "m.pt", batch)
    path = save_bundle(model, tmp_path / "m.pt", batch, allow_pickle=True)
    with pytest.raises(BundleError, match="arbitrary code.*--allow-pickle"):
        load_bundle(path)
    with pytest.warns(UserWarning, match="arbitrary code"):
        loaded = load_bundle(path, allow_pickle=True)
    assert loaded.pickled
    assert torch.equal(loaded.model(batch)["y"], model(batch)["y"])


def test_bare_pickled_module_refused(tmp_path, tiny):
    model, _ = tiny
    path = tmp_path / "whole.pt"
    torch.save(model, path)
    with pytest.raises(BundleError, match="pickled Python objects"):
        load_bundle(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_bundle(path, allow_pickle=True)
    assert "uih_lengths" in loaded.example_batch  # generated from the model's schema


def test_truncated_file(bundle_path, tmp_path):
    data = bundle_path.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleError, match="truncated|corrupt|not a torch.save"):
        load_bundle(cut)


def test_foreign_files(tmp_path):
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(BundleError, match="not a model bundle"):
        load_bundle(text)
    state = tmp_path / "state.pt"
    torch.save({"weight": torch.zeros(2)}, state)
    with pytest.raises(BundleError, match="not an hstu-export bundle"):
        load_bundle(state)
    with pytest.raises(BundleError, match="no such file"):
        load_bundle(tmp_path / "missing.pt")


def test_missing_keys_and_unknown_model(bundle_path, tmp_path):
    data = torch.load(bundle_path, weights_only=True)
    broken = dict(data)
    del broken["state_dict"]
    torch.save(broken, tmp_path / "nokeys.pt")
    with pytest.raises(BundleError, match=r"missing key\(s\) \['state_dict'\]"):
        load_bundle(tmp_path / "nokeys.pt")
    renamed = dict(data, source=dict(data["source"], name="nope"))
    torch.save(renamed, tmp_path / "unknown.pt")
    with pytest.raises(BundleError, match="unknown model 'nope'"):
        load_bundle(tmp_path / "unknown.pt")
    newer = dict(data, format_version=99)
    torch.save(newer, tmp_path / "newer.pt")
    with pytest.raises(BundleError, match="upgrade"):
        load_bundle(tmp_path / "newer.pt")
    wrong_weights = dict(data, state_dict={k: v for k, v in data["state_dict"].items() if "stu" not in k})
    torch.save(wrong_weights, tmp_path / "weights.pt")
    with pytest.raises(BundleError, match="does not fit"):
        load_bundle(tmp_path / "weights.pt")


def test_weights_only_really_blocks_code(tmp_path):
    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"format": "hstu-export-bundle", "x": Boom()}, path)
    with pytest.raises(BundleError, match="arbitrary code"):
        load_bundle(path)
    assert pickle  # the module is used for the payload above


@pytest.mark.parametrize("kind", ["truncated", "foreign", "pickled"])
def test_cli_describe_bad_input_exit_2(kind, bundle_path, tmp_path, tiny, capsys):
    path = tmp_path / f"{kind}.pt"
    if kind == "truncated":
        path.write_bytes(bundle_path.read_bytes()[:1000])
    elif kind == "foreign":
        path.write_bytes(b"\x00\x01garbage")
    else:
        torch.save(tiny[0], path)
    assert cli_main(["describe", str(path)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 3  # one message (rich may wrap it)


def test_cli_describe(bundle_path, capsys):
    assert cli_main(["describe", str(bundle_path)]) == 0
    out = capsys.readouterr().out
    assert "hstu_ranking" in out
    params = sum(p.numel() for p in load_bundle(bundle_path).model.parameters())
    assert f"{params:,}" in out
    for table in ("item", "action", "ctx_user_id"):
        assert table in out
    assert "uih_item_ids" in out


def test_console_script_version_and_help():
    exe = Path(sys.executable).with_name("hstu-export")
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True).stdout
    assert hstu_export.__version__ in out
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("describe", "export", "inspect"):
        assert command in out
