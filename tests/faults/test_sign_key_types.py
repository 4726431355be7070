"""Fault campaign, issue 37 item 3: ``sign`` and ``verify --key`` with keys OpenSSF model-signing's key
signer does not take (RSA, Ed25519, an elliptic curve other than P-256/P-384/P-521, an encrypted key, a
public key where a private one is needed) are refused with one line naming the keys that work, before
anything is written; P-384 and P-521 keys, which it takes, sign and verify."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

import hstu_export
from hstu_export.cli import main as cli_main

pytestmark = pytest.mark.slow  # the conftest's exported package

SUPPORTED = "PEM elliptic-curve private key on P-256, P-384 or P-521"


def write_private(path: Path, key, password: bytes | None = None) -> Path:
    encryption = (serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    return path


def write_public(path: Path, key) -> Path:
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def pkg(package, tmp_path) -> Path:
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    return copy


@pytest.mark.parametrize(("kind", "make", "expected"), [
    ("RSA", lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048), "is of type RSA"),
    ("Ed25519", ed25519.Ed25519PrivateKey.generate, "is of type Ed25519"),
    ("secp256k1", lambda: ec.generate_private_key(ec.SECP256K1()), "is an elliptic-curve key on secp256k1"),
])
def test_unsupported_private_key_is_refused_with_one_line(kind, make, expected, pkg, tmp_path, cli_streams):
    key = write_private(tmp_path / f"{kind}.pem", make())
    before = files(pkg)
    assert cli_main(["sign", str(pkg), "--key", str(key)]) == 2
    line = cli_streams.error_line()
    assert f"private key {key} {expected}" in line
    assert f"take an unencrypted {SUPPORTED}" in line and "openssl ecparam -name prime256v1" in line
    assert files(pkg) == before and {p.name for p in tmp_path.iterdir()} == {f"{kind}.pem", "pkg"}


def test_encrypted_or_public_key_is_refused_with_one_line(pkg, tmp_path, cli_streams):
    key = ec.generate_private_key(ec.SECP256R1())
    encrypted = write_private(tmp_path / "encrypted.pem", key, password=b"secret")
    public = write_public(tmp_path / "public.pem", key)
    before = files(pkg)
    assert cli_main(["sign", str(pkg), "--key", str(encrypted)]) == 2
    assert f"private key {encrypted} is encrypted; signing takes an unencrypted" in cli_streams.error_line()
    assert cli_main(["sign", str(pkg), "--key", str(public)]) == 2
    assert f"private key {public} is not a PEM private key" in cli_streams.error_line()
    assert files(pkg) == before


@pytest.mark.parametrize("curve", [ec.SECP384R1, ec.SECP521R1], ids=["P-384", "P-521"])
def test_p384_and_p521_keys_sign_and_verify(curve, pkg, tmp_path):
    key = curve()
    private = write_private(tmp_path / "key.pem", ec.generate_private_key(key))
    public = write_public(tmp_path / "pub.pem", serialization.load_pem_private_key(private.read_bytes(), None))
    assert cli_main(["sign", str(pkg), "--key", str(private)]) == 0
    assert cli_main(["verify", str(pkg), "--key", str(public), "--signature-only"]) == 0
    hstu_export.load(pkg, require_signature=public)


def test_verify_with_an_rsa_public_key_names_the_key_type(pkg, tmp_path, cli_streams):
    signing = write_private(tmp_path / "key.pem", ec.generate_private_key(ec.SECP256R1()))
    assert cli_main(["sign", str(pkg), "--key", str(signing)]) == 0
    cli_streams.capsys.readouterr()
    rsa_public = write_public(tmp_path / "rsa.pub.pem", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    assert cli_main(["verify", str(pkg), "--key", str(rsa_public), "--signature-only"]) == 2
    line = cli_streams.error_line()
    assert f"public key {rsa_public} is of type RSA" in line
    assert "a PEM elliptic-curve public key on P-256, P-384 or P-521" in line
