"""A package is untrusted input (issue 12, item 3).

A fault campaign found manifest.json trusted whole: a file path of ``../x`` or an absolute path was
loaded from outside the package without a checksum; ``op_libraries`` imported any module named there;
malformed fields gave internal errors (KeyError/TypeError); of 100 random single-bit flips of
manifest.json, 44 were accepted silently. Now the manifest is validated field by field, every path
stays inside the package and is listed with its sha256, op libraries come from a fixed list, and
manifest.sha256 covers the manifest itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch
from hstu_export.cli import main as cli_main
from hstu_export.errors import PackageError, RequestError
from hstu_export.package.manifest import OP_LIBRARIES, Manifest
from hstu_export.runtimes.predictor import load_op_libraries

pytestmark = pytest.mark.slow

MODEL_FILE = "model/model.ts"  # the torchscript backend's one artifact


@pytest.fixture(scope="module")
def package(workdir, bundle) -> Path:
    settings = ExportSettings(backend="torchscript", max_batch_size=4, verify=VerifySettings(num_random_batches=1))
    return hstu_export.export(bundle, workdir / "pkg-torchscript", settings).path


@pytest.fixture(scope="module")
def example(package) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A request and the package's outputs for it, before anything was tampered with."""
    predictor = hstu_export.load(package)
    batch = generate_batch(predictor.input_schema, 3, seed=5)
    return batch, predictor(batch)


@pytest.fixture(scope="module")
def batch_file(workdir, example) -> Path:
    path = workdir / "batch.pt"
    torch.save(example[0], path)
    return path


@pytest.fixture
def pkg(package, tmp_path) -> Path:
    """A private copy of the package, to damage."""
    target = tmp_path / "pkg"
    shutil.copytree(package, target)
    return target


def read(root: Path) -> dict[str, Any]:
    return json.loads((root / "manifest.json").read_text())


def reseal(root: Path) -> None:
    """Recomputes manifest.sha256, as someone editing the manifest on purpose would: what is left to
    refuse the edit is the validation of the fields."""
    digest = hashlib.sha256((root / "manifest.json").read_bytes()).hexdigest()
    (root / "manifest.sha256").write_text(f"{digest}  manifest.json\n")


def write(root: Path, manifest: dict[str, Any]) -> None:
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    reseal(root)


def edit(root: Path, path: tuple[Any, ...], value: Any = None, *, remove: bool = False) -> None:
    manifest = read(root)
    obj = manifest
    for key in path[:-1]:
        obj = obj[key]
    if remove:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    write(root, manifest)


def label(path: tuple[Any, ...]) -> str:
    """A field's name as messages spell it: ``backend.files.model``, ``output_names[0]``, ``files['a/b']``."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        elif re.fullmatch(r"[A-Za-z_]\w*", key):
            out += f".{key}" if out else key
        else:
            out += f"[{key!r}]"
    return out


def refused(root: Path, match: str | None = None, **kwargs: Any) -> str:
    with pytest.raises(PackageError) as info:
        hstu_export.load(root, **kwargs)
    message = str(info.value)
    if match is not None:
        assert re.search(match, message), message
    assert "\n" not in message.strip()
    return message


def outside_copy_of_model(pkg: Path) -> Path:
    """The package's model file, byte for byte, outside the package (so its sha256 matches)."""
    outside = pkg.parent / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copy(pkg / MODEL_FILE, outside / "model.ts")
    return outside / "model.ts"


# -- a package as written ------------------------------------------------------------------------

def test_fresh_package_loads_and_its_manifest_checksum_is_sha256sum_format(package, example):
    predictor = hstu_export.load(package)
    assert isinstance(predictor.manifest, dict) and predictor.manifest["format_version"] == 5
    typed = predictor.package_manifest
    assert isinstance(typed, Manifest)
    assert typed.backend.files == {"model": MODEL_FILE} and set(typed.files) == {MODEL_FILE}
    assert typed.op_libraries == () and typed.output_names == ("ctr", "cvr")  # the lookups call no fbgemm op
    digest = hashlib.sha256((package / "manifest.json").read_bytes()).hexdigest()
    assert (package / "manifest.sha256").read_text() == f"{digest}  manifest.json\n"
    if shutil.which("sha256sum"):  # checkable without Python
        subprocess.run(["sha256sum", "--check", "--status", "manifest.sha256"], cwd=package, check=True)
    batch, outputs = example
    for name, value in predictor(batch).items():
        assert torch.equal(value, outputs[name])


