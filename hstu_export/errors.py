"""Exceptions a user can cause. The CLI turns each into one line and an exit code."""

from __future__ import annotations


class HstuExportError(Exception):
    """Base class of every error we raise on purpose. ``exit_code`` is what the CLI returns."""

    exit_code: int = 2


class BundleError(HstuExportError):
    """A model bundle is missing, truncated, foreign or inconsistent."""


class ModelRegistryError(HstuExportError):
    """A model name is not registered, or registered twice."""


class ConfigError(HstuExportError):
    """A setting or preset is invalid."""


class TraceError(HstuExportError):
    """FX tracing failed; the message names the module and suggests ``--leaf-module``."""


class ModelRunError(HstuExportError):
    """The user's model failed while export ran it (on the export device, or the reference device); the
    message names the model's file and line and the likely cause."""

    exit_code = 1


class PassError(HstuExportError):
    """A graph pass failed; the message names the pass."""

    exit_code = 1


class UnmappedOpsError(HstuExportError):
    """Operator mapping found ops with no replacement for the chosen target."""

    exit_code = 1


class BackendUnavailableError(HstuExportError):
    """A backend's libraries or device are missing (for example TensorRT or CUDA)."""


class ExportError(HstuExportError):
    """Compiling or writing the package failed."""

    exit_code = 1


class VerificationError(HstuExportError):
    """Exported outputs do not match eager outputs within tolerance."""

    exit_code = 1


class PackageError(HstuExportError):
    """A package is missing, corrupt (checksum), or was built for other versions or hardware."""


class RequestError(HstuExportError):
    """A request does not match the package's input schema."""


class ServingError(HstuExportError):
    """Serving itself failed: a replica's process ended, or did not start."""

    exit_code = 1
