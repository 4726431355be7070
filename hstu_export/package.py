"""Package directories: atomic writing, the manifest, checksums.

A package is built in a hidden temporary directory beside the target, every file fsynced, then renamed
into place, so a reader never sees half a package and an export killed midway leaves none. An existing
target is only replaced with ``force``, and only when it is one of our packages (never a user's directory,
the input, the working directory or one of their ancestors). The old package is moved aside to
``.NAME.old-PID-*`` first and removed after the rename; if the process is killed in between, the next
export to that path or the next ``load()`` of it puts things right (``recover_interrupted_replace``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hstu_export import __version__
from hstu_export.errors import PackageError

PACKAGE_FORMAT = "hstu-export-package"
# 2: ops in the hstu_export:: namespace (1: hstu::), input schema with arguments, graph-input names.
PACKAGE_FORMAT_VERSION = 2
OP_NAMESPACE = "hstu_export"
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


def check_target(target: Path, force: bool, protect: Iterable[str | Path | None] = ()) -> None:
    """Fails early (before any work) when the target exists and may not be replaced.

    ``protect`` lists the export's inputs (the model bundle): a target holding one is never replaced.
    A replace that an earlier, killed export left half done is put right first."""
    target = Path(target)
    recover_interrupted_replace(target)
    if target.is_symlink():
        raise PackageError(f"{target} is a symbolic link; pass the directory it points to or choose another --out")
    if target.exists() and not force:
        raise PackageError(f"{target} already exists; choose another --out or pass --force to replace it")
    if target.exists() and not target.is_dir():
        raise PackageError(f"{target} exists and is not a directory; remove it or choose another --out")
    if target.exists():
        check_replaceable(target, protect)
    if not target.parent.exists():
        raise PackageError(f"parent directory {target.parent} does not exist")


def check_replaceable(target: Path, protect: Iterable[str | Path | None] = ()) -> None:
    """Raises PackageError unless ``target`` is a directory ``--force`` may delete: one of our packages
    that is not the working directory, the home directory, the filesystem root, nor holds an input."""
    resolved = Path(target).resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd:
        raise PackageError(f"--out {target} is the current directory; --force will not delete it: "
                           "choose a new directory for the package")
    if resolved.parent == resolved:
        raise PackageError(f"--out {target} is the filesystem root; choose a new directory for the package")
    if resolved == _home():
        raise PackageError(f"--out {target} is your home directory; choose a new directory for the package")
    if cwd.is_relative_to(resolved):
        raise PackageError(f"--out {target} contains the current directory; --force will not delete it: "
                           "choose a new directory for the package")
    for path in protect:
        if path is None:
            continue
        if Path(path).resolve().is_relative_to(resolved):
            raise PackageError(f"--out {target} contains the input {path}; --force will not delete it: "
                               "choose another --out")
    if not is_package(resolved):
        raise PackageError(
            f"--out {target} exists and is not an hstu-export package (no {MANIFEST} of format {PACKAGE_FORMAT}); "
            "--force only replaces packages: choose another --out, or remove the directory yourself"
        )


def _home() -> Path | None:
    try:
        return Path.home().resolve()
    except (RuntimeError, KeyError):  # no home directory known
        return None


def is_package(path: Path) -> bool:
    """Whether ``path`` is a directory holding one of our manifests (checksums are not read)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == PACKAGE_FORMAT


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
    """Deletes staging directories of earlier exports to ``target`` whose process is gone (killed), and
    puts right a replace such an export left half done (``recover_interrupted_replace``)."""
    recover_interrupted_replace(target)
    removed = []
    for path, pid in _leftovers(target, "partial"):
        if _process_alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def recover_interrupted_replace(target: Path) -> list[Path]:
    """Finishes or undoes a ``--force`` replace whose process died between its two renames.

    ``commit`` moves the old package to ``.NAME.old-PID-*``, renames the new one in, then deletes the old.
    For each such directory of a dead process: if ``target`` is missing (killed between the renames) the
    old package is moved back; otherwise (killed after the second rename) it is deleted. Directories of
    live processes are left alone: their replace may still be running. Returns the paths handled."""
    target = Path(target)
    # Newest first: if several were left, the most recently moved aside is the one to restore.
    leftovers = sorted(_leftovers(target, "old"), key=lambda item: _ctime(item[0]), reverse=True)
    handled = []
    for path, pid in leftovers:
        if _process_alive(pid):
            continue
        try:
            if not target.exists() and not target.is_symlink() and is_package(path):
                os.rename(path, target)
            else:
                shutil.rmtree(path)
        except OSError:
            continue  # another process got there first, or the directory is read-only: leave it
        handled.append(path)
    return handled


def _leftovers(target: Path, kind: str) -> list[tuple[Path, int]]:
    """``(path, pid)`` of the hidden ``.NAME.<kind>-PID[-*]`` directories beside ``target``."""
    prefix = f".{target.name}.{kind}-"
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    found = []
    for path in entries:
        if not path.name.startswith(prefix):
            continue
        pid_text = path.name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit():
            found.append((path, int(pid_text)))
    return found


def _ctime(path: Path) -> float:
    try:
        return path.stat().st_ctime
    except OSError:
        return 0.0


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


def commit(staged: Path, target: Path, force: bool, protect: Iterable[str | Path | None] = ()) -> None:
    """fsync everything in ``staged``, then rename it to ``target`` (replacing it only with ``force``, and
    only if it is still one of our packages: it is checked again here, after the long export)."""
    for path in sorted(staged.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(staged)
    old: Path | None = None
    if target.exists() or target.is_symlink():
        if not force:
            raise PackageError(f"{target} appeared during the export; not replacing it without --force")
        if target.is_symlink() or not target.is_dir():
            raise PackageError(f"{target} changed during the export and is no longer a package directory; "
                               "not replacing it")
        # The staged manifest names the bundle it was exported from: never delete that either.
        check_replaceable(target, [*protect, _recorded_bundle(staged)])
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
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


def _recorded_bundle(root: Path) -> str | None:
    try:
        bundle = json.loads((root / MANIFEST).read_text())["model"]["bundle"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return bundle if isinstance(bundle, str) else None


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
    version = manifest.get("format_version", 0)
    if isinstance(version, int) and version < PACKAGE_FORMAT_VERSION:
        raise PackageError(
            f"{root} is an hstu-export package of format {version} (its graphs call ops in the hstu:: namespace, "
            f"now hstu_export::); this hstu-export ({__version__}) reads format {PACKAGE_FORMAT_VERSION}: re-export the "
            "model with this version"
        )
    if manifest.get("op_namespace", OP_NAMESPACE) != OP_NAMESPACE:
        raise PackageError(f"{root} calls ops in namespace {manifest.get('op_namespace')!r}, not {OP_NAMESPACE!r}")
    if not isinstance(version, int) or version > PACKAGE_FORMAT_VERSION:
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
