"""``--force`` replaces only our own packages, and a replace killed midway is put right later.

The refusals happen before any work (no model is loaded); the tests that export (marked slow) use the
TorchScript backend, the quickest to compile."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import hstu_export
from hstu_export import ExportSettings, VerifySettings
from hstu_export.cli import main as cli_main
from hstu_export.errors import PackageError
from hstu_export.package.directory import (
    MANIFEST,
    PACKAGE_FORMAT,
    check_target,
    commit,
    recover_interrupted_replace,
    remove_stale_partials,
)

QUICK = ["--backend", "torchscript", "--max-batch-size", "2", "--verify-batches", "0", "-q"]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fake_package(root: Path) -> Path:
    """A directory that passes for one of our packages (a manifest of our format), with one file,
    notes.txt, that its manifest lists (a file it did not list would stop ``--force`` by itself)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "notes.txt").write_text("keep me")
    files = {"notes.txt": hashlib.sha256(b"keep me").hexdigest()}
    (root / MANIFEST).write_text(json.dumps({"format": PACKAGE_FORMAT, "format_version": 1, "files": files}))
    return root


# ----------------------------------------------------------------------------------- refusals (CLI)


@pytest.mark.slow
def test_force_refuses_a_user_directory(bundle, tmp_path, capsys):
    userdir = tmp_path / "userdir"
    (userdir / "sub").mkdir(parents=True)
    (userdir / "thesis.tex").write_text("years of work")
    (userdir / "sub" / "data.csv").write_text("1,2,3")
    before = _files(userdir)
    assert cli_main([str(bundle), "--out", str(userdir), "--force", *QUICK]) == 2
    err = capsys.readouterr().err
    assert "is not an hstu-export package" in err and "--force only replaces packages" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3  # one message (rich may wrap it)
    assert _files(userdir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["userdir"]  # nothing staged beside it


@pytest.mark.slow
def test_force_refuses_the_directory_holding_the_model(bundle, tmp_path):
    modeldir = tmp_path / "modeldir"
    modeldir.mkdir()
    model = modeldir / "model.pt"
    shutil.copy(bundle, model)
    before = model.read_bytes()
    assert cli_main([str(model), "--out", str(modeldir), "--force", *QUICK]) == 2
    assert model.read_bytes() == before
    assert sorted(p.name for p in modeldir.iterdir()) == ["model.pt"]


@pytest.mark.slow
def test_force_refuses_a_package_holding_the_model(bundle, package, tmp_path, capsys):
    """Even one of our packages is kept when the model being exported lies inside it (checked when the
    new package is renamed in, from the bundle path its manifest records)."""
    pkg = tmp_path / "pkg"
    shutil.copytree(package, pkg)
    model = pkg / "model.pt"
    shutil.copy(bundle, model)
    before = _files(pkg)
    assert cli_main([str(model), "--out", str(pkg), "--force", *QUICK]) == 2
    assert "contains the input" in capsys.readouterr().err
    assert _files(pkg) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


@pytest.mark.slow
def test_force_refuses_the_current_directory(bundle, tmp_path, monkeypatch, capsys):
    here = _fake_package(tmp_path / "here")  # even one that looks like a package
    monkeypatch.chdir(here)
    before = _files(here)
    assert cli_main([str(bundle), "--out", ".", "--force", *QUICK]) == 2
    assert "is the current directory" in capsys.readouterr().err
    assert _files(here) == before
    assert cli_main([str(bundle), "--out", "..", "--force", *QUICK]) == 2
    assert "contains the current directory" in capsys.readouterr().err
    assert _files(here) == before


# ------------------------------------------------------------------------------ refusals (check_target)


def test_check_target_refuses_home_root_and_ancestors(tmp_path, monkeypatch):
    home = _fake_package(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(PackageError, match="is your home directory"):
        check_target(home, force=True)
    with pytest.raises(PackageError, match="filesystem root"):
        check_target(Path("/"), force=True)
    work = _fake_package(tmp_path / "work")
    inner = _fake_package(work / "inner")
    monkeypatch.chdir(inner)
    with pytest.raises(PackageError, match="contains the current directory"):
        check_target(work, force=True)
    with pytest.raises(PackageError, match="is the current directory"):
        check_target(Path("."), force=True)
    assert (home / "notes.txt").exists() and (inner / "notes.txt").exists()


def test_check_target_refuses_a_package_holding_a_protected_input(tmp_path):
    pkg = _fake_package(tmp_path / "pkg")
    (pkg / "model.pt").write_bytes(b"weights")
    with pytest.raises(PackageError, match=r"contains the input .*model\.pt"):
        check_target(pkg, force=True, protect=[pkg / "model.pt"])
    # An ancestor of the input, reached through a relative path.
    nested = _fake_package(tmp_path / "outer") / "deep"
    nested.mkdir()
    (nested / "m.pt").write_bytes(b"weights")
    with pytest.raises(PackageError, match="contains the input"):
        check_target(tmp_path / "outer", force=True, protect=[None, tmp_path / "outer" / "deep" / ".." / "deep" / "m.pt"])
    # Protecting an unrelated path does not stop the replace of a package.
    check_target(_fake_package(tmp_path / "pkg3"), force=True, protect=[tmp_path / "elsewhere.pt"])


def test_check_target_refuses_files_symlinks_and_foreign_manifests(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(PackageError, match="not a directory"):
        check_target(tmp_path / "file", force=True)
    pkg = _fake_package(tmp_path / "pkg")
    (tmp_path / "link").symlink_to(pkg)
    with pytest.raises(PackageError, match="symbolic link"):
        check_target(tmp_path / "link", force=True)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / MANIFEST).write_text(json.dumps({"format": "someone-elses", "files": {}}))
    with pytest.raises(PackageError, match="not an hstu-export package"):
        check_target(foreign, force=True)
    (foreign / MANIFEST).write_text("{not json")
    with pytest.raises(PackageError, match="not an hstu-export package"):
        check_target(foreign, force=True)
    check_target(pkg, force=True)  # ours: allowed
    check_target(tmp_path / "new", force=True)  # absent: allowed


def test_commit_rechecks_what_it_replaces(tmp_path):
    target = _fake_package(tmp_path / "pkg")
    check_target(target, force=True)
    # During the export, the package is swapped for a user's directory.
    shutil.rmtree(target)
    target.mkdir()
    (target / "mine.txt").write_text("mine")
    staged = tmp_path / ".pkg.partial-1"
    staged.mkdir()
    (staged / "a.bin").write_bytes(b"new")
    with pytest.raises(PackageError, match="not an hstu-export package"):
        commit(staged, target, force=True)
    assert _files(target) == {"mine.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pkg.partial-1", "pkg"]
    with pytest.raises(PackageError, match="contains the input"):
        commit(staged, _fake_package(tmp_path / "pkg2"), force=True, protect=[tmp_path / "pkg2" / "notes.txt"])


# ------------------------------------------------------------------------------- replacing a package


@pytest.mark.slow
def test_force_replaces_an_existing_package(bundle, package, tmp_path):
    target = tmp_path / "pkg"
    shutil.copytree(package, target)
    old_created = json.loads((target / MANIFEST).read_text())["created"]
    assert cli_main([str(bundle), "--out", str(target), "--force", *QUICK[:2], "--max-batch-size", "3",
                     "--verify-batches", "0", "-q"]) == 0
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["ranges"]["max_batch_size"] == 3 and manifest["format"] == PACKAGE_FORMAT
    assert manifest["created"] >= old_created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]  # no .pkg.old-* or .partial-* left
    assert hstu_export.load(target).max_batch_size == 3


# ------------------------------------------------------------------------ a replace killed midway


@pytest.mark.slow
def test_load_restores_a_package_moved_aside_by_a_killed_export(package, tmp_path, dead_pid):
    target = tmp_path / "pkg"
    shutil.copytree(package, tmp_path / f".pkg.old-{dead_pid}")  # killed between the two renames
    predictor = hstu_export.load(target)
    assert predictor.max_batch_size == 2
    assert _files(target) == _files(package)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


@pytest.mark.slow
def test_next_export_removes_a_leftover_when_the_target_exists(bundle, package, tmp_path, dead_pid):
    target = tmp_path / "pkg"
    shutil.copytree(package, target)
    shutil.copytree(package, tmp_path / f".pkg.old-{dead_pid}")  # killed after the second rename
    (tmp_path / f".pkg.old-{dead_pid}" / MANIFEST).unlink()  # ... and midway through deleting it
    settings = ExportSettings(backend="torchscript", max_batch_size=3, force=True,
                              verify=VerifySettings(num_random_batches=0))
    hstu_export.export(bundle, target, settings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]
    assert hstu_export.load(target).max_batch_size == 3


def test_stale_partials_sweep_restores_or_removes(tmp_path, dead_pid):
    target = tmp_path / "pkg"
    leftover = _fake_package(tmp_path / f".pkg.old-{dead_pid}-1a2b")
    package = _files(leftover)
    remove_stale_partials(target)  # what staging_dir does first: the target was missing, so restored
    assert _files(target) == package and not leftover.exists()
    _fake_package(leftover)
    remove_stale_partials(target)  # the target is there: the leftover is deleted
    assert _files(target) == package and not leftover.exists()


def test_leftover_of_a_live_process_is_left_alone(tmp_path):
    target = tmp_path / "pkg"
    live = _fake_package(tmp_path / f".pkg.old-{os.getpid()}")  # a replace still in progress
    assert recover_interrupted_replace(target) == []
    assert live.exists() and not target.exists()
    with pytest.raises(PackageError, match="no such directory"):
        hstu_export.load(target)
    assert live.exists()
    # Names that only look alike (another package's leftovers) are not touched either.
    other = tmp_path / ".pkg.old-x.old-1"
    other.mkdir()
    assert recover_interrupted_replace(target) == [] and other.exists()
