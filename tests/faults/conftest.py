"""Shared fixtures of the fault tests: the tiny model's bundle and a package of it, saved once per module;
disks that are read-only or full, for real (a tmpfs, with root) or simulated."""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch, save_bundle
from hstu_export.models import build_preset


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def bundle(workdir):
    model = build_preset("tiny", seed=1)
    return save_bundle(model, workdir / "tiny.pt", generate_batch(model.input_schema(), 4, seed=2))


@pytest.fixture(scope="module")
def package(workdir, bundle):
    """A real package (TorchScript, the quickest backend to compile; at most 2 users), exported once; tests
    that change it copy it."""
    settings = ExportSettings(backend="torchscript", max_batch_size=2, verify=VerifySettings(num_random_batches=0))
    return hstu_export.export(bundle, workdir / "pkg-torchscript", settings).path


@pytest.fixture
def dead_pid() -> int:
    """The id of a process that has exited (and been reaped), so nothing runs under it."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


class CliStreams:
    """What the CLI printed, read through pytest's ``capsys``."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.stdout = ""

    def error_line(self) -> str:
        """The one line on stderr since the last read, after checking that there is exactly one and that it
        is an ``error:`` line (no traceback, no 'internal error'); stdout is kept in ``stdout``."""
        captured = self.capsys.readouterr()
        self.stdout = captured.out
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert lines[0].startswith("error:") and "internal error" not in lines[0], lines[0]
        return lines[0]


@pytest.fixture
def cli_streams(capsys) -> CliStreams:
    return CliStreams(capsys)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (root and mount needed; skipped otherwise)."""
    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False)


@pytest.fixture
def fill_up() -> Callable[[Path], None]:
    """``fill_up(directory)`` fills the file system holding ``directory`` (a small tmpfs) with one file, to
    the last byte."""

    def fill(directory: Path) -> None:
        with open(directory / "filler", "wb", buffering=0) as f:
            for size in (2**16, 2**10, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
        assert shutil.disk_usage(directory).free == 0

    return fill


@pytest.fixture
def simulated_read_only(monkeypatch) -> Callable[[Path], None]:
    """``mark(directory)``: ``os.statvfs`` reports ``directory`` as on a read-only mount (what a real one
    reports; writes are not stopped, so a test also sees any write that was not refused first)."""
    marked: set[Path] = set()
    real = os.statvfs

    def statvfs(path):
        result = real(path)
        if Path(path) in marked:
            return os.statvfs_result((*result[:8], result.f_flag | os.ST_RDONLY, *result[9:]))
        return result

    monkeypatch.setattr(os, "statvfs", statvfs)
    return lambda directory: marked.add(Path(directory))


@pytest.fixture
def simulated_full_disk(monkeypatch) -> Iterator[Callable[[Path], None]]:
    """``fill(directory)``: from then on, opening a file under ``directory`` for writing creates it and then
    fails with ENOSPC, as a disk does that fills while the file is written (``open`` and ``io.open``, which
    ``pathlib``, ``os.fdopen`` and ``shutil.copyfile`` use)."""
    full: list[Path] = []
    real_open = io.open

    def under_full_directory(file) -> Path | None:
        if isinstance(file, int):  # os.fdopen(fd) of a file made by tempfile.mkstemp
            path = Path(os.readlink(f"/proc/self/fd/{file}"))
        else:
            path = Path(os.path.abspath(os.fspath(file)))
        return path if any(path.is_relative_to(d) for d in full) else None

    def fake_open(file, mode="r", *args, **kwargs):
        path = under_full_directory(file) if isinstance(file, (int, str, bytes, os.PathLike)) else None
        if path is None or not any(c in mode for c in "wax+"):
            return real_open(file, mode, *args, **kwargs)
        if isinstance(file, int):
            os.close(file)
        else:
            real_open(file, "wb").close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr("builtins.open", fake_open)
    yield lambda directory: full.append(Path(os.path.abspath(directory)))
