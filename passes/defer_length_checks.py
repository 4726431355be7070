"""defer_length_checks: the length checks that map_ops records beside foreign jagged ops
(``check_lengths_at_most``: no sequence longer than the bound the model's own op would cut it to) each read
a maximum back from the device, and on a GPU every read waits for the device and leaves it idle while the
host launches what follows. Here each check's condition stays on the device (``length_beyond``) and one
``check_no_length_beyond`` at the end of the graph reads them all at once. A request that breaks one still
fails before anything is returned; what the graph computes is unchanged."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx

from hstu_export.capture.graph_functions import check_lengths_at_most, check_no_length_beyond, length_beyond

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext


class DeferLengthChecks:
    name = "defer_length_checks"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        graph = gm.graph
        checks = [n for n in graph.nodes if n.op == "call_function" and n.target is check_lengths_at_most]
        if len(checks) < 2:  # one read either way
            return gm
        flags = []
        for node in checks:
            offsets, bound = _arguments(node)
            with graph.inserting_before(node):
                flags.append(graph.call_function(length_beyond, (offsets, bound)))
            node.replace_all_uses_with(offsets)
            graph.erase_node(node)
        output = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(output):
            graph.call_function(check_no_length_beyond, (flags,))
        gm.recompile()
        ctx.add_stat("deferred_checks", len(checks))
        return gm


def _arguments(node: torch.fx.Node) -> tuple[torch.fx.Node, object]:
    names = ("offsets", "bound")
    values = dict(zip(names, node.args, strict=False)) | {k: v for k, v in node.kwargs.items() if k in names}
    return values["offsets"], values["bound"]
