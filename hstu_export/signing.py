"""Package signatures with OpenSSF model-signing (key-based, offline).

``sign_package(pkg, private_key)`` writes ``pkg/package.sig``: a Sigstore bundle signing the sha256 of
every file of the package (manifest, its checksum and artifacts). ``verify_signature(pkg, public_key)``
checks it. ``manifest.sha256`` detects corruption; a signature also detects a package rewritten by
someone who cannot sign with the key. Keys are PEM elliptic-curve keys (``openssl ecparam -name
prime256v1 -genkey -noout -out key.pem``; ``openssl ec -in key.pem -pubout -out pub.pem``).

model-signing is optional (``pip install 'hstu-export[sign]'``); ``make install`` installs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hstu_export.errors import ConfigError, PackageError
from hstu_export.package import SIGNATURE

INSTALL_HINT = "pip install model-signing pyopenssl (or 'hstu-export[sign]')"


def _model_signing() -> Any:
    try:
        import model_signing
    except ImportError as exc:
        raise ConfigError(f"signing needs OpenSSF model-signing ({exc.name} is missing): {INSTALL_HINT}") from None
    return model_signing


def _key(path: str | os.PathLike[str], what: str) -> Path:
    key = Path(path)
    if not key.is_file():
        raise ConfigError(f"{what} {key}: no such file")
    return key


def sign_package(package: str | os.PathLike[str], private_key: str | os.PathLike[str]) -> Path:
    """Signs every file of ``package`` with ``private_key``; returns the signature's path."""
    from hstu_export.package import read_manifest

    root = Path(package).resolve()
    read_manifest(root)  # only an intact package of ours is signed
    ms = _model_signing()
    signature = root / SIGNATURE
    key = _key(private_key, "private key")
    tmp = root.parent / f".{root.name}.{SIGNATURE}.tmp-{os.getpid()}"  # outside the files being signed
    try:
        config = ms.signing.Config().use_elliptic_key_signer(private_key=key)
        config.set_hashing_config(ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE]))
        config.sign(root, tmp)
        os.replace(tmp, signature)
    except (ValueError, TypeError, OSError) as exc:
        raise PackageError(f"signing {root} failed: {_first_line(exc)} (is {private_key} a PEM elliptic-curve "
                           "private key?)") from None
    finally:
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
    key = _key(public_key, "public key")
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
