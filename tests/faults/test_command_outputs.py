"""Fault campaign, issue 37: what the commands besides ``export`` write (``sign``, ``request --out``,
``run --output-dir/--output``, ``bench --json``, ``serving-repo``) on read-only and full disks, a serving
repository inside its package, the modes of what is written under the umask, and ``bench --batch-size``
beyond the package's maximum.

Read-only and full disks are real (a 1 MiB tmpfs, remounted read-only or filled to the last byte; root
needed, skipped otherwise) and simulated (``os.statvfs`` reporting a read-only mount; ``open`` failing
with ENOSPC under a directory: ``simulated_read_only`` and ``simulated_full_disk`` in conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import hstu_export
from hstu_export import generate_batch
from hstu_export.cli import main as cli_main
from hstu_export.package.directory import MANIFEST, load_manifest, rename_into_place
from hstu_export.package.tensor_dir import load_tensors
from hstu_export.verification.bench import clamp_batch_size

slow = pytest.mark.slow  # these use the conftest's exported package

CASES = ["sign", "request", "run --output-dir", "run --output", "bench --json", "serving-repo"]


@dataclass(frozen=True)
class Inputs:
    package: Path
    bundle: Path
    batch: Path  # 2 users, what the package accepts
    key: Path  # a P-256 private key


@pytest.fixture(scope="module")
def inputs(package, bundle, workdir) -> Inputs:
    batch = workdir / "batch.pt"
    torch.save(generate_batch(load_manifest(package).input_schema, 2, seed=3), batch)
    key = workdir / "key.pem"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return Inputs(package, bundle, batch, key)


def command(case: str, inputs: Inputs, place: Path) -> tuple[list[str], Path]:
    """The command line of ``case`` writing its output into the directory ``place``, and the output's path.
    ``sign`` writes into the package, so the package is copied into ``place`` first."""
    pkg = str(inputs.package)
    if case == "sign":
        target = place / "pkg"
        shutil.copytree(inputs.package, target)
        return ["sign", str(target), "--key", str(inputs.key)], target / "package.sig"
    if case == "request":
        return ["request", pkg, "--out", str(place / "req"), "--batch-size", "2"], place / "req"
    if case == "run --output-dir":
        return ["run", pkg, "--batch", str(inputs.batch), "--output-dir", str(place / "out")], place / "out"
    if case == "run --output":
        return ["run", pkg, "--batch", str(inputs.batch), "--output", str(place / "out.pt")], place / "out.pt"
    if case == "bench --json":
        return ["bench", pkg, "--model", str(inputs.bundle), "--batch-size", "1", "--iters", "1", "--warmup", "0",
                "--json", str(place / "bench.json")], place / "bench.json"
    assert case == "serving-repo"
    return ["serving-repo", pkg, "--out", str(place / "repo")], place / "repo"


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too): a file's bytes, None for a directory."""
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def fresh_dir(tmp_path: Path) -> Path:
    place = tmp_path / "disk"
    place.mkdir()
    return place


# --------------------------------------------------------------------- read-only and full disks


@slow
@pytest.mark.parametrize("case", CASES)
def test_read_only_destination_is_refused_before_work(case, inputs, tmp_path, simulated_read_only, cli_streams):
    place = fresh_dir(tmp_path)
    argv, _ = command(case, inputs, place)
    simulated_read_only(place)
    simulated_read_only(place / "pkg")  # sign writes into the package too
    before = snapshot(place)
    assert cli_main(argv) == 2
    line = cli_streams.error_line()
    assert "is on a read-only file system; choose a writable location" in line and str(place) in line
    assert cli_streams.stdout == ""  # refused before the package ran or was read for the repository
    assert snapshot(place) == before


@slow
@pytest.mark.parametrize("case", CASES)
def test_full_disk_while_writing_is_one_line_and_leaves_nothing(case, inputs, tmp_path, simulated_full_disk,
                                                                cli_streams):
    place = fresh_dir(tmp_path)
    argv, output = command(case, inputs, place)
    before = snapshot(place)
    simulated_full_disk(place)
    assert cli_main(argv) == 1
    line = cli_streams.error_line()
    doing = f"signing {place / 'pkg'}" if case == "sign" else f"writing the {_what(case)} {output}"
    assert line.startswith(f"error: {doing} failed: No space left on device"), line
    assert line.endswith("free some space or choose another location")
    assert snapshot(place) == before  # no partial output, no staging file or directory


def _what(case: str) -> str:
    return {"request": "request", "run --output-dir": "outputs", "run --output": "outputs",
            "bench --json": "benchmark results", "serving-repo": "serving repository"}[case]


