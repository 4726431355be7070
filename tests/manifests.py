"""A package's manifest rewritten for tests that tamper with packages: with a matching manifest.sha256, so
that what the loader refuses is the edit itself, not a checksum."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hstu_export.package.directory import manifest_sha256_line


def write_manifest_bytes(package: Path, data: bytes) -> None:
    """``data`` as the package's manifest.json, and its checksum line."""
    (package / "manifest.json").write_bytes(data)
    (package / "manifest.sha256").write_text(manifest_sha256_line(data))


def rewrite_manifest(package: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """The package's manifest after ``edit`` (which changes the dict in place)."""
    manifest = json.loads((package / "manifest.json").read_text())
    edit(manifest)
    write_manifest_bytes(package, json.dumps(manifest).encode())


def edit_safetensors_header(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """The safetensors file ``path`` with its header after ``edit`` (in place), padded to 8, its data unchanged."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])


def rewrite_tables_header(package: Path, edit: Callable[[dict[str, Any]], Any],
                          relpath: str = "sparse/tables.safetensors") -> None:
    """The package's tables file with its safetensors header after ``edit`` (in place), its bytes unchanged, and the
    file's checksum in the manifest updated: what the loader refuses is the header itself."""
    path = package / relpath
    edit_safetensors_header(path, edit)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    rewrite_manifest(package, lambda m: m["files"].update({relpath: digest}))
