"""Tables outside the program (hstu_export/package/tables.py, the aoti backend's sparse half): stored once in a
safetensors file whose bytes depend only on the tables, read back memory-mapped with its header checked against
the manifest, handed to the compiled program; a dense-only re-export publishes no table bytes."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from manifests import edit_safetensors_header, rewrite_manifest, rewrite_tables_header

import hstu_export
from hstu_export import ExportSettings, VerifySettings, export, generate_batch, save_bundle
from hstu_export.errors import PackageError
from hstu_export.models import build_preset
from hstu_export.package.publish import publish
from hstu_export.package.tables import read_tables, write_tables

TABLES = "sparse/tables.safetensors"


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"item": torch.randn(7, 3), "half": torch.randn(5, 2).half(), "brain": torch.randn(3, 4).bfloat16(),
            "ids": torch.arange(9, dtype=torch.int8), "empty": torch.zeros(0, 4), "long": torch.arange(3)}


def test_tables_round_trip_as_views_of_one_mapping(tmp_path) -> None:
    tensors = _tensors()
    entries = write_tables(tmp_path / "t.safetensors", tensors)
    assert [e["name"] for e in entries] == sorted(tensors)
    assert {e["name"]: (e["dtype"], e["shape"]) for e in entries}["brain"] == ("bfloat16", [3, 4])
    back = read_tables(tmp_path / "t.safetensors", entries, "t")
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    # Views of one mapping of the file, not copies.
    storages = {back[n].untyped_storage().data_ptr() for n in tensors if tensors[n].numel()}
    assert len(storages) == 1
    assert str(tmp_path / "t.safetensors") in Path("/proc/self/maps").read_text()


def test_the_same_tables_write_the_same_bytes(tmp_path) -> None:
    tensors = _tensors()
    write_tables(tmp_path / "a", tensors)
    write_tables(tmp_path / "b", dict(reversed(list(tensors.items()))))
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    write_tables(tmp_path / "c", dict(tensors, item=tensors["item"] + 1))
    assert (tmp_path / "a").read_bytes() != (tmp_path / "c").read_bytes()


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: p.write_bytes(b"\x01\x00"), "its header length is missing"),
    (lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + p.read_bytes()[8:]), "does not fit its"),
    (lambda p: p.write_bytes(struct.pack("<Q", 16) + b"{not json}      " + b"\0" * 16), "cannot be read as a safetensors"),
    (lambda p: p.write_bytes(struct.pack("<Q", 8) + b"[1, 2]  " + b"\0" * 16), "not a JSON object"),
    (lambda p: edit_safetensors_header(p, lambda h: h.pop("item")), "lacks 'item'"),
    (lambda p: edit_safetensors_header(p, lambda h: h.update(extra=h["item"])), "holds 'extra', which the manifest does not list"),
    (lambda p: edit_safetensors_header(p, lambda h: h["item"].update(dtype="F16")), "table 'item' has dtype F16, the manifest says "
                                                                         "float32"),
    (lambda p: edit_safetensors_header(p, lambda h: h["item"].update(shape=[6, 3])), "has shape [6, 3], the manifest says [7, 3]"),
    (lambda p: edit_safetensors_header(p, lambda h: h["item"].update(data_offsets=[0, 10 ** 9])), "are not 21 aligned float32"),
    (lambda p: edit_safetensors_header(p, lambda h: h["item"].update(data_offsets=[2, 86])), "are not 21 aligned float32"),
    (lambda p: edit_safetensors_header(p, lambda h: h["item"].update(data_offsets=[0])), "are not 21 aligned float32"),
])
def test_a_damaged_tables_file_is_refused_in_one_line(tmp_path, damage, message) -> None:
    path = tmp_path / "t.safetensors"
    entries = write_tables(path, _tensors())
    damage(path)
    with pytest.raises(PackageError) as info:
        read_tables(path, entries, "pkg: t.safetensors")
    assert message in str(info.value) and "re-export the package" in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def dense_update(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny preset exported with aoti, then again after a change to its dense weights only (a training job
    publishing its dense half): the two packages, the request they are checked on, and the tables' names."""
    root = tmp_path_factory.mktemp("tables")
    model = build_preset("tiny", seed=5)
    examples = generate_batch(model.input_schema(), 4, seed=6)
    settings = ExportSettings(backend="aoti", max_batch_size=4, verify=VerifySettings(num_random_batches=1))
    first = export(save_bundle(model, root / "a.pt", examples), root / "a", settings)
    tables = {t["name"] for t in first.manifest["artifacts"]["sparse"]["constants"]["tensors"]}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name not in tables:
                parameter.mul_(1.25)
    second = export(save_bundle(model, root / "b.pt", examples), root / "b", settings)
    return Path(first.path), Path(second.path), generate_batch(model.input_schema(), 3, seed=9), tables


