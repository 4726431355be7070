"""lower_embeddings: torchrec lookups in the sparse half become plain per-feature gathers.

The request arrives as per-feature values and lengths, and the sparse half assembles them into a
KeyedJaggedTensor only to hand it to torchrec's EmbeddingCollection / EmbeddingBagCollection, which splits it
apart again (with reads of the lengths back to the host). When a collection's KJT is built from one values and
one lengths tensor per key (``build_kjt``, or the user's own ``KeyedJaggedTensor(keys=..., values=cat(...),
lengths=cat(...))``, ``.sync()`` or not), each feature's lookup is rewritten to what torchrec computes for it:

- EmbeddingCollection: ``embedding(ids, table).float()`` per feature; ``jt.values()`` is that, ``jt.lengths()``
  the feature's lengths, and any other use of a feature's JaggedTensor gets one built from them;
- EmbeddingBagCollection: ``embedding_bag(ids, table, offsets, mode, include_last_offset=True).float()`` per
  feature (with the KJT's weights when the collection is weighted); ``kt[name]`` and ``kt.to_dict()[name]`` are
  one of them, ``kt.values()`` their concatenation, and any other use (``regroup_as_dict``, ``length_per_key()``)
  gets a KeyedTensor built from them.

The numbers are the modules' own (the same kernels on the same tables). The tables stay where they were (the
parameters keep their names, under a ``LoweredTables`` holder), so the scripted sparse half runs no torchrec
lookup. A collection is kept as it is when its KJT cannot be read per key (permuted, variable batch, built with
offsets), its output is used whole, it is a subclass with its own forward, or its tables are quantized (it runs
after quantize_embeddings); ``ctx.sparse_lowering`` records each collection, lowered or kept with the reason,
for the manifest.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn

from hstu_export.capture.graph_functions import (
    build_jt,
    build_kjt,
    build_kt,
    build_weighted_jt,
    build_weighted_kjt,
)
from hstu_export.passes.boundary import SPARSE

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

NAME = "lower_embeddings"


@dataclass
class _Kjt:
    """A KJT the graph built from one tensor per key."""

    keys: list[str]
    values: list[Any]
    lengths: list[Any]
    weights: list[Any] | None


class LowerEmbeddings:
    name = NAME
    recursive = False  # finds the sparse half itself

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        sparse = getattr(gm, SPARSE, None)
        half = sparse if isinstance(sparse, torch.fx.GraphModule) else gm
        calls: dict[str, list[torch.fx.Node]] = {}
        for node in half.graph.nodes:
            if node.op == "call_module":
                calls.setdefault(str(node.target), []).append(node)
        records: list[dict[str, Any]] = []
        quantized = {str(t.get("module")) for t in ctx.quantized_tables if t.get("mode", "none") != "none"}
        for target, nodes in calls.items():
            module = half.get_submodule(target)
            kind = _collection_kind(module)
            if target in quantized:
                records.append({"module": target, "lowered": False,
                                "reason": "its tables are quantized (--quantize-embeddings): torchrec's quantized "
                                          "module looks them up"})
                continue
            if kind is None:
                if _looks_like_collection(module):
                    records.append({"module": target, "lowered": False,
                                    "reason": f"{type(module).__name__} is not torchrec's own EmbeddingCollection "
                                              "or EmbeddingBagCollection (a lookup of its own)"})
                continue
            # Every call of a collection is rewritten, or none: the module is replaced by its tables' holder.
            plans = [_plan(node, module, kind) for node in nodes]
            reason = next((p for p in plans if isinstance(p, str)), None)
            if reason is None:
                owner = "embeddings" if kind == "ec" else "embedding_bags"
                for node, plan in zip(nodes, plans, strict=True):
                    _rewrite(half.graph, node, module, kind, owner, plan)
                holder = LoweredTables(owner, getattr(module, owner))
                half.set_submodule(target, holder)
            records.append({"module": target, "lowered": reason is None, **({"reason": reason} if reason else {})})
        if any(r["lowered"] for r in records):
            # The collection calls and the KJTs only they read (the range checks are impure and stay).
            half.graph.eliminate_dead_code()
            half.graph.lint()
            half.recompile()
        ctx.sparse_lowering = records
        ctx.add_stat("lowered", [r["module"] for r in records if r["lowered"]])
        ctx.add_stat("kept", {r["module"]: r["reason"] for r in records if not r["lowered"]})
        return gm


class LoweredTables(nn.Module):
    """A lowered collection's tables, under the collection's own attribute (``embeddings`` or
    ``embedding_bags``), so their parameters keep their names; the graph reads them as attributes. It has no
    forward: nothing calls it, and TorchScript compiles none."""

    def __init__(self, owner: str, tables: nn.ModuleDict) -> None:
        super().__init__()
        self.add_module(owner, tables)


def _collection_kind(module: nn.Module) -> str | None:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    # Only the classes themselves (or subclasses that keep their forward): a lookup of the user's own is
    # not what the rewrite reproduces.
    if isinstance(module, EmbeddingCollection) and type(module).forward is EmbeddingCollection.forward:
        return "ec"
    if isinstance(module, EmbeddingBagCollection) and type(module).forward is EmbeddingBagCollection.forward:
        return "ebc"
    return None


def _looks_like_collection(module: nn.Module) -> bool:
    name = type(module).__name__
    return "EmbeddingCollection" in name or "EmbeddingBagCollection" in name


_Plan = tuple[_Kjt, list[tuple[str, str, str]], list[tuple[torch.fx.Node, str, str]]]


def _plan(call: torch.fx.Node, module: nn.Module, kind: str) -> _Plan | str:
    """What rewriting one collection call needs (its KJT's parts, its tables, its output's uses), or why it
    cannot be rewritten."""
    if len(call.args) != 1 or call.kwargs:
        return "it is called with other arguments than one KeyedJaggedTensor"
    kjt = _resolve_kjt(call.args[0])
    if isinstance(kjt, str):
        return kjt
    tables = _tables(module, kind)
    missing = sorted({feature for feature, _, _ in tables} - set(kjt.keys))
    if missing:
        return f"its KeyedJaggedTensor lacks feature(s) {missing}"
    if kind == "ebc" and getattr(module, "_is_weighted", False) and kjt.weights is None:
        return "the collection is weighted but its KeyedJaggedTensor has no weights"
    uses = _uses(call, kind, {name for _, name, _ in tables})
    if isinstance(uses, str):
        return uses
    return kjt, tables, uses


def _rewrite(graph: torch.fx.Graph, call: torch.fx.Node, module: nn.Module, kind: str, owner: str,
             plan: _Plan) -> None:
    """Each feature's lookup before ``call``, and the uses of its output read from them."""
    kjt, tables, uses = plan
    lookups: dict[str, torch.fx.Node] = {}
    with graph.inserting_before(call):
        for feature, name, table in tables:
            at = kjt.keys.index(feature)
            weight = graph.get_attr(f"{call.target}.{owner}.{table}.weight")
            ids = kjt.values[at]
            if kind == "ec":
                rows = graph.call_function(torch.nn.functional.embedding, (ids, weight))
            else:
                lengths = kjt.lengths[at]
                # The KJT's offsets: a leading 0, then the running sum of the lengths.
                offsets = graph.call_function(torch.cumsum, (lengths, 0), {"dtype": torch.int64})
                offsets = graph.call_function(torch.nn.functional.pad, (offsets, (1, 0)))
                ids = graph.call_method("to", (ids, torch.int64))
                bag = getattr(module, owner)[table]
                per_sample = kjt.weights[at] if getattr(module, "_is_weighted", False) and kjt.weights else None
                rows = graph.call_function(
                    torch.nn.functional.embedding_bag, (ids, weight, offsets),
                    {"mode": bag.mode, "include_last_offset": True, "per_sample_weights": per_sample})
            lookups[name] = graph.call_method("float", (rows,))
    kt: torch.fx.Node | None = None
    for use, name, what in uses:
        if what in ("values", "pooled"):  # jt.values(), kt[name]: the feature's gather itself
            use.replace_all_uses_with(lookups[name])
        elif what == "lengths":
            use.replace_all_uses_with(kjt.lengths[kjt.keys.index(_feature_of(tables, name))])
        elif what == "all":  # kt.values(): every pooled feature, in the KeyedTensor's key order
            with graph.inserting_before(use):
                cat = graph.call_function(torch.cat, ([lookups[n] for _, n, _ in tables],), {"dim": 1})
            use.replace_all_uses_with(cat)
        elif what == "jt":  # the feature's JaggedTensor, as the collection makes it
            feature = _feature_of(tables, name)
            parts = (lookups[name], kjt.lengths[kjt.keys.index(feature)])
            need_indices = bool(getattr(module, "_need_indices", False))
            with graph.inserting_before(call):
                jt = graph.call_function(build_weighted_jt if need_indices else build_jt,
                                         (*parts, kjt.values[kjt.keys.index(feature)]) if need_indices else parts)
            use.replace_all_uses_with(jt)
        elif what == "kt":  # the KeyedTensor, as the collection makes it
            if kt is None:
                with graph.inserting_before(call):
                    kt = graph.call_function(build_kt, ([n for _, n, _ in tables], [lookups[n] for _, n, _ in tables]))
            use.replace_input_with(call, kt)