# -- paths ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("verify_checksums", [True, False])
@pytest.mark.parametrize("listed", [True, False], ids=["listed", "unlisted"])
@pytest.mark.parametrize("spelling", [
    "absolute", "../outside/model.ts", "model//model.ts", "./model/model.ts", "model/./model.ts",
    "model/../model/model.ts", "model/model.ts/", "model\\model.ts", "",
])
def test_paths_that_leave_the_package_or_respell_a_file_are_refused(pkg, spelling, listed, verify_checksums):
    outside = outside_copy_of_model(pkg)
    path = str(outside) if spelling == "absolute" else spelling
    manifest = read(pkg)
    manifest["backend"]["files"]["model"] = path
    if listed:  # with a matching sha256: only the path itself is wrong
        manifest["files"][path] = manifest["files"][MODEL_FILE]
    write(pkg, manifest)
    field = label(("files", path)) if listed else "backend.files.model"
    message = refused(pkg, verify_checksums=verify_checksums)
    assert f"manifest field {field}:" in message
    assert ("absolute path" if spelling == "absolute" else "not a plain relative path") in message


@pytest.mark.parametrize("verify_checksums", [True, False])
def test_artifact_symlinked_out_of_the_package_is_refused(pkg, verify_checksums):
    outside = outside_copy_of_model(pkg)
    (pkg / MODEL_FILE).unlink()
    (pkg / MODEL_FILE).symlink_to(outside)  # same bytes: the sha256 would match
    message = refused(pkg, "leaves the package", verify_checksums=verify_checksums)
    assert "backend.files.model" in message


@pytest.mark.parametrize("verify_checksums", [True, False])
def test_directory_symlinked_out_of_the_package_is_refused(pkg, verify_checksums):
    outside = outside_copy_of_model(pkg).parent
    shutil.rmtree(pkg / "model")
    (pkg / "model").symlink_to(outside, target_is_directory=True)
    refused(pkg, "backend.files.model: model/model.ts leaves the package", verify_checksums=verify_checksums)


@pytest.mark.parametrize("name", ["manifest.json", "manifest.sha256"])
def test_symlinked_manifest_outside_the_package_is_refused(pkg, package, name):
    (pkg / name).unlink()
    (pkg / name).symlink_to(package / name)  # the same bytes, outside
    refused(pkg, f"{name} leaves the package")


@pytest.mark.parametrize("verify_checksums", [True, False])
def test_artifact_not_listed_with_a_checksum_is_refused(pkg, verify_checksums):
    shutil.copy(pkg / MODEL_FILE, pkg / "model" / "other.ts")
    edit(pkg, ("backend", "files", "model"), "model/other.ts")
    refused(pkg, r"backend\.files\.model: model/other\.ts is not listed in the manifest's files",
            verify_checksums=verify_checksums)


def test_two_roles_naming_one_file_are_refused(pkg):
    edit(pkg, ("backend", "files", "sparse"), MODEL_FILE)
    refused(pkg, r"backend\.files\.sparse: model/model\.ts is also backend\.files\.model")


def test_file_not_in_the_manifest_is_refused(pkg):
    (pkg / "model" / "smuggled.py").write_text("print('hi')\n")
    refused(pkg, r"files not in the manifest: \['model/smuggled.py'\]")


# -- op libraries --------------------------------------------------------------------------------

EVIL_MODULE = "hstu_manifest_evil_module"


@pytest.mark.parametrize("name", ["os", EVIL_MODULE, f"hstu_export.ops.{EVIL_MODULE}", "fbgemm_gpu.x",
                                  "hstu_export.exporter", "", "FBGEMM_GPU"])
