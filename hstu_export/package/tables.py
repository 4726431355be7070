"""The tables of a compiled sparse half, stored once outside its program: a safetensors file
(``sparse/tables.safetensors``) that the program is handed at load, as AOTInductor's user-managed
constants (docs/PACKAGE.md "Tables outside the program").

The file is written by the safetensors library: an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range), the tensors' bytes. Its bytes depend only on the tensors,
so a re-export with the same tables writes the same file (``publish`` then hard-links it instead of
copying). It is read back memory-mapped (a private mapping: nothing is ever written to the file): on CPU the
program gathers straight from the mapped pages (the page cache, shared by every process that serves the
package); on CUDA each tensor is copied to the device once, at load, or to pinned host memory.

A package is untrusted input, and AOTInductor checks neither the shape nor the dtype of a constant it is
given: a table shorter than the one compiled would be read past its end. So the file's header must name
exactly the tensors the manifest lists, each with the dtype and shape the manifest gives, at byte ranges
inside the file that fit its dtype's alignment.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, PackageError

TABLES_FORMAT = "safetensors"
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on the JSON header
# safetensors dtype codes <-> torch dtypes (the ones a sparse program's constants can have)
_CODES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in _CODES.values()}


TABLES_DEVICES = ("cpu", "cuda")


def check_tables_device(artifacts: dict[str, Any], root: Path, device_type: str, asked: str) -> None:
    """ConfigError unless the package at ``root`` (its manifest's ``artifacts``, its ``device_type``) can keep its
    tables on ``asked`` (``load(..., tables_device=asked)``): only tables stored outside their program can."""
    if asked not in TABLES_DEVICES:
        raise ConfigError(f"tables device {str(asked)[:40]!r}: expected cpu or cuda")
    if not any("constants" in entry for entry in artifacts.values()):
        raise ConfigError(f"{root} keeps its tables inside its programs: only a package of format 5 whose sparse "
                          "half is compiled (aoti) stores them apart; serve it without a tables device")
    if asked == "cuda" and device_type != "cuda":
        raise ConfigError(f"{root} is a {device_type} package: its tables cannot live on cuda (tables device cpu, "
                          "or none)")


def dtype_names() -> list[str]:
    """The dtype names (``float32``, ...) a table may have."""
    return list(_NAMES.values())


def write_tables(path: Path, tensors: dict[str, Tensor]) -> list[dict[str, Any]]:
    """Writes ``tensors`` (contiguous copies on the host) to ``path``; returns their manifest entries
    ``{name, dtype, shape}`` in name order."""
    from safetensors.torch import save_file

    unsupported = sorted(n for n, t in tensors.items() if t.dtype not in _NAMES)
    if unsupported:
        raise ValueError(f"tables of dtype {tensors[unsupported[0]].dtype} cannot be stored outside the program "
                         f"({unsupported[0]})")
    host = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(host, str(path))
    return [{"name": name, "dtype": _NAMES[host[name].dtype], "shape": [int(s) for s in host[name].shape]}
            for name in sorted(host)]


def read_tables(path: Path, expected: list[dict[str, Any]], what: str) -> dict[str, Tensor]:
    """The tensors of ``path`` by name, as CPU tensors over one private mapping of the file, after checking
    its header against ``expected`` (the manifest's entries). ``what`` names the file in errors."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if length < 2 or length > min(size - 8, _HEADER_LIMIT) or length % 8:
                raise PackageError(f"{what} is not a safetensors file (its header length "
                                   f"{'is missing' if length < 0 else f'{length} does not fit its {size} bytes, or is not padded to 8'}); "
                                   "re-export the package")
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackageError(f"{what} cannot be read as a safetensors file ({str(exc)[:200]}); re-export the package") \
            from None
    if not isinstance(header, dict):
        raise PackageError(f"{what}: its header is not a JSON object; re-export the package")
    header.pop("__metadata__", None)
    wanted = {entry["name"]: entry for entry in expected}
    if set(header) != set(wanted):
        missing, extra = sorted(set(wanted) - set(header)), sorted(set(header) - set(wanted))
        problem = f"lacks {missing[0]!r}" if missing else f"holds {extra[0][:80]!r}, which the manifest does not list"
        raise PackageError(f"{what} {problem} ({len(header)} tables, the manifest lists {len(wanted)}); "
                           "re-export the package")
    data_start = 8 + length
    spans = []
    for name, entry in wanted.items():
        spans.append((_checked_span(name, header[name], entry, size - data_start, what), name))
    mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8) if size else None
    tensors = {}
    for (begin, end), name in sorted(spans):
        dtype = _CODES[header[name]["dtype"]]
        raw = mapped[data_start + begin: data_start + end]
        tensors[name] = raw.view(dtype).view(wanted[name]["shape"]) if end > begin else \
            torch.empty(wanted[name]["shape"], dtype=dtype)
    return tensors


def _checked_span(name: str, found: Any, entry: dict[str, Any], data_bytes: int, what: str) -> tuple[int, int]:
    """The byte range of table ``name`` in the file's data, once its dtype, shape and range are what the manifest
    says and fit the file."""
    where = f"{what}: table {name[:80]!r}"
    if not isinstance(found, dict) or not isinstance(found.get("data_offsets"), list):
        raise PackageError(f"{where} is not described by dtype, shape and data_offsets; re-export the package")
    dtype = _CODES.get(found.get("dtype")) if isinstance(found.get("dtype"), str) else None
    if dtype is None or _NAMES[dtype] != entry["dtype"]:
        raise PackageError(f"{where} has dtype {str(found.get('dtype'))[:20]}, the manifest says {entry['dtype']}; "
                           "re-export the package")
    if found.get("shape") != entry["shape"]:
        raise PackageError(f"{where} has shape {str(found.get('shape'))[:80]}, the manifest says {entry['shape']} "
                           "(the shape its program was compiled for); re-export the package")
    offsets = found["data_offsets"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for dim in entry["shape"]:
        numel *= dim
    if (len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes or offsets[1] - offsets[0] != numel * itemsize
            or offsets[0] % itemsize):
        raise PackageError(f"{where}: its bytes {str(offsets)[:60]} are not {numel} aligned {entry['dtype']} "
                           f"values inside the file's {data_bytes} data bytes; re-export the package")
    return offsets[0], offsets[1]
