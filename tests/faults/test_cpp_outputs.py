"""Fault campaign, issue 37 item 5: ``hstu-export-run --out`` on a full disk leaves nothing behind.

Before, each output file was written to ``<file>.partial`` and renamed at once: a full disk left the
``.partial`` file (and the outputs written before it) in the directory. Now a directory's files are all
written before any is renamed, and on failure the partial files and the directories the run created are
removed: one error line, exit 1, the directory as it was.

What is real and what is set up:
- real: writes failing with ENOSPC from ``/dev/full`` (a leftover ``<file>.partial`` link to it in an
  existing ``--out``: the runtime's own write hits the full device); a 1 MiB tmpfs filled to the last byte;
  a tmpfs with room for a fixed number of files (``nr_inodes``), so that a run of two requests fills it in the
  second output directory, after the first was written whole. The tmpfs cases need root and ``mount``
  (skipped otherwise, as in test_disk_and_bundles.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kv_requests import CONFIGS, Users

from hstu_export.package.tensor_dir import file_name, save_tensors

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)]


def _request_dir(directory: Path) -> Path:
    users = Users(CONFIGS["no-context"], seed=5)
    users.grow("a", 6)
    users.grow("b", 2)
    return save_tensors(users.request(["a", "b"], [3, 1]), directory)


def _outputs(root: Path) -> list[str]:
    return json.loads((root / "manifest.json").read_text())["output_names"]


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr.startswith("hstu-export-run: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "internal error" not in done.stderr
    return done.stderr


@pytest.fixture
def small_tmpfs(tmp_path) -> Iterator[Callable[..., Path]]:
    """``mount(**options)``: a real tmpfs with those mount options (size, nr_inodes), unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(**options: object) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        spec = ",".join(f"{key}={value}" for key, value in options.items())
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", spec, "tmpfs", str(point)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in mounted:
            subprocess.run(["umount", str(point)], check=False)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_device_leaves_no_partial_file_and_overwrites_nothing(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The last output's partial file is a link to /dev/full: the first output's file was written, the last
    one's write fails. Neither partial file stays, and the earlier output already in ``--out`` is not replaced."""
    _, root, _ = kv_package
    names = _outputs(root)
    assert len(names) >= 2
    out = tmp_path / "out"
    out.mkdir()
    earlier = out / file_name(names[0])
    earlier.write_bytes(b"an earlier run's output")
    (out / (file_name(names[-1]) + ".partial")).symlink_to("/dev/full")
    done = cpp_runtime.run(root, _request_dir(tmp_path / "request"), "--out", out, "-q")
    line = _one_error_line(done)
    assert f"cannot write the outputs to {out}: {file_name(names[-1])}.partial: No space left on device" in line
    assert "nothing was written" in line
    assert sorted(p.name for p in out.iterdir()) == [earlier.name]
    assert earlier.read_bytes() == b"an earlier run's output"
    # The same directory, once writable, takes the outputs whole.
    done = cpp_runtime.run(root, _request_dir(tmp_path / "request"), "--out", out, "-q")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(file_name(n) for n in names)


def test_a_full_file_system_leaves_nothing(cpp_runtime, kv_package, tmp_path, small_tmpfs) -> None:  # type: ignore[no-untyped-def]
    """A 1 MiB tmpfs filled to its last byte: the new ``--out`` directory is removed with its partial file."""
    _, root, _ = kv_package
    disk = small_tmpfs(size="1m")
    with open(disk / "filler", "wb", buffering=0) as filler:
        for size in (2**16, 2**10, 1):
            try:
                while True:
                    filler.write(b"\0" * size)
            except OSError:
                pass
    assert shutil.disk_usage(disk).free == 0
    done = cpp_runtime.run(root, _request_dir(tmp_path / "request"), "--out", disk / "out" / "run", "-q")
    assert "No space left on device" in _one_error_line(done)
    assert [p.name for p in disk.iterdir()] == ["filler"]


@pytest.mark.parametrize("room", [0, 1], ids=["first-file", "second-file"])
def test_a_disk_full_in_the_second_request_removes_the_first(cpp_runtime, kv_package, tmp_path, small_tmpfs,
                                                             room) -> None:  # type: ignore[no-untyped-def]
    """Two requests through the KV cache write ``--out``/1 and ``--out``/2. The tmpfs has inodes for its root,
    ``out``, ``out/1`` with its files and ``out/2`` (and ``room`` files more): the second directory's first
    (or second) file cannot be created. The first directory, written whole, goes too: ``--out`` was this run's."""
    _, root, _ = kv_package
    outputs = len(_outputs(root))
    disk = small_tmpfs(size="1m", nr_inodes=1 + 1 + 1 + outputs + 1 + room)
    request = _request_dir(tmp_path / "request")
    done = cpp_runtime.run(root, request, request, "--kv-cache", "auto", "--user-ids", "1,2", "--user-ids", "1,2",
                           "--out", disk / "out", "-q")
    line = _one_error_line(done)
    assert f"cannot write the outputs to {disk / 'out' / '2'}" in line and "No space left on device" in line
    assert list(disk.iterdir()) == []
    # With the room, the same run writes both.
    more = small_tmpfs(size="1m", nr_inodes=1 + 1 + 2 * (1 + outputs))
    done = cpp_runtime.run(root, request, request, "--kv-cache", "auto", "--user-ids", "1,2", "--user-ids", "1,2",
                           "--out", more / "out", "-q")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (more / "out" / "2").iterdir()) == sorted(file_name(n) for n in _outputs(root))
