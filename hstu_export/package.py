"""Package directories: atomic writing, the manifest, checksums.

A package is built in a hidden temporary directory beside the target, every file fsynced, then renamed
into place, so a reader never sees half a package and an export killed midway leaves none. An existing
target is only replaced with ``force`` (the old one is moved aside first and removed after the rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hstu_export import __version__
from hstu_export.errors import PackageError

PACKAGE_FORMAT = "hstu-export-package"
PACKAGE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def library_versions() -> dict[str, str | None]:
    """Versions recorded in (and checked against) a manifest."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    fbgemm = version("fbgemm-gpu") or version("fbgemm-gpu-cpu")
    return {
        "hstu_export": __version__,
        "torch": torch.__version__,
        "triton": version("triton"),
        "torchrec": version("torchrec"),
        "fbgemm_gpu": fbgemm,
        "python": platform.python_version(),
    }


def device_info(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"type": "cuda", "name": torch.cuda.get_device_name(index), "arch": f"sm_{major}{minor}",
                "cuda": torch.version.cuda}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "arch": platform.machine()}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` except the manifest, by POSIX relative path."""
    return {p.relative_to(root).as_posix(): sha256_file(p)
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def check_target(target: Path, force: bool) -> None:
    """Fails early (before any work) when the target exists and may not be replaced."""
    if target.exists() and not force:
        raise PackageError(f"{target} already exists; choose another --out or pass --force to replace it")
    if target.exists() and not target.is_dir():
        raise PackageError(f"{target} exists and is not a directory; remove it or choose another --out")
    if not target.parent.exists():
        raise PackageError(f"parent directory {target.parent} does not exist")


@contextlib.contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """A hidden temporary directory beside ``target`` (same filesystem, so the final rename is atomic),
    removed on any failure."""
    remove_stale_partials(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_partials(target: Path) -> list[Path]:
    """Deletes staging directories of earlier exports to ``target`` whose process is gone (killed)."""
    removed = []
    for path in target.parent.glob(f".{target.name}.partial-*"):
        pid_text = path.name[len(f".{target.name}.partial-"):].split("-", 1)[0]
        if not pid_text.isdigit() or _process_alive(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_manifest(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    manifest = dict(manifest, format=PACKAGE_FORMAT, format_version=PACKAGE_FORMAT_VERSION, files=checksums(root))
    text = json.dumps(manifest, indent=2, sort_keys=False, default=str)
    (root / MANIFEST).write_text(text + "\n")
    return manifest


def commit(staged: Path, target: Path, force: bool) -> None:
    """fsync everything in ``staged``, then rename it to ``target`` (replacing it only with ``force``)."""
    for path in sorted(staged.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(staged)
    old: Path | None = None
    if target.exists():
        if not force:
            raise PackageError(f"{target} appeared during the export; not replacing it without --force")
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    try:
        os.rename(staged, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(root: Path, verify_checksums: bool = True) -> dict[str, Any]:
    root = Path(root)
    if not root.is_dir():
        raise PackageError(f"{root}: not a package directory (no such directory)")
    path = root / MANIFEST
    if not path.is_file():
        raise PackageError(f"{root} is not an hstu-export package: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PackageError(f"{path} is corrupt: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != PACKAGE_FORMAT:
        raise PackageError(f"{path} is not an hstu-export manifest")
    if manifest.get("format_version", 0) > PACKAGE_FORMAT_VERSION:
        raise PackageError(
            f"{root} has package format {manifest.get('format_version')}; this hstu-export ({__version__}) reads "
            f"up to {PACKAGE_FORMAT_VERSION}: upgrade hstu-export"
        )
    if verify_checksums:
        expected: dict[str, str] = manifest.get("files", {})
        actual = checksums(root)
        for name, digest in expected.items():
            if name not in actual:
                raise PackageError(f"{root}: file {name} listed in the manifest is missing")
            if actual[name] != digest:
                raise PackageError(f"{root}: checksum mismatch for {name} (the file is corrupt or was modified)")
        extra = sorted(set(actual) - set(expected))
        if extra:
            raise PackageError(f"{root}: files not in the manifest: {extra[:5]}")
    return manifest
