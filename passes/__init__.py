"""Graph passes, one file each, and the one list that orders them.

Adding a pass = one file here defining a class (``name`` attribute, ``run(gm, ctx) -> gm``, statistics
through ``ctx.add_stat``; set ``recursive = False`` to see only the top graph) + one line in ``PASSES``.
Pass classes are constructed without arguments; their settings come from the ``PassContext``.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hstu_export.errors import ConfigError

if TYPE_CHECKING:
    from hstu_export.pipeline import GraphPass


@dataclass(frozen=True)
class PassSpec:
    name: str
    target: str  # "<module in hstu_export.passes>:<class>"
    optional: bool = False  # skipped in the default pipeline while its file is absent


# The default pipeline, in run order.
PASSES: tuple[PassSpec, ...] = (
    PassSpec("prune_unused", "prune_unused:PruneUnused"),
    PassSpec("split_sparse_dense", "split_sparse_dense:SplitSparseDense"),
    PassSpec("remove_boundary_marks", "remove_boundary_marks:RemoveBoundaryMarks"),
    # Operator mapping (passes/map_ops.py, class MapOps; reads ctx.op_target and ctx.allow_unmapped).
    # Runs on both halves after the split; the default pipeline skips it while the file is absent.
    PassSpec("map_ops", "map_ops:MapOps"),
    PassSpec("eliminate_dead_code", "eliminate_dead_code:EliminateDeadCode"),
)


def known_pass_names() -> list[str]:
    return [spec.name for spec in PASSES]


def default_pass_names() -> list[str]:
    """The default pipeline's passes that are installed (an absent optional pass is left out)."""
    return [spec.name for spec in PASSES if not spec.optional or is_installed(spec.name)]


def is_installed(name: str) -> bool:
    spec = next((s for s in PASSES if s.name == name), None)
    if spec is None:
        return False
    module_name = spec.target.partition(":")[0]
    return importlib.util.find_spec(f"{__name__}.{module_name}") is not None


def create_pass(name: str, required: bool = True) -> GraphPass | None:
    """A fresh instance of the registered pass ``name``; None when it is optional, not installed and
    not ``required`` (named explicitly)."""
    spec = next((s for s in PASSES if s.name == name), None)
    if spec is None:
        raise ConfigError(f"unknown pass {name!r}; known passes: {', '.join(known_pass_names())}")
    module_name, _, class_name = spec.target.partition(":")
    qualified = f"{__name__}.{module_name}"
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if exc.name != qualified or not spec.optional:
            raise
        if required:
            raise ConfigError(f"pass {name!r} is not installed (passes/{module_name}.py is missing)") from None
        return None
    return getattr(module, class_name)()
