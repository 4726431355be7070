"""remove_boundary_marks: ``x = sparse_boundary(y, ...)`` becomes ``y`` once the split has used the marks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx

from hstu_export.capture.graph_functions import sparse_boundary

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext


class RemoveBoundaryMarks:
    name = "remove_boundary_marks"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        removed = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is sparse_boundary:
                value = node.args[0] if node.args else node.kwargs["value"]
                node.replace_all_uses_with(value)
                gm.graph.erase_node(node)
                removed += 1
        ctx.add_stat("removed_marks", removed)
        return gm
