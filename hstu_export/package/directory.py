"""Package directories: atomic writing, the manifest, checksums.

Integrity: ``manifest.json`` lists the sha256 of every other file (``files``), and ``manifest.sha256``
beside it holds the sha256 of ``manifest.json``'s exact bytes, in ``sha256sum`` format
(``<hex>  manifest.json``; ``sha256sum -c manifest.sha256`` checks it without Python). A hash of the
bytes as stored needs no canonical JSON form (which other languages could not reproduce byte for byte)
and also catches a flip in whitespace. ``load_manifest`` checks both, then validates every field
(``hstu_export.package.manifest``): a package is untrusted input.

A package is built in a hidden temporary directory beside the target, every file fsynced, then renamed
into place, so a reader never sees half a package and an export killed midway leaves none. An existing
target is only replaced with ``force``, and only when it is one of our packages holding nothing but the files
its manifest lists (never a user's directory or a file a user kept in a package, the input, the working
directory or one of their ancestors). The old package is moved aside to ``.NAME.old-PID-*`` first and
removed after the rename; if the process is killed in between, the next export to that path or the next
``load()`` of it puts things right (``recover_interrupted_replace``). A package's directories and files
get the modes the umask gives, as ``mkdir`` would.

The other commands' outputs (requests, outputs, signatures, benchmark results, serving repositories) are
written the same way: ``write_file_atomically``, ``new_output_dir``, ``rename_into_place``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hstu_export.errors import ExportError, PackageError
from hstu_export.package.manifest import Manifest, parse_manifest, resolve_inside
from hstu_export.settings import format_bytes
from hstu_export.version import __version__

PACKAGE_FORMAT = "hstu-export-package"
SERVING_MARKER = "serving.json"  # marks a serving repository (hstu_export.serving.triton_repo), replaced like a package
# 5: a compiled (aoti) sparse program holds no tables; they are stored beside it (artifacts.sparse.constants).
# 4: the manifest describes each artifact's positional inputs and outputs (artifacts) and the op
# libraries' shared libraries (op_library_files): docs/PACKAGE.md. 3: manifest.sha256 holds the sha256
# of manifest.json. 2: ops in the hstu_export:: namespace (1: hstu::), input schema with arguments,
# graph-input names.
PACKAGE_FORMAT_VERSION = 5
OLDEST_READABLE_FORMAT = 4  # a format-4 package differs only in holding its tables inside its programs
OP_NAMESPACE = "hstu_export"
MANIFEST = "manifest.json"
MANIFEST_SHA256 = "manifest.sha256"
SIGNATURE = "package.sig"  # hstu_export.package.signing writes it
MAX_MANIFEST_BYTES = 64 * 2**20  # a manifest is kilobytes; more is not one of ours (and not read into memory)
# Why a package of an older format cannot be read, by format version.
_OLD_FORMATS = {
    1: "its graphs call ops in the hstu:: namespace, now hstu_export::",
    2: f"its manifest has no checksum of its own ({MANIFEST_SHA256})",
    3: "its manifest does not describe its artifacts' inputs and outputs, which servers outside Python read",
}


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
    """sha256 of every file under ``root`` except the manifest and its checksum, by POSIX relative path."""
    return {name: sha256_file(root / name) for name in package_files(root)}


def package_files(root: Path) -> list[str]:
    """POSIX relative paths of the files under ``root`` that ``files`` lists: all but the manifest, its
    checksum and a signature (top level only: a ``manifest.json`` deeper down is an ordinary file)."""
    names = (p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file())
    return [name for name in names if name not in (MANIFEST, MANIFEST_SHA256, SIGNATURE)]


def manifest_sha256_line(manifest_bytes: bytes) -> str:
    """The content of ``manifest.sha256`` for a ``manifest.json`` of these bytes (``sha256sum`` format)."""
    return f"{hashlib.sha256(manifest_bytes).hexdigest()}  {MANIFEST}\n"


def check_target(target: Path, force: bool, protect: Iterable[str | Path | None] = ()) -> None:
    """Fails early (before any work) when the target exists and may not be replaced.

    ``protect`` lists the export's inputs (the model bundle): a target holding one is never replaced.
    A replace that an earlier, killed export left half done is put right first, and its staging directories
    are removed (they would count against the free space ``check_free_space`` finds)."""
    target = Path(target)
    remove_stale_partials(target)
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
    check_writable(target.parent, f"--out {target}: its parent directory")


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
    foreign = unlisted_files(resolved)
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise PackageError(
            f"--out {target} holds {foreign[0]}{more}, which its manifest does not list (not written by "
            "hstu-export); --force will not delete it: move it out of the package, or choose another --out"
        )


def unlisted_files(root: Path) -> list[str]:
    """POSIX relative paths of what lies in the package directory ``root`` besides the files its manifest
    lists, its checksum and its signature: files, symbolic links and other non-directories a user put
    there. Directories themselves are not counted (deleting an empty one loses nothing)."""
    root = Path(root)
    try:
        listed = json.loads((root / MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    ours = set(listed) if isinstance(listed, dict) else set()
    ours |= {MANIFEST, MANIFEST_SHA256, SIGNATURE}
    found = []
    for directory, dirnames, filenames in os.walk(root):
        here = Path(directory).relative_to(root)
        links = [d for d in dirnames if os.path.islink(os.path.join(directory, d))]  # not followed by walk
        for name in sorted([*filenames, *links]):
            relative = (here / name).as_posix()
            if relative not in ours:
                found.append(relative)
    return sorted(found)


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


# File-system failures the user's machine causes, not our code: full disk or quota, a file too large for
# the file system, read-only mounts, permissions, failing storage.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})
# A package holds its weights once or twice over (the sparse and dense artifacts, zip records padded to
# 64 bytes) plus compiled code (an AOTInductor .so is a few MiB), graph dumps and the manifest.
PACKAGE_WEIGHT_FACTOR = 1.25
PACKAGE_OVERHEAD_BYTES = 64 * 2**20


def check_writable(directory: Path, what: str) -> None:
    """Raises PackageError unless files can be created in ``directory`` (or, if it does not exist yet, in its
    nearest existing ancestor): not on a read-only file system, and writable by this user. As root, write
    permission is granted whatever the mode bits say, so only a read-only mount stops root."""
    directory = Path(directory)
    existing = directory
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError as exc:
        raise PackageError(f"{what} {existing} cannot be examined: {exc.strerror}") from None
    if read_only:
        raise PackageError(f"{what} {existing} is on a read-only file system; choose a writable location")
    if not existing.is_dir():
        raise PackageError(f"{what} {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PackageError(f"{what} {existing} is not writable by this user (permission denied); choose a "
                           "writable location")


def estimated_package_bytes(weight_bytes: int) -> int:
    """About how many bytes a package of a model whose tensors take ``weight_bytes`` (in the export dtype)
    needs on disk while it is written."""
    return int(weight_bytes * PACKAGE_WEIGHT_FACTOR) + PACKAGE_OVERHEAD_BYTES


def check_free_space(target: Path, weight_bytes: int) -> None:
    """Raises PackageError when the file system that will hold ``target`` lacks the space the package is
    estimated to need: refusing before the export is the only clean way out, because torch's zip writer
    aborts the whole process (``terminate called ... inline_container.cc``) when the disk fills under
    ``torch.jit.save``."""
    target = Path(target)
    needed = estimated_package_bytes(weight_bytes)
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        return  # check_target has already said what is wrong with the parent directory
    if free < needed:
        raise PackageError(
            f"not enough disk space for the package {target}: it needs about {format_bytes(needed)} "
            f"({format_bytes(weight_bytes)} of weights x {PACKAGE_WEIGHT_FACTOR} + {format_bytes(PACKAGE_OVERHEAD_BYTES)} "
            f"for code and graphs), {format_bytes(free)} is free there; free some space or choose another --out"
        )


@contextlib.contextmanager
def staging_dir(target: Path, what: str = "the package", option: str = "--out") -> Iterator[Path]:
    """A hidden temporary directory beside ``target`` (same filesystem, so the final rename is atomic),
    removed on any failure. A file-system failure while ``what`` is written inside the block (full
    disk, read-only, no permission; see ``file_system_errors``) becomes one ExportError line; ``option``
    is the command-line option that named ``target``, for the advice."""
    remove_stale_partials(target)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    except OSError as exc:
        raise PackageError(f"cannot create {what} beside {target}: {_describe_os_error(exc)}; choose "
                           f"another {option}") from exc
    try:
        with file_system_errors(tmp, f"writing {what} {target}"):
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def file_system_errors(where: Path | None, doing: str) -> Iterator[None]:
    """Turns a file-system failure raised inside the block (an OSError of ``DISK_ERRNOS`` anywhere in the
    exception's chain, as backends wrap them, or torch's zip writer failing on a full disk) into
    ``ExportError("<doing> failed: ...")``; anything else passes unchanged. ``where`` is the directory being
    written, for the free space in the message."""
    try:
        yield
    except BaseException as exc:
        problem = _file_system_problem(exc, where)
        if problem is None:
            raise
        raise ExportError(f"{doing} failed: {problem}") from exc


def is_file_system_failure(exc: BaseException, where: Path | None) -> bool:
    """Whether ``exc`` is a failure of the file system that ``file_system_errors`` reports (a full disk while
    torch wrote an archive among them): such an error must reach it, not be taken for a failure of the step."""
    return _file_system_problem(exc, where) is not None


def _file_system_problem(exc: BaseException, where: Path | None) -> str | None:
    """What went wrong with the file system, in words, if that is why ``exc`` was raised; else None."""
    chain = _exception_chain(exc)
    zip_failed = any(_is_zip_writer_failure(e) for e in chain)
    if zip_failed:
        _finalize_zip_writers(chain)
    for e in chain:
        if isinstance(e, shutil.Error):  # copytree: one (src, dst, reason) per file that failed
            for entry in e.args[0] if e.args and isinstance(e.args[0], list) else []:
                found = re.search(r"\[Errno (\d+)\]", str(entry[-1]) if isinstance(entry, tuple) else "")
                if found and int(found.group(1)) in DISK_ERRNOS:
                    code = int(found.group(1))
                    return f"{os.strerror(code)} ({entry[1]}){_advice(code, where)}"
        elif isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return f"{_describe_os_error(e)}{_advice(e.errno, where)}"
    if zip_failed and where is not None:
        # The zip writer reports a short write as "unexpected pos": say what it most likely was.
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            return None
        if free < PACKAGE_OVERHEAD_BYTES:
            return f"{os.strerror(errno.ENOSPC)} while torch wrote an archive{_advice(errno.ENOSPC, where)}"
    return None


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    pending: list[BaseException | None] = [exc]
    while pending and len(chain) < 32:
        e = pending.pop()
        if e is None or any(e is seen for seen in chain):
            continue
        chain.append(e)
        pending += [e.__context__, e.__cause__]
    return chain


def _is_zip_writer_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and "inline_container.cc" in text and (
        "unexpected pos" in text or "failed writing" in text or "write failed" in text)


def _finalize_zip_writers(chain: list[BaseException]) -> None:
    """Marks the torch zip writers that a failed write left open as finished. A ``PyTorchFileWriter`` that
    was never finished writes its end of archive when it is destroyed, from a C++ destructor: on a full
    disk that write throws again and the process aborts (exit 134) long after our error was reported.
    ``write_end_of_file`` marks the writer finished even when it throws, so here it throws harmlessly.
    The writers are found in the local variables of the frames the exception passed through (AOTInductor's
    ``PT2ArchiveWriter`` keeps one as ``archive_file``)."""
    writer_type = getattr(torch._C, "PyTorchFileWriter", None)
    if writer_type is None:
        return
    for e in chain:
        tb = e.__traceback__
        while tb is not None:
            for value in list(tb.tb_frame.f_locals.values()):
                try:  # an object's attributes, one level down; some objects refuse even to be asked
                    attributes = [] if isinstance(value, type) else list(vars(value).values())
                except Exception:
                    attributes = []
                for candidate in (value, *attributes):
                    if isinstance(candidate, writer_type):
                        try:
                            candidate.write_end_of_file()
                        except RuntimeError:
                            pass  # the disk is still full; the writer is finished all the same
            tb = tb.tb_next


def _describe_os_error(exc: OSError) -> str:
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else type(exc).__name__)
    return f"{reason} ({exc.filename})" if exc.filename else reason


def _advice(code: int, where: Path | None) -> str:
    if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "; choose a writable location"
    try:
        free = f" ({format_bytes(shutil.disk_usage(where).free)} free there now)" if where is not None else ""
    except OSError:
        free = ""
    return f"{free}; free some space or choose another location"


def remove_stale_partials(target: Path) -> list[Path]:
    """Deletes staging directories of earlier exports to ``target`` whose process is gone (killed), and
    puts right a replace such an export left half done (``recover_interrupted_replace``)."""
    recover_interrupted_replace(target)
    removed = []
    for path, pid in _leftovers(target, "partial"):
        if _process_alive(pid):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:  # a file of write_file_atomically
            with contextlib.suppress(OSError):
                path.unlink()
        removed.append(path)
    return removed


def recover_interrupted_replace(target: Path) -> list[Path]:
    """Finishes or undoes a ``--force`` replace whose process died between its two renames.

    ``commit`` moves the old package to ``.NAME.old-PID-*``, renames the new one in, then deletes the old.
    For each such directory of a dead process: if ``target`` is missing (killed between the renames) the
    old package (or serving repository, which ``rename_into_place`` replaces the same way) is moved back;
    otherwise (killed after the second rename) it is deleted. Directories of
    live processes are left alone: their replace may still be running. Returns the paths handled."""
    target = Path(target)
    # Newest first: if several were left, the most recently moved aside is the one to restore.
    leftovers = sorted(_leftovers(target, "old"), key=lambda item: _ctime(item[0]), reverse=True)
    handled = []
    for path, pid in leftovers:
        if _process_alive(pid):
            continue
        try:
            if not target.exists() and not target.is_symlink() and (
                    is_package(path) or (path / SERVING_MARKER).is_file()):
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
    """Writes ``manifest.json`` (with the checksums of every other file) and ``manifest.sha256``."""
    manifest = dict(manifest, format=PACKAGE_FORMAT, format_version=PACKAGE_FORMAT_VERSION, files=checksums(root))
    data = (json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n").encode()
    (root / MANIFEST).write_bytes(data)
    (root / MANIFEST_SHA256).write_bytes(manifest_sha256_line(data).encode())
    return manifest


def commit(staged: Path, target: Path, force: bool, protect: Iterable[str | Path | None] = ()) -> None:
    """fsync everything in ``staged``, then rename it to ``target`` (replacing it only with ``force``, and
    only if it is still one of our packages: it is checked again here, after the long export)."""
    if target.exists() or target.is_symlink():
        if not force:
            raise PackageError(f"{target} appeared during the export; not replacing it without --force")
        if target.is_symlink() or not target.is_dir():
            raise PackageError(f"{target} changed during the export and is no longer a package directory; "
                               "not replacing it")
        # The staged manifest names the bundle it was exported from: never delete that either.
        check_replaceable(target, [*protect, _recorded_bundle(staged)])
    rename_into_place(staged, target)


def rename_into_place(staged: Path, target: Path) -> None:
    """fsyncs everything in ``staged``, gives it the modes the umask gives new files and directories, and
    renames it to ``target``. An existing ``target`` (the caller has checked that it may go) is moved aside
    to ``.NAME.old-PID-*`` first, restored if the rename fails, and removed after it."""
    for path in sorted(staged.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    follow_umask(staged)
    _fsync_dir(staged)
    old: Path | None = None
    if target.exists() or target.is_symlink():
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


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, so no thread sees it changed)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(root: Path) -> None:
    """Gives ``root`` and everything under it the modes that ``mkdir`` and ``open`` give under the umask
    (``tempfile`` makes its directories and files 0700 and 0600, which would leave a package readable by
    its owner alone); executable files stay executable. Symbolic links are left as they are."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, 0o777 & ~mask)
        for name in filenames:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                continue
            executable = os.stat(path).st_mode & 0o111
            os.chmod(path, (0o777 if executable else 0o666) & ~mask)


