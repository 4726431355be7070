"""Which request ids each of the sparse half's outputs is looked up from, row by row (docs/KV_CACHE.md, "Derived
delta programs"): what lets a derived delta program compare a token's ids, a few bytes, where it would compare the
embedding rows the sparse half looked up for it (a kilobyte and more at production widths).

An output qualifies when, walking back from it, there is nothing but

- casts (``.float()``, ``.to(dtype)``, ...), which keep each row itself;
- a lookup of a table the sparse half holds (``F.embedding(ids, table)``, as lower_embeddings writes a torchrec
  EmbeddingCollection's; never one with ``max_norm``, which rewrites the table as it reads it): row ``i`` of the
  output is the table's row ``ids[i]``;
- the range checks every artifact makes on its inputs (``check_ranges``, which returns them as they are);
- a concatenation of such values along a later axis (one row from each);

down to request inputs, the ids. A pooled lookup (``embedding_bag``) is not row by row, and a collection kept as
torchrec's module is not read: their outputs are compared as they are.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from hstu_export.capture.graph_functions import check_ranges

CASTS = {"float", "double", "half", "bfloat16", "to", "type", "contiguous", "clone", "long", "int"}


def looked_up_ids(sparse: torch.fx.GraphModule, names: Sequence[str]) -> dict[str, list[str]]:
    """Of the sparse half's outputs (``names``: in its output order where it returns a tuple), those whose rows
    are looked up row by row from request inputs, each with those inputs' names (its placeholders). What it reads
    off the graph, the caller holds to the example: each input as many rows as the output."""
    output = next(n for n in sparse.graph.nodes if n.op == "output")
    (result,) = output.args
    if isinstance(result, dict):
        returned = dict(result)
    elif isinstance(result, (tuple, list)) and len(result) == len(names):
        returned = dict(zip(names, result, strict=True))
    else:
        return {}
    found = {}
    for name in names:
        node = returned.get(name)
        ids = _ids_of(node) if isinstance(node, torch.fx.Node) else None
        if ids:
            found[name] = list(dict.fromkeys(ids))
    return found


def _ids_of(n: torch.fx.Node) -> list[str] | None:
    if n.op == "placeholder":
        return [str(n.target)]
    if n.op == "call_method" and n.target in CASTS:
        if any(isinstance(a, torch.fx.Node) for a in (*n.args[1:], *n.kwargs.values())):
            return None  # to(other tensor): a device or dtype read from the request
        return _ids_of(n.args[0]) if isinstance(n.args[0], torch.fx.Node) else None
    if n.op == "call_function" and n.target in (F.embedding, torch.embedding):
        bound = _bound(n, ("input", "weight") if n.target is F.embedding else ("weight", "input"))
        ids, table = bound.get("input"), bound.get("weight")
        if bound.get("max_norm") is not None or not isinstance(table, torch.fx.Node) or table.op != "get_attr":
            return None
        return _ids_of(ids) if isinstance(ids, torch.fx.Node) else None
    if n.op == "call_function" and n.target is operator.getitem:
        source, index = n.args
        if (isinstance(source, torch.fx.Node) and source.op == "call_function" and source.target is check_ranges
                and isinstance(index, int)):
            checked = source.args[0]
            return _ids_of(checked[index]) if isinstance(checked[index], torch.fx.Node) else None
        return None
    if n.op == "call_function" and n.target in (torch.cat, torch.concat):
        # A negative axis of 1-D parts would be the first: the caller holds each id's rows to the output's.
        parts, dim = n.args[0], n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
        if not isinstance(parts, (tuple, list)) or not parts or not isinstance(dim, int) or dim == 0:
            return None
        got = [_ids_of(p) if isinstance(p, torch.fx.Node) else None for p in parts]
        return None if any(g is None for g in got) else [k for g in got for k in g]  # type: ignore[union-attr]
    return None


def _bound(n: torch.fx.Node, positional: tuple[str, ...]) -> dict[str, Any]:
    return {**dict(zip(positional, n.args)), **n.kwargs}
