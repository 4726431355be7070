"""Fault campaign, issue 12 items 5 and 6: file-system failures while writing a package, sizes the machine
cannot hold, bundle checksums and malformed bundles.

What is real and what is simulated here:
- real: a torch zip writer failing on a full device (it writes to ``/dev/full``, which answers every write
  with ENOSPC) inside ``staging_dir``, in a subprocess because the unfixed failure aborts the process; a
  byte flipped inside a real bundle's largest tensor record; malformed configs and state dicts; sizes
  (``item_vocab_size=10**12``, ``--max-batch-size 2**64``) against this machine's memory; with root and
  ``mount`` (skipped otherwise), a 1 MiB tmpfs as ``--out``'s file system, full for real.
- simulated (monkeypatched): free disk space (``shutil.disk_usage``), a read-only mount (``os.statvfs``),
  a missing write permission (``os.access``; as root, chmod 0o555 stops nothing), ``mkdtemp`` failing,
  writers raising ``OSError(ENOSPC/EROFS/EACCES)`` mid-write, and the machine's available memory.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

import hstu_export.settings as settings_module
import hstu_export.sources.bundle as bundle_module
from hstu_export import export, generate_batch, load_bundle, save_bundle
from hstu_export.cli import main as cli_main
from hstu_export.errors import BundleError, ConfigError, ExportError, PackageError, VerificationError
from hstu_export.models import HSTUConfig, HstuRankingModel, build_preset
from hstu_export.package.directory import check_target, staging_dir
from hstu_export.settings import ExportSettings
from hstu_export.sources.bundle import CHECKSUM_KEY, content_sha256

REPO = Path(__file__).resolve().parents[2]
NORM = "transducer.post_norm_weight"


def one_error_line(capsys) -> str:
    """The CLI's stderr is exactly one ``error:`` line (no traceback, no 'internal error')."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error:") and "internal error" not in lines[0]
    return lines[0]


def entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def fake_memory(monkeypatch, available: int, total: int = 2**30) -> None:
    for module in (settings_module, bundle_module):
        monkeypatch.setattr(module, "machine_memory", lambda: (total, available))


def edited(bundle: Path, tmp_path: Path, name: str, *, keep_checksum: bool = False, **changes) -> Path:
    """A copy of ``bundle`` with payload keys replaced; without ``keep_checksum`` the checksum is dropped (as
    in a bundle written before checksums), so what is tested is the validation, not the checksum."""
    data = torch.load(bundle, weights_only=True)
    data.update(changes)
    if not keep_checksum:
        data.pop(CHECKSUM_KEY, None)
    path = tmp_path / name
    torch.save(data, path)
    return path


def with_config(bundle: Path, tmp_path: Path, **config) -> Path:
    data = torch.load(bundle, weights_only=True)
    source = dict(data["source"], config=dict(data["source"]["config"], **config))
    return edited(bundle, tmp_path, "config.pt", source=source)


# ------------------------------------------------------------------ writing the package: file-system errors


def test_read_only_out_parent_is_refused_before_work(bundle, tmp_path, monkeypatch, capsys):
    """Simulated read-only mount: ``os.statvfs`` reports ST_RDONLY for the parent."""
    parent = tmp_path / "ro"
    parent.mkdir()
    real = os.statvfs

    def statvfs(path):
        result = real(path)
        if Path(path) == parent:
            return os.statvfs_result((*result[:8], result.f_flag | os.ST_RDONLY, *result[9:]))
        return result

    monkeypatch.setattr(os, "statvfs", statvfs)
    assert cli_main(["export", str(bundle), "-o", str(parent / "pkg"), "-q"]) == 2
    assert "read-only file system" in one_error_line(capsys)
    assert entries(parent) == set()


def test_unwritable_out_parent_is_refused_before_work(bundle, tmp_path, monkeypatch, capsys):
    """Real (chmod 0o555) when not root; as root, permission is simulated through ``os.access``."""
    parent = tmp_path / "locked"
    parent.mkdir()
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == parent else real(p, mode, **kw))
    else:
        parent.chmod(0o555)
    try:
        assert cli_main(["export", str(bundle), "-o", str(parent / "pkg"), "-q"]) == 2
        assert "not writable" in one_error_line(capsys)
        assert entries(parent) == set()
    finally:
        parent.chmod(0o755)


