"""hstu-export publish (hstu_export/package/publish.py) and PublishedPredictor (hstu_export/serving/published.py):
versions switched atomically, unchanged files linked, old versions removed, rollbacks, clear refusals, and a
server that follows the current version under concurrent requests without a failed or mixed answer."""

from __future__ import annotations

import errno
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_packages import export_tiny

import hstu_export
from hstu_export.cli import main
from hstu_export.errors import ConfigError, ExportError, PackageError
from hstu_export.package.publish import CURRENT, current_version, publish, switch, versions
from hstu_export.serving.published import PublishedPredictor


@pytest.fixture(scope="module")
def packages(tiny_serving_package, tiny_serving_package_v2, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Two versions of one model (other weights, same requests) and one that takes smaller batches."""
    smaller = export_tiny(tmp_path_factory.mktemp("publish"), seed=5, max_batch=2)
    return Path(tiny_serving_package), Path(tiny_serving_package_v2), smaller


def _answer(path: Path, request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return hstu_export.load(path)(request)


def test_publish_switches_links_and_prunes(packages, tmp_path) -> None:  # type: ignore[no-untyped-def]
    first, second, _ = packages
    root = tmp_path / "ranker"
    request = hstu_export.generate_batch(hstu_export.load(first).input_schema, 2, seed=11)
    one = publish(first, root)
    assert (one.version, one.linked, current_version(root)) == (1, [], 1)
    again = publish(root / "1", tmp_path / "other")  # a published version is itself a package
    assert again.version == 1
    two = publish(first, root)  # the same files: all linked, nothing of the package copied but its manifest
    assert two.version == 2 and two.linked and set(two.copied) <= {"manifest.json", "manifest.sha256"}
    for name in two.linked:
        assert (root / "1" / name).stat().st_ino == (root / "2" / name).stat().st_ino
    three = publish(second, root, keep=2)
    assert (three.version, three.removed, versions(root), current_version(root)) == (3, [1], [2, 3], 3)
    assert (root / CURRENT).is_symlink() and not list(root.glob(".staging-*"))
    old, new = _answer(first, request), _answer(second, request)
    for name, value in _answer(root, request).items():  # load(ROOT) loads the current version
        assert torch.equal(value, new[name])
    assert switch(root, 2) == root / "2"
    for name, value in _answer(root, request).items():
        assert torch.equal(value, old[name])
        assert not torch.equal(value, new[name])


def test_refusals_leave_nothing_behind(packages, tmp_path) -> None:  # type: ignore[no-untyped-def]
    first, _, _ = packages
    root = tmp_path / "ranker"
    publish(first, root)
    damaged = tmp_path / "damaged"
    shutil.copytree(first, damaged)
    artifact = next(p for p in damaged.rglob("*.ts"))
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="checksum|sha256"):
        publish(damaged, root)
    with pytest.raises(PackageError, match="not a package"):
        publish(tmp_path, root)
    with pytest.raises(ConfigError, match="is a package"):
        publish(first, damaged)
    with pytest.raises(ConfigError, match="inside"):
        publish(root / "1", root)
    with pytest.raises(ConfigError, match="no version 9"):
        switch(root, 9)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        publish(first, tmp_path / "a-file")
    (root / "7").symlink_to(first)  # a version that is a link is not one of ours
    assert versions(root) == [1]
    (root / "current").unlink()
    (root / "current").symlink_to("7")
    with pytest.raises(PackageError, match="not at a published version"):
        hstu_export.load(root)
    (root / "7").unlink()
    switch(root, 1)
    with pytest.raises(ConfigError, match="keep"):
        publish(first, root, keep=0)
    assert versions(root) == [1] and current_version(root) == 1 and not list(root.glob(".staging-*"))


def test_a_full_disk_fails_in_one_line_and_leaves_nothing(packages, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    first, second, _ = packages
    root = tmp_path / "ranker"
    publish(first, root)

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shutil, "copy2", full)
    with pytest.raises(ExportError, match="publishing failed: .*space"):
        publish(second, root)
    assert versions(root) == [1] and current_version(root) == 1 and not list(root.glob(".staging-*"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackageError, match="no published versions"):
        PublishedPredictor(tmp_path / "empty")


def test_cli(packages, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    first, second, _ = packages
    root = tmp_path / "ranker"
    assert main(["publish", str(first), "--to", str(root)]) == 0
    assert main(["publish", str(second), "--to", str(root), "--keep", "1"]) == 0
    out = capsys.readouterr().out
    assert f"as {root / '2'} (current)" in out and "removed version(s) 1" in out
    assert main(["publish", "--to", str(root), "--switch", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "no version 1" in err and len(err.splitlines()) == 1
    assert main(["publish", str(first), "--to", str(root), "--switch", "2"]) == 2
    assert main(["publish", "--to", str(root)]) == 2
    assert current_version(root) == 2


def test_a_server_follows_current_without_failed_or_mixed_answers(packages, tmp_path) -> None:  # type: ignore[no-untyped-def]
    first, second, smaller = packages
    root = tmp_path / "ranker"
    publish(first, root)
    served = PublishedPredictor(root, check_seconds=0.0)
    request = hstu_export.generate_batch(served.input_schema, 2, seed=12)
    old, new = _answer(first, request), _answer(second, request)
    seen: list[list[int]] = []  # per client, the version of each answer in order
    failures: list[BaseException] = []
    stop = threading.Event()

    def client() -> None:
        mine: list[int] = []
        seen.append(mine)
        while not stop.is_set():
            try:
                answer = served(request)
            except BaseException as exc:  # counted: there must be none
                failures.append(exc)
                continue
            if all(torch.equal(answer[k], old[k]) for k in old):
                mine.append(1)
            elif all(torch.equal(answer[k], new[k]) for k in new):
                mine.append(2)
            else:
                failures.append(AssertionError("an answer of neither version"))

    clients = [threading.Thread(target=client) for _ in range(3)]
    for thread in clients:
        thread.start()
    time.sleep(0.3)
    publish(second, root)
    deadline = time.monotonic() + 60
    while served.version != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    stop.set()
    for thread in clients:
        thread.join()
    assert not failures, failures[:3]
    assert served.version == 2 and served.switches == 1
    for mine in seen:  # each client: the old version, then the new one, never back
        assert mine and mine[0] == 1 and mine[-1] == 2 and mine == sorted(mine), mine
    publish(smaller, root)  # takes other batch sizes: not switched to, and said why
    assert served.refresh() == 2
    assert "maximum batch size" in (served.last_error or "")
    assert current_version(root) == 3 and served.version == 2