def check_output_file(path: Path, option: str) -> None:
    """Raises PackageError unless a file can be written at ``path`` (named by ``option``): its parent
    directory exists and is writable, and ``path`` is not a directory. Called before the work whose result
    is written, so a bad path costs nothing."""
    path = Path(path)
    if path.is_dir():
        raise PackageError(f"{option} {path} is a directory; give the path of a file")
    if not path.parent.is_dir():
        raise PackageError(f"{option} {path}: its parent directory {path.parent} does not exist")
    check_writable(path.parent, f"{option} {path}: its parent directory")


def write_file_atomically(path: Path, data: bytes, what: str) -> None:
    """Writes ``data`` to ``path`` as a whole or not at all: into a hidden temporary file beside it
    (``.NAME.partial-PID-*``), fsynced, given the umask's mode, then renamed over ``path``. A file-system
    failure (see ``file_system_errors``) becomes one ExportError line naming ``what``; the temporary file
    is removed and an existing ``path`` is left as it was."""
    path = Path(path)
    remove_stale_partials(path)
    tmp: Path | None = None
    with file_system_errors(path.parent, f"writing {what} {path}"):
        try:
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.partial-{os.getpid()}-", dir=path.parent)
            tmp = Path(name)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~current_umask())
            os.replace(tmp, path)
            tmp = None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        _fsync_dir(path.parent)