def test_unwritable_dump_graphs_dir_is_refused_before_work(bundle, tmp_path, monkeypatch, capsys):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    real = os.statvfs

    def statvfs(path):
        result = real(path)
        if Path(path) == dumps:
            return os.statvfs_result((*result[:8], result.f_flag | os.ST_RDONLY, *result[9:]))
        return result

    monkeypatch.setattr(os, "statvfs", statvfs)
    out = tmp_path / "pkg"
    assert cli_main(["export", str(bundle), "-o", str(out), "--dump-graphs", str(dumps / "deeper"), "-q"]) == 2
    line = one_error_line(capsys)
    assert "--dump-graphs" in line and "read-only" in line
    assert not out.exists() and entries(dumps) == set()


def test_not_enough_disk_space_is_refused_with_the_estimate(bundle, tmp_path, monkeypatch, capsys):
    """Simulated: ``shutil.disk_usage`` reports 1 MiB free."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=2**20))
    out = tmp_path / "pkg"
    assert cli_main(["export", str(bundle), "-o", str(out), "-q"]) == 2
    line = one_error_line(capsys)
    # tiny: 93,442 float32 parameters = 365 KiB; x1.25 + 64 MiB for code and graphs.
    assert "not enough disk space" in line and "365.0 KiB of weights" in line and "64.4 MiB" in line
    assert "1.0 MiB is free" in line
    assert entries(tmp_path) == set()


def test_staging_dir_that_cannot_be_created_is_one_line(tmp_path, monkeypatch):
    def mkdtemp(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path))

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(PackageError, match="cannot create the package beside .*Read-only file system"):
        with staging_dir(tmp_path / "pkg"):
            pass


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT])
def test_write_failure_inside_the_staging_dir_becomes_one_export_error(tmp_path, code):
    """A writer raising OSError mid-write (simulated), bare or wrapped by a backend's own error."""
    target = tmp_path / "pkg"
    for wrapped in (False, True):
        with pytest.raises(ExportError) as caught:
            with staging_dir(target) as staged:
                (staged / "dense").mkdir()
                (staged / "dense" / "part.bin").write_bytes(b"x" * 1000)
                error = OSError(code, os.strerror(code), str(staged / "dense" / "dense.pt2"))
                if not wrapped:
                    raise error
                try:
                    raise error
                except OSError as exc:
                    raise ExportError("AOTInductor compilation failed: whatever it said") from exc
        message = str(caught.value)
        assert message.startswith(f"writing the package {target} failed: {os.strerror(code)}")
        assert "dense.pt2" in message and "\n" not in message
        assert entries(tmp_path) == set()  # staging removed, nothing else touched


def test_copytree_failure_inside_the_staging_dir_becomes_one_export_error(tmp_path):
    with pytest.raises(ExportError, match="No space left on device"):
        with staging_dir(tmp_path / "pkg") as staged:
            raise shutil.Error([(str(tmp_path / "a.svg"), str(staged / "graphs" / "a.svg"),
                                 "[Errno 28] No space left on device: 'a.svg'")])
    assert entries(tmp_path) == set()


def test_other_errors_inside_the_staging_dir_pass_unchanged(tmp_path):
    for error in (ValueError("a bug"), VerificationError("differs"), OSError(errno.ENOENT, "No such file")):
        with pytest.raises(type(error)) as caught:
            with staging_dir(tmp_path / "pkg"):
                raise error
        assert caught.value is error
    assert entries(tmp_path) == set()