def test_op_library_outside_the_fixed_list_is_never_imported(pkg, tmp_path, monkeypatch, name):
    marker = tmp_path / "imported.txt"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{EVIL_MODULE}.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    edit(pkg, ("op_libraries",), ["fbgemm_gpu", name])
    refused(pkg, r"manifest field op_libraries\[1\]: .* is not an op library hstu-export loads")
    # The loader itself refuses too (it maps names to modules; it never imports a manifest's string).
    with pytest.raises(PackageError, match="not one hstu-export loads"):
        load_op_libraries([name], pkg)
    assert not marker.exists()
    assert EVIL_MODULE not in sys.modules


def test_fixed_op_library_list_covers_what_exports_write():
    from hstu_export.runtimes.graph_io import OP_LIBRARY_MODULES
    from hstu_export.runtimes.tensorrt import RUNTIME_LIBRARY

    assert {*OP_LIBRARY_MODULES.values(), RUNTIME_LIBRARY} <= set(OP_LIBRARIES)
    assert set(OP_LIBRARIES.values()) == set(OP_LIBRARIES)  # each name imports the module of that name


# -- fields: wrong type, missing, wrong value ----------------------------------------------------

FEATURE0 = ("input_schema", "features", 0)  # uih_lengths
FIELDS = [
    ("format",), ("format_version",), ("op_namespace",), ("model",), ("model", "bundle"), ("versions",),
    ("versions", "torch"), ("backend",), ("backend", "name"), ("backend", "files"), ("backend", "files", "model"),
    ("backend", "meta"), ("device",), ("device", "type"), ("device", "arch"), ("device", "name"), ("dtype",),
    ("op_target",), ("op_libraries",), ("op_libraries", 0), ("input_schema",), ("input_schema", "features"),
    FEATURE0, (*FEATURE0, "name"), (*FEATURE0, "dtype"), (*FEATURE0, "kind"), (*FEATURE0, "max_value"),
    (*FEATURE0, "trailing"), (*FEATURE0, "same_as"), ("input_schema", "arguments"), ("ranges",),
    ("ranges", "max_batch_size"), ("ranges", "lengths"), ("ranges", "lengths", "max_batch_size"),
    ("ranges", "lengths", "max_lengths"), ("ranges", "lengths", "max_lengths", "uih_lengths"),
    ("ranges", "lengths", "min_lengths"), ("ranges", "dims"), ("sparse_input_names",), ("sparse_input_names", 0),
    ("sparse_output_names",), ("dense_input_names",), ("dense_passthrough_inputs",), ("output_names",),
    ("output_names", 0), ("files",), ("files", MODEL_FILE), ("parity",), ("parity", "tolerances"),
    ("parity", "tolerances", "rel_l2"), ("parity", "passed"), ("created",), ("timings",), ("passes",),
    ("capture",), ("settings",), ("sparse_lowering",), ("artifacts",), ("artifacts", "model"), ("artifacts", "model", "file"),
    ("artifacts", "model", "format"), ("artifacts", "model", "inputs"), ("artifacts", "model", "inputs", 0),
    ("artifacts", "model", "inputs", 0, "name"), ("artifacts", "model", "inputs", 0, "shape"),
    ("artifacts", "model", "inputs", 0, "feature"), ("artifacts", "model", "outputs"), ("op_library_files",),
]
# Fields a package may leave out (their absence has a meaning), and list items (removing one is
# a different list, tested by value below).
OPTIONAL = {("model", "bundle"), (*FEATURE0, "max_value"), (*FEATURE0, "trailing"), (*FEATURE0, "same_as"),
            ("parity", "tolerances"), ("parity", "passed"), ("created",), ("timings",), ("passes",),
            ("capture",), ("settings",), ("sparse_lowering",), ("artifacts", "model", "inputs", 0, "feature"),
            ("op_library_files",)}
REQUIRED = [f for f in FIELDS if f not in OPTIONAL and not isinstance(f[-1], int)]
# Where removing a field is reported under another name.
REMOVED_AS = {("files", MODEL_FILE): "backend.files.model"}


