"""The compiled sparse half's prechecked model (runtimes/aoti.py ``prechecked_sparse``, ``--prechecked-sparse``).

sparse/sparse.pt2 holds two models: "model", whose range checks read every feature's extremes from the device
(what a stock loader takes), and "prechecked", whose ids are clamped into their ranges instead, so it never waits
for the device. The runtimes check the manifest's ranges on the host, then run the prechecked model when those
ranges lie within the ones its check was replaced for (``backend.meta.sparse_program.prechecked.ranges``), else the
checked one. The "no-context" package of ``kv_package`` has both models (tests/conftest.py); the "context" one,
exported on CPU with the default (auto), has only the checked one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kv_requests import CONFIGS, Users
from manifests import rewrite_manifest

import hstu_export
from hstu_export.errors import ConfigError, RequestError
from hstu_export.package.tensor_dir import save_tensors
from hstu_export.settings import ExportSettings

pytestmark = pytest.mark.slow

PRECHECKED_PHRASE = ", sparse half prechecked on the host"


def _request(config: str, out_of_range: int | None = None) -> dict[str, torch.Tensor]:
    made = Users(CONFIGS[config], seed=11)
    for user, length in {"a": 30, "b": 3, "c": 46}.items():
        made.grow(user, length)
    request = made.request(["a", "b", "c"], [2, 16, 1])
    if out_of_range is not None:
        request["uih_item_ids"][5] = out_of_range
    return request


def _item(manifest: dict, name: str = "uih_item_ids") -> dict:
    return next(f for f in manifest["input_schema"]["features"] if f["name"] == name)


def _tables(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / "sparse" / "tables.safetensors"))


def _sparse_inputs(root: Path, request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    manifest = json.loads((root / "manifest.json").read_text())
    return {spec["name"]: request[spec["feature"]] for spec in manifest["artifacts"]["sparse"]["inputs"]}


@pytest.mark.parametrize("kv_package", ["context", "no-context"], indirect=True)
def test_the_runtimes_run_the_prechecked_model_where_the_package_has_one(kv_package, cpp_runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config, root, manifest = kv_package
    has = config == "no-context"
    meta = manifest["backend"]["meta"]["sparse_program"]
    assert ("prechecked" in meta) == has
    if has:  # every checked feature, with the bounds the checked model holds it to
        assert meta["prechecked"]["ranges"]["uih_item_ids"] == [0, 999, None]
        assert meta["prechecked"]["ranges"]["uih_lengths"] == [1, 46, 4]
    assert hstu_export.load(root).split.sparse_model == ("prechecked" if has else "model")
    request = save_tensors(_request(config), tmp_path / "request")
    done = cpp_runtime.run(root, request)
    assert done.returncode == 0, done.stderr
    assert (PRECHECKED_PHRASE in done.stdout) == has, done.stdout


@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_both_models_answer_alike_and_only_the_checked_one_refuses(kv_package) -> None:  # type: ignore[no-untyped-def]
    """Loaded as a stock loader loads them, by name, with the package's tables: bit for bit equal inside the
    ranges; an id past its table is refused by "model" and read as the table's last row by "prechecked"."""
    from torch._inductor.package import load_package

    _, root, _ = kv_package
    tables = _tables(root)
    models = {}
    for name in ("model", "prechecked"):
        models[name] = load_package(str(root / "sparse" / "sparse.pt2"), name)
        models[name].load_constants(tables, check_full_update=True, user_managed=True)
    inputs = _sparse_inputs(root, _request("no-context"))
    checked, prechecked = models["model"](**inputs), models["prechecked"](**inputs)
    assert len(checked) == len(prechecked) > 0
    assert all(torch.equal(a, b) for a, b in zip(checked, prechecked, strict=True))

    beyond = _sparse_inputs(root, _request("no-context", out_of_range=1000))
    with pytest.raises(RuntimeError, match=r"Expected u\d+ <= 999 but received 1000"):
        models["model"](**beyond)
    last_row = _sparse_inputs(root, _request("no-context", out_of_range=999))
    assert all(torch.equal(a, b) for a, b in zip(models["prechecked"](**beyond), models["model"](**last_row),
                                                  strict=True))


