"""Suite-wide checks and fixtures: every manifest a test writes validates against
docs/manifest.schema.json (the package contract of docs/PACKAGE.md); ``cpp_runtime`` builds the C++
runtime (runtimes/cpp) once per session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "docs" / "manifest.schema.json"
CPP_BUILD = REPO / "build" / "cpp"
validated: list[Path] = []


@pytest.fixture(autouse=True, scope="session")
def _manifests_follow_the_contract():  # type: ignore[no-untyped-def]
    import jsonschema

    import hstu_export.exporter as exporter
    import hstu_export.package.directory as package

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


def _cpp_env() -> dict[str, str]:
    # The op libraries are found the way a deployment finds them: the build's default directory.
    return {k: v for k, v in os.environ.items() if k != "HSTU_EXPORT_OP_LIBRARY_PATH"}


class CppRuntime:
    """The built ``hstu-export-run``; ``run(*args)`` runs it (text output, 10 minute limit)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def run(self, *args: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.path), *map(str, args)], capture_output=True, text=True, env=_cpp_env(),
                              timeout=600)


@pytest.fixture(scope="session")
def cpp_runtime() -> CppRuntime:
    """hstu-export-run, built with runtimes/cpp/build.sh against this environment's torch (incremental:
    a second session in the same checkout only rebuilds what changed). No toolchain fails, never skips."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: the C++ runtime tests need cmake and a C++20 compiler "
                    "(apt-get install cmake g++; `make install` does it when run as root)")
    done = subprocess.run(["bash", str(REPO / "runtimes" / "cpp" / "build.sh"), str(CPP_BUILD)],
                          env={**_cpp_env(), "PYTHON": sys.executable}, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return CppRuntime(CPP_BUILD / "hstu-export-run")


@pytest.fixture(scope="session", params=["context", "no-context"])
def kv_package(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """(config name, package path, manifest): the zoo model of kv_requests.CONFIGS exported on CPU with
    --kv-cache (pages of kv_requests.PAGE tokens), once a session for every test that serves one. "no-context"
    also has the prechecked sparse model (--prechecked-sparse on, as a CUDA export has by default), so the tests
    that serve both run both sparse models."""
    from kv_requests import CONFIGS, PAGE, bundle_of

    from hstu_export import ExportSettings
    from hstu_export.exporter import export

    name = request.param
    work = tmp_path_factory.mktemp(f"kv-{name}")
    bundle = bundle_of(CONFIGS[name], work / "model.pt")
    result = export(bundle, work / "pkg", ExportSettings(max_batch_size=4, kv_cache=True, kv_page_size=PAGE,
                                                         prechecked_sparse="on" if name == "no-context" else "auto"))
    return name, work / "pkg", result.manifest



@pytest.fixture(scope="session")
def tiny_serving_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package the serving tests serve (tests/test_serving_repo.py, tests/test_triton_server.py): the tiny
    preset on TorchScript, at most 4 users a call. Read only."""
    from tiny_packages import export_tiny

    return export_tiny(tmp_path_factory.mktemp("serving"), seed=5)


@pytest.fixture(scope="session")
def tiny_serving_package_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second version of tiny_serving_package: the same requests, other weights (tests/test_publish.py,
    the published-version test of tests/test_triton_server.py). Read only."""
    from tiny_packages import export_tiny

    return export_tiny(tmp_path_factory.mktemp("serving-v2"), seed=7)