def wrong_type(value: Any) -> Any:
    return "7" if isinstance(value, (int, float)) and not isinstance(value, bool) else 7


@pytest.mark.parametrize("path", FIELDS, ids=label)
def test_field_of_the_wrong_type_is_refused_naming_it(pkg, path):
    manifest = read(pkg)
    if path == ("op_libraries", 0):
        manifest["op_libraries"] = ["fbgemm_gpu"]  # the package needs none: one to spoil
    obj = manifest
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = wrong_type(obj[path[-1]])
    write(pkg, manifest)
    message = refused(pkg)
    assert f"manifest field {label(path)}" in message, message


@pytest.mark.parametrize("path", REQUIRED, ids=label)
def test_missing_field_is_refused_naming_it(pkg, path):
    edit(pkg, path, remove=True)
    message = refused(pkg)
    assert f"manifest field {REMOVED_AS.get(path, label(path))}" in message, message


@pytest.mark.parametrize("path", sorted(OPTIONAL, key=label), ids=label)
def test_optional_field_may_be_left_out(pkg, path, example):
    edit(pkg, path, remove=True)
    batch, outputs = example
    got = hstu_export.load(pkg)(batch)
    assert all(torch.equal(got[k], outputs[k]) for k in outputs)


@pytest.mark.parametrize(("path", "value", "match"), [
    (("backend", "name"), "pickle", r"backend\.name: 'pickle' is not one of aoti, torchscript"),
    (("device", "type"), "tpu", r"device\.type: 'tpu' is not one of cpu, cuda"),
    (("dtype",), "float8", r"dtype: 'float8' is not one of float32"),
    (("op_target",), "cuda", r"op_target: 'cuda' is not one of"),
    (("op_namespace",), "hstu", r"namespace 'hstu' \(manifest field op_namespace\)"),
    (("format",), "someone-elses", r"not an hstu-export manifest \(manifest field format"),
    (("format_version",), 99, r"format 99 \(manifest field format_version\).*upgrade hstu-export"),
    (("format_version",), True, r"manifest field format_version"),
    (("files", MODEL_FILE), "0" * 63, r"files\['model/model.ts'\]: expected a sha256"),
    (("ranges", "max_batch_size"), 0, r"ranges\.max_batch_size: 0 is below the minimum 1"),
    (("ranges", "lengths", "max_batch_size"), 9, r"ranges\.lengths\.max_batch_size: 9 differs"),
    (("ranges", "lengths", "min_lengths", "uih_lengths"), 99, r"min_lengths\.uih_lengths: is above its maximum"),
    (("ranges", "dims", "batch"), [4, 1], r"ranges\.dims\.batch: \[4, 1\]: min is above max"),
    (("sparse_input_names", 0), "nope", r"sparse_input_names\[0\]: 'nope' is not a feature of input_schema"),
    (("dense_passthrough_inputs", 0), "ctr", r"dense_passthrough_inputs\[0\]: 'ctr' is not a feature"),
    (("sparse_output_names", 0), "user_id", r"sparse_output_names\[0\]: 'user_id' is a feature"),
    (("dense_input_names",), [], r"manifest field dense_input_names: expected the sparse outputs"),
    (("output_names",), [], r"output_names: is empty"),
    (("output_names",), ["ctr", "ctr"], r"output_names: names \['ctr'\] twice"),
    (("op_libraries",), ["fbgemm_gpu", "fbgemm_gpu"], r"op_libraries: names \['fbgemm_gpu'\] twice"),
    ((*FEATURE0, "kind"), "ragged", r"manifest field input_schema: feature 'uih_lengths': kind 'ragged'"),
    ((*FEATURE0, "dtype"), "int128", r"manifest field input_schema: feature 'uih_lengths': dtype 'int128'"),
    ((*FEATURE0, "max_value"), 4.5, r"input_schema\.features\[0\]\.max_value: expected an int, got float"),
    ((*FEATURE0, "max_value"), float("nan"), r"input_schema\.features\[0\]\.max_value: nan is not a finite"),
    ((*FEATURE0, "surprise"), 1, r"input_schema\.features\[0\]\.surprise: unknown key"),
    ((*FEATURE0, "name"), "uih\nlengths", r"input_schema\.features\[0\]\.name: 'uih\\nlengths' contains a control"),
    (("versions", "torch"), "2.13\nrm -rf /", r"versions\.torch: '2\.13\\nrm -rf /' contains a control character"),
    ((*FEATURE0, "trailing"), [-1], r"input_schema\.features\[0\]\.trailing\[0\]: -1 is below"),
    (("input_schema", "features", 2, "jagged_by"), "user_id", r"refers to 'user_id', which is not a lengths"),
    (("parity", "tolerances", "rel_l2"), -1.0, r"parity\.tolerances\.rel_l2: -1.0 is below the minimum 0"),
    (("versions", "torch"), "1.0", r"built with torch 1\.0 .*re-export"),
])
def test_field_of_the_wrong_value_is_refused_naming_it(pkg, path, value, match):
    edit(pkg, path, value)
    refused(pkg, match)