@contextlib.contextmanager
def new_output_dir(target: Path, what: str, option: str) -> Iterator[Path]:
    """A directory of output written as a whole or not at all: ``target`` must be absent or an empty
    directory (nothing in it is overwritten); the block fills the staging directory it is given, which is
    then renamed to ``target``. Missing parent directories are created, and removed again on failure,
    with the staging directory (see ``staging_dir``)."""
    target = Path(target)
    check_new_output_dir(target, option)
    with parent_dirs(target, what), staging_dir(target, what, option) as staged:
        yield staged
        check_new_output_dir(target, option)  # again: something may have appeared meanwhile
        rename_into_place(staged, target)


@contextlib.contextmanager
def parent_dirs(target: Path, what: str) -> Iterator[None]:
    """Creates the missing parent directories of ``target`` for the block, and removes them again (those
    still empty) if the block fails, so a failed write leaves no trace."""
    target = Path(target)
    created: list[Path] = []
    try:
        with file_system_errors(target.parent, f"writing {what} {target}"):
            for parent in reversed([target.parent, *target.parent.parents]):
                if not parent.exists():
                    parent.mkdir()
                    created.append(parent)
        yield
    except BaseException:
        for parent in reversed(created):
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def check_new_output_dir(target: Path, option: str) -> None:
    """Raises PackageError unless ``target`` (named by ``option``) can become a new directory of output:
    absent or an empty directory, and its nearest existing ancestor writable."""
    target = Path(target)
    if target.is_symlink():
        raise PackageError(f"{option} {target} is a symbolic link; choose a new directory")
    if target.exists() and not target.is_dir():
        raise PackageError(f"{option} {target} exists and is not a directory; choose a new directory")
    try:
        occupied = target.is_dir() and any(target.iterdir())
    except OSError as exc:
        raise PackageError(f"{option} {target} cannot be read: {_describe_os_error(exc)}; choose a new "
                           "directory") from None
    if occupied:
        raise PackageError(f"{option} {target} exists and is not empty; choose a new directory (nothing in it "
                           "is overwritten)")
    check_writable(target.parent, f"{option} {target}: its parent directory")


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
    """The decoded manifest of the package at ``root``, after every check of :func:`load_manifest`."""
    return load_manifest(root, verify_checksums=verify_checksums).raw