def test_the_sparse_program_gathers_from_the_tables_file(dense_update) -> None:
    first, _, request, tables = dense_update
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["format_version"] == 5 and manifest["artifacts"]["sparse"]["format"] == "aoti"
    assert manifest["artifacts"]["sparse"]["constants"]["file"] == TABLES and TABLES in manifest["files"]
    assert {n.rsplit(".", 2)[-2] for n in tables} == {"item", "action", "ctx_user_id", "ctx_user_age"}
    # Stored once: the compiled program holds none of the tables' bytes.
    item = read_tables(first / TABLES, manifest["artifacts"]["sparse"]["constants"]["tensors"], "t")[
        "sparse_arch.embedding_collection.embeddings.item.weight"]
    assert item.numel() == 1000 * 32
    assert item[:8].contiguous().numpy().tobytes() not in (first / "sparse" / "sparse.pt2").read_bytes()
    # In a fresh process: the file is mapped by the load, and the program gathers from the mapped pages.
    code = (f"from pathlib import Path; import hstu_export; maps = Path('/proc/self/maps'); "
            f"path = {str((first / TABLES).resolve())!r}; before = path in maps.read_text(); "
            f"predictor = hstu_export.load({str(first)!r}); print(before, path in maps.read_text())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["False", "True"], done.stdout + done.stderr[-2000:]
    predictor = hstu_export.load(first)
    answers = predictor(request)
    assert all(torch.isfinite(v).all() for v in answers.values())


def test_a_dense_update_publishes_no_table_bytes(dense_update, tmp_path) -> None:
    first, second, request, _ = dense_update
    assert (first / TABLES).read_bytes() == (second / TABLES).read_bytes()
    old, new = hstu_export.load(first)(request), hstu_export.load(second)(request)
    assert any(not torch.equal(old[n], new[n]) for n in old)  # the dense half did change
    root = tmp_path / "ranker"
    publish(first, root)
    two = publish(second, root)
    assert TABLES in two.linked and TABLES not in two.copied
    assert (root / "1" / TABLES).stat().st_ino == (root / "2" / TABLES).stat().st_ino
    for name, value in hstu_export.load(root)(request).items():
        assert torch.equal(value, new[name])


@pytest.mark.parametrize(("tamper", "message"), [
    (lambda p: rewrite_tables_header(p, lambda h: h[next(k for k in h if k.endswith("item.weight"))].update(
        shape=[999, 32])), "has shape [999, 32], the manifest says [1000, 32] (the shape its program was compiled for)"),
    (lambda p: rewrite_manifest(p, lambda m: m["artifacts"]["sparse"].pop("constants")),
     "manifest field artifacts.sparse.constants: missing"),
    (lambda p: rewrite_manifest(p, lambda m: m["artifacts"]["sparse"]["constants"]["tensors"].pop()),
     "which the manifest does not list"),
    (lambda p: rewrite_manifest(p, lambda m: m["artifacts"]["sparse"]["constants"].update(file="dense/dense.pt2")),
     "dense/dense.pt2 is also backend.files.dense"),
])
def test_a_package_with_tampered_tables_is_refused(dense_update, tmp_path, tamper, message) -> None:
    package = tmp_path / "pkg"
    shutil.copytree(dense_update[0], package)
    tamper(package)
    with pytest.raises(PackageError) as info:
        hstu_export.load(package)
    assert message in str(info.value), str(info.value)


def test_tables_device_is_refused_where_it_cannot_apply(dense_update, tiny_serving_package, tmp_path, capsys) -> None:
    from hstu_export.cli import main
    from hstu_export.errors import ConfigError

    first = dense_update[0]
    request = dense_update[2]
    on_host = hstu_export.load(first, tables_device="cpu")  # a CPU package: its tables are on the host already
    for name, value in on_host(request).items():
        assert torch.equal(value, hstu_export.load(first)(request)[name])
    with pytest.raises(ConfigError, match="is a cpu package: its tables cannot live on cuda"):
        hstu_export.load(first, tables_device="cuda")
    with pytest.raises(ConfigError, match="tables device 'gpu': expected cpu or cuda"):
        hstu_export.load(first, tables_device="gpu")
    with pytest.raises(ConfigError, match="keeps its tables inside its programs: only a package of format 5"):
        hstu_export.load(tiny_serving_package, tables_device="cpu")
    from hstu_export.package.tensor_dir import save_tensors

    folder = save_tensors(request, tmp_path / "request")
    assert main(["run", str(tiny_serving_package), "--batch", str(folder), "--tables-device", "cpu"]) == 2
    assert "keeps its tables inside its programs" in capsys.readouterr().err


def test_tables_device_reaches_every_way_of_serving(dense_update, tiny_serving_package, tmp_path,
                                                    monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """PublishedPredictor, ReplicaSet and the Triton repository pass tables_device on to each load: "cpu" serves
    this CPU package as it is, "cuda" is refused by the load itself."""
    from triton_stand_in import StandInTensor, initialized_model

    from hstu_export.errors import ConfigError
    from hstu_export.serving.published import PublishedPredictor
    from hstu_export.serving.replicas import ReplicaSet
    from hstu_export.serving.triton_repo import ServingRepoSettings, write_serving_repo

    first, _, request, _ = dense_update
    expected = hstu_export.load(first)(request)
    root = tmp_path / "ranker"
    publish(first, root)
    served = PublishedPredictor(root, tables_device="cpu")
    assert all(torch.equal(value, expected[name]) for name, value in served(request).items())
    with pytest.raises(ConfigError, match="is a cpu package: its tables cannot live on cuda"):
        PublishedPredictor(root, tables_device="cuda")
    with pytest.raises(ConfigError, match="a loader or a tables device, not both"):
        PublishedPredictor(root, loader=hstu_export.load, tables_device="cpu")
    with ReplicaSet(first, ["cpu"], tables_device="cpu") as replicas:
        answer = replicas.submit(request).result(timeout=120)
    assert all(torch.equal(value, expected[name]) for name, value in answer.items())
    with pytest.raises(ConfigError, match="is a cpu package: its tables cannot live on cuda"):
        ReplicaSet(first, ["cpu"], tables_device="cuda")
    # The repository refuses what the load would, and its instances load with the parameter it writes.
    with pytest.raises(ConfigError, match="is a cpu package: its tables cannot live on cuda"):
        write_serving_repo(first, tmp_path / "repo", ServingRepoSettings(tables_device="cuda"))
    with pytest.raises(ConfigError, match="keeps its tables inside its programs"):
        write_serving_repo(tiny_serving_package, tmp_path / "repo", ServingRepoSettings(tables_device="cpu"))
    model_dir = write_serving_repo(first, tmp_path / "repo", ServingRepoSettings(tables_device="cpu"))
    config = (model_dir / "config.pbtxt").read_text()
    assert 'key: "tables_device" value: { string_value: "cpu" }' in config
    model = initialized_model(model_dir, monkeypatch)
    [response] = model.execute([{n: StandInTensor(n, t.unsqueeze(0)) for n, t in request.items()}])
    assert response.error is None
    got = {t.name(): t.value[0] for t in response.output_tensors}
    assert all(torch.equal(got[name], value) for name, value in expected.items())
    (model_dir / "config.pbtxt").write_text(config.replace('string_value: "cpu"', 'string_value: "cuda"'))
    with pytest.raises(ConfigError, match="is a cpu package: its tables cannot live on cuda"):
        initialized_model(model_dir, monkeypatch)
