"""guard_ranges: the exported ranges travel inside the artifacts.

The Python predictor validates every request, but a package's artifacts also load with stock PyTorch
(``torch.jit.load``, ``aoti_load_package``) and from C++, where nothing would stop a history longer than
the export's maximum or an id past a table's end from reaching compiled code. This pass makes the graphs
check their own inputs: each request feature a graph takes (the sparse half takes most of them; the
dense half checks those it takes that the sparse half does not) goes through one ``check_ranges`` call
per graph, which raises on a value outside [min, max] (lengths against the exported lengths, ids against
the tables, the number of users against the maximum batch size). In an exported program the checks are
runtime assertions; in TorchScript, asserts, with every feature's extremes read from the device at once.

Runs after the split (``recursive = False``: it edits both halves); needs ``ctx.ranges`` (set by the
exporter) and does nothing without them.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch.fx

from hstu_export.capture.graph_functions import CLAMPABLE, NO_LIMIT, check_ranges
from hstu_export.passes.boundary import DENSE, SPARSE

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

class GuardRanges:
    name = "guard_ranges"
    recursive = False

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        schema, ranges = ctx.schema, ctx.ranges
        sparse, dense = getattr(gm, SPARSE, None), getattr(gm, DENSE, None)
        if schema is None or ranges is None or not isinstance(sparse, torch.fx.GraphModule):
            ctx.add_stat("skipped", "no exported ranges (inspect) or no split")
            return gm
        limits, lengths = {}, set()
        for f in schema.features:
            if f.kind == "lengths":
                limits[f.graph_name] = (ranges.min_lengths[f.name], ranges.max_lengths[f.name], f.name)
                lengths.add(f.graph_name)
            elif f.min_value is not None or f.max_value is not None:
                if f.torch_dtype.is_floating_point:
                    continue
                limits[f.graph_name] = (f.min_value, f.max_value, f.name)
        per_user = {f.graph_name for f in schema.features if f.kind in ("lengths", "per_user")}
        checked_in_sparse: set[str] = set()
        for half, graph_module in ((SPARSE, sparse), (DENSE, dense)):
            if not isinstance(graph_module, torch.fx.GraphModule):
                continue
            placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
            nodes = [n for n in placeholders if str(n.target) in limits and n.users
                     and not (half == DENSE and str(n.target) in checked_in_sparse)]
            if nodes:
                bounds = [limits[str(n.target)] for n in nodes]
                lows = [-NO_LIMIT if low is None else low for low, _, _ in bounds]
                highs = [NO_LIMIT if high is None else high for _, high, _ in bounds]
                # The number of users is compiled as a dynamic dim of at least 2 (torch.export cannot make a
                # dim of at most 1 dynamic, and the export example has 2 users): with --max-batch-size 1 the
                # artifacts take 2, and the loaders, which read the manifest, hold requests to 1.
                users = max(ranges.max_batch_size, 2)
                rows = [users if str(n.target) in per_user else NO_LIMIT for n in nodes]
                # One call for all of a graph's features, after its last input: their values then come from it.
                with graph_module.graph.inserting_after(placeholders[-1]):
                    check = graph_module.graph.call_function(
                        check_ranges, (list(nodes), lows, highs, rows, [feature for _, _, feature in bounds]))
                # Which values are ids a program may clamp instead (a lengths feature is never clamped: runtimes/aoti.py
                # prechecked_sparse).
                check.meta[CLAMPABLE] = [str(n.target) not in lengths for n in nodes]
                for index, node in enumerate(nodes):
                    with graph_module.graph.inserting_after(check):
                        value = graph_module.graph.call_function(operator.getitem, (check, index))
                    value.meta.update(node.meta)
                    for user in [u for u in node.users if u is not check]:
                        user.replace_input_with(node, value)
                    if half == SPARSE:
                        checked_in_sparse.add(str(node.target))
            graph_module.recompile()
            ctx.add_stat(f"{half}_checks", len(nodes))
        return gm