def load_manifest(root: Path, verify_checksums: bool = True) -> Manifest:
    """The validated manifest of the package at ``root``. Checks, in order: ``manifest.json`` decodes and is
    ours; its format version; its own sha256 (``manifest.sha256``); the op namespace; every field (types,
    values, paths inside the package); with ``verify_checksums``, the sha256 of every file it lists, and
    no file it does not list. Raises PackageError, naming what is wrong."""
    root = Path(root)
    if not root.is_dir():
        raise PackageError(f"{root}: not a package directory (no such directory)")
    path = root / MANIFEST
    if not path.is_file():
        raise PackageError(f"{root} is not an hstu-export package: {MANIFEST} is missing")
    resolve_inside(root, MANIFEST)
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise PackageError(f"{path} is {path.stat().st_size} bytes, too large for a manifest (at most "
                           f"{MAX_MANIFEST_BYTES}); it is not an hstu-export manifest")
    data = path.read_bytes()
    try:
        manifest = json.loads(data, object_pairs_hook=_without_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise PackageError(f"{path} is corrupt: {_first_line(exc)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != PACKAGE_FORMAT:
        found = manifest.get("format", "no format field") if isinstance(manifest, dict) else type(manifest).__name__
        raise PackageError(f"{path} is not an hstu-export manifest (manifest field format: expected "
                           f"{PACKAGE_FORMAT!r}, got {str(found)[:80]!r})")
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version < OLDEST_READABLE_FORMAT:
        why = _OLD_FORMATS.get(version, "an older layout")
        raise PackageError(
            f"{root} is an hstu-export package of format {version} ({why}); this hstu-export ({__version__}) reads "
            f"formats {OLDEST_READABLE_FORMAT} to {PACKAGE_FORMAT_VERSION}: re-export the model with this version"
        )
    if not isinstance(version, int) or isinstance(version, bool) or version > PACKAGE_FORMAT_VERSION:
        raise PackageError(
            f"{root} has package format {str(version)[:40]} (manifest field format_version); this hstu-export "
            f"({__version__}) reads up to {PACKAGE_FORMAT_VERSION}: upgrade hstu-export"
        )
    _check_manifest_sha256(root, data)
    if manifest.get("op_namespace", OP_NAMESPACE) != OP_NAMESPACE:
        raise PackageError(f"{root} calls ops in namespace {str(manifest.get('op_namespace'))[:80]!r} (manifest field "
                           f"op_namespace), not {OP_NAMESPACE!r}")
    parsed = parse_manifest(manifest, root)
    for role in parsed.backend.files:
        parsed.artifact(root, role)
    if verify_checksums:
        _verify_files(root, parsed.files)
    return parsed


def _without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (readers disagree on which one counts)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key[:80]!r} appears twice in one object")
        obj[key] = value
    return obj


def _check_manifest_sha256(root: Path, data: bytes) -> None:
    path = root / MANIFEST_SHA256
    if not path.is_file():
        raise PackageError(f"{root}: {MANIFEST_SHA256} (the checksum of {MANIFEST}) is missing: the package is "
                           "incomplete or was modified; re-export it")
    resolve_inside(root, MANIFEST_SHA256)
    found = re.fullmatch(rb"([0-9a-f]{64})  " + re.escape(MANIFEST.encode()) + rb"\n?", path.read_bytes()[:200])
    if found is None:
        raise PackageError(f"{root}: {MANIFEST_SHA256} is corrupt (expected '<sha256>  {MANIFEST}'); re-export the "
                           "package")
    if found.group(1).decode() != hashlib.sha256(data).hexdigest():
        raise PackageError(f"{root}: checksum mismatch for {MANIFEST} ({MANIFEST_SHA256} holds another sha256: the "
                           "manifest is corrupt or was modified); re-export the package")


def _verify_files(root: Path, expected: dict[str, str]) -> None:
    for name, digest in expected.items():
        path = resolve_inside(root, name, f"files[{name!r}]")
        if not path.is_file():
            raise PackageError(f"{root}: file {name} listed in the manifest is missing")
        if sha256_file(path) != digest:
            raise PackageError(f"{root}: checksum mismatch for {name} (the file is corrupt or was modified)")
    extra = sorted(set(package_files(root)) - set(expected))
    if extra:
        raise PackageError(f"{root}: files not in the manifest: {extra[:5]}")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__
