"""lookup_keys: which request ids each of the sparse half's outputs is looked up from, row by row."""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from hstu_export.capture.graph_functions import check_ranges
from hstu_export.lookup_keys import looked_up_ids


def _sparse_half() -> torch.fx.GraphModule:
    """A sparse half as lower_embeddings writes one (range checks, a lookup a feature, ``.float()``), with the
    outputs that are not row-by-row lookups beside."""
    root = nn.Module()
    root.items, root.actions = nn.Embedding(10, 4), nn.Embedding(5, 4)
    graph = torch.fx.Graph()
    ids, actions, weights, offsets = (graph.placeholder(name) for name in ("ids", "actions", "weights", "offsets"))
    checked = graph.call_function(check_ranges, ([ids, actions, weights, offsets], [0, 0, 0, 0], [9, 4, 1, 9],
                                                 [9, 9, 9, 9], ["ids", "actions", "weights", "offsets"]))
    ids, actions, weights, offsets = (graph.call_function(operator.getitem, (checked, i)) for i in range(4))
    items, table = graph.get_attr("items.weight"), graph.get_attr("actions.weight")
    rows = graph.call_function(F.embedding, (ids, items))
    outputs = {
        "item_rows": graph.call_method("float", (rows,)),
        "both": graph.call_function(torch.cat, ([rows, graph.call_function(F.embedding, (actions, table))],),
                                    {"dim": 1}),
        "stacked": graph.call_function(torch.cat, ([rows, rows],), {"dim": 0}),
        "weighted": graph.call_function(torch.mul, (rows, graph.call_method("unsqueeze", (weights, 1)))),
        "renormed": graph.call_function(F.embedding, (ids, items), {"max_norm": 1.0}),
        "pooled": graph.call_function(F.embedding_bag, (ids, items, offsets)),
        "to_other": graph.call_method("to", (rows, weights)),
        "passed": ids,
    }
    graph.output(outputs)
    return torch.fx.GraphModule(root, graph)


def test_outputs_looked_up_row_by_row_name_their_ids_and_no_other_does() -> None:
    sparse = _sparse_half()
    found = looked_up_ids(sparse, list(next(n for n in sparse.graph.nodes if n.op == "output").args[0]))
    # A lookup (cast or not) names its ids, a concatenation along a later axis the ids of each part, and a value
    # passed through is its own id. Not a concatenation of rows, a product with a request value, a lookup that
    # rewrites its table (max_norm), a pooled lookup, nor a cast to another tensor's dtype.
    assert found == {"item_rows": ["ids"], "both": ["ids", "actions"], "passed": ["ids"]}, found


def test_a_sparse_half_returning_positionally_is_read_in_the_names_order() -> None:
    sparse = _sparse_half()
    output = next(n for n in sparse.graph.nodes if n.op == "output")
    returned = output.args[0]
    output.args = ((returned["weighted"], returned["item_rows"]),)
    sparse.recompile()
    assert looked_up_ids(sparse, ["weighted", "item_rows"]) == {"item_rows": ["ids"]}
    assert looked_up_ids(sparse, ["only one name"]) == {}  # the names do not fit what it returns: nothing is read
