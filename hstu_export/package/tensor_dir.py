"""Named tensors as a directory, one ``torch.save``'d tensor per file: the request and output format the
C++ runtime (``hstu-export-run PKG REQUEST_DIR --out OUT_DIR``) reads and writes, and that
``hstu-export request`` / ``hstu-export run --batch DIR --output-dir DIR`` write from Python.

A file is ``<name>.pt`` with the name percent-encoded: every byte outside ``[A-Za-z0-9_.-]`` (and a
leading ``.``) becomes ``%XX`` (upper-case hex of its UTF-8 bytes), so any feature name is one plain
file name (``features.item.values`` stays as it is; ``a/b`` becomes ``a%2Fb``). Files not ending in
``.pt`` are ignored. docs/PACKAGE.md states the format.
"""

from __future__ import annotations

import io
import string
from pathlib import Path

import torch
from torch import Tensor

from hstu_export.errors import RequestError

SUFFIX = ".pt"
_SAFE = frozenset((string.ascii_letters + string.digits + "_.-").encode())
_HEX = frozenset(b"0123456789ABCDEF")


def file_name(name: str) -> str:
    """The file holding tensor ``name``."""
    encoded = "".join(chr(b) if b in _SAFE and not (i == 0 and b == ord(".")) else f"%{b:02X}"
                      for i, b in enumerate(name.encode()))
    return encoded + SUFFIX


def tensor_name(file: str) -> str:
    """The tensor name a file holds (the inverse of :func:`file_name`); RequestError if it is not one."""
    if not file.endswith(SUFFIX) or file == SUFFIX:
        raise RequestError(f"{file!r} is not a tensor file (<name>{SUFFIX})")
    raw, out, i = file[: -len(SUFFIX)].encode(), bytearray(), 0
    while i < len(raw):
        if raw[i] == ord("%"):
            code = raw[i + 1: i + 3]
            if len(code) != 2 or not set(code) <= _HEX:
                raise RequestError(f"{file!r}: '%' must be followed by two upper-case hex digits")
            out.append(int(code, 16))
            i += 3
        elif raw[i] in _SAFE and not (i == 0 and raw[i] == ord(".")):
            out.append(raw[i])
            i += 1
        else:
            raise RequestError(f"{file!r}: byte {chr(raw[i])!r} must be percent-encoded")
    try:
        return out.decode()
    except UnicodeDecodeError:
        raise RequestError(f"{file!r}: the decoded name is not UTF-8") from None


def save_tensors(tensors: dict[str, Tensor], directory: str | Path) -> Path:
    """Writes each tensor (detached, on the CPU, contiguous) to ``directory/<encoded name>.pt``."""
    root = Path(directory)
    for name, value in tensors.items():
        if not isinstance(value, Tensor):
            raise RequestError(f"{name!r} must be a tensor, got {type(value).__name__}")
    root.mkdir(parents=True, exist_ok=True)
    for name, value in tensors.items():
        (root / file_name(name)).write_bytes(saved_bytes(value.detach().cpu().contiguous()))
    return root


def write_tensors(tensors: dict[str, Tensor], directory: str | Path, what: str, option: str) -> Path:
    """:func:`save_tensors` into a new (or empty) ``directory``, as a whole or not at all
    (``hstu_export.package.directory.new_output_dir``): a full or read-only disk is one error line and leaves nothing
    behind. ``what`` and ``option`` name the output in that line."""
    from hstu_export.package.directory import new_output_dir

    root = Path(directory)
    with new_output_dir(root, what, option) as staged:
        save_tensors(tensors, staged)
    return root


def saved_bytes(value: object) -> bytes:
    """``torch.save`` of ``value``, in memory. Written from Python, a full disk is an OSError (ENOSPC);
    torch's own file writer reports it as ``basic_ios::clear: iostream error``."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def load_untrusted(path: Path, what: str) -> object:
    """``torch.load`` of request data from disk, tensors and plain containers only (``weights_only``); a
    file it cannot read is a RequestError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RequestError(f"{path} is not a torch.save'd {what}: {str(exc).splitlines()[0][:200]}") from None


def load_tensors(directory: str | Path) -> dict[str, Tensor]:
    """The tensors of a directory written by :func:`save_tensors` (or by the C++ runtime), by name.
    Untrusted input: files are read with ``weights_only``, anything but one tensor per file is refused."""
    root = Path(directory)
    if not root.is_dir():
        raise RequestError(f"{directory}: no such directory of tensors")
    out: dict[str, Tensor] = {}
    for path in sorted(root.iterdir()):
        if not path.name.endswith(SUFFIX):
            continue
        name = tensor_name(path.name)
        if not path.is_file():
            raise RequestError(f"{path}: not a regular file")
        value = load_untrusted(path, "tensor")
        if not isinstance(value, Tensor):
            raise RequestError(f"{path} holds a {type(value).__name__}, not a tensor")
        out[name] = value
    if not out:
        raise RequestError(f"{directory} holds no tensor files (<name>{SUFFIX})")
    return out
