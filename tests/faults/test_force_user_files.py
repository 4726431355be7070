"""Fault campaign, issue 37 item 4: ``--force`` replaces a package only while the package directory holds
nothing but the files its manifest lists (and our checksum and signature): a file a user kept in it stops
the replace, with one line naming the file, and nothing is deleted. Checked before the export
(``check_target``) and again when the new package is renamed in (``commit``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import hstu_export
from hstu_export.cli import main as cli_main
from hstu_export.errors import PackageError
from hstu_export.package.directory import check_target, commit, unlisted_files

pytestmark = pytest.mark.slow  # the conftest's exported package

QUICK = ["--backend", "torchscript", "--max-batch-size", "3", "--verify-batches", "0", "-q"]


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def pkg(package, tmp_path) -> Path:
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    return copy


@pytest.mark.parametrize("kept", ["notes.txt", "model/my-weights.bin"])
def test_force_refuses_a_package_holding_a_users_file(kept, bundle, pkg, tmp_path, cli_streams):
    (pkg / kept).write_text("the user's own")
    before = files(pkg)
    assert cli_main([str(bundle), "--out", str(pkg), "--force", *QUICK]) == 2
    line = cli_streams.error_line()
    assert f"--out {pkg} holds {kept}, which its manifest does not list" in line
    assert "--force will not delete it: move it out of the package, or choose another --out" in line
    assert files(pkg) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]  # refused before anything was staged


def test_the_line_counts_further_files_and_links(pkg, tmp_path):
    (pkg / "a.txt").write_text("a")
    (pkg / "model" / "b.txt").write_text("b")
    (tmp_path / "elsewhere").mkdir()
    (pkg / "link").symlink_to(tmp_path / "elsewhere")  # a link to a directory is not walked into, but counted
    assert unlisted_files(pkg) == ["a.txt", "link", "model/b.txt"]
    with pytest.raises(PackageError, match=r"holds a\.txt \(and 2 more\), which its manifest does not list"):
        check_target(pkg, force=True)


def test_what_we_write_does_not_stop_the_replace(pkg):
    """The manifest's files, its checksum, a signature and empty directories are ours or hold nothing."""
    assert unlisted_files(pkg) == []
    (pkg / "package.sig").write_text("{}")
    (pkg / "empty").mkdir()
    assert unlisted_files(pkg) == []
    check_target(pkg, force=True)
    (pkg / "model" / "package.sig").write_text("{}")  # only the top-level signature is ours
    assert unlisted_files(pkg) == ["model/package.sig"]


def test_commit_refuses_a_file_kept_during_the_export(pkg, tmp_path):
    check_target(pkg, force=True)
    (pkg / "notes.txt").write_text("written while the export ran")
    before = files(pkg)
    staged = tmp_path / ".pkg.partial-1"
    staged.mkdir()
    (staged / "a.bin").write_bytes(b"new")
    with pytest.raises(PackageError, match="holds notes.txt, which its manifest does not list"):
        commit(staged, pkg, force=True)
    assert files(pkg) == before


def test_force_still_replaces_a_package_of_our_files(bundle, pkg, tmp_path):
    (pkg / "package.sig").write_text("{}")  # a signed package: the signature is ours
    assert cli_main([str(bundle), "--out", str(pkg), "--force", *QUICK]) == 0
    assert hstu_export.load(pkg).max_batch_size == 3
    assert not (pkg / "package.sig").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]
