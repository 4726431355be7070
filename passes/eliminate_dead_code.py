"""eliminate_dead_code: remove nodes whose results nobody uses (impure nodes stay), then the parameters
and submodules only those nodes referenced."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx

from .prune_unused import prune_unused_attributes

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext


class EliminateDeadCode:
    name = "eliminate_dead_code"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        before = len(gm.graph.nodes)
        # Graph.eliminate_dead_code keeps placeholders, outputs and nodes with side effects
        # (Node.is_impure: mutating ops, side-effectful functions, impure submodules).
        gm.graph.eliminate_dead_code()
        ctx.add_stat("removed_nodes", before - len(gm.graph.nodes))
        tensors, nbytes, modules = prune_unused_attributes(gm)
        ctx.add_stat("removed_tensors", tensors)
        ctx.add_stat("removed_bytes", nbytes)
        ctx.add_stat("removed_modules", modules)
        return gm