@slow
@pytest.mark.parametrize("state", ["read-only", "full"])
@pytest.mark.parametrize("case", CASES)
def test_real_read_only_or_full_tmpfs(case, state, inputs, tiny_tmpfs, fill_up, cli_streams):
    argv, _ = command(case, inputs, tiny_tmpfs)
    if state == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    else:
        fill_up(tiny_tmpfs)
    before = snapshot(tiny_tmpfs)
    assert cli_main(argv) == (2 if state == "read-only" else 1)
    line = cli_streams.error_line()
    assert ("read-only file system" if state == "read-only" else "No space left on device") in line
    assert snapshot(tiny_tmpfs) == before


@slow
@pytest.mark.parametrize("case", ["sign", "run --output", "bench --json", "serving-repo"])
def test_failed_replace_keeps_the_previous_output(case, inputs, tmp_path, simulated_full_disk, cli_streams):
    """An output that exists (a signature, an outputs file, a results file, a repository with --force) is
    as it was when writing its replacement fails."""
    place = fresh_dir(tmp_path)
    argv, output = command(case, inputs, place)
    if case == "serving-repo":
        argv.append("--force")
    assert cli_main(argv) == 0 and output.exists()
    cli_streams.capsys.readouterr()
    before = snapshot(place)
    simulated_full_disk(place)
    assert cli_main(argv) == 1
    assert "No space left on device" in cli_streams.error_line()
    assert snapshot(place) == before


@slow
def test_sign_removes_a_temporary_signature_a_killed_sign_left(inputs, tmp_path, dead_pid):
    place = fresh_dir(tmp_path)
    argv, output = command("sign", inputs, place)
    (place / f".pkg.partial-{dead_pid}-package.sig").write_text("{}")
    (place / ".pkg.partial-1-package.sig").write_text("{}")  # of a live process (init): kept
    assert cli_main(argv) == 0 and output.is_file()
    assert sorted(p.name for p in place.iterdir()) == [".pkg.partial-1-package.sig", "pkg"]


@slow
def test_missing_parents_made_for_a_request_are_removed_when_it_fails(inputs, tmp_path, simulated_full_disk,
                                                                      cli_streams):
    place = fresh_dir(tmp_path)
    out = place / "a" / "b" / "req"
    simulated_full_disk(place)
    assert cli_main(["request", str(inputs.package), "--out", str(out), "--batch-size", "1"]) == 1
    assert f"writing the request {out} failed: No space left on device" in cli_streams.error_line()
    assert snapshot(place) == {}


@slow
@pytest.mark.parametrize("case", ["request", "run --output-dir"])
def test_output_directory_that_is_not_empty_is_refused(case, inputs, tmp_path, cli_streams):
    place = fresh_dir(tmp_path)
    argv, output = command(case, inputs, place)
    output.mkdir()
    (output / "ctr.pt").write_bytes(b"the user's own")  # also a name the command would write
    before = snapshot(place)
    assert cli_main(argv) == 2
    assert "exists and is not empty; choose a new directory" in cli_streams.error_line()
    assert snapshot(place) == before


@slow
def test_request_and_outputs_are_written_whole(inputs, tmp_path):
    """The atomic writers write what the commands produce: the request runs, the outputs directory and
    file hold the predictor's outputs, and no staging file or directory is left beside them."""
    place = fresh_dir(tmp_path)
    request, out_dir, out_file = place / "req", place / "out", place / "out.pt"
    assert cli_main(["request", str(inputs.package), "--out", str(request), "--batch-size", "2"]) == 0
    assert cli_main(["run", str(inputs.package), "--batch", str(request), "--output-dir", str(out_dir),
                     "--output", str(out_file)]) == 0
    expected = hstu_export.load(inputs.package)(load_tensors(request))
    from_dir, from_file = load_tensors(out_dir), torch.load(out_file, weights_only=True)
    assert set(from_dir) == set(from_file) == set(expected)
    for name, value in expected.items():
        assert torch.equal(from_dir[name], value) and torch.equal(from_file[name], value)
    assert sorted(p.name for p in place.iterdir()) == ["out", "out.pt", "req"]


# --------------------------------------------------------------------- a serving repository and its package


@slow
@pytest.mark.parametrize("where", ["inside", "itself", "through a link"])
def test_serving_repo_inside_its_package_is_refused(where, inputs, tmp_path, cli_streams):
    pkg = tmp_path / "pkg"
    shutil.copytree(inputs.package, pkg)
    out = {"inside": pkg / "repo", "itself": pkg, "through a link": tmp_path / "link" / "repo"}[where]
    (tmp_path / "link").symlink_to(pkg)
    before = snapshot(pkg)
    assert cli_main(["serving-repo", str(pkg), "--out", str(out)]) == 2
    line = cli_streams.error_line()
    assert f"--out {out} is inside the package {pkg}" in line and "choose another --out" in line
    assert snapshot(pkg) == before
    hstu_export.load(pkg)  # still whole: no file it does not list


