"""Import the Triton kernels and the PyTorch reference without the rest of hstu_export.

The GPU machine has no torchrec/fbgemm, and ``hstu_export/__init__.py`` (and ``ops/__init__.py``)
import modules that may need them. The kernels and the reference need only torch and triton, so the
two parent packages are registered as bare namespace modules, which skips their ``__init__``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]


def _bare_package(name: str, path: Path) -> None:
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module


def import_kernels() -> tuple[ModuleType, ModuleType]:
    """(hstu_export.ops._triton, hstu_export.ops.reference)."""
    _bare_package("hstu_export", REPO_ROOT / "hstu_export")
    _bare_package("hstu_export.ops", REPO_ROOT / "hstu_export" / "ops")
    import hstu_export.ops._triton as kernels
    import hstu_export.ops.reference as reference

    return kernels, reference
