"""Package signatures with OpenSSF model-signing (key-based, offline).

``sign_package(pkg, private_key)`` writes ``pkg/package.sig``: a Sigstore bundle signing the sha256 of
every file of the package (manifest, its checksum and artifacts). ``verify_signature(pkg, public_key)``
checks it. ``manifest.sha256`` detects corruption; a signature also detects a package rewritten by
someone who cannot sign with the key. Keys are unencrypted PEM elliptic-curve keys on the curves
model-signing's key signer takes, P-256, P-384 or P-521 (``openssl ecparam -name prime256v1 -genkey
-noout -out key.pem``; ``openssl ec -in key.pem -pubout -out pub.pem``); any other key (RSA, Ed25519,
another curve) is refused with one line naming these, before anything is written.

model-signing is optional (``pip install 'hstu-export[sign]'``); ``make install`` installs it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hstu_export.errors import ConfigError, PackageError
from hstu_export.package.directory import (
    SIGNATURE,
    check_writable,
    current_umask,
    file_system_errors,
    remove_stale_partials,
)

INSTALL_HINT = "pip install model-signing pyopenssl (or 'hstu-export[sign]')"
# model-signing's elliptic-curve signer and verifier take these curves (cryptography's name: NIST name).
SUPPORTED_CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
NEW_KEY_HINT = {True: "openssl ecparam -name prime256v1 -genkey -noout -out key.pem makes one",
                False: "openssl ec -in key.pem -pubout -out pub.pem writes a signing key's public key"}


def _model_signing() -> Any:
    try:
        import model_signing
    except ImportError as exc:
        raise ConfigError(f"signing needs OpenSSF model-signing ({exc.name} is missing): {INSTALL_HINT}") from None
    return model_signing


def _key(path: str | os.PathLike[str], private: bool) -> Path:
    """``path``, once it is known to hold a key model-signing can use (ConfigError naming what it holds and
    the keys that work otherwise: model-signing itself fails on others with AttributeError ... 'curve')."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    what = "private key" if private else "public key"
    supported = f"{'an unencrypted' if private else 'a'} PEM elliptic-curve {what} on P-256, P-384 or P-521"
    hint = NEW_KEY_HINT[private]
    key = Path(path)
    if not key.is_file():
        raise ConfigError(f"{what} {key}: no such file")
    try:
        data = key.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {key} cannot be read: {exc.strerror}") from None
    try:
        loaded = (serialization.load_pem_private_key(data, password=None) if private
                  else serialization.load_pem_public_key(data))
    except TypeError:  # cryptography: "Password was not given but private key is encrypted"
        raise ConfigError(f"{what} {key} is encrypted; signing takes {supported} (decrypt a copy: "
                          f"openssl ec -in {key} -out key.pem)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(f"{what} {key} is not a PEM {what}; {'signing' if private else 'verifying'} takes "
                          f"{supported} ({hint})") from None
    public = loaded.public_key() if private else loaded
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise ConfigError(f"{what} {key} is of type {_key_kind(public)}; package signatures take {supported} "
                          f"({hint})")
    if public.curve.name not in SUPPORTED_CURVES:
        raise ConfigError(f"{what} {key} is an elliptic-curve key on {public.curve.name}; package signatures "
                          f"take {supported} ({hint})")
    return key


def _key_kind(public: Any) -> str:
    """A public key's type, as people name it."""
    from cryptography.hazmat.primitives.asymmetric import dsa, ed448, ed25519, rsa, x448, x25519

    kinds = {rsa.RSAPublicKey: "RSA", dsa.DSAPublicKey: "DSA", ed25519.Ed25519PublicKey: "Ed25519",
             ed448.Ed448PublicKey: "Ed448", x25519.X25519PublicKey: "X25519", x448.X448PublicKey: "X448"}
    return next((name for cls, name in kinds.items() if isinstance(public, cls)), type(public).__name__)


def sign_package(package: str | os.PathLike[str], private_key: str | os.PathLike[str]) -> Path:
    """Signs every file of ``package`` with ``private_key``; returns the signature's path."""
    from hstu_export.package.directory import read_manifest

    root = Path(package).resolve()
    read_manifest(root)  # only an intact package of ours is signed
    ms = _model_signing()
    signature = root / SIGNATURE
    key = _key(private_key, private=True)
    # The signature is written beside the package (outside the files being signed), then renamed in.
    check_writable(root, f"{root}: the package directory")
    check_writable(root.parent, f"{root}: the directory holding the package")
    # Named as a staging file of ``root``, so one left by a killed process is removed by the next sign.
    remove_stale_partials(root)
    tmp = root.parent / f".{root.name}.partial-{os.getpid()}-{SIGNATURE}"
    try:
        with file_system_errors(root.parent, f"signing {root}"):
            config = ms.signing.Config().use_elliptic_key_signer(private_key=key)
            config.set_hashing_config(ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE]))
            config.sign(root, tmp)
            os.chmod(tmp, 0o666 & ~current_umask())
            os.replace(tmp, signature)
    except (ValueError, TypeError, OSError) as exc:
        raise PackageError(f"signing {root} failed: {_first_line(exc)}") from None
    finally:
        with contextlib.suppress(OSError):  # on a read-only file system even this fails
            tmp.unlink(missing_ok=True)
    return signature


def verify_signature(package: str | os.PathLike[str], public_key: str | os.PathLike[str]) -> None:
    """Raises PackageError unless ``package`` carries a signature by ``public_key``'s private key over
    exactly its files."""
    root = Path(package)
    signature = root / SIGNATURE
    if not signature.is_file():
        raise PackageError(f"{root} is not signed ({SIGNATURE} is missing); sign it with hstu-export sign")
    ms = _model_signing()
    key = _key(public_key, private=False)
    try:
        config = ms.verifying.Config().use_elliptic_key_verifier(public_key=key)
        config.set_hashing_config(ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE]))
        config.verify(root, signature)
    except Exception as exc:  # model-signing raises ValueError and library errors alike
        raise PackageError(f"{root}: the signature does not verify with {public_key}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = [line for line in str(exc).splitlines() if line.strip()]
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= 300 else first[:297] + "..."