ZIP_ON_FULL_DEVICE = """
import shutil, sys
from pathlib import Path
from torch.export.pt2_archive._package import PT2ArchiveWriter  # AOTInductor's package writer
from hstu_export.package.directory import staging_dir
if sys.argv[2] == "full":
    real = shutil.disk_usage
    shutil.disk_usage = lambda p: real(p)._replace(free=0)
try:
    with staging_dir(Path(sys.argv[1])):
        with PT2ArchiveWriter("/dev/full") as writer:
            writer.write_bytes("data/weights", b"x" * 200_000)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("disk", ["full", "not-full"])
def test_torch_zip_writer_failing_does_not_abort_the_process(tmp_path, disk):
    """Real: torch's zip writer on /dev/full fails as on a full disk. Left unfinished, its C++ destructor
    writes again, throws and aborts the process (exit 134) after the error was reported."""
    proc = subprocess.run([sys.executable, "-c", ZIP_ON_FULL_DEVICE, str(tmp_path / "pkg"), disk],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    if disk == "full":  # the zip writer only says "unexpected pos": the free space tells what it was
        assert proc.stdout.startswith("ExportError writing the package")
        assert "No space left on device while torch wrote an archive" in proc.stdout
    else:
        assert proc.stdout.startswith("RuntimeError") and "inline_container.cc" in proc.stdout
    assert entries(tmp_path) == set()


SCRIPT_ON_FULL_DEVICE = """
import torch
from pathlib import Path
from hstu_export.runtimes.graph_io import save_script
try:
    save_script(torch.jit.script(torch.nn.Linear(4, 4)), Path("/dev/full"))
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_torchscript_writer_on_a_full_device_raises_instead_of_aborting(tmp_path):
    """Real: torch.jit.save's own writer aborts from C++ on a full disk; the artifact is serialised in
    memory and written from Python, where the failure is an OSError the export reports."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT_ON_FULL_DEVICE], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"OSError {errno.ENOSPC}"


# A CLI export with the disk-space pre-check turned off, so the write itself meets the full disk.
EXPORT_WITHOUT_PRECHECK = """
import sys
import hstu_export.package.directory as package
package.check_free_space = lambda *args, **kwargs: None
from hstu_export.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_real_full_disk_is_refused_before_work(bundle, tiny_tmpfs):
    proc = subprocess.run([sys.executable, "-m", "hstu_export.cli", str(bundle), "-o", str(tiny_tmpfs / "pkg"), "-q"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "not enough disk space" in proc.stderr and "Traceback" not in proc.stderr
    assert entries(tiny_tmpfs) == set()


@pytest.mark.slow
def test_real_full_disk_while_aoti_writes_is_one_line(bundle, tiny_tmpfs):
    """The campaign's finding: AOTInductor packaging on a full disk ended in ``terminate called ...
    inline_container.cc`` (exit 134). The first AOTInductor package written, the sparse half's .pt2 (~2 MB),
    does not fit in 1 MiB: a full disk is the export's one-line error, not a reason to store the sparse half as
    TorchScript."""
    proc = subprocess.run([sys.executable, "-c", EXPORT_WITHOUT_PRECHECK, "export", str(bundle),
                           "-o", str(tiny_tmpfs / "pkg"), "-q"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: writing the package")
    assert "No space left on device" in lines[0] and "terminate called" not in proc.stderr
    assert entries(tiny_tmpfs) == set()  # the staging directory is gone


def test_real_read_only_file_system_is_refused_before_work(bundle, tiny_tmpfs, tmp_path, capsys):
    (tiny_tmpfs / "dumps").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    assert cli_main(["export", str(bundle), "-o", str(tiny_tmpfs / "pkg"), "-q"]) == 2
    assert "is on a read-only file system" in one_error_line(capsys)
    out = tmp_path / "pkg"
    assert cli_main(["export", str(bundle), "-o", str(out), "--dump-graphs", str(tiny_tmpfs / "dumps"), "-q"]) == 2
    assert "--dump-graphs" in one_error_line(capsys)
    assert not out.exists() and entries(tiny_tmpfs) == {"dumps"}


def test_backend_write_failure_during_export_is_one_line(bundle, tmp_path, monkeypatch, capsys):
    """Simulated: the backend writes part of its artifact, then the disk is full."""
    from hstu_export.runtimes.torchscript import TorchScriptBackend

    def compile(self, inputs, out_dir):
        (out_dir / "model").mkdir()
        (out_dir / "model" / "model.ts").write_bytes(b"x" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out_dir / "model" / "model.ts"))

    monkeypatch.setattr(TorchScriptBackend, "compile", compile)
    out = tmp_path / "pkg"
    assert cli_main(["export", str(bundle), "--backend", "torchscript", "-o", str(out), "-q"]) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"error: writing the package {out} failed: No space left on device")
    assert "model.ts" in line and "free some space" in line
    assert entries(tmp_path) == set()


def test_graph_dump_write_failure_is_one_line(bundle, tmp_path, monkeypatch):
    """Simulated: the passes' graph dumps meet a full disk."""
    import hstu_export.exporter as exporter

    dumps = tmp_path / "dumps"

    def capture(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dumps / "03_map_ops.svg"))

    monkeypatch.setattr(exporter, "capture", capture)
    with pytest.raises(ExportError, match=rf"writing the graph dumps to {dumps} failed: No space left on device "
                                          r"\(.*03_map_ops.svg\)"):
        export(bundle, tmp_path / "pkg", ExportSettings(dump_dir=dumps))
    assert not (tmp_path / "pkg").exists()


def test_check_target_removes_dead_staging_dirs_before_space_is_measured(tmp_path, dead_pid):
    stale = tmp_path / f".pkg.partial-{dead_pid}-abc"
    stale.mkdir()
    (stale / "big.bin").write_bytes(b"x" * 1000)
    check_target(tmp_path / "pkg", force=False)
    assert not stale.exists()


# ------------------------------------------------------------------ sizes beyond the machine


@pytest.mark.parametrize("value", ["1e9", "18446744073709551616", "100000", "2**64"])
def test_cli_refuses_huge_max_batch_size(bundle, tmp_path, value, capsys):
    out = tmp_path / "pkg"
    assert cli_main(["export", str(bundle), "-o", str(out), "-q", "--max-batch-size", value]) == 2
    err = capsys.readouterr().err
    assert "--max-batch-size" in err and "Traceback" not in err and "internal error" not in err
    assert not out.exists()


@pytest.mark.parametrize("value", [1e9, "32", True, 2.0])
def test_settings_refuse_non_integer_batch_sizes(value):
    with pytest.raises(ConfigError, match="--max-batch-size must be a whole number"):
        ExportSettings(max_batch_size=value)


def test_request_larger_than_memory_is_refused_before_tracing(bundle, tmp_path, monkeypatch):
    """Simulated memory: 1 MiB available (the tiny model's 365 KiB of weights fit). Its largest request at
    batch 1024 is, in int64: 2 lengths and 3 per-user values per user, and per user 46 history ids, actions
    and timestamps and 16 candidate ids: 1024 * (2 + 3 + 3 * 46 + 16) * 8 bytes = 1.3 MiB."""
    fake_memory(monkeypatch, available=2**20)
    with pytest.raises(ConfigError) as caught:
        export(bundle, tmp_path / "pkg", ExportSettings(backend="torchscript", max_batch_size=1024))
    message = str(caught.value)
    assert "batch 1,024, uih_lengths <= 46, candidate_lengths <= 16" in message
    assert f"{1024 * (2 + 3 + 3 * 46 + 16) * 8 / 2**20:.1f} MiB for its inputs alone" in message
    assert "1.0 MiB of memory available" in message and "--max-batch-size" in message
    assert entries(tmp_path) == set()


def test_model_too_large_for_memory_is_refused_before_building(bundle, tmp_path, capsys):
    """Real: 10**12 items x 32 floats (128 TB) is more than any machine this runs on."""
    path = with_config(bundle, tmp_path, item_vocab_size=10**12)
    with pytest.raises(BundleError, match=r"32,000,000,\d{3},\d{3} parameters .*item_vocab_size 1,000,000,000,000 "
                                          r"x embedding_dim 32.*of available memory"):
        load_bundle(path)
    assert cli_main(["describe", str(path)]) == 2
    assert "of available memory" in one_error_line(capsys)


def test_model_memory_estimate_uses_the_machine_memory(bundle, tmp_path, monkeypatch):
    """Simulated memory (64 MiB available): 10**6 items x 32 + the tiny model's other 61,442 parameters."""
    fake_memory(monkeypatch, available=64 * 2**20, total=128 * 2**20)
    path = with_config(bundle, tmp_path, item_vocab_size=10**6)
    with pytest.raises(BundleError, match=r"about 32,061,442 parameters \(122\.3 MiB in float32.*"
                                          r"64\.0 MiB of available memory \(128\.0 MiB in all\)"):
        load_bundle(path)


def test_machine_memory_and_sizes_in_words():
    total, available = settings_module.machine_memory()
    assert 0 < available <= total
    assert [settings_module.format_bytes(n) for n in (512, 1536, 5 * 2**30, 128 * 10**12, 2**60)] == [
        "512 B", "1.5 KiB", "5.0 GiB", "116.4 TiB", "1024.0 PiB"]


@pytest.mark.parametrize("changes", [
    {},
    {"num_layers": 3, "contextual_features": [], "contextual_vocab_sizes": [], "task_hidden_dims": [8, 4],
     "task_names": ["a", "b", "c"], "num_heads": 4, "attention_dim": 8, "linear_dim": 12},
])
def test_parameter_estimate_is_the_models_parameter_count(changes):
    config = HSTUConfig.from_dict(dict(HSTUConfig().to_dict(), **changes))
    model = HstuRankingModel(config)
    actual = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    assert sum(config.parameter_counts().values()) == actual


# ------------------------------------------------------------------ bundle checksums


def flip_byte_in_largest_tensor(path: Path, out: Path) -> str:
    """Flips one bit in the middle of the largest record's data (its local header located from the zip's
    central directory); returns the record's name."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    assert info.compress_type == zipfile.ZIP_STORED
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    raw[start + info.file_size // 2] ^= 0x10
    out.write_bytes(bytes(raw))
    return info.filename


def test_saved_bundle_carries_a_checksum_of_its_contents(bundle):
    data = torch.load(bundle, weights_only=True)
    assert data[CHECKSUM_KEY] == content_sha256(data["source"], data["state_dict"], data["example_batch"],
                                                data["input_schema"])
    assert len(data[CHECKSUM_KEY]) == 64


def test_flipped_byte_in_tensor_data_is_detected(bundle, tmp_path, capsys):
    flipped = tmp_path / "flipped.pt"
    record = flip_byte_in_largest_tensor(bundle, flipped)
    assert "/data/" in record  # a tensor's storage, not the pickle
    # torch.load alone does not notice: the weights are silently different.
    original = torch.load(bundle, weights_only=True)["state_dict"]
    corrupted = torch.load(flipped, weights_only=True)["state_dict"]
    assert any(not torch.equal(original[k], corrupted[k]) for k in original)
    with pytest.raises(BundleError, match=r"changed since it was saved \(checksum mismatch.*re-save it"):
        load_bundle(flipped)
    assert cli_main(["describe", str(flipped)]) == 2
    assert "checksum mismatch" in one_error_line(capsys)


@pytest.mark.parametrize("what", ["config", "example_batch", "input_schema", "weights"])
def test_edits_after_saving_are_detected(bundle, tmp_path, what):
    data = torch.load(bundle, weights_only=True)
    if what == "config":
        change = {"source": dict(data["source"], config=dict(data["source"]["config"], alpha=0.5))}
    elif what == "example_batch":
        batch = dict(data["example_batch"])
        batch["query_time"] = batch["query_time"] + 1
        change = {"example_batch": batch}
    elif what == "input_schema":  # the tiny model states its own schema, so none was stored
        assert data["input_schema"] is None
        change = {"input_schema": json.dumps(build_preset("tiny").input_schema().to_json())}
    else:
        change = {"state_dict": dict(data["state_dict"], **{NORM: data["state_dict"][NORM] * 2})}
    path = edited(bundle, tmp_path, "edited.pt", keep_checksum=True, **change)
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(path)


def test_bundles_without_a_checksum_still_load(bundle, tmp_path):
    data = torch.load(bundle, weights_only=True)
    v2 = edited(bundle, tmp_path, "v2.pt")
    assert CHECKSUM_KEY not in torch.load(v2, weights_only=True)
    v1 = tmp_path / "v1.pt"
    torch.save({"format": data["format"], "format_version": 1, "model_name": data["source"]["name"],
                "config": data["source"]["config"], "state_dict": data["state_dict"],
                "example_batch": data["example_batch"]}, v1)
    for path in (v2, v1):
        loaded = load_bundle(path)
        assert torch.equal(loaded.model.state_dict()[NORM], data["state_dict"][NORM])


def test_malformed_checksum_is_refused(bundle, tmp_path):
    path = edited(bundle, tmp_path, "bad.pt", keep_checksum=True, **{CHECKSUM_KEY: 12345})
    with pytest.raises(BundleError, match="'content_sha256' must be a sha256"):
        load_bundle(path)


def test_checksum_covers_bfloat16_and_empty_tensors():
    base = {"a": torch.zeros(0, 3), "b": torch.ones(2, dtype=torch.bfloat16), "c": torch.tensor(3)}
    digest = content_sha256({"kind": "x"}, base, {"q": torch.arange(3)}, None)
    changed = dict(base, b=torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16))
    assert content_sha256({"kind": "x"}, changed, {"q": torch.arange(3)}, None) != digest
    reshaped = dict(base, a=torch.zeros(3, 0))
    assert content_sha256({"kind": "x"}, reshaped, {"q": torch.arange(3)}, None) != digest


# ------------------------------------------------------------------ malformed bundles: which key, what was expected


def test_wrong_shaped_tensor_names_the_key_and_shapes(bundle, tmp_path):
    state = torch.load(bundle, weights_only=True)["state_dict"]
    path = edited(bundle, tmp_path, "shape.pt", state_dict=dict(state, **{NORM: torch.zeros(3)}))
    with pytest.raises(BundleError, match=rf"state_dict\['{NORM}'\]: expected shape \[32\], got \[3\]"):
        load_bundle(path)


def test_state_dict_that_is_a_list_is_refused(bundle, tmp_path):
    state = torch.load(bundle, weights_only=True)["state_dict"]
    path = edited(bundle, tmp_path, "list.pt", state_dict=list(state.values()))
    with pytest.raises(BundleError, match="'state_dict' must be a dict of tensors by parameter name, got list"):
        load_bundle(path)


def test_non_tensor_in_state_dict_names_the_key(bundle, tmp_path):
    state = torch.load(bundle, weights_only=True)["state_dict"]
    path = edited(bundle, tmp_path, "value.pt", state_dict=dict(state, **{NORM: "weights"}))
    with pytest.raises(BundleError, match=rf"state_dict\['{NORM}'\]: expected a tensor, got str"):
        load_bundle(path)


def test_example_batch_entry_that_is_not_a_tensor_is_named(bundle, tmp_path):
    batch = torch.load(bundle, weights_only=True)["example_batch"]
    path = edited(bundle, tmp_path, "batch.pt", example_batch=dict(batch, query_time=[1, 2]))
    with pytest.raises(BundleError, match="entry 'query_time' holds a list"):
        load_bundle(path)


@pytest.mark.parametrize(("config", "message"), [
    ({"embedding_dim": "abc"}, "model config 'embedding_dim': expected an integer, got 'abc'"),
    ({"embedding_dim": 1.5}, "model config 'embedding_dim': expected an integer, got 1.5"),
    ({"item_vocab_size": 1e9}, "model config 'item_vocab_size': expected an integer, got 1000000000.0"),
    ({"task_names": "ctr"}, "model config 'task_names': expected a list of strings, got 'ctr'"),
    ({"contextual_vocab_sizes": [1000, "10"]}, "model config 'contextual_vocab_sizes': expected a list of integers"),
    ({"alpha": "big"}, "model config 'alpha': expected a number, got 'big'"),
    ({"embedding_dim": -1}, "model config 'embedding_dim': expected an integer >= 1, got -1"),
    ({"task_hidden_dims": [-4]}, r"model config 'task_hidden_dims': expected integers >= 1, got \[-4\]"),
    ({"contextual_vocab_sizes": [-5, 10]}, "model config 'contextual_vocab_sizes': expected integers >= 1"),
    ({"max_attn_len": -1}, "model config 'max_attn_len': expected an integer >= 0, got -1"),
    ({"time_bucket_base": 0}, "model config 'time_bucket_base': expected a number > 0, got 0"),
    ({"colour": "red"}, r"unknown keys \['colour'\]"),
])
def test_malformed_zoo_config_names_the_key_and_what_was_expected(bundle, tmp_path, config, message):
    with pytest.raises(BundleError, match=message):
        load_bundle(with_config(bundle, tmp_path, **config))


def test_config_that_is_not_a_dict_is_refused(bundle, tmp_path):
    data = torch.load(bundle, weights_only=True)
    path = edited(bundle, tmp_path, "cfg.pt", source=dict(data["source"], config=[1, 2]))
    with pytest.raises(BundleError, match="the config of model 'hstu_ranking' must be a dict of settings, got list"):
        load_bundle(path)


def test_malformed_bundle_on_the_cli_is_one_line_exit_2(bundle, tmp_path, capsys):
    path = with_config(bundle, tmp_path, embedding_dim="abc")
    assert cli_main(["export", str(path), "-o", str(tmp_path / "pkg"), "-q"]) == 2
    assert "expected an integer, got 'abc'" in one_error_line(capsys)


def test_round_trip_of_a_fresh_bundle_still_loads(tmp_path):
    model = build_preset("tiny", seed=4)
    path = save_bundle(model, tmp_path / "m.pt", generate_batch(model.input_schema(), 3, seed=1))
    loaded = load_bundle(path)
    assert torch.equal(loaded.model.state_dict()[NORM], model.state_dict()[NORM])
