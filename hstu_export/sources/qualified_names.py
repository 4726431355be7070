"""Objects named by their import path: ``package.module:attribute`` (or ``package.module.attribute``).

Used for factories in bundles, opaque functions, and user-declared op mappings. Importing the named
module runs its code, as importing any installed dependency does.
"""

from __future__ import annotations

import importlib
from typing import Any

from hstu_export.errors import HstuExportError


def import_object(module_name: str, attr: str, what: str, error: type[HstuExportError]) -> Any:
    """``module_name``'s attribute ``attr`` (dotted for nested ones); ``error`` names ``what`` on failure."""
    try:
        value: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while importing
        raise error(
            f"cannot import {module_name!r} for {what} ({type(exc).__name__}: {exc}); install it or put it on "
            "PYTHONPATH"
        ) from None
    for part in attr.split("."):
        value = getattr(value, part, None)
        if value is None:
            raise error(f"{what}: module {module_name} has no {attr!r}")
    return value


def split_name(spec: str, colon_only: bool = False) -> tuple[str, str]:
    """(module, attribute) of ``package.module:attribute``, or of ``package.module.attribute`` unless
    ``colon_only``; empty strings when ``spec`` has neither form."""
    if ":" in spec or colon_only:
        module_name, sep, attr = spec.partition(":")
    else:
        module_name, sep, attr = spec.rpartition(".")
    return (module_name, attr) if sep and module_name and attr else ("", "")