def _tables(module: nn.Module, kind: str) -> list[tuple[str, str, str]]:
    """(feature, output name, table) per lookup, in the collection's output order."""
    configs = module.embedding_configs() if kind == "ec" else module.embedding_bag_configs()
    from torchrec.modules.embedding_modules import get_embedding_names_by_table

    names = get_embedding_names_by_table(configs)
    return [(feature, name, config.name)
            for config, table_names in zip(configs, names, strict=True)
            for feature, name in zip(config.feature_names, table_names, strict=True)]


def _feature_of(tables: list[tuple[str, str, str]], name: str) -> str:
    return next(feature for feature, n, _ in tables if n == name)


def _uses(call: torch.fx.Node, kind: str, names: set[str]) -> list[tuple[torch.fx.Node, str, str]] | str:
    """The collection output's uses as (node to replace, output name, what). What the rewrite reads off the
    gathers (a feature's values or lengths, ``kt[name]``, ``kt.values()``) is replaced by them; any other use
    gets the torchrec object rebuilt from the gathers ("jt": a feature's JaggedTensor, "kt": the KeyedTensor).
    A string: why the uses cannot be rewritten."""
    found: list[tuple[torch.fx.Node, str, str]] = []

    def by_name(node: torch.fx.Node) -> str | None:
        if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 \
                and isinstance(node.args[1], str) and node.args[1] in names:
            return node.args[1]
        return None

    for user in call.users:
        name = by_name(user)
        if kind == "ec":
            if name is None:
                return f"its output is used as {_describe(user)}, not per feature"
            for jt_use in user.users:
                method = jt_use.target if jt_use.op == "call_method" and len(jt_use.args) == 1 else None
                if method not in ("values", "lengths"):
                    found.append((user, name, "jt"))
                    break
            else:
                found.extend((jt_use, name, str(jt_use.target)) for jt_use in user.users)
        elif name is not None:
            found.append((user, name, "pooled"))
        elif user.op == "call_method" and user.target == "values" and len(user.args) == 1:
            found.append((user, "", "all"))
        elif user.op == "call_method" and user.target == "to_dict" and len(user.args) == 1 \
                and all(by_name(item) for item in user.users):
            found.extend((item, str(by_name(item)), "pooled") for item in user.users)
        else:
            found.append((user, "", "kt"))
    return found