def test_cuda_package_on_this_machine(pkg):
    edit(pkg, ("device", "type"), "cuda")  # arch stays the CPU's: refused on any machine
    refused(pkg, "no usable CUDA device|compiled for x86_64|compiled for")


@pytest.mark.parametrize("text", ["[]", "null", '"manifest"', "{", "", "\xff\xfe", '{"format": 7}',
                                  '{"format": "hstu-export-package", "format": "hstu-export-package"}'])
def test_manifest_that_is_not_one_is_refused(pkg, text):
    (pkg / "manifest.json").write_bytes(text.encode("latin-1"))
    reseal(pkg)
    refused(pkg, "corrupt|not an hstu-export manifest")


def test_huge_manifest_is_refused_without_reading_it(pkg):
    with open(pkg / "manifest.json", "r+b") as f:
        f.truncate(65 * 2**20)  # sparse: no 65 MiB written
    refused(pkg, r"manifest\.json is 68157440 bytes, too large for a manifest")


def test_duplicate_keys_are_refused(pkg):
    text = (pkg / "manifest.json").read_text()
    (pkg / "manifest.json").write_text(text.replace('  "dtype": "float32"', '  "dtype": "float16",\n  "dtype": "float32"'))
    reseal(pkg)
    refused(pkg, r"corrupt: key 'dtype' appears twice")


# -- the manifest's own checksum -----------------------------------------------------------------