@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_a_manifest_wider_than_the_prechecked_ranges_runs_the_checked_model(kv_package, cpp_runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Then a request the manifest lets past is refused by the program itself, naming the feature."""
    _, root, _ = kv_package
    package = tmp_path / "pkg"
    shutil.copytree(root, package)
    rewrite_manifest(package, lambda m: _item(m).update(max_value=5000))
    predictor = hstu_export.load(package)
    assert predictor.split.sparse_model == "model"
    with pytest.raises(RequestError, match="uih_item_ids.*refused by sparse/sparse.pt2 itself"):
        predictor(_request("no-context", out_of_range=1000))
    done = cpp_runtime.run(package, save_tensors(_request("no-context"), tmp_path / "request"))
    assert done.returncode == 0 and PRECHECKED_PHRASE not in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_ranges_widened_in_the_manifest_and_its_meta_clamp_ids_to_the_table(kv_package, cpp_runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A package edited so that both the manifest and the prechecked model's recorded ranges allow ids past the
    table: the program still reads no row outside it (the id is clamped), in Python and in C++, and no runtime
    crashes."""
    _, root, _ = kv_package
    package = tmp_path / "pkg"
    shutil.copytree(root, package)

    def widen(manifest: dict) -> None:
        _item(manifest).update(max_value=5000)
        manifest["backend"]["meta"]["sparse_program"]["prechecked"]["ranges"]["uih_item_ids"][1] = 5000

    rewrite_manifest(package, widen)
    predictor = hstu_export.load(package)
    assert predictor.split.sparse_model == "prechecked"
    clamped = predictor(_request("no-context", out_of_range=1000))
    expected = hstu_export.load(root)(_request("no-context", out_of_range=999))
    assert clamped.keys() == expected.keys() and all(torch.equal(clamped[k], expected[k]) for k in expected)
    request = save_tensors(_request("no-context", out_of_range=1000), tmp_path / "request")
    done = cpp_runtime.run(package, request, "--out", tmp_path / "out")
    assert done.returncode == 0 and PRECHECKED_PHRASE in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
@pytest.mark.parametrize("edit", ["ranges not a map", "a bound not a whole number", "an unknown feature"])
def test_a_prechecked_section_that_does_not_read_well_runs_the_checked_model(kv_package, cpp_runtime, tmp_path,
                                                                             edit) -> None:  # type: ignore[no-untyped-def]
    _, root, _ = kv_package
    package = tmp_path / "pkg"
    shutil.copytree(root, package)

    def spoil(manifest: dict) -> None:
        section = manifest["backend"]["meta"]["sparse_program"]["prechecked"]
        if edit == "ranges not a map":
            section["ranges"] = "all"
        elif edit == "a bound not a whole number":
            section["ranges"]["uih_item_ids"][1] = 999.5
        else:
            section["ranges"]["no_such_feature"] = [0, 1, None]

    rewrite_manifest(package, spoil)
    assert hstu_export.load(package).split.sparse_model == "model"
    done = cpp_runtime.run(package, save_tensors(_request("no-context"), tmp_path / "request"))
    assert done.returncode == 0 and PRECHECKED_PHRASE not in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_a_prechecked_model_the_program_lacks_is_refused_in_one_line(kv_package, cpp_runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hstu_export.errors import PackageError

    _, root, _ = kv_package
    package = tmp_path / "pkg"
    shutil.copytree(root, package)
    rewrite_manifest(package, lambda m: m["backend"]["meta"]["sparse_program"]["prechecked"].update(model="other"))
    with pytest.raises(PackageError, match=r"could not load sparse/sparse\.pt2 \(its model 'other'\)"):
        hstu_export.load(package)
    done = cpp_runtime.run(package, save_tensors(_request("no-context"), tmp_path / "request"))
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "could not load sparse/sparse.pt2 (its model 'other')" in done.stderr, done.stderr


def test_an_export_whose_two_models_disagree_fails(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What export checks of the two models (runtimes/aoti.py _models_agree): the same answers, bit for bit."""
    from types import SimpleNamespace

    from hstu_export.errors import ExportError
    from hstu_export.runtimes import aoti

    class Program:
        def __init__(self, path: Path, model: str) -> None:
            self.model = model

        def use_constants(self, tables: dict) -> None:
            self.tables = tables

        def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.tables["t"][ids] + (1 if self.model == "prechecked" else 0),)

    monkeypatch.setattr(aoti, "_load_pt2", Program)
    inputs = SimpleNamespace(example_features={"ids": torch.tensor([0, 2])}, sparse_input_names=["ids"])
    with pytest.raises(ExportError, match="prechecked model answers the export example differently"):
        aoti._models_agree(tmp_path / "sparse.pt2", {"t": torch.arange(6.0).reshape(3, 2)}, inputs)  # type: ignore[arg-type]
    monkeypatch.setattr(Program, "__call__", lambda self, ids: (self.tables["t"][ids],))
    aoti._models_agree(tmp_path / "sparse.pt2", {"t": torch.arange(6.0).reshape(3, 2)}, inputs)  # type: ignore[arg-type]


def test_the_setting_takes_auto_on_or_off() -> None:
    assert ExportSettings(device="cuda").prechecked_for_device
    assert not ExportSettings().prechecked_for_device
    assert ExportSettings(prechecked_sparse="on").prechecked_for_device
    assert not ExportSettings(device="cuda", prechecked_sparse="off").prechecked_for_device
    with pytest.raises(ConfigError, match="--prechecked-sparse must be auto, on or off, got 'yes'"):
        ExportSettings(prechecked_sparse="yes")
    with pytest.raises(ConfigError, match="--prechecked-sparse on .* needs --backend aoti \\(not onnx\\)"):
        ExportSettings(backend="onnx", prechecked_sparse="on")