def _describe(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "output":
        return "a graph output"
    return getattr(node.target, "__name__", str(node.target))


def _resolve_kjt(node: Any) -> _Kjt | str:
    """The per-key tensors a KJT node was built from, or why they cannot be read off the graph."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not isinstance(node, torch.fx.Node):
        return "its KeyedJaggedTensor is not computed in the graph"
    source = node
    if node.op == "call_method" and node.target == "sync" and len(node.args) == 1 and not node.kwargs:
        source = node.args[0]
    if not isinstance(source, torch.fx.Node) or source.op != "call_function":
        return "its KeyedJaggedTensor does not come from a constructor the pass reads"
    if source.target in (build_kjt, build_weighted_kjt):
        keys, values, lengths, *rest = source.args
        weights = list(rest[0]) if rest else None
        return _Kjt(list(keys), list(values), list(lengths), weights)
    if source.target is KeyedJaggedTensor:
        kwargs = dict(zip(("keys", "values", "weights", "lengths", "offsets"), source.args)) | dict(source.kwargs)
        for extra in ("offsets", "stride", "stride_per_key_per_rank", "inverse_indices", "length_per_key",
                      "offset_per_key", "index_per_key", "jt_dict", "stride_per_key"):
            if kwargs.get(extra) is not None:
                return f"its KeyedJaggedTensor is built with {extra}= (only keys, values, lengths and weights are read)"
        keys = kwargs.get("keys")
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            return "its KeyedJaggedTensor's keys are not a constant list"
        per_key = {}
        for field in ("values", "lengths", "weights"):
            if kwargs.get(field) is None:
                continue
            parts = _cat_leaves(kwargs[field])
            if len(parts) != len(keys):
                return (f"its KeyedJaggedTensor's {field} are not one concatenated tensor per key "
                        f"({len(parts)} parts for {len(keys)} keys)")
            per_key[field] = parts
        if "values" not in per_key or "lengths" not in per_key:
            return "its KeyedJaggedTensor has no values or no lengths"
        return _Kjt(list(keys), per_key["values"], per_key["lengths"], per_key.get("weights"))
    return "its KeyedJaggedTensor does not come from a constructor the pass reads"


def _cat_leaves(node: Any) -> list[Any]:
    """The tensors a tree of ``torch.cat`` (along dim 0) joins, in order; a single tensor is its own leaf."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is torch.cat:
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if dim == 0 and isinstance(parts, (list, tuple)):
            return [leaf for part in parts for leaf in _cat_leaves(part)]
    return [node]
