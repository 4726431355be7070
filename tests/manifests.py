"""A package's manifest rewritten for tests that tamper with packages: with a matching manifest.sha256, so
that what the loader refuses is the edit itself, not a checksum."""

from __future__ import annotations

import json
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
