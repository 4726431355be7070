"""The manifest and the artifacts agree, and what an artifact refuses reaches the caller as one line
(issue 37).

A fault campaign found: Python ``load`` did not check ``output_names`` against what the artifacts
return (reversed names served ctr's scores as ``cvr``); request dtypes were checked against the
manifest's feature list, not what the compiled programs take (``query_time`` declared int32 served
scores 0.003-0.0065 off); a range check inside a TorchScript artifact surfaced as a raw
``torch.jit.Error`` ("internal error" from ``hstu-export run``). Compiled guards (AOTInductor's
``Expected u14 >= 2 but received 1``) reached callers raw too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch
from hstu_export.cli import main as cli_main
from hstu_export.errors import PackageError, RequestError
from hstu_export.package.tensor_dir import save_tensors

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def package(workdir, bundle) -> Path:
    settings = ExportSettings(backend="torchscript", max_batch_size=4, verify=VerifySettings(num_random_batches=1))
    return hstu_export.export(bundle, workdir / "pkg-refusals", settings).path


@pytest.fixture
def pkg(package, tmp_path) -> Path:
    target = tmp_path / "pkg"
    shutil.copytree(package, target)
    return target


def rewrite(root: Path, change: Any) -> None:
    """Edits manifest.json with ``change(manifest)`` and recomputes manifest.sha256, as someone editing it
    on purpose would."""
    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    digest = hashlib.sha256((root / "manifest.json").read_bytes()).hexdigest()
    (root / "manifest.sha256").write_text(f"{digest}  manifest.json\n")


def feature(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in manifest["input_schema"]["features"] if f["name"] == name)


def test_output_names_that_are_not_what_the_artifact_returns_are_refused(pkg):
    def reverse(manifest: dict[str, Any]) -> None:
        # Both lists that name the outputs agree with each other, so only the artifact can tell them wrong.
        manifest["output_names"] = manifest["output_names"][::-1]
        manifest["outputs"] = manifest["outputs"][::-1]

    rewrite(pkg, reverse)
    with pytest.raises(PackageError, match=r"output_names: \['cvr', 'ctr'\] is not what artifacts\.model returns, in "
                                           r"its order \(\['ctr', 'cvr'\]\)"):
        hstu_export.load(pkg)


def test_a_feature_dtype_the_artifact_does_not_take_is_refused(pkg):
    def narrower(manifest: dict[str, Any]) -> None:
        feature(manifest, "query_time")["dtype"] = "int32"

    rewrite(pkg, narrower)
    with pytest.raises(PackageError, match=r"input_schema\.features\.query_time\.dtype: is 'int32' but "
                                           r"artifacts\.model\.inputs\[\d+\] takes 'int64'"):
        hstu_export.load(pkg)


def widened(manifest: dict[str, Any]) -> None:
    """The history's maximum raised past what the artifact checks (a manifest that does not match its
    programs)."""
    feature(manifest, "uih_lengths")["max_value"] = 60
    manifest["ranges"]["lengths"]["max_lengths"]["uih_lengths"] = 60


def test_a_range_check_inside_the_artifact_is_a_request_error_naming_the_feature(pkg, package):
    exported_max = hstu_export.load(package).input_schema.get("uih_lengths").max_value
    rewrite(pkg, widened)
    predictor = hstu_export.load(pkg)
    batch = generate_batch(predictor.input_schema, 2, seed=3, lengths={"uih_lengths": [3, exported_max + 2]})
    with pytest.raises(RequestError) as info:
        predictor(batch)
    message = str(info.value)
    assert message == (f"feature 'uih_lengths' has length {exported_max + 2} beyond the range model/model.ts was "
                       "exported for (refused by model/model.ts itself; the manifest's maximum is 60, so the manifest "
                       "does not match the package's programs: re-export the package)"), message
    assert "\n" not in message


def test_cli_run_refused_by_the_artifact_is_one_line(pkg, package, tmp_path, capsys):
    exported_max = hstu_export.load(package).input_schema.get("uih_lengths").max_value
    rewrite(pkg, widened)
    schema = hstu_export.load(pkg).input_schema
    request = save_tensors(generate_batch(schema, 1, seed=4, lengths={"uih_lengths": [exported_max + 1]}),
                           tmp_path / "request")
    capsys.readouterr()
    code = cli_main(["run", str(pkg), "--batch", str(request)])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "feature 'uih_lengths' has length" in err and "internal error" not in err


def test_a_compiled_guard_is_a_request_error_naming_the_features_at_their_limits(package, monkeypatch):
    """AOTInductor's guards carry no feature names: the refusal names the request's features at their
    limits instead (here one user at the shortest history and one candidate)."""
    predictor = hstu_export.load(package)

    def guarded(features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("run_impl failed: Expected u14 >= 2 but received 1")

    monkeypatch.setattr(predictor, "_runner", guarded)
    batch = generate_batch(predictor.input_schema, 1, seed=5, lengths={"uih_lengths": [1], "candidate_lengths": [1]})
    with pytest.raises(RequestError) as info:
        predictor(batch)
    message = str(info.value)
    assert "refuse this request although its manifest accepts it (run_impl failed: Expected u14 >= 2" in message
    assert "at their limits: B=1 (min), uih_lengths=1..1 (min), candidate_lengths=1..1 (min)" in message


def test_any_other_failure_of_the_programs_is_a_package_error(package, monkeypatch):
    predictor = hstu_export.load(package)

    def broken(features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("something inside the program\nwith a second line")

    monkeypatch.setattr(predictor, "_runner", broken)
    with pytest.raises(PackageError, match=r"running the package failed: something inside the program$"):
        predictor(generate_batch(predictor.input_schema, 2, seed=6))


def test_the_cpp_runtime_refuses_a_feature_dtype_the_artifact_does_not_take(pkg, tmp_path, cpp_runtime):
    schema = hstu_export.load(pkg).input_schema
    request = save_tensors(generate_batch(schema, 2, seed=7), tmp_path / "request")

    def narrower(manifest: dict[str, Any]) -> None:
        feature(manifest, "query_time")["dtype"] = "int32"

    rewrite(pkg, narrower)
    done = cpp_runtime.run(pkg, request, "--out", tmp_path / "out")
    assert done.returncode != 0 and not (tmp_path / "out").exists()
    assert ("field 'input_schema.features.query_time.dtype' is 'int32' but artifacts.model.inputs[" in done.stderr
            and "takes 'int64'" in done.stderr and len(done.stderr.strip().splitlines()) == 1), done.stderr