@slow
def test_serving_repo_holding_its_package_is_not_replaced(inputs, tmp_path, cli_streams):
    repo = tmp_path / "repo"
    assert cli_main(["serving-repo", str(inputs.package), "--out", str(repo)]) == 0
    pkg = repo / "pkg"  # a package kept in a repository hstu-export wrote, which --force would replace
    shutil.copytree(inputs.package, pkg)
    before = snapshot(repo)
    assert cli_main(["serving-repo", str(pkg), "--out", str(repo), "--force"]) == 2
    assert f"--out {repo} contains the package {pkg}" in cli_streams.error_line()
    assert snapshot(repo) == before


def test_export_with_a_serving_repo_inside_the_package_is_refused_before_work(bundle, tmp_path, cli_streams):
    out = tmp_path / "pkg"
    assert cli_main([str(bundle), "--backend", "torchscript", "-o", str(out), "--emit-serving-repo",
                     str(out / "repo"), "-q"]) == 2
    assert f"is inside the package {out}" in cli_streams.error_line()
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------- modes under the umask


def modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix() or ".": stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.fixture
def umask():
    """``set(mask)`` sets the process's umask for the test; the old one is put back after."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


@slow
@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_package_and_outputs_follow_the_umask(mask, bundle, inputs, tmp_path, umask):
    umask(mask)
    settings = hstu_export.ExportSettings(backend="torchscript", max_batch_size=2,
                                          verify=hstu_export.VerifySettings(num_random_batches=0))
    pkg = hstu_export.export(bundle, tmp_path / "pkg", settings).path
    assert cli_main(["sign", str(pkg), "--key", str(inputs.key)]) == 0
    assert cli_main(["serving-repo", str(pkg), "--out", str(tmp_path / "repo")]) == 0
    assert cli_main(["request", str(pkg), "--out", str(tmp_path / "req"), "--batch-size", "1"]) == 0
    assert cli_main(["run", str(pkg), "--batch", str(tmp_path / "req"), "--output", str(tmp_path / "out.pt"),
                     "--output-dir", str(tmp_path / "out")]) == 0
    directory, file = 0o777 & ~mask, 0o666 & ~mask  # what mkdir and open give
    for root in (pkg, tmp_path / "repo", tmp_path / "req", tmp_path / "out", tmp_path / "out.pt"):
        found = modes(root)
        expected = {name: directory if (root / name).is_dir() else file for name in found}
        assert found == expected, root
    assert (pkg / "package.sig").is_file() and MANIFEST in modes(pkg)


def test_rename_into_place_gives_tempfile_outputs_the_umask_modes(tmp_path, umask):
    """tempfile makes 0700 directories and 0600 files; an executable file stays executable."""
    umask(0o002)
    staged = Path(tempfile.mkdtemp(dir=tmp_path))
    (staged / "sub").mkdir(mode=0o700)
    fd, name = tempfile.mkstemp(dir=staged / "sub")
    os.close(fd)
    tool = staged / "tool.so"
    tool.write_bytes(b"\x7fELF")
    tool.chmod(0o700)
    rename_into_place(staged, tmp_path / "out")
    assert modes(tmp_path / "out") == {".": 0o775, "sub": 0o775, f"sub/{Path(name).name}": 0o664, "tool.so": 0o775}


# --------------------------------------------------------------------- bench beyond the maximum batch size


def test_clamp_batch_size_says_when_it_cuts():
    assert clamp_batch_size(None, 32) == (32, None)
    assert clamp_batch_size(32, 32) == (32, None) and clamp_batch_size(3, 32) == (3, None)
    size, note = clamp_batch_size(64, 32)
    assert size == 32 and note == ("--batch-size 64 is beyond the package's maximum batch size 32; benchmarking "
                                   "batches of 32 users")


@slow
def test_bench_notes_a_batch_size_beyond_the_maximum(inputs, tmp_path, capsys):
    results = tmp_path / "bench.json"
    argv = ["bench", str(inputs.package), "--model", str(inputs.bundle), "--iters", "1", "--warmup", "0",
            "--json", str(results)]
    assert cli_main([*argv, "--batch-size", "64"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    note = "--batch-size 64 is beyond the package's maximum batch size 2; benchmarking batches of 2 users"
    assert err == [f"note: {note}"]
    res = json.loads(results.read_text())
    assert res["batch_size"] == 2 and res["requested_batch_size"] == 64 and res["note"] == note
    assert cli_main([*argv, "--batch-size", "2"]) == 0  # within the maximum: no note
    assert capsys.readouterr().err.strip() == ""
    res = json.loads(results.read_text())
    assert res["batch_size"] == 2 and "note" not in res and "requested_batch_size" not in res
    # The Python API says it too.
    from hstu_export.verification.packages import bench_package

    res = bench_package(inputs.package, str(inputs.bundle), batch_size=64, iters=1, warmup=0)
    assert res["batch_size"] == 2 and res["requested_batch_size"] == 64 and res["note"] == note