def test_edit_without_updating_the_checksum_is_refused(pkg):
    manifest = read(pkg)
    manifest["ranges"]["lengths"]["max_lengths"]["uih_lengths"] = 10_000  # valid, but not what was exported
    (pkg / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    refused(pkg, r"checksum mismatch for manifest\.json .*re-export")
    refused(pkg, r"checksum mismatch for manifest\.json", verify_checksums=False)


@pytest.mark.parametrize("content", ["", "0" * 64 + "  manifest.json\n", "not a checksum\n",
                                     "{} *manifest.json\n", "{}  other.json\n", "{}  manifest.json\nextra\n"])
def test_damaged_manifest_checksum_file_is_refused(pkg, content):
    digest = hashlib.sha256((pkg / "manifest.json").read_bytes()).hexdigest()
    (pkg / "manifest.sha256").write_text(content.format(digest))
    refused(pkg, r"manifest\.sha256 is corrupt|checksum mismatch for manifest\.json")


def test_missing_manifest_checksum_is_refused(pkg):
    (pkg / "manifest.sha256").unlink()
    refused(pkg, r"manifest\.sha256 \(the checksum of manifest\.json\) is missing.*re-export")


def test_package_of_format_2_is_refused_with_re_export(pkg):
    edit(pkg, ("format_version",), 2)  # written before manifests had their own checksum
    refused(pkg, r"package of format 2 \(its manifest has no checksum of its own \(manifest\.sha256\)\).*"
                 r"reads formats 4 to 5: re-export the model")


def test_package_of_format_3_is_refused_with_re_export(pkg):
    edit(pkg, ("format_version",), 3)  # written before manifests described their artifacts
    refused(pkg, r"package of format 3 \(its manifest does not describe its artifacts' inputs and outputs.*"
                 r"reads formats 4 to 5: re-export the model")


@pytest.mark.parametrize(("path", "value", "message"), [
    (("artifacts", "model", "file"), "model/other.ts", r"artifacts\.model\.file: model/other\.ts is not backend\.files\.model"),
    (("artifacts", "model", "inputs", 5, "feature"), "nope", r"artifacts\.model\.inputs\[5\]\.feature: 'nope' is not a feature"),
    (("artifacts", "model", "outputs", 0, "dtype"), "complex64", r"artifacts\.model\.outputs\[0\]\.dtype"),
    (("artifacts", "extra"), {}, r"backend\.files\.extra: missing \(artifacts\.extra describes it\)"),
])
def test_artifact_descriptions_are_checked(pkg, path, value, message):
    edit(pkg, path, value)
    refused(pkg, message)


def flipped_packages(root: Path, seed: int, count: int) -> list[tuple[int, int, bytes]]:
    data = (root / "manifest.json").read_bytes()
    rng = random.Random(seed)
    flips = []
    for _ in range(count):
        offset, bit = rng.randrange(len(data)), rng.randrange(8)
        flipped = bytearray(data)
        flipped[offset] ^= 1 << bit
        flips.append((offset, bit, bytes(flipped)))
    return flips


def parsed(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return ValueError


def test_random_bit_flips_are_refused_or_harmless(pkg, example):
    batch, outputs = example
    original = parsed((pkg / "manifest.json").read_bytes())
    refused_flips = 0
    for offset, bit, data in flipped_packages(pkg, seed=12, count=100):
        (pkg / "manifest.json").write_bytes(data)
        try:
            predictor = hstu_export.load(pkg)
        except PackageError:
            refused_flips += 1
            continue
        # Accepted: only if the flip left the manifest's content as it was (whitespace), and then the
        # package must behave exactly as before.
        assert parsed(data) == original, f"flip of bit {bit} at byte {offset} changed the manifest and was accepted"
        got = predictor(batch)
        assert all(torch.equal(got[k], outputs[k]) for k in outputs)
    assert refused_flips >= 90  # the manifest is mostly content: nearly every flip changes it


def compact(root: Path) -> None:
    """The manifest without the fields no load reads (reports, settings, timings), written without
    indentation: flips then land on what the loader and the runtimes use."""
    manifest = read(root)
    for key in ("passes", "boundary", "capture", "settings", "timings", "triton_configs", "created"):
        del manifest[key]
    manifest["model"] = {"bundle": None}
    manifest["parity"] = {"passed": True, "tolerances": manifest["parity"]["tolerances"]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    reseal(root)


def test_random_bit_flips_with_a_recomputed_checksum_never_give_an_internal_error(pkg, example):
    """Flips made on purpose (the checksum recomputed) must meet the field validation: each one is
    refused with PackageError, or the package loads and serves the request as before (or refuses it as
    outside a range the flip narrowed, or naming a feature the flip renamed). Never another exception."""
    batch, outputs = example
    compact(pkg)
    got = hstu_export.load(pkg)(batch)
    assert all(torch.equal(got[k], outputs[k]) for k in outputs)
    outcomes = {"refused": 0, "request refused": 0, "identical": 0}
    for offset, bit, data in flipped_packages(pkg, seed=34, count=100):
        (pkg / "manifest.json").write_bytes(data)
        reseal(pkg)
        where = f"flip of bit {bit} at byte {offset}"
        try:
            predictor = hstu_export.load(pkg)
        except PackageError:
            outcomes["refused"] += 1
            continue
        try:
            got = predictor(batch)
        except RequestError:
            outcomes["request refused"] += 1
            continue
        assert set(got) == set(outputs), where
        assert all(torch.equal(got[k], outputs[k]) for k in outputs), where
        outcomes["identical"] += 1
    # Most flips break the JSON or a field's name, type or value; the rest (a digit of a range, a letter of
    # a string nothing checks) load.
    assert sum(outcomes.values()) == 100 and outcomes["refused"] >= 80, outcomes


# -- the CLI -------------------------------------------------------------------------------------

def flip_one_bit(root: Path) -> None:
    data = bytearray((root / "manifest.json").read_bytes())
    data[len(data) // 3] ^= 0x04
    (root / "manifest.json").write_bytes(bytes(data))


DAMAGE = {
    "bit flip": flip_one_bit,
    "path ../": lambda root: edit(root, ("backend", "files", "model"), "../model.ts"),
    "absolute path": lambda root: edit(root, ("backend", "files", "model"), "/etc/passwd"),
    "op library os": lambda root: edit(root, ("op_libraries",), ["os"]),
    "wrong type": lambda root: edit(root, ("backend", "files", "model"), 7),
    "missing field": lambda root: edit(root, ("input_schema",), remove=True),
    "wrong value": lambda root: edit(root, ("ranges", "max_batch_size"), -4),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_cli_run_on_an_untrusted_package_exits_2_with_one_line(pkg, batch_file, capsys, damage):
    DAMAGE[damage](pkg)
    capsys.readouterr()
    assert cli_main(["run", str(pkg), "--batch", str(batch_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert "internal error" not in err and "Traceback" not in err


def test_cli_process_on_a_flipped_manifest_exits_2_with_one_line(pkg, batch_file):
    flip_one_bit(pkg)
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from hstu_export.cli import main; sys.exit(main())",
         "run", str(pkg), "--batch", str(batch_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "manifest.json" in lines[0], proc.stderr[-2000:]


def test_typed_manifest_is_what_the_loader_reads(pkg, example):
    """Predictor.manifest stays the decoded dict; the typed manifest holds the same values."""
    predictor = hstu_export.load(pkg)
    typed, raw = predictor.package_manifest, predictor.manifest
    assert raw == read(pkg)
    assert typed.backend.name == raw["backend"]["name"] and typed.files == raw["files"]
    assert typed.ranges.max_batch_size == raw["ranges"]["max_batch_size"] == predictor.max_batch_size
    assert list(typed.dense_input_names) == raw["dense_input_names"]
    assert typed.input_schema.to_json() == raw["input_schema"]
    assert copy.deepcopy(raw) == raw  # plain JSON values


def test_backend_load_handed_a_dict_checks_its_fields_and_paths(pkg, example):
    """Code may hand a backend's load() a dict of just the fields it reads (tests do): their types and
    paths are checked as in a package's manifest."""
    from hstu_export.runtimes.torchscript import TorchScriptBackend

    manifest = read(pkg)
    fields = {key: manifest[key] for key in ("backend", "sparse_input_names", "sparse_output_names",
                                             "dense_passthrough_inputs", "output_names")}
    backend, cpu = TorchScriptBackend(), torch.device("cpu")
    batch, outputs = example
    schema = hstu_export.load(pkg).input_schema
    got = backend.load(pkg, copy.deepcopy(fields), cpu)(schema.to_graph_inputs(batch))
    assert all(torch.equal(got[k], outputs[k]) for k in outputs)
    for path, value, match in [
        (("backend", "files", "model"), "../model.ts", r"backend\.files\.model: '\.\./model\.ts' is not a plain"),
        (("backend", "files", "model"), "/etc/passwd", r"backend\.files\.model: '/etc/passwd' is an absolute path"),
        (("output_names",), None, r"manifest field output_names: expected an array, got null"),
        (("backend", "name"), "pickle", r"backend\.name: 'pickle' is not one of"),
    ]:
        bad = copy.deepcopy(fields)
        obj = bad
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
        with pytest.raises(PackageError, match=match):
            backend.load(pkg, bad, cpu)
    outside = outside_copy_of_model(pkg)
    (pkg / MODEL_FILE).unlink()
    (pkg / MODEL_FILE).symlink_to(outside)
    with pytest.raises(PackageError, match="backend.files.model: model/model.ts leaves the package"):
        backend.load(pkg, copy.deepcopy(fields), cpu)
