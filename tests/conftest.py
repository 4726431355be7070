"""Suite-wide checks: every manifest a test writes validates against docs/manifest.schema.json (the
package contract of docs/PACKAGE.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "manifest.schema.json"
validated: list[Path] = []


@pytest.fixture(autouse=True, scope="session")
def _manifests_follow_the_contract():  # type: ignore[no-untyped-def]
    import jsonschema

    import hstu_export.exporter as exporter
    import hstu_export.package as package

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    original = package.write_manifest

    def write_and_validate(root, manifest):  # type: ignore[no-untyped-def]
        written = original(root, manifest)
        errors = sorted(validator.iter_errors(json.loads((Path(root) / package.MANIFEST).read_text())),
                        key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path)
            raise AssertionError(f"{root}: manifest does not follow docs/manifest.schema.json at {where!r}: "
                                 f"{errors[0].message}")
        validated.append(Path(root))
        return written

    package.write_manifest = write_and_validate
    exporter.write_manifest = write_and_validate
    yield
    package.write_manifest = original
    exporter.write_manifest = original
