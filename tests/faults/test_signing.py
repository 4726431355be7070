"""Signed packages (OpenSSF model-signing, key-based, offline): sign, verify, and refuse a package that
was changed after signing, signed by another key, or not signed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch, save_bundle
from hstu_export.cli import main as cli_main
from hstu_export.errors import PackageError
from hstu_export.models import build_preset

pytestmark = pytest.mark.slow


def _keys(directory: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.pem", directory / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    root = tmp_path_factory.mktemp("signing")
    model = build_preset("tiny", seed=1)
    bundle = save_bundle(model, root / "tiny.pt", generate_batch(model.input_schema(), 4, seed=2))
    settings = ExportSettings(backend="torchscript", max_batch_size=4, verify=VerifySettings(num_random_batches=1))
    package = hstu_export.export(bundle, root / "pkg", settings).path
    private, public = _keys(root, "release")
    assert cli_main(["sign", str(package), "--key", str(private)]) == 0
    _, other_public = _keys(root, "other")
    return package, public, other_public, bundle


def test_signed_package_loads_with_its_key(signed, tmp_path):
    package, public, _, bundle = signed
    assert (package / "package.sig").is_file()
    predictor = hstu_export.load(package, require_signature=public)
    batch = generate_batch(predictor.input_schema, 2, seed=3)
    assert predictor(batch)["ctr"].shape[0] == int(batch["candidate_lengths"].sum())
    hstu_export.load(package)  # the signature file is not an unlisted file for unsigned loading
    assert cli_main(["verify", str(package), "--key", str(public), "--signature-only"]) == 0
    assert cli_main(["verify", str(package), "--key", str(public), "--model", str(bundle), "--batches", "1"]) == 0


def test_changed_file_fails_the_signature(signed, tmp_path):
    package, public, _, _ = signed
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    # Rewritten consistently (manifest checksums updated): only the signature can tell.
    manifest = (copy / "manifest.json").read_text().replace('"dtype": "float32"', '"dtype": "float32" ')
    (copy / "manifest.json").write_text(manifest)
    with pytest.raises(PackageError, match="signature does not verify"):
        hstu_export.load(copy, require_signature=public)


def test_other_key_and_unsigned_package_are_refused(signed, tmp_path, capsys):
    package, _, other_public, _ = signed
    with pytest.raises(PackageError, match="signature does not verify"):
        hstu_export.load(package, require_signature=other_public)
    unsigned = tmp_path / "unsigned"
    shutil.copytree(package, unsigned)
    (unsigned / "package.sig").unlink()
    with pytest.raises(PackageError, match="is not signed"):
        hstu_export.load(unsigned, require_signature=other_public)
    assert cli_main(["verify", str(unsigned), "--key", str(other_public), "--signature-only"]) == 2
    assert "is not signed" in capsys.readouterr().err


def test_signing_needs_a_real_key_and_package(signed, tmp_path, capsys):
    package, public, _, _ = signed
    assert cli_main(["sign", str(package), "--key", str(tmp_path / "missing.pem")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli_main(["sign", str(package), "--key", str(public)]) == 2  # a public key cannot sign
    assert len([line for line in capsys.readouterr().err.splitlines() if line.strip()]) == 1
    assert cli_main(["sign", str(tmp_path), "--key", str(public)]) == 2  # not a package
