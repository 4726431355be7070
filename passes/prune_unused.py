"""prune_unused: drop parameters, buffers and submodules that no node of the graph references."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx
from torch import Tensor

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext


class PruneUnused:
    name = "prune_unused"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        tensors, nbytes, modules = prune_unused_attributes(gm)
        ctx.add_stat("removed_tensors", tensors)
        ctx.add_stat("removed_bytes", nbytes)
        ctx.add_stat("removed_modules", modules)
        return gm


def prune_unused_attributes(gm: torch.fx.GraphModule) -> tuple[int, int, int]:
    """Deletes what no ``get_attr``/``call_module`` node of ``gm.graph`` reaches.

    Returns (tensors freed, their bytes, submodules removed). A tensor also registered under a used
    name (tied weights) is kept and not counted.
    """
    used = {str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}

    def is_used(path: str) -> bool:  # the target itself or inside a used module
        return any(path == u or path.startswith(u + ".") for u in used)

    def holds_used(path: str) -> bool:  # an ancestor of something used
        return path == "" or any(u.startswith(path + ".") for u in used)

    named = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    kept = {id(t) for name, t in named if is_used(name)}
    freed: dict[int, Tensor] = {id(t): t for name, t in named if not is_used(name) and id(t) not in kept}

    # Unused tensors sitting directly on a module that is kept as a container of used things.
    for name, _ in named:
        owner_path, _, attr = name.rpartition(".")
        if not is_used(name) and holds_used(owner_path) and not is_used(owner_path):
            owner = gm.get_submodule(owner_path)
            if attr in owner._parameters or attr in owner._buffers:
                delattr(owner, attr)

    # Whole submodules holding nothing used; delete the top-most of each unused subtree.
    unused = {p for p, _ in gm.named_modules(remove_duplicate=False) if p and not is_used(p) and not holds_used(p)}
    removed_modules = 0
    for path in sorted(unused):
        parent_path, _, attr = path.rpartition(".")
        if parent_path in unused:
            continue
        parent = gm.get_submodule(parent_path)
        if attr in parent._modules:
            delattr(parent, attr)
            removed_modules += 1
    return len(freed), sum(t.numel() * t.element_size() for t in freed.values()), removed_modules
