"""Published versions of a package, for a server to follow:

    ROOT/1/  ROOT/2/  ROOT/3/     each a whole package (as ``hstu-export`` writes one)
    ROOT/current -> 3             the version to serve (a relative symlink, switched atomically)

``publish(PKG, ROOT)`` checks PKG (every file against its manifest's checksums), stages it as the next
version beside the others, renames it into place, then points ``current`` at it (a new link renamed over the
old one: a reader sees the old version or the new one, never neither). A file the new version shares with
the version published before it (same path, same checksum: tables that did not change) is hard-linked, not
copied. Versions beyond the newest ``keep`` are removed, never the current one. Publishers of one ROOT take
turns (a lock file); a reader needs no lock.

``hstu_export.load(ROOT)`` loads the current version;
:class:`hstu_export.serving.published.PublishedPredictor` follows ``current`` while serving.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hstu_export.errors import ConfigError, PackageError
from hstu_export.package.directory import _fsync_dir, file_system_errors, is_package, load_manifest

__all__ = ["CURRENT", "Published", "current_version", "is_published_root", "publish", "switch", "versions"]

CURRENT = "current"
_LOCK = ".publish.lock"
_STAGING = ".staging-"
_VERSION = re.compile(r"^[1-9][0-9]*$")


@dataclass(frozen=True)
class Published:
    version: int
    path: Path
    linked: list[str] = field(default_factory=list)  # files hard-linked from the version before
    linked_bytes: int = 0
    copied: list[str] = field(default_factory=list)
    copied_bytes: int = 0
    removed: list[int] = field(default_factory=list)  # versions removed beyond ``keep``


def is_published_root(path: Path) -> bool:
    """``path`` holds published versions (a ``current`` link) rather than being a package itself."""
    return (path / CURRENT).is_symlink() and not is_package(path)


def versions(root: Path) -> list[int]:
    """The published versions under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if _VERSION.match(p.name) and p.is_dir() and not p.is_symlink())


def current_version(root: Path) -> int | None:
    """The version ``current`` points at (None: nothing published)."""
    link = root / CURRENT
    if not link.is_symlink():
        return None
    target = os.readlink(link)
    if not _VERSION.match(target) or (root / target).is_symlink() or not (root / target).is_dir():
        raise PackageError(f"{link} points at {target!r}, not at a published version of {root}; "
                           f"point it again with `hstu-export publish --to {root} --switch N`")
    return int(target)


def current_path(root: Path) -> Path:
    """The directory of the current version (a PackageError when nothing is published)."""
    version = current_version(root)
    if version is None:
        raise PackageError(f"{root} holds no published version ({CURRENT} is missing); publish one with "
                           f"`hstu-export publish PKG --to {root}`")
    return root / str(version)


def publish(package: str | Path, root: str | Path, *, keep: int = 3) -> Published:
    """Publishes the package at ``package`` as the next version under ``root`` and makes it current."""
    source, root = Path(package), Path(root)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"--keep must be 1 or more (the current version is always kept), got {keep!r}")
    if not is_package(source):
        raise PackageError(f"{source} is not a package (no manifest.json); export one with `hstu-export MODEL`")
    if is_package(root):
        raise ConfigError(f"{root} is a package; --to names the directory that holds published versions")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is a file; --to names the directory that holds published versions")
    if source.resolve().is_relative_to(root.resolve()):
        raise ConfigError(f"{source} is inside {root}: publish from a package outside the published versions")
    if (root / CURRENT).exists() and not (root / CURRENT).is_symlink():
        raise ConfigError(f"{root / CURRENT} is not a link hstu-export publish wrote; move it away or publish elsewhere")
    manifest = load_manifest(source, verify_checksums=True)  # a damaged package is never published
    with file_system_errors(root, "publishing"), _locked(root):
        _remove_stale_staging(root)
        earlier = current_version(root)
        number = max(versions(root), default=0) + 1
        staged = root / f"{_STAGING}{number}-{os.getpid()}"
        before = load_manifest(root / str(earlier), verify_checksums=False).raw["files"] if earlier is not None else {}
        files = manifest.raw["files"]
        try:
            linked: list[str] = []
            copied: list[str] = []
            sizes = {"linked": 0, "copied": 0}
            for path in sorted(p for p in source.rglob("*") if p.is_file()):
                name = path.relative_to(source).as_posix()
                target = staged / name
                target.parent.mkdir(parents=True, exist_ok=True)
                same = name in files and before.get(name) == files[name]
                if same and _link(root / str(earlier) / name, target):
                    linked.append(name)
                    sizes["linked"] += target.stat().st_size
                else:
                    shutil.copy2(path, target)
                    copied.append(name)
                    sizes["copied"] += target.stat().st_size
            load_manifest(staged, verify_checksums=True)  # what was staged is what was checked
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)  # a failed publish leaves nothing behind
            raise
        final = root / str(number)
        os.rename(staged, final)
        _fsync_dir(root)
        _point_current(root, number)
        removed = [v for v in versions(root)[:-keep] if v != number]
        for version in removed:
            shutil.rmtree(root / str(version))
    return Published(number, final, linked, sizes["linked"], copied, sizes["copied"], removed)


def switch(root: str | Path, version: int) -> Path:
    """Makes an already published ``version`` current (a rollback, or forward again)."""
    root = Path(root)
    if version not in versions(root):
        have = ", ".join(map(str, versions(root))) or "none"
        raise ConfigError(f"{root} has no version {version} (published: {have})")
    with file_system_errors(root, "switching the current version"), _locked(root):
        load_manifest(root / str(version), verify_checksums=True)
        _point_current(root, version)
    return root / str(version)


def _point_current(root: Path, version: int) -> None:
    fresh = root / f".{CURRENT}-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        fresh.unlink()
    os.symlink(str(version), fresh)
    os.replace(fresh, root / CURRENT)
    _fsync_dir(root)


def _link(existing: Path, target: Path) -> bool:
    """A hard link to ``existing`` at ``target``; False where the file system has none (then it is copied)."""
    try:
        os.link(existing, target)
        return True
    except OSError:
        return False


def _remove_stale_staging(root: Path) -> None:
    """Staging left by a publisher that died (the lock is held: no other publisher is staging now)."""
    for path in root.glob(f"{_STAGING}*"):
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / _LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
