"""The KV delta program derived from a model's traced dense half, for any HSTU model (docs/KV_CACHE.md,
"Derived delta programs").

The dense graph is read along its token axis: the rows of the jagged sequence every attention runs over.
Walking back from each attention's q, k and v, a node is

- *row-local*: a projection, norm, activation, elementwise op, cast, embedding lookup, or a reshape or split
  that keeps the first axis; row ``i`` of its output depends on row ``i`` of its inputs only;
- the *attention* (``hstu_export::hstu_mha`` after map_ops, whichever library it came from);
- a *row selection*: a jagged concatenation (``concat_2D_jagged`` after map_ops), each of whose rows is a row of
  one of its two sides, picked by the request's lengths alone. The walk goes on into each side, on that side's
  rows (its *space*), so that the row-local work before it (the projections and MLPs a model builds its tokens
  with) runs on the new rows only;
- *row-mixing*: anything else that makes token rows (gathers, the arithmetic of positions and time buckets).
  Those nodes are the *frontier*: the rows the layers start from. The walk also stops at integer rows (a
  position or time bucket an embedding looks up, a mask): those are compared exactly, a few bytes a row, and the
  float work they feed runs on the new rows only. A side's input read only by a cast to a narrower float (a
  bf16 export's cast before a projection) is compared after the cast.

The layers are the row-local nodes and attentions reached from the frontier. Because the attention is
causal and a history row never attends to a candidate, a row's K/V in every layer depends only on the
frontier rows up to it. So the delta program

1. runs everything up to the frontier on the whole request (gathers and additions, cheap), and takes each
   token's frontier row through the selections (:func:`frontier_rows`),
2. compares each user's cached prefix of frontier rows with the rows stored when it was cached: a user
   whose prefix differs in any bit is *stale* (the program says so and the caller recomputes it; stale
   K/V are never served),
3. runs the layers on the rows past each user's cached prefix only (each side of a selection on the rows of
   its own those rows come from: :func:`concat_sources`), each attention reading the cached
   K/V from the pages and storing the new rows' K/V (and frontier rows) there (on the ``triton`` target an
   attention between a projection's column slices and the STU gate is one op, the written program's),
4. puts the layers' rows back in their places (cached rows zero) for whatever reads them after the last
   layer: the heads, which read the candidates' rows, never cached. Where they read no other row (checked on
   the example), the last layer past its projection runs on the targets' rows alone.

With nothing cached it is the whole model. What the cache may reuse is derived too: a row is reusable
exactly when its frontier row is unchanged, which covers whatever the model computes its tokens from
(ids, timestamps against the query time, positions counted from either end, contextual tokens).

A model is not cacheable when an attention is not causal, divides by a length read from the batch
(generative-recommenders' default: export with ``--attention-scale fixed:N``), or when the layers read a
value of the whole batch or mix rows between layers; :func:`derive_delta` refuses it naming the node.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.operator_schemas import normalize_function

from hstu_export.capture.graph_functions import to_dtype_of, to_floating_dtype
from hstu_export.errors import ConfigError, ExportError, RequestError
from hstu_export.ops.jagged import jagged_positions_by_search, jagged_positions_of, lengths_to_offsets
from hstu_export.ops.reference import _append_row, stu_gate

# The attention every mapped model calls (map_ops' generic op, before its lowering to a target).
ATTENTION = "hstu_export.hstu_mha.default"
# A row selection: each output row is a row of one of its two inputs, picked by the lengths alone.
CONCAT = "hstu_export.concat_2D_jagged.default"
# The rows a region node is computed on: the sequence's (None), or a branch of a selection: (selection, 0 or 1).
Space = tuple[torch.fx.Node, int] | None

ROW_LOCAL_MODULES = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.SiLU, nn.ReLU, nn.GELU, nn.Sigmoid, nn.Tanh,
                     nn.Dropout, nn.Identity, nn.Embedding)  # fmt: skip
# Lookups of a table (not of the request) by per-row indices: row i of the output is the row index i names.
# (F.embedding takes the indices first, torch.embedding the table first; index_select along the table's first
# axis is read in row_local.)
LOOKUPS = {F.embedding: 0, torch.embedding: 1}
ELEMENTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add, torch.sub, torch.mul,
    torch.div, torch.neg, torch.sigmoid, torch.tanh, torch.relu, torch.exp, torch.rsqrt, torch.sqrt, torch.square,
    torch.where, torch.clamp, F.silu, F.relu, F.gelu, F.dropout, F.linear, F.layer_norm, F.rms_norm, F.normalize,
    F.group_norm,  # statistics of each sample (the first axis: a row) over its groups
    stu_gate,  # the STU gate over the rows' last axis (ungate)
    to_dtype_of, to_floating_dtype,  # the casts of a bf16 or fp16 export before a layer (follow_parameter_dtypes)
}  # fmt: skip
ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "neg", "sigmoid", "tanh", "relu", "exp", "rsqrt", "sqrt",
                       "clamp", "to", "float", "half", "bfloat16", "type", "contiguous", "clone", "type_as"}
SHAPE_METHODS = {"view", "reshape", "flatten", "unsqueeze", "squeeze", "split", "chunk"}
METADATA_METHODS = {"size", "dim"}


@dataclass
class DerivedDelta:
    """What :func:`derive_delta` makes: ``program`` (the dense inputs, then ``kv_cached [B]``,
    ``kv_k_pages`` / ``kv_v_pages [layers, pages, page, H, D]``, ``kv_x_pages [pages, page, row_width]``,
    ``kv_page_table [B, width]``, ``kv_new_rows [new tokens]`` and, with ``targets_only``, ``kv_target_rows``
    (:func:`delta_row_inputs`); returns the dense half's outputs and ``kv_stale [B]``) and ``counts`` (the dense
    inputs it reads -> ``(seq_lengths [B], num_targets [B])``, what the cache sizes a user's pages by before the
    call)."""

    program: torch.fx.GraphModule
    counts: torch.fx.GraphModule
    num_layers: int
    num_heads: int
    attention_dim: int
    linear_dim: int
    row_width: int
    row_dtype: torch.dtype
    max_seq_len: int
    frontier: list[str]
    layer_nodes: int
    target_inputs: list[str]  # the dense inputs the target counts are computed from (the candidates' lengths)
    gated_fused: int = 0  # layers whose attention and STU gate run as one op (the triton target's gated op)
    op_target: str = "aten"  # the op target the program is lowered to
    targets_only: bool = False  # the last layer past its projection runs on the targets' rows (kv_target_rows)
    host_counts: dict[str, dict[str, Any]] | None = None  # the counts as sums of their inputs (:func:`host_counts`)
    # Request inputs the program takes after the dense ones: the ids compared instead of the rows looked up from
    # them (``row_keys`` of :func:`derive_delta`).
    key_inputs: list[str] = field(default_factory=list)
    # frontier node -> what is compared for it: its ids, a block of ids ({"ids", "rows_each"}), nothing ([])
    compared_ids: dict[str, list[Any]] = field(default_factory=dict)

    def layout(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "num_heads": self.num_heads, "attention_dim": self.attention_dim,
                "linear_dim": self.linear_dim, "row_width": self.row_width,
                "row_dtype": str(self.row_dtype).removeprefix("torch."), "max_seq_len": self.max_seq_len}


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n] = out
        return out


def _nodes_in(value: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, lambda n: found.append(n) or n)
    return found


def _ancestors(nodes: list[torch.fx.Node], through_metadata: bool = True) -> set[torch.fx.Node]:
    """``nodes`` and what they are computed from; without ``through_metadata``, not what a size, shape or dtype
    is read from (the value behind a metadata read is not an input of what reads it)."""
    seen: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if through_metadata or not _metadata(n):
            stack.extend(n.all_input_nodes)
    return seen


def _metadata(n: torch.fx.Node) -> bool:
    """A read of a tensor's size, shape, dimensions, dtype or device."""
    return (n.op == "call_method" and n.target in METADATA_METHODS) or (
        n.op == "call_function" and n.target is getattr and len(n.args) == 2
        and n.args[1] in ("shape", "dtype", "device", "ndim"))  # fmt: skip


def _rows_shape(rows: Any, shape: Any) -> torch.Size:
    """``shape`` with its first size ``rows``: a layer value's shape read outside the layers, on the whole request."""
    return torch.Size((rows, *shape[1:]))


class _Analysis:
    """The token-axis reading of one dense graph on one example (its values give every node's shape)."""

    def __init__(self, gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any]) -> None:
        self.gm, self.values = gm, values
        self.attentions = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == ATTENTION]
        if not self.attentions:
            raise ConfigError("--kv-cache: the dense half has no HSTU attention hstu-export knows (map_ops found none "
                              "to map); only models whose attention is mapped can be cached")
        self.args = [self._bind(a) for a in self.attentions]
        self.rows = int(values[self.args[0]["q"]].shape[0])
        # Token rows come from the request: a parameter or constant whose first axis happens to be as long is not.
        self.from_request = {n for n in gm.graph.nodes if n.op == "placeholder"}
        for n in gm.graph.nodes:
            if any(a in self.from_request for a in n.all_input_nodes):
                self.from_request.add(n)
        q, k, v = (values[self.args[0][name]] for name in ("q", "k", "v"))
        if self.rows in {*q.shape[1:], *k.shape[1:], *v.shape[1:]}:
            raise ExportError(f"--kv-cache: the export example has {self.rows} token rows, as many as a head count or "
                              f"width of the attention ({tuple(q.shape)}); rows could not be told apart. Export with "
                              f"other ranges (the example's lengths follow them)")
        self.region: set[torch.fx.Node] = set()
        self.frontier: list[torch.fx.Node] = []
        self.space: dict[torch.fx.Node, Space] = {}  # region node -> the rows it is computed on
        self.leaf_spaces: dict[torch.fx.Node, set[Space]] = {}  # frontier node -> the spaces its rows are read in
        self.blocked: set[torch.fx.Node] = set()  # selections read as frontier

    def _bind(self, node: torch.fx.Node) -> dict[str, Any]:
        bound = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        return dict(bound.kwargs)

    def rowish(self, n: Any, rows: int | None = None) -> bool:
        """Whether ``n`` holds token rows: ``rows`` of them (the sequence's by default), from the request."""
        if not isinstance(n, torch.fx.Node) or n not in self.from_request:
            return False
        rows = self.rows if rows is None else rows
        v = self.values.get(n)
        if isinstance(v, Tensor):
            return v.dim() > 0 and v.shape[0] == rows
        if isinstance(v, (tuple, list)) and v:
            return all(isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows for t in v)
        return False

    def _dim(self, node: torch.fx.Node, dim: Any, rows: int | None = None) -> int | None:
        first = next((a for a in node.all_input_nodes if self.rowish(a, rows)), None)
        if first is None:
            return None  # no input holds these rows: the op made them (a flatten of the first axes)
        v = self.values.get(first)
        ndim = v.dim() if isinstance(v, Tensor) else v[0].dim()
        return dim % max(ndim, 1) if isinstance(dim, int) else None

    def row_local(self, n: torch.fx.Node, rows: int | None = None) -> bool:
        """Whether row i of ``n`` depends on row i of its inputs only (shapes from the example; ``rows``: the row
        count of the space it is read in, the sequence's by default)."""
        if not self.rowish(n, rows):
            return False
        if n.op == "call_module":
            return isinstance(self.gm.get_submodule(str(n.target)), ROW_LOCAL_MODULES)
        if n.op == "call_function" and n.target in LOOKUPS:
            at = LOOKUPS[n.target]
            indices, table = n.args[at], n.args[1 - at] if len(n.args) > 1 else n.kwargs.get("weight")
            return self.rowish(indices, rows) and not self.rowish(table, rows)
        if (n.op == "call_function" and n.target is torch.index_select) or (
                n.op == "call_method" and n.target == "index_select"):
            # table.index_select(0, indices): a lookup as above (a table that is not static is refused below).
            bound = dict(zip(("input", "dim", "index"), n.args), **n.kwargs)
            table, dim, indices = bound.get("input"), bound.get("dim"), bound.get("index")
            return dim == 0 and self.rowish(indices, rows) and not self.rowish(table, rows)
        if n.op == "call_function" and n.target is operator.getitem:
            source, index = n.args
            if isinstance(self.values.get(source), (tuple, list)):
                return isinstance(index, int)
            entries = index if isinstance(index, tuple) else (index,)
            return (len(entries) > 1 and entries[0] in (slice(None), Ellipsis)
                    and not _nodes_in(entries))  # fmt: skip
        if n.op == "call_function" and n.target in (torch.cat, torch.concat):
            return self._dim(n, n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0), rows) not in (0, None)
        if n.op == "call_function" and n.target in (torch.split, torch.chunk):
            return self._dim(n, n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0), rows) not in (0, None)
        if n.op == "call_function" and n.target in (torch.addmm, torch.mm, torch.matmul, operator.matmul):
            # A product with the rows on the left and weights on the right (addmm's bias broadcast or per row).
            operands = [a for a in n.args if isinstance(a, torch.fx.Node)]
            left, right = operands[-2:] if len(operands) >= 2 else (None, None)
            weights = self.values.get(right)
            return (self.rowish(left, rows) and not self.rowish(right, rows) and isinstance(weights, Tensor)
                    and weights.dim() <= 2)
        if n.op == "call_function" and n.target in (torch.flatten, torch.reshape):
            return True  # the first axis keeps its size (rowish): each row stays itself
        if n.op == "call_function":
            return n.target in ELEMENTWISE
        if n.op == "call_method" and n.target in ELEMENTWISE_METHODS:
            return True
        if n.op == "call_method" and n.target in ("view", "reshape"):
            return True
        if n.op == "call_method" and n.target in ("flatten",):
            start = n.kwargs.get("start_dim", n.args[1] if len(n.args) > 1 else 0)
            return self._dim(n, start, rows) not in (0, None)
        if n.op == "call_method" and n.target in ("unsqueeze", "squeeze", "split", "chunk"):
            dim = n.kwargs.get("dim", n.args[2] if n.target in ("split", "chunk") and len(n.args) > 2 else
                               n.args[1] if n.target in ("unsqueeze", "squeeze") and len(n.args) > 1 else 0)
            if n.target in ("unsqueeze", "squeeze"):
                return True  # the output keeps the rows (rowish), so the first axis was not touched
            return self._dim(n, dim, rows) not in (0, None)
        return False

    def exact(self, n: torch.fx.Node) -> bool:
        """Integer or boolean rows: the walk stops there (compared bit for bit; whatever computed them from the
        batch's layout, such as a position counted from the user's first row, stays before the frontier)."""
        v = self.values.get(n)
        return isinstance(v, Tensor) and not v.is_floating_point() and not v.is_complex()

    def walk(self) -> None:
        """Region (row-local nodes, attentions and the row selections before them) and frontier, from the
        attentions backward, then forward over whatever row-local work follows them. A selection whose branches'
        nodes are read anywhere but on their way to it is read as the frontier instead (:meth:`_unsound`)."""
        while True:
            conflicts = self._walk_once()
            unsound = self._unsound(conflicts)
            if not unsound:
                return
            self.blocked |= unsound

    def _walk_once(self) -> set[torch.fx.Node]:
        """One walk with the selections of ``blocked`` read as frontier; returns the selections one of whose
        branches' nodes was reached in another space too."""
        self.region, self.space, self.leaf_spaces = set(), {}, {}
        conflicts: set[torch.fx.Node] = set()
        frontier = self.leaf_spaces

        def visit(n: torch.fx.Node, space: Space) -> None:
            stack = [(n, space)]
            while stack:
                m, sp = stack.pop()
                if m in self.region:
                    if self.space[m] != sp:
                        conflicts.update(s for s in (self._owner(self.space[m]), self._owner(sp)) if s is not None)
                    continue
                if m in frontier:
                    frontier[m].add(sp)
                    continue
                rows = self.rows_in(sp)
                if m in self.attentions and sp is None:
                    self._enter(m, sp)
                    bound = self.args[self.attentions.index(m)]
                    stack.extend((bound[name], sp) for name in ("q", "k", "v"))
                elif self._selection(m, rows):
                    self._enter(m, sp)
                    stack.extend(((m.args[0], (m, 0)), (m.args[2], (m, 1))))
                elif self.row_local(m, rows) and not self.exact(m) and (sp is None or self._reads_own_rows(m, rows)):
                    self._enter(m, sp)
                    stack.extend((a, sp) for a in m.all_input_nodes if self.rowish(a, rows))
                else:
                    frontier[m] = {sp}

        for a in self.attentions:
            visit(a, None)
        for n in self.gm.graph.nodes:  # topological: what the layers' rows feed, row by row
            if n in self.region or n in frontier or n.op == "output":
                continue
            if any(self.space.get(a, 0) is None for a in n.all_input_nodes) and (n in self.attentions or (
                    self.row_local(n) and not self.exact(n))):
                for a in n.all_input_nodes:
                    if self.rowish(a) and a not in self.region:
                        visit(a, None)
                self._enter(n, None)
        for f in list(frontier):  # a side's input read only by a cast to a narrower float: compared after the cast
            readers = [u for u in f.users if u in self.region]
            if (len(readers) == 1 and len(frontier[f]) == 1 and None not in frontier[f] and len(f.users) == 1
                    and self._narrowing(readers[0], self.rows_in(self.space[readers[0]]))):
                cast = readers[0]
                self.region.discard(cast)
                frontier[cast] = {self.space.pop(cast)}
                del frontier[f]
        self.frontier = [n for n in self.gm.graph.nodes if n in frontier]
        return conflicts

    def _enter(self, n: torch.fx.Node, space: Space) -> None:
        self.region.add(n)
        self.space[n] = space

    @staticmethod
    def _owner(space: Space) -> torch.fx.Node | None:
        return None if space is None else space[0]

    def rows_in(self, space: Space) -> int:
        """The example's row count of ``space``: the sequence's, or a selection's branch's."""
        if space is None:
            return self.rows
        selection, branch = space
        return int(self.values[selection.args[2 * branch]].shape[0])

    def _selection(self, n: torch.fx.Node, rows: int) -> bool:
        """Whether ``n`` is a jagged concatenation the walk goes through: each output row is a row of one of its
        branches, picked by the request's lengths alone (never by a layer's value), and its branches' rows can be
        told apart from the batch's other sizes on the example."""
        if n.op != "call_function" or str(n.target) != CONCAT or n in self.blocked or len(n.args) != 4:
            return False
        if not self.rowish(n, rows) or self.exact(n):
            return False
        offsets = [self.values.get(a) for a in (n.args[1], n.args[3])]
        if not all(isinstance(o, Tensor) and o.dim() == 1 for o in offsets):
            return False
        users = int(offsets[0].shape[0]) - 1
        for branch in (n.args[0], n.args[2]):
            v = self.values.get(branch)
            if not isinstance(branch, torch.fx.Node) or not isinstance(v, Tensor) or v.dim() == 0:
                return False
            if v.shape[0] in {users, users + 1, *v.shape[1:], *self.values[n].shape[1:]}:
                return False
        attentions = set(self.attentions)
        return not (_ancestors([n], through_metadata=False) & attentions)

    def _narrowing(self, n: torch.fx.Node, rows: int) -> bool:
        """A cast of one input's floating rows to a narrower floating dtype (a bf16 export's cast before a layer)."""
        v = self.values.get(n)
        inputs = [a for a in n.all_input_nodes if self.rowish(a, rows)]
        if not isinstance(v, Tensor) or not v.is_floating_point() or len(inputs) != 1 or not self.row_local(n, rows):
            return False
        source = self.values.get(inputs[0])
        return (isinstance(source, Tensor) and source.is_floating_point() and source.shape == v.shape
                and v.element_size() < source.element_size())

    def never_empty(self, n: torch.fx.Node, inputs: set[str]) -> bool:
        """Whether ``n`` holds a row whenever one of ``inputs`` does (a dense input of those, or a row-local value
        of one's rows)."""
        if n.op == "placeholder":
            return n.target in inputs
        v = self.values.get(n)
        if not isinstance(v, Tensor) or v.dim() == 0:
            return False
        rows = int(v.shape[0])
        return self.row_local(n, rows) and any(self.never_empty(a, inputs) for a in n.all_input_nodes
                                               if self.rowish(a, rows))

    def looked_up_from(self, n: torch.fx.Node, keys: dict[str, Sequence[str]]) -> tuple[str, ...] | None:
        """The request inputs whose rows ``n``'s rows are a function of, row by row: ``n`` a dense input the sparse
        half looked up from them (``keys``: dense input -> those inputs), or row-local work on such inputs and on
        values the same for every request (parameters, constants); None for anything else."""
        if n.op == "placeholder":
            return tuple(keys[n.target]) if n.target in keys else None
        v = self.values.get(n)
        first = v[0] if isinstance(v, (tuple, list)) and v else v
        if not isinstance(first, Tensor) or first.dim() == 0 or not self.row_local(n, int(first.shape[0])):
            return None
        rows, found = int(first.shape[0]), []
        for a in n.all_input_nodes:
            if self.rowish(a, rows):
                got = self.looked_up_from(a, keys)
                if got is None:
                    return None
                found += got
            elif not self._static(a):
                return None
        return tuple(dict.fromkeys(found)) or None

    def blocks_of(self, n: torch.fx.Node, keys: dict[str, Sequence[str]], example: dict[str, Tensor],
                  ) -> tuple[tuple[str, ...], int] | None:  # fmt: skip
        """Where ``n`` (a frontier value) is computed from dense inputs the sparse half looked up (``keys``) and
        values the same for every request alone, ``k`` rows of it from each of their rows (row ``r`` from their row
        ``r // k``, the same function of it for every ``r // k``: a user's contextual tokens from its per-user
        embeddings): the ids of those inputs and ``k`` (:func:`block_keys`); None otherwise. The graph is read for
        the inputs; which rows make which is checked on the example: each input row changed alone changes its
        ``k`` rows alone, the input rows reordered reorder the rows' blocks alike, and a batch of one user fewer
        leaves the other users' rows as they were (no read of the batch's size)."""
        v = self.values.get(n)
        read = self._read_from(n)
        sources = [p for p in self.gm.graph.nodes if p.op == "placeholder" and p in read]
        if (not isinstance(v, Tensor) or not v.is_floating_point() or v.dim() == 0 or not sources
                or any(p.target not in keys for p in sources)):
            return None
        counts = {int(self.values[p].shape[0]) for p in sources if isinstance(self.values.get(p), Tensor)
                  and self.values[p].dim() > 0}  # fmt: skip
        floats = [p for p in sources if self.values[p].is_floating_point()]
        if len(counts) != 1 or not floats:
            return None
        (m,) = counts
        if m < 2 or v.shape[0] % m or not 1 <= v.shape[0] // m <= _MAX_BLOCK:
            return None
        k = int(v.shape[0]) // m
        graph = torch.fx.Graph()
        copies: dict[torch.fx.Node, torch.fx.Node] = {}
        graph.graph_copy(self.gm.graph, copies)
        graph.output(copies[n])
        alone = torch.fx.GraphModule(self.gm, graph)
        alone.graph.eliminate_dead_code()
        alone.recompile()
        names = [str(p.target) for p in graph.nodes if p.op == "placeholder"]
        generator = torch.Generator().manual_seed(0)

        def run(changed: dict[str, Tensor]) -> Tensor:
            with torch.no_grad():
                return alone(*[changed.get(name, example[name]) for name in names]).float().reshape(-1, v[0].numel())

        base = run({})
        for j in range(m):
            changed = {}
            for p in floats:
                x = self.values[p].clone()
                noise = torch.randn(x[j].shape, generator=generator).to(device=x.device, dtype=x.dtype)
                x[j] = x[j] + noise * (1 + float(x.abs().max()))
                changed[str(p.target)] = x
            moved = (run(changed) != base).any(dim=1)
            block = torch.zeros_like(moved)
            block[j * k:(j + 1) * k] = True
            if bool((moved & ~block).any()) or not bool(moved[block].all()):
                return None
        order = torch.roll(torch.arange(m, device=v.device), 1)
        got = run({str(p.target): self.values[p].index_select(0, order.to(self.values[p].device)) for p in sources})
        want = base.reshape(m, k, -1).index_select(0, order).reshape(v.shape[0], -1)
        if not bool((got - want).abs().max() <= row_tolerance(v.dtype) * want.abs().max()):  # as rows are compared
            return None
        # A batch of one user fewer (every input of that many rows cut, so that a size read anywhere sees it): the
        # rows left must be the same, or they read the batch's size.
        fewer = {name: example[name][: m - 1] for name in names
                 if isinstance(example[name], Tensor) and example[name].dim() > 0 and example[name].shape[0] == m}
        try:
            got = run(fewer)
        except Exception:  # an input cut that the graph needs whole: a batch whose size it cannot be told apart from
            return None
        want = base[: (m - 1) * k]
        if got.shape != want.shape or not bool((got - want).abs().max() <= row_tolerance(v.dtype) * want.abs().max()):
            return None
        return tuple(dict.fromkeys(k_ for p in sources for k_ in keys[str(p.target)])), k

    def _read_from(self, n: torch.fx.Node) -> set[torch.fx.Node]:
        """``n`` and what it is computed from (not what a size, shape or dtype is read from), where an entry of
        what a call returned that is one of its arguments as it is (the same tensor, on the example: a model's
        dict of its features, built by a function of its own) is read from that argument alone."""
        seen: set[torch.fx.Node] = set()
        stack = [n]
        while stack:
            m = stack.pop()
            if m in seen:
                continue
            seen.add(m)
            if _metadata(m):
                continue
            if m.op == "call_function" and m.target is operator.getitem and isinstance(m.args[0], torch.fx.Node):
                value = self.values.get(m)
                same = [a for a in m.args[0].all_input_nodes if value is not None and self.values.get(a) is value]
                if isinstance(value, Tensor) and len(same) == 1 and m.args[0].op == "call_function":
                    stack.append(same[0])
                    continue
            stack.extend(m.all_input_nodes)
        return seen

    def constant_rows(self, n: torch.fx.Node) -> bool:
        """Whether every row of ``n`` is the same in every request: a tile, repeat or expand of one row of values
        the same for every request (a model's one embedding for every candidate's unknown action)."""
        v = self.values.get(n)
        if not isinstance(v, Tensor) or v.dim() == 0 or not (
                (n.op == "call_method" and n.target in ("tile", "repeat", "expand"))
                or (n.op == "call_function" and n.target in (torch.tile, torch.Tensor.repeat, torch.Tensor.expand))):
            return False
        source = n.args[0]
        one = self.values.get(source)
        return (isinstance(source, torch.fx.Node) and isinstance(one, Tensor) and one.dim() == v.dim()
                and one.shape[0] == 1 and self._static(source))

    def _reads_own_rows(self, n: torch.fx.Node, rows: int) -> bool:
        """A node in a branch of a selection reads only rows of that branch and values the same for every
        request of one shape (else it stays before the frontier, computed on every row)."""
        return all(self.rowish(a, rows) or self._static(a) for a in n.all_input_nodes)

    def _unsound(self, conflicts: set[torch.fx.Node]) -> set[torch.fx.Node]:
        """The selections to read as frontier: those reached in two spaces or read outside the layers, and those
        whose branches' nodes are read outside their way to it or whose lengths are computed from the layers."""
        unsound = set(conflicts)
        for n in self.region:
            space = self.space[n]
            if str(n.target) == CONCAT and n.op == "call_function" and n not in self.attentions and (
                    any(u not in self.region and not _metadata(u) for u in n.users)
                    or _ancestors(_nodes_in((n.args[1], n.args[3])), through_metadata=False) & self.region):
                unsound.add(n)
            if space is None:
                continue
            owner, branch = space
            for u in n.users:
                if u is owner and owner.args[2 * branch] is n and owner.args[2 - 2 * branch] is not n:
                    continue
                if (u not in self.region and not _metadata(u)) or (u in self.region and self.space[u] != space):
                    unsound.add(owner)
        return unsound

    def check(self) -> None:
        """The conditions under which cached K/V are exact; a refusal names the node."""
        first = self.args[0]
        for node, bound in zip(self.attentions, self.args, strict=True):
            where = f"attention {node.name}"
            if bound.get("causal") is not True:
                raise ConfigError(f"--kv-cache: {where} is not causal; a cached token's K/V would depend on later tokens")
            if isinstance(bound.get("scaling_seqlen"), torch.fx.Node):
                raise ConfigError(f"--kv-cache: {where} divides by a length read from the batch ({bound['scaling_seqlen'].name}), "
                                  f"so a user's rows depend on who else is in it; export with --attention-scale fixed:N")
            for name in ("contextual_seq_len", "max_attn_len", "max_seq_len", "alpha"):
                if isinstance(bound.get(name), torch.fx.Node):
                    raise ConfigError(f"--kv-cache: {where} takes its {name} from the batch ({bound[name].name})")
            for name in ("seq_offsets", "num_targets", "contextual_seq_len", "max_attn_len"):
                if bound.get(name) is not first.get(name):
                    raise ConfigError(f"--kv-cache: attentions {self.attentions[0].name} and {node.name} run over "
                                      f"different sequences ({name}); the cache holds one sequence a user")
        region_ancestors = _ancestors(self.frontier, through_metadata=False) & self.region
        if region_ancestors:
            mixed = next(f for f in self.frontier if _ancestors([f], through_metadata=False) & self.region)
            raise ConfigError(f"--kv-cache: {mixed.name} ({_what(mixed)}) mixes token rows between the layers; the "
                              f"delta program can run only row-local work and the attention there")
        for f in self.frontier:
            v = self.values[f]
            if not isinstance(v, Tensor) or v.is_complex():
                raise ConfigError(f"--kv-cache: the layers start from {f.name} ({_what(f)}), which is not a tensor of "
                                  f"real or integer rows; only those can be compared with the cached ones")
        for n in self.region:
            if n in self.attentions or (n.op == "call_function" and str(n.target) == CONCAT):
                continue  # a selection's lengths: read before the layers, never computed from them (_unsound)
            for a in n.all_input_nodes:
                if a in self.region or a in self.frontier or self.rowish(a):
                    continue
                if not self._static(a):
                    raise ConfigError(f"--kv-cache: {n.name} ({_what(n)}) in the layers reads {a.name}, a value "
                                      f"computed from the whole batch; a cached row must depend on its own tokens only")

    def _static(self, n: torch.fx.Node) -> bool:
        """A value that is the same for every request of one shape: parameters, constants, shape and dtype
        reads, and what is computed from those alone."""
        memo: dict[torch.fx.Node, bool] = {}

        def static(m: torch.fx.Node) -> bool:
            if m not in memo:
                if m.op == "get_attr" or _metadata(m):
                    memo[m] = True
                elif m.op == "placeholder" or m in self.region:
                    memo[m] = False
                else:
                    memo[m] = all(static(a) for a in m.all_input_nodes)
            return memo[m]

        return static(n)


def _what(n: torch.fx.Node) -> str:
    return str(n.target) if n.op != "call_function" else getattr(n.target, "__name__", str(n.target))


# ---- what the derived program calls --------------------------------------------------------------------


def delta_rows(seq_offsets: Tensor, num_targets: Tensor | None, cached: Tensor, frontier: list[Tensor],
               x_pages: Tensor, page_table: Tensor, new_rows: Tensor, whole_history: bool = False,
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """One delta call's row bookkeeping: ``(new_rows, q_offsets, seq_lens, num_targets, stale)``.

    ``cached[b]`` tokens of user b are taken as cached (a count beyond its non-target tokens is 0). Its
    frontier rows before that are compared with ``x_pages`` (stale: a floating row differs beyond its rounding,
    :func:`row_tolerance`, or an integer one in any bit); its new non-target frontier rows are stored there
    (others to the scratch page, the pool's last): :func:`frontier_row`'s layout. ``new_rows``: the rows past
    each cached prefix, in order (:func:`new_rows_of`), given by the caller, which has the counts on the host:
    their number sizes the layers' work, and a count read back from the device would stall it (and keep the
    program from a CUDA graph). Rows outside the request are clamped into it. ``whole_history``: the
    attention's contextual rows see every history row, so every later row of a layer depends on the whole
    history through them, and a user whose history grew is stale too."""
    offsets = seq_offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    targets = torch.zeros_like(lengths) if num_targets is None else num_targets.to(torch.int64)
    stored = lengths - targets
    cached = cached.to(torch.int64)
    cached = torch.where((cached >= 0) & (cached <= stored), cached, 0)
    q_offsets = lengths_to_offsets(lengths - cached)
    total = frontier[0].shape[0]
    user, pos = jagged_positions_by_search(offsets, total)
    page_size, width, scratch = x_pages.shape[1], page_table.shape[1], x_pages.shape[0] - 1
    col = pos // page_size
    page = page_table.to(torch.int64)[user, col.clamp(0, max(width - 1, 0))].clamp(0, scratch)
    slot = pos % page_size
    differs = _rows_differ(x_pages[page, slot], _frontier_parts(frontier, x_pages.dtype))
    differs = differs & (pos < cached[user]) & (col < width)
    # per user: its differing rows added up by user, in int32 (which Inductor adds with atomics in the kernel; an
    # int64 sum by index falls back to aten's, a sort on CUDA). The other rows add their zero to a place of their
    # own past the users', so that only a stale user's rows ever wait on each other's atomics: all of them on the
    # user's place cost 0.10 ms of a 32-user call on an H100 (docs/PERF_INVESTIGATIONS.md).
    places = torch.where(differs, user, lengths.shape[0] + torch.arange(total, device=user.device))
    stale = differs.new_zeros(lengths.shape[0] + total, dtype=torch.int32).index_put_(
        (places,), differs.to(torch.int32), accumulate=True)[:lengths.shape[0]] > 0
    if whole_history:
        stale = stale | ((cached > 0) & (cached < stored))
    at = new_rows.to(torch.int64).clamp(0, max(total - 1, 0))
    keep = (pos[at] < stored[user[at]]) & (col[at] < width)  # the new rows of the history, not the candidates'
    x_new, _ = frontier_row([f.index_select(0, at) for f in frontier], x_pages.dtype)
    x_pages.index_put_((torch.where(keep, page[at], scratch), slot[at]), x_new)
    return at, q_offsets, lengths, targets, stale


def _row_lists(seq_lengths: Sequence[int], stored: Sequence[int], cached: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(:func:`new_rows_of`, :func:`target_rows_of`), computed together (a runtime's delta call needs both)."""
    lengths = np.asarray(seq_lengths, dtype=np.int64)
    non_targets = np.asarray(stored, dtype=np.int64)
    kept = np.asarray(cached, dtype=np.int64)
    kept = np.where((kept >= 0) & (kept <= non_targets), kept, 0)  # beyond the stored tokens: none cached
    counts, targets = lengths - kept, lengths - non_targets
    ends, target_ends = np.cumsum(counts), np.cumsum(targets)
    # A user's new rows run from its first uncached row, its targets end where its new rows end.
    rows = np.repeat(np.cumsum(lengths) - lengths + kept - (ends - counts), counts)
    rows += np.arange(rows.size, dtype=np.int64)
    target_rows = np.repeat(ends - targets - (target_ends - targets), targets)
    target_rows += np.arange(target_rows.size, dtype=np.int64)
    return torch.from_numpy(rows), torch.from_numpy(target_rows)


def new_rows_of(seq_lengths: Sequence[int], stored: Sequence[int], cached: Sequence[int]) -> Tensor:
    """``kv_new_rows`` of a delta call: the rows past each user's ``cached`` tokens (users of ``seq_lengths``
    rows side by side, of which ``stored`` are not targets), in order; int64 on the host. A cached count
    beyond a user's stored tokens counts as none, as :func:`delta_rows` takes it."""
    return _row_lists(seq_lengths, stored, cached)[0]


def target_rows_of(seq_lengths: Sequence[int], stored: Sequence[int], cached: Sequence[int]) -> Tensor:
    """``kv_target_rows`` of a delta call: each user's target rows (its rows past the ``stored`` ones, never cached)
    as indices into :func:`new_rows_of`'s list, in order; int64 on the host."""
    return _row_lists(seq_lengths, stored, cached)[1]


def delta_row_inputs(seq_lengths: Sequence[int], stored: Sequence[int], cached: Sequence[int]) -> dict[str, Tensor]:
    """The row lists a runtime gives a delta call, by input name (a program takes those it lists)."""
    new_rows, target_rows = _row_lists(seq_lengths, stored, cached)
    return {NEW_ROWS: new_rows, TARGET_ROWS: target_rows}


def row_tolerance(dtype: torch.dtype) -> float:
    """How far a frontier row may be from its cached copy, relative to the row's largest value, and still be
    the same row: the rounding of the same values computed in another order (a matrix product over a batch of
    another shape or with the row elsewhere in it gives other bits, never other values)."""
    return max(4 * torch.finfo(dtype).eps, 1e-5)


def frontier_row(frontier: list[Tensor], dtype: torch.dtype) -> tuple[Tensor, int]:
    """The frontier rows as one row of ``dtype`` a token, and how many of its leading values are floating: the
    floating frontier tensors cast to ``dtype``, then the integer ones as int64, their bytes read as ``dtype``
    (8 bytes a value: :func:`row_width`), so that a stored row gives them back bit for bit."""
    floats, ints = _frontier_parts(frontier, dtype)
    lanes = [_int64_lanes(t, dtype).view(dtype) for t in ints]
    return torch.cat([*floats, *lanes], dim=1), sum(f.shape[1] for f in floats)


def _frontier_parts(frontier: list[Tensor], dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`frontier_row`'s parts before they are put side by side: the floating frontier tensors as [rows, k] of
    ``dtype``, and the integer ones as [rows, k] int64, in that order (each integer value is then
    :func:`_int64_lanes`' integers of ``dtype``'s size)."""
    total = frontier[0].shape[0]
    floats = [f.reshape(total, -1).to(dtype) for f in frontier if f.is_floating_point()]
    ints = [f.reshape(total, -1).to(torch.int64) for f in frontier if not f.is_floating_point()]
    return floats, ints


def _int64_lanes(ints: Tensor, dtype: torch.dtype) -> Tensor:
    """``ints`` [N, k] (int64) as [N, k * 8 / size] integers of ``dtype``'s size holding their bytes, low bytes first
    (as a view of the int64s would), cut by shifts and masks: viewed as ``dtype`` they are a view between types of
    one size, where a view of the int64s would change the rows' length."""
    size = torch.empty((), dtype=dtype).element_size()
    if size == ints.element_size():
        return ints
    parts = [_lane(ints, dtype, i) for i in range(ints.element_size() // size)]
    return torch.stack(parts, dim=-1).reshape(ints.shape[0], -1)


def _lane(ints: Tensor, dtype: torch.dtype, i: int) -> Tensor:
    """Lane ``i`` of int64 ``ints`` as integers of ``dtype``'s size (:func:`_int64_lanes`)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size == ints.element_size():
        return ints
    bits = 8 * size
    return ((ints >> (bits * i)) & ((1 << bits) - 1)).to(_SAME_SIZE_INT[size])


def _lanes_of(dtype: torch.dtype) -> int:
    """How many values of ``dtype`` an int64 takes in a frontier row (:func:`_int64_lanes`)."""
    return torch.empty((), dtype=torch.int64).element_size() // torch.empty((), dtype=dtype).element_size()


def row_width(frontier: list[Tensor], dtype: torch.dtype) -> int:
    """The width of :func:`frontier_row`'s rows (of one token's frontier tensors ``frontier``)."""
    lanes = _lanes_of(dtype)
    return sum(f.numel() * (1 if f.is_floating_point() else lanes) for f in frontier)


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _rows_differ(cached: Tensor, parts: tuple[list[Tensor], list[Tensor]]) -> Tensor:
    """Per row: whether the frontier row of ``parts`` (:func:`_frontier_parts`) differs from ``cached`` (rows in
    :func:`frontier_row`'s layout): its floating values beyond :func:`row_tolerance` (NaN differs), the integer
    lanes in any bit. Each part is held against its own columns of ``cached``, so that the request's rows are
    read once and never put side by side (a copy of them all); a part's largest difference and largest value
    are two reductions of one pass over both rows, and an integer part of a few columns is compared lane by lane,
    elementwise over the rows, which joins that pass where a reduction over them would be a pass of its own."""
    floats, ints = parts
    differs = torch.zeros(cached.shape[0], dtype=torch.bool, device=cached.device)
    start, gap, top = 0, None, None
    for f in floats:
        current = f.to(torch.float32)
        part_gap = (cached[:, start:start + f.shape[1]].to(torch.float32) - current).abs().amax(dim=1)
        part_top = current.abs().amax(dim=1)
        gap, top = (part_gap, part_top) if gap is None else (torch.maximum(gap, part_gap), torch.maximum(top, part_top))
        start += f.shape[1]
    if gap is not None:
        differs = ~(gap <= row_tolerance(cached.dtype) * top)
    if not ints:
        return differs
    held = cached[:, start:].view(_SAME_SIZE_INT[cached.element_size()])
    lanes = _lanes_of(cached.dtype)
    at = 0
    for t in ints:
        width = t.shape[1] * lanes
        if width <= _UNROLLED_LANES:
            for j in range(t.shape[1]):
                for i in range(lanes):
                    differs = differs | (held[:, at + j * lanes + i] != _lane(t[:, j], cached.dtype, i))
        else:
            differs = differs | (held[:, at:at + width] != _int64_lanes(t, cached.dtype)).any(dim=1)
        at += width
    return differs


_UNROLLED_LANES = 16
_MAX_BLOCK = 64  # rows made from one input row, at most, for :meth:`_Analysis.blocks_of` (a user's contextual tokens)


def block_keys(ids: list[Tensor], k: int) -> Tensor:
    """The compared rows of a frontier value each of whose input rows makes ``k`` rows of it, row ``r`` from input
    row ``r // k`` alone (a user's contextual tokens, made from its per-user ids): per row, that input row's ids
    (``ids``, the keys of each input, as int64 columns) and ``r % k``, its place among the ``k``."""
    held = torch.cat([t.reshape(t.shape[0], -1).to(torch.int64) for t in ids], dim=1)
    rows = torch.arange(held.shape[0] * k, device=held.device)
    return torch.cat([held.index_select(0, rows // k), (rows % k).unsqueeze(1)], dim=1)


def rows_back(new: Tensor, new_rows: Tensor, like: Tensor, fill: float) -> Tensor:
    """The layers' rows of the new tokens put back among all the request's rows (the others ``fill``)."""
    full = new.new_full((like.shape[0], *new.shape[1:]), fill)
    return full.index_copy(0, new_rows, new)


def rows_at(new: Tensor, new_rows: Tensor, like: Tensor, wanted: Tensor, fill: float) -> Tensor:
    """The request's rows ``wanted`` (indices among all its rows, as many as ``like`` has; a negative one counts
    from the end) of a layer value computed on the rows ``new_rows`` alone (``new``), the others ``fill``: what
    :func:`rows_back` then a gather of ``wanted`` give, without the value of every row in between."""
    total = like.shape[0]
    at = wanted.to(torch.int64)
    at = torch.where(at < 0, at + total, at).clamp(0, max(total - 1, 0))
    place = torch.full((total,), -1, dtype=torch.int64, device=new.device)
    place = place.index_put((new_rows,), torch.arange(new_rows.shape[0], device=new.device))[at]
    got = new.index_select(0, place.clamp(min=0))
    return torch.where((place >= 0).reshape(-1, *([1] * (new.dim() - 1))), got, torch.full_like(got, fill))


def jagged_right_rows(offsets_left: Tensor, offsets_right: Tensor, total_right: int) -> Tensor:
    """Where the right rows of :func:`~hstu_export.ops.reference.split_2D_jagged_reference` sit among the rows it
    splits (each user's left rows, then its right ones): right row ``j`` of user ``b`` is row
    ``offsets_left[b + 1] + offsets_right[b] + j``."""
    left, right = offsets_left.to(torch.int64), offsets_right.to(torch.int64)
    user, pos = jagged_positions_by_search(right, total_right)
    return left[1:][user] + right[:-1][user] + pos


def concat_sources(offsets_left: Tensor, offsets_right: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where rows ``positions`` of :func:`~hstu_export.ops.reference.concat_2D_jagged_reference`'s output come
    from: ``(row among the left rows, row among the right rows, whether from the left)``; a row from one side
    reads row 0 of the other (never used)."""
    left, right = offsets_left.to(torch.int64), offsets_right.to(torch.int64)
    user, pos = jagged_positions_of(left + right, positions)
    left_len = left[user + 1] - left[user]
    from_left = pos < left_len
    return (torch.where(from_left, left[user] + pos, 0), torch.where(from_left, 0, right[user] + pos - left_len),
            from_left)


def concat_by_search(values_left: Tensor, offsets_left: Tensor, values_right: Tensor, offsets_right: Tensor) -> Tensor:
    """:func:`~hstu_export.ops.reference.concat_2D_jagged_reference` as one gather whose sources are found by a
    binary search of each row (:func:`concat_sources`): a compiler can fuse it into what reads it, where the
    ``triton`` target's concatenation is a kernel of its own that writes every row (:func:`gathered_jagged`)."""
    left_rows = values_left.shape[0]
    total = left_rows + values_right.shape[0]
    from_left_rows, from_right_rows, from_left = concat_sources(
        offsets_left, offsets_right, torch.arange(total, dtype=torch.int64, device=offsets_left.device))
    index = torch.where(from_left, from_left_rows, left_rows + from_right_rows).clamp(0, max(total - 1, 0))
    return torch.cat([values_left, values_right], dim=0).index_select(0, index)


def split_by_search(values: Tensor, offsets_left: Tensor, offsets_right: Tensor, total_len_left: int,
                    total_len_right: int) -> tuple[Tensor, Tensor]:
    """:func:`~hstu_export.ops.reference.split_2D_jagged_reference` as two gathers (:func:`concat_by_search`'s
    inverse); a side nothing reads is not computed."""
    left, right = offsets_left.to(torch.int64), offsets_right.to(torch.int64)
    user, pos = jagged_positions_by_search(left, total_len_left)
    last = max(values.shape[0] - 1, 0)
    left_rows = (left[user] + right[user] + pos).clamp(0, last)
    right_rows = jagged_right_rows(left, right, total_len_right).clamp(0, last)
    return values.index_select(0, left_rows), values.index_select(0, right_rows)


def gathered_jagged(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (a derived delta program, before its lowering to a target) with each jagged concatenation and split
    it still holds (those outside the layers: the whole request's positions and timestamps before the frontier,
    the heads' inputs after the layers) written as gathers (:func:`concat_by_search`, :func:`split_by_search`).
    Their rows are few values wide, and a gather is one the compiler can fuse into what reads it, where the
    ``triton`` target's ops are kernels of their own: on an H100 three of them took 37 us of a 32-user call of
    generative-recommenders' program, and none is left once written so
    (`benchmarks/results/h100_compile_rewrites/gr_before/` against `h100_compile_rewrites/`)."""
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in (CONCAT, SPLIT)]:
        concat = str(node.target) == CONCAT
        op = torch.ops.hstu_export.concat_2D_jagged.default if concat else torch.ops.hstu_export.split_2D_jagged.default
        bound = normalize_function(op, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        with gm.graph.inserting_before(node):
            gathered = gm.graph.call_function(concat_by_search if concat else split_by_search, (), dict(bound))
        gathered.meta = dict(node.meta)
        node.replace_all_uses_with(gathered)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def take_rows(rows: Tensor, positions: Tensor, may_be_empty: bool) -> Tensor:
    """Rows ``positions`` of ``rows``, each clamped to its last row. Where ``rows`` may hold no row in a request
    (the export's ranges let it), they are read with a zero row after them (a copy), so that a side without rows
    is still read inside its bounds; the rows read past a side's own are never used. Boolean rows are padded as
    bytes: Inductor's vectorized C++ for a padded boolean computed in the same kernel does not compile
    (torch 2.13, a blend of two mask types)."""
    if may_be_empty:
        if rows.dtype == torch.bool:
            return take_rows(rows.to(torch.uint8), positions, True).to(torch.bool)
        rows = _append_row(rows, 0)
    return rows.index_select(0, positions.clamp(0, rows.shape[0] - 1))


def pick_rows(from_left: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """Per row, the left row where ``from_left`` holds, else the right one."""
    return torch.where(from_left.reshape(-1, *([1] * (max(left.dim(), right.dim()) - 1))), left, right)


def _merged(from_left: Tensor, left: list[Tensor], right: list[Tensor]) -> list[Tensor]:
    """The frontier rows of a selection's two branches as one list: a left tensor and a right one of the same
    row shape share their columns (each row holds its own side's; floating ones of any two dtypes, as they are
    compared in the row dtype, integer ones of one dtype), the others keep their own (zero on the other side's
    rows); then which side each row is from, so that rows of different sides never compare equal."""

    def shared(a: Tensor, b: Tensor) -> bool:
        return a.shape[1:] == b.shape[1:] and (a.dtype == b.dtype or (a.is_floating_point() and b.is_floating_point()))

    out, unused = [], list(range(len(right)))
    for lhs in left:
        j = next((j for j in unused if shared(lhs, right[j])), None)
        if j is None:
            out.append(pick_rows(from_left, lhs, torch.zeros((), dtype=lhs.dtype, device=lhs.device)))
        else:
            unused.remove(j)
            out.append(pick_rows(from_left, lhs, right[j]))
    for j in unused:
        out.append(pick_rows(from_left, torch.zeros((), dtype=right[j].dtype, device=right[j].device), right[j]))
    return [*out, from_left.to(torch.int64)]


# A space's frontier: (its frontier tensors, each with whether it may hold no row, and its selections as
# (offsets_left, offsets_right, left's, right's)).
Plan = tuple[list[tuple[Tensor, bool]], list[tuple[Tensor, Tensor, Any, Any]]]


def frontier_rows(plan: Plan, positions: Tensor | None = None) -> list[Tensor]:
    """The rows the cache compares for a space (the sequence's: ``positions`` None, its frontier tensors whole; a
    branch's: rows ``positions`` of its ones, :func:`take_rows`): its frontier tensors' rows, then each
    selection's branches' rows, :func:`_merged`. A token's row so holds what its layer rows are computed from."""
    leaves, selections = plan
    out = [leaf if positions is None else take_rows(leaf, positions, empty) for leaf, empty in leaves]
    if positions is None:
        positions = torch.arange(_plan_rows(plan), device=_plan_device(plan))
    for offsets_left, offsets_right, left, right in selections:
        from_left_rows, from_right_rows, from_left = concat_sources(offsets_left, offsets_right, positions)
        out += _merged(from_left, frontier_rows(left, from_left_rows), frontier_rows(right, from_right_rows))
    return out


def _plan_rows(plan: Plan) -> Any:
    leaves, selections = plan
    if leaves:
        return leaves[0][0].shape[0]
    _, _, left, right = selections[0]
    return _plan_rows(left) + _plan_rows(right)


def _plan_device(plan: Plan) -> torch.device:
    leaves, selections = plan
    return leaves[0][0].device if leaves else selections[0][0].device


def paged_attention_reference(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_pool: Tensor, v_pool: Tensor,
                              layer: int, page_table: Tensor, seq_lens: Tensor, num_targets: Tensor,
                              scaling_seqlen: int, alpha: float, contextual_seq_len: int, max_attn_len: int,
                              max_seq_len: int) -> Tensor:  # fmt: skip
    from hstu_export.ops.paged import paged_hstu_mha_store_reference

    return paged_hstu_mha_store_reference(
        q, k, v, q_offsets, k_pool, v_pool, layer, page_table, seq_lens, num_targets, scaling_seqlen, alpha,
        contextual_seq_len, max_attn_len, max_seq_len=max_seq_len, max_query_len=max_seq_len)


def paged_attention_triton(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_pool: Tensor, v_pool: Tensor,
                           layer: int, page_table: Tensor, seq_lens: Tensor, num_targets: Tensor,
                           scaling_seqlen: int, alpha: float, contextual_seq_len: int, max_attn_len: int,
                           max_seq_len: int) -> Tensor:  # fmt: skip
    import hstu_export.ops._triton  # noqa: F401  (registers hstu_export::paged_hstu_mha_store_triton)

    return torch.ops.hstu_export.paged_hstu_mha_store_triton(
        q, k, v, q_offsets, k_pool, v_pool, layer, page_table, seq_lens, num_targets, scaling_seqlen, alpha,
        contextual_seq_len, max_attn_len, max_seq_len, max_seq_len, 0)


def paged_gated_attention_triton(uvqk: Tensor, q_offsets: Tensor, k_pool: Tensor, v_pool: Tensor, layer: int,
                                 page_table: Tensor, seq_lens: Tensor, num_targets: Tensor, norm_weight: Tensor,
                                 norm_bias: Tensor, eps: float, num_heads: int, attention_dim: int, linear_dim: int,
                                 scaling_seqlen: int, alpha: float, contextual_seq_len: int, max_attn_len: int,
                                 max_seq_len: int, target_rows: Tensor | None = None) -> Tensor:  # fmt: skip
    """The paged attention and its STU gate in one op (two kernels; the attention's output is written once, into
    the gate's concat): what :func:`paged_attention_triton` then :func:`~hstu_export.ops.reference.stu_gate`
    compute from one uvqk projection's columns (u, v, q, k); of the rows ``target_rows`` names alone, when given
    (every row's K/V is stored)."""
    import hstu_export.ops._triton  # noqa: F401  (registers hstu_export::paged_hstu_mha_gated_store_triton)

    return torch.ops.hstu_export.paged_hstu_mha_gated_store_triton(
        uvqk, q_offsets, k_pool, v_pool, layer, page_table, seq_lens, num_targets, norm_weight, norm_bias, eps,
        num_heads, attention_dim, linear_dim, scaling_seqlen, alpha, contextual_seq_len, max_attn_len, max_seq_len,
        max_seq_len, 0, target_rows)


@dataclass
class _GatedBlock:
    """An attention whose q, k and v are column slices of one projection (u, v, q, k) and whose output feeds only
    the STU gate with that u: the shape :func:`ungate` writes, which the derived program runs as one op."""

    uvqk: torch.fx.Node
    reshape: torch.fx.Node
    gate: torch.fx.Node
    num_heads: int
    attention_dim: int
    linear_dim: int


def _gated_block(attention: torch.fx.Node, bound: dict[str, Any]) -> _GatedBlock | None:
    """``attention``'s gated block, or None when the graph around it is anything else."""

    def column(node: Any) -> tuple[torch.fx.Node, int] | None:  # (split, index) of reshape(getitem(split, index))
        if not (isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in ("reshape", "view")):
            return None
        item = node.args[0]
        if not (isinstance(item, torch.fx.Node) and item.target is operator.getitem and isinstance(item.args[1], int)):
            return None
        split = item.args[0]
        if not (isinstance(split, torch.fx.Node) and split.op == "call_function" and split.target is torch.split):
            return None
        return split, item.args[1]

    found = [column(bound[name]) for name in ("v", "q", "k")]
    if any(f is None for f in found) or len({f[0] for f in found}) != 1 or [f[1] for f in found] != [1, 2, 3]:
        return None
    split = found[0][0]
    sizes, dim = split.args[1], split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 4 and dim in (-1, 1)):
        return None
    heads, dv = bound["v"].args[-2:] if len(bound["v"].args) == 4 else (None, None)
    _, dqk = bound["q"].args[-2:] if len(bound["q"].args) == 4 else (None, None)
    if not all(isinstance(x, int) and x > 0 for x in (heads, dv, dqk)) or list(sizes) != [dv * heads, dv * heads,
                                                                                       dqk * heads, dqk * heads]:
        return None
    users = list(attention.users)
    if len(users) != 1 or users[0].op != "call_method" or users[0].target not in ("reshape", "view"):
        return None
    reshape = users[0]
    gates = list(reshape.users)
    if len(gates) != 1 or gates[0].op != "call_function" or gates[0].target is not stu_gate:
        return None
    gate = gates[0]
    u = gate.args[0] if gate.args else gate.kwargs.get("u")
    if not (isinstance(u, torch.fx.Node) and u.target is operator.getitem and u.args == (split, 0)):
        return None
    if (gate.args[1] if len(gate.args) > 1 else gate.kwargs.get("a")) is not reshape:
        return None
    return _GatedBlock(uvqk=split.args[0], reshape=reshape, gate=gate, num_heads=heads, attention_dim=dqk,
                       linear_dim=dv)


# ---- the derivation ------------------------------------------------------------------------------------


NEW_ROWS, TARGET_ROWS = "kv_new_rows", "kv_target_rows"
DELTA_INPUTS = ("kv_cached", "kv_k_pages", "kv_v_pages", "kv_x_pages", "kv_page_table", NEW_ROWS)


def delta_inputs(derived: DerivedDelta) -> tuple[str, ...]:
    """The cache inputs ``derived``'s program takes after the dense ones, in order."""
    return (*DELTA_INPUTS, TARGET_ROWS) if derived.targets_only else DELTA_INPUTS


def derive_delta(gm: torch.fx.GraphModule, example: dict[str, Tensor], *, op_target: str = "aten",
                 fill: float = 0.0, targets_only: bool = True,
                 never_empty_inputs: Collection[str] = (),
                 row_keys: dict[str, Sequence[str]] | None = None) -> DerivedDelta:  # fmt: skip
    """The delta program of a dense graph whose attentions are ``hstu_export::hstu_mha`` nodes (map_ops'
    generic op), read on ``example`` (the dense inputs by placeholder name). ``op_target`` picks the paged
    attention (``triton``: our kernel; else plain aten); ``fill`` is what the rows of cached tokens read
    after the last layer (a check may pass NaN: no output may read them). ``targets_only``: the last layer,
    past its projection (every new row's K/V is stored), runs on the targets' rows alone where the outputs
    read no other row of it (:func:`_reads_targets_only`, on ``example``). ``never_empty_inputs``: the dense
    inputs whose first axis holds a row in every request the export allows (a side of a jagged concatenation
    computed from one is read without a copy). ``row_keys``: the dense inputs whose rows the sparse half looked
    up, row by row, from request inputs (ids; their examples in ``example``), by those inputs' names: a frontier
    row computed from such inputs alone is compared as those ids, a few bytes a row instead of the rows looked up
    (the program takes them after the dense inputs, :attr:`DerivedDelta.key_inputs`); the tables are the
    package's, the same on every call. Raises ConfigError naming why a model cannot be cached."""
    gm, values = _without_dtype_reads(gm, example)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    analysis = _Analysis(gm, values)
    analysis.walk()
    analysis.check()
    region, frontier, attentions = analysis.region, analysis.frontier, analysis.attentions
    space, leaf_spaces = analysis.space, analysis.leaf_spaces
    selections = [n for n in gm.graph.nodes if n in region and n.op == "call_function" and str(n.target) == CONCAT]
    lengths_of_selections = _nodes_in([(s.args[1], s.args[3]) for s in selections])
    never_empty = {f for f in frontier if analysis.never_empty(f, set(never_empty_inputs))}
    # What is compared for a frontier node, where not its rows: the ids they are looked up from (key input
    # names), a block of ids (:func:`block_keys`), or nothing (rows the same in every request).
    keyed: dict[torch.fx.Node, tuple[Any, ...]] = {}
    for f in frontier if row_keys else ():
        if (ids := analysis.looked_up_from(f, row_keys)) is not None:
            keyed[f] = ids
        elif (block := analysis.blocks_of(f, row_keys, example)) is not None:
            keyed[f] = (block,)
    for f in frontier:
        if f not in keyed and analysis.constant_rows(f):
            keyed[f] = ()
    dense_names = {str(p.target) for p in placeholders}
    key_inputs = [k for k in dict.fromkeys(name for got in keyed.values() for source in got
                                           for name in ((source,) if isinstance(source, str) else source[0]))
                  if k not in dense_names]

    def plan(where: Space, value: Any, arg: Any) -> Plan:
        """``where``'s :data:`Plan`, of ``value(node, key input name or block)`` and ``arg(node)``: each frontier
        node's rows, or the ids they are looked up from."""
        return ([(value(k), f not in never_empty) for f in frontier if where in leaf_spaces[f]
                 for k in keyed.get(f, (f,))],
                [(arg(s.args[1]), arg(s.args[3]), plan((s, 0), value, arg), plan((s, 1), value, arg))
                 for s in selections if space[s] == where])

    def example_value(source: Any) -> Tensor:
        if isinstance(source, tuple):
            return block_keys([example[name] for name in source[0]], source[1])
        return example[source] if isinstance(source, str) else values[source]

    example_rows = frontier_rows(plan(None, example_value, values.__getitem__))
    if not example_rows:
        raise ExportError("--kv-cache: the derivation left no frontier row to compare")
    bound0 = analysis.args[0]
    shapes = [(tuple(values[b["k"]].shape), tuple(values[b["v"]].shape)) for b in analysis.args]
    if len({s for s in shapes}) != 1:
        raise ConfigError(f"--kv-cache: the layers' attentions differ in shape ({sorted(set(shapes))}); one pool holds "
                          f"every layer's K/V")
    (_, heads, dqk), (_, _, dv) = shapes[0]
    row_dtypes = {f.dtype for f in example_rows if f.is_floating_point()}
    row_dtype = row_dtypes.pop() if len(row_dtypes) == 1 else torch.float32
    width = row_width([f[0] for f in example_rows], row_dtype)
    seq_offsets, num_targets = bound0["seq_offsets"], bound0.get("num_targets")
    contextual = int(bound0.get("contextual_seq_len", 0) or 0)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    (result,) = output.args
    if not isinstance(result, dict):
        raise ConfigError("--kv-cache: the dense half returns no named outputs")
    early = _ancestors([*frontier, *_nodes_in((seq_offsets, num_targets)), *lengths_of_selections],
                       through_metadata=False) - set(placeholders)
    # Parameters first: an early node may read one's size (a table's rows capping an index) without the walk
    # above, which does not go through such reads, having counted the parameter as early.
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    ordered = [*attrs, *(n for n in gm.graph.nodes if n in early and n.op != "get_attr"),
               *(n for n in gm.graph.nodes if n not in early and n.op != "get_attr")]
    # The last layer past its attention: what only the outputs read (nothing after it feeds an attention).
    tail = _computed_from(attentions[-1], region) if num_targets is not None else set()
    # With our kernels, an attention between a projection's column slices and the STU gate runs as one op.
    blocks = {n: block for n, bound in zip(attentions, analysis.args, strict=True)
              if (block := _gated_block(n, bound)) is not None}  # fmt: skip
    # Gathers of a layer value's rows outside the layers, taken from the rows computed (_row_gathers).
    gathers = _row_gathers(gm, region, values)
    right_splits = {n for n, bound in gathers.items() if isinstance(bound, dict)}

    def build(target: str, on_targets: bool, fill: float) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, Any] = {}   # original node -> its value in the delta graph (whole rows)
        rows: dict[torch.fx.Node, Any] = {}  # region / frontier node -> its new rows (the tail's: the targets')
        leaf_rows: dict[tuple[torch.fx.Node, Space], Any] = {}  # a frontier node's rows a branch's new rows read
        picks: dict[torch.fx.Node, Any] = {}  # a selection -> which of its new rows are from the left
        backs: dict[torch.fx.Node, torch.fx.Node] = {}
        picked: dict[torch.fx.Node, torch.fx.Node] = {}  # a node's new rows -> the targets' among them
        for p in placeholders:
            env[p] = graph.placeholder(p.target)
            env[p].meta = dict(p.meta)
        keys = {**{str(p.target): env[p] for p in placeholders}, **{k: graph.placeholder(k) for k in key_inputs}}
        names = (*DELTA_INPUTS, TARGET_ROWS) if on_targets else DELTA_INPUTS
        extra = {name: graph.placeholder(name) for name in names}
        book: dict[str, torch.fx.Node] = {}
        attention = paged_attention_triton if target == "triton" else paged_attention_reference
        last = on_targets and tail

        def computed_at(n: torch.fx.Node) -> torch.fx.Node:
            """The request's rows a region node's rows were computed for (the new ones; a tail node's: the
            targets')."""
            if not (last and n in tail):
                return book["new_rows"]
            if "target_rows" not in book:
                book["target_rows"] = graph.call_function(torch.index_select, (book["new_rows"], 0, extra[TARGET_ROWS]))
            return book["target_rows"]

        def whole(n: torch.fx.Node) -> Any:
            if n in region:  # a region value read outside the layers: its rows put back
                if n not in backs:
                    backs[n] = graph.call_function(rows_back, (rows[n], computed_at(n), book["like"], fill))
                return backs[n]
            return env[n]

        def picked_rows(n: torch.fx.Node) -> Any:
            """An outside node that gathers rows of a region value (the heads taking the candidates' rows), as a
            gather of the rows computed: None for any other node."""
            if n.op == "call_function" and n.target is operator.getitem and n.args[0] in right_splits:
                split = gathers[n.args[0]]
                wanted = graph.call_function(jagged_right_rows, tuple(
                    torch.fx.node.map_arg(split[name], whole) for name in ("offsets_left", "offsets_right",
                                                                           "total_len_right")))
                source = split["values"]
            elif n in gathers:
                source, wanted = gathers[n]
                wanted = env[wanted]
            else:
                return None
            return graph.call_function(rows_at, (rows[source], computed_at(source), book["like"], wanted, fill))

        def local(a: torch.fx.Node, tail_node: bool) -> Any:
            """``a``'s rows as a node of the layers reads them: a tail node reads the targets' rows."""
            if not tail_node or a in tail:
                return rows[a]
            if a not in picked:
                picked[a] = graph.call_function(torch.index_select, (rows[a], 0, extra[TARGET_ROWS]))
            return picked[a]

        def whole_rows(v: torch.fx.Node) -> tuple[Any, torch.fx.Node]:
            """How many rows region node ``v`` has on the whole request, and a frontier value it is computed from:
            read off the frontier values before it (a selection's: its branches' added up)."""
            if v in frontier:
                return graph.call_method("size", (env[v], 0)), env[v]
            if v in selections:
                (left, leaf), (right, _) = whole_rows(v.args[0]), whole_rows(v.args[2])
                return graph.call_function(operator.add, (left, right)), leaf
            rows = analysis.rows_in(space[v]) if v not in attentions else analysis.rows
            return whole_rows(next(a for a in (
                [analysis.args[attentions.index(v)]["q"]] if v in attentions else v.all_input_nodes)
                if a in region or analysis.rowish(a, rows)))

        def layer_metadata(n: torch.fx.Node) -> Any:
            """A size, shape or device read of a layer value outside the layers: read off the whole request's
            rows (the frontier values': as many), the other sizes as recorded; it can then come before the layers
            run."""
            rows, leaf = whole_rows(n.all_input_nodes[0])
            value = values[n]
            if n.target == "size" and isinstance(value, int):
                dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
                return rows if dim % values[n.args[0]].dim() == 0 else value
            if isinstance(value, torch.Size):
                return graph.call_function(_rows_shape, (rows, tuple(value)))
            if n.target == "device" or (isinstance(n.args[-1], str) and n.args[-1] == "device"):
                return graph.call_function(getattr, (leaf, "device"))
            return value  # dim(), ndim, dtype: the same on every request

        def bookkeeping() -> None:
            def value(source: Any) -> Any:
                if isinstance(source, tuple):
                    return graph.call_function(block_keys, ([keys[name] for name in source[0]], source[1]))
                return keys[source] if isinstance(source, str) else env[source]

            compared = graph.call_function(frontier_rows, (plan(None, value, env.__getitem__),))
            book["like"] = graph.call_function(operator.getitem, (compared, 0))  # as many rows as the request
            out = graph.call_function(delta_rows, (
                env[seq_offsets], env[num_targets] if num_targets is not None else None, extra["kv_cached"],
                compared, extra["kv_x_pages"], extra["kv_page_table"], extra[NEW_ROWS], contextual > 0))
            for i, name in enumerate(("new_rows", "q_offsets", "seq_lens", "num_targets", "stale")):
                book[name] = graph.call_function(operator.getitem, (out, i))
            positions: dict[Space, torch.fx.Node] = {None: book["new_rows"]}
            for s in reversed(selections):  # a selection before those in its branches
                got = graph.call_function(concat_sources, (env[s.args[1]], env[s.args[3]], positions[space[s]]))
                positions[(s, 0)], positions[(s, 1)], picks[s] = (
                    graph.call_function(operator.getitem, (got, i)) for i in range(3))
            for f in frontier:
                for where in leaf_spaces[f]:
                    if where is None:
                        rows[f] = graph.call_function(torch.index_select, (env[f], 0, book["new_rows"]))
                    else:
                        leaf_rows[(f, where)] = graph.call_function(take_rows, (env[f], positions[where],
                                                                                f not in never_empty))

        def row_input(a: torch.fx.Node, where: Space, on: bool) -> Any:
            """``a``'s new rows as a region node computed on ``where``'s rows reads them (None: not rows)."""
            if a in region or (where is None and a in rows):
                return local(a, on)
            return leaf_rows.get((a, where)) if where is not None else None

        gated = blocks if target == "triton" else {}
        at_gate = {block.gate: n for n, block in gated.items()}
        folded = {block.reshape for block in gated.values()}
        for n in ordered:
            if n.op in ("placeholder", "output") or n in folded or n in gated:
                continue
            if n in region and not book:
                bookkeeping()
            if n in at_gate:
                a = at_gate[n]
                b, block = analysis.args[attentions.index(a)], gated[a]
                gate = inspect.signature(stu_gate).bind(*n.args, **n.kwargs)
                gate.apply_defaults()
                norm = (env[gate.arguments["norm_weight"]], env[gate.arguments["norm_bias"]], gate.arguments["eps"])
                rows[n] = graph.call_function(paged_gated_attention_triton, (
                    rows[block.uvqk], book["q_offsets"], extra["kv_k_pages"], extra["kv_v_pages"],
                    attentions.index(a), extra["kv_page_table"], book["seq_lens"], book["num_targets"], *norm,
                    block.num_heads, block.attention_dim, block.linear_dim, b["scaling_seqlen"], b["alpha"],
                    b.get("contextual_seq_len", 0), b.get("max_attn_len", 0), b["max_seq_len"],
                    extra[TARGET_ROWS] if last and n in tail else None))
            elif n in attentions:
                b = analysis.args[attentions.index(n)]
                rows[n] = graph.call_function(attention, (
                    rows[b["q"]], rows[b["k"]], rows[b["v"]], book["q_offsets"], extra["kv_k_pages"],
                    extra["kv_v_pages"], attentions.index(n), extra["kv_page_table"], book["seq_lens"],
                    book["num_targets"], b["scaling_seqlen"], b["alpha"], b.get("contextual_seq_len", 0),
                    b.get("max_attn_len", 0), b["max_seq_len"]))
                if last and n in tail:  # every new row's query ran; the targets' are read on
                    rows[n] = graph.call_function(torch.index_select, (rows[n], 0, extra[TARGET_ROWS]))
            elif n in selections:
                rows[n] = graph.call_function(pick_rows, (picks[n], row_input(n.args[0], (n, 0), False),
                                                          row_input(n.args[2], (n, 1), False)))
            elif n in region:
                on, where = bool(last) and n in tail, space[n]
                size_of_rows = analysis.rows_in(where)
                first_row = next(r for a in n.all_input_nodes if (r := row_input(a, where, on)) is not None)

                def arg(a: torch.fx.Node, on: bool = on, where: Space = where, first_row: torch.fx.Node = first_row,
                        size_of_rows: int = size_of_rows) -> Any:
                    got = row_input(a, where, on)
                    if got is not None:
                        return got
                    value = values.get(a)
                    if isinstance(value, int) and not isinstance(value, bool) and value == size_of_rows:
                        return graph.call_method("size", (first_row, 0))  # the row count: the rows computed
                    return env[a]

                rows[n] = graph.node_copy(n, arg)
            elif n in right_splits:
                continue  # only its right rows are read: picked_rows gathers them
            elif _metadata(n) and n.all_input_nodes[0] in region:
                env[n] = layer_metadata(n)
            else:
                got = picked_rows(n)
                env[n] = got if got is not None else graph.node_copy(n, whole)
        mapped = torch.fx.node.map_arg(result, whole)
        graph.output({**mapped, "kv_stale": book["stale"]})
        program = torch.fx.GraphModule(gm, graph)
        program.graph.eliminate_dead_code()
        program.recompile()
        return program

    counts = _counts_program(gm, seq_offsets, num_targets)
    sums = host_counts(counts)
    if sums is not None:  # read off the graph, which takes per-user values only; held against the program too
        names = [n.target for n in counts.graph.nodes if n.op == "placeholder"]
        with torch.no_grad():
            want = counts(**{name: example[name] for name in names})
        users = want[0].shape[0]
        per_user = all(example[name].dim() == 1 and example[name].shape[0] == users for name in names)
        got = counts_on_host(sums, example) if per_user else None
        sums = sums if got is not None and all(
            torch.equal(g, w.cpu().to(torch.int64)) for g, w in zip(got, want, strict=True)) else None
    on_targets = bool(targets_only and tail) and _reads_targets_only(
        build("aten", True, float("nan")), counts, example,
        {k: values.get(v) for k, v in result.items() if isinstance(v, torch.fx.Node)},
        (len(attentions), heads, dqk, dv, values[bound0["k"]].dtype), (width, row_dtype))
    return DerivedDelta(
        program=build(op_target, on_targets, fill), counts=counts,
        num_layers=len(attentions), num_heads=heads, attention_dim=dqk, linear_dim=dv, row_width=width,
        row_dtype=row_dtype, max_seq_len=int(bound0["max_seq_len"]), frontier=[f.name for f in frontier],
        layer_nodes=len(region), gated_fused=len(blocks) if op_target == "triton" else 0, op_target=op_target,
        targets_only=on_targets, host_counts=sums, key_inputs=key_inputs,
        compared_ids={f.name: [name if isinstance(name, str) else {"ids": list(name[0]), "rows_each": name[1]}
                               for name in got] for f, got in keyed.items()},
        target_inputs=[str(n.target) for n in _ancestors(_nodes_in(num_targets)) if n.op == "placeholder"])  # fmt: skip


SPLIT = "hstu_export.split_2D_jagged.default"


def _row_gathers(gm: torch.fx.GraphModule, region: set[torch.fx.Node], values: dict[torch.fx.Node, Any],
                 ) -> dict[torch.fx.Node, Any]:  # fmt: skip
    """The nodes outside the layers that gather rows of a layer value by an index of the request (the heads
    taking the candidates' rows): a node read as ``value[index]`` or ``index_select(value, 0, index)`` -> (value,
    index); a jagged split of one whose left rows nothing reads -> its arguments by name. Such a gather is taken
    from the rows computed (:func:`rows_at`), not from the value of every row put back."""
    found: dict[torch.fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or not n.args or n.args[0] not in region:
            continue
        if n.op == "call_function" and str(n.target) == SPLIT:
            bound = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True).kwargs
            others = _nodes_in([v for k, v in bound.items() if k != "values"])
            if n.users and all(u.target is operator.getitem and u.args[1] == 1 for u in n.users) and not (
                    _ancestors(others, through_metadata=False) & region):
                found[n] = dict(bound)
            continue
        if n.target is operator.getitem:
            index = n.args[1]
        elif n.target is torch.index_select or n.target == "index_select":
            bound = dict(zip(("input", "dim", "index"), n.args), **n.kwargs)
            index = bound.get("index") if bound.get("dim") == 0 else None
        else:
            continue
        value = values.get(index) if isinstance(index, torch.fx.Node) else None
        if (isinstance(value, Tensor) and value.dim() == 1 and not value.is_floating_point()
                and value.dtype is not torch.bool and index not in region
                and not (_ancestors([index], through_metadata=False) & region)):  # fmt: skip
            found[n] = (n.args[0], index)
    return found


def _computed_from(start: torch.fx.Node, region: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """``start`` and the nodes of ``region`` computed from it."""
    seen, stack = {start}, [start]
    while stack:
        for user in stack.pop().users:
            if user in region and user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _reads_targets_only(program: torch.fx.GraphModule, counts: torch.fx.GraphModule, example: dict[str, Tensor],
                        want: dict[str, Any], pool: tuple[int, int, int, int, torch.dtype],
                        row: tuple[int, torch.dtype]) -> bool:  # fmt: skip
    """Whether ``program`` (a delta program whose last layer runs on the targets' rows, every other row of it NaN
    where the outputs would read it) answers ``example`` with nothing cached as the model does (``want``): finite
    wherever the model's outputs are. A model whose outputs read other rows of its last layer (a pooled history,
    say) keeps the whole last layer."""
    inputs = nothing_cached(counts, example, pool, row)
    try:
        with torch.no_grad():
            got = program(**{n.target: inputs[n.target] for n in program.graph.nodes if n.op == "placeholder"})
    except (RuntimeError, IndexError, ValueError):  # the outputs index rows the targets' alone do not hold
        return False
    return all(isinstance(got.get(k), Tensor) and got[k].shape == v.shape
               and not bool((torch.isfinite(v) & ~torch.isfinite(got[k])).any())
               for k, v in want.items() if isinstance(v, Tensor))  # fmt: skip


def nothing_cached(counts: torch.fx.GraphModule, example: dict[str, Tensor], pool: tuple[int, int, int, int, torch.dtype],
                   row: tuple[int, torch.dtype]) -> dict[str, Tensor]:  # fmt: skip
    """A delta program's inputs for ``example`` (its dense inputs) with nothing cached, in pages of 16 tokens:
    ``pool`` is (layers, heads, attention dim, linear dim, dtype) of the K/V pages, ``row`` (width, dtype) of
    the frontier rows'; ``counts`` the delta program's counts program."""
    lengths, rows = prefill_rows(counts, example)
    layers, heads, dqk, dv, dtype = pool
    users, page = lengths.shape[0], 16
    width = max(1, -(-int(lengths.max()) // page)) if users else 1
    device = next(iter(example.values())).device
    return {**example, "kv_cached": torch.zeros(users, dtype=torch.int64, device=device),
              "kv_k_pages": torch.zeros(layers, users * width + 1, page, heads, dqk, dtype=dtype, device=device),
              "kv_v_pages": torch.zeros(layers, users * width + 1, page, heads, dv, dtype=dtype, device=device),
              "kv_x_pages": torch.zeros(users * width + 1, page, row[0], dtype=row[1], device=device),
              "kv_page_table": torch.arange(users * width, dtype=torch.int32, device=device).reshape(users, width),
              **{name: value.to(device) for name, value in rows.items()}}  # fmt: skip


def prefill_rows(counts: torch.fx.GraphModule, example: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """``example``'s sequence lengths (on the host) and :func:`delta_row_inputs` with nothing cached (every row
    new); ``counts`` the delta program's counts program."""
    names = [n.target for n in counts.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        lengths, targets = (t.cpu() for t in counts(**{name: example[name] for name in names}))
    return lengths, delta_row_inputs(lengths.tolist(), (lengths - targets).tolist(), [0] * lengths.shape[0])


def _without_dtype_reads(gm: torch.fx.GraphModule, example: dict[str, Tensor],
                         ) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, Any]]:  # fmt: skip
    """``gm``'s graph (a copy, over the same parameters) with each tensor's ``.dtype`` read replaced by the dtype it
    had on ``example``, and what nothing reads then removed: a value read only for its dtype (a model casting its
    next input to its attention's dtype, after fuse_stu_gate took the attention's place in the gate) is not
    computed, and an attention left so is not taken for a layer. With the copy, each of its nodes' value on
    ``example``."""
    recorder = _Recorder(gm)
    with torch.no_grad():
        recorder.run(*[example[n.target] for n in gm.graph.nodes if n.op == "placeholder"])
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    copied = torch.fx.GraphModule(gm, graph)
    folded = []
    for n, copy in copies.items():
        value = recorder.values.get(n.args[0]) if n.op == "call_function" and n.target is getattr and len(
            n.args) == 2 and n.args[1] == "dtype" else None
        if isinstance(value, Tensor):
            for user in list(copy.users):
                user.args = torch.fx.node.map_arg(user.args, lambda a, c=copy, d=value.dtype: d if a is c else a)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a, c=copy, d=value.dtype: d if a is c else a)
            folded.append(copy)
    stack = folded  # what the folded reads alone kept, back to a value something else reads (never an effect)
    while stack:
        m = stack.pop()
        if m.users or m.op in ("placeholder", "output") or m.is_impure() or str(m.target).endswith("_"):
            continue
        inputs = m.all_input_nodes
        graph.erase_node(m)
        stack.extend(inputs)
    copied.recompile()
    kept = set(graph.nodes)
    return copied, {copy: recorder.values[n] for n, copy in copies.items() if copy in kept and n in recorder.values}


def sequence_counts(seq_offsets: Tensor, num_targets: Tensor | None) -> tuple[Tensor, Tensor]:
    offsets = seq_offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    return lengths, torch.zeros_like(lengths) if num_targets is None else num_targets.to(torch.int64)


@dataclass(frozen=True)
class _Sum:
    """Per user: ``constant`` plus the inputs (per-user tensors) by name times their integer coefficients."""

    terms: tuple[tuple[str, int], ...]
    constant: int

    def plus(self, other: _Sum, sign: int = 1) -> _Sum:
        terms = dict(self.terms)
        for name, k in other.terms:
            terms[name] = terms.get(name, 0) + sign * k
        return _Sum(tuple(sorted((n, k) for n, k in terms.items() if k)), self.constant + sign * other.constant)

    def times(self, k: int) -> _Sum:
        return _Sum(tuple((n, c * k) for n, c in self.terms if c * k), self.constant * k)

    def as_dict(self) -> dict[str, Any]:
        return {"terms": dict(self.terms), "constant": self.constant}


@dataclass(frozen=True)
class _Offsets:
    """The offsets of per-user lengths ``lengths`` (a :class:`_Sum`): B + 1 values from 0."""

    lengths: _Sum


@dataclass(frozen=True)
class _Running:
    """The running (inclusive) sum over users of ``lengths``."""

    lengths: _Sum


@dataclass(frozen=True)
class _Stacked:
    """Per-user sums put one after another (``cat``), or as the rows of a matrix (its ``view(k, -1)``)."""

    parts: tuple[_Sum, ...]
    rows: bool = False


@dataclass(frozen=True)
class _Users:
    """The number of users plus ``extra`` (a size read of per-user values)."""

    extra: int


_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.long, torch.int)


def host_counts(counts: torch.fx.GraphModule) -> dict[str, dict[str, Any]] | None:
    """The counts program (:func:`_counts_program`) as sums a host computes from its per-user inputs without the
    program: ``{"seq_lengths": {"terms": {input: k}, "constant": c}, "num_targets": {...}}``, each user's value
    ``c + sum(k * input[user])``, its inputs taken for per-user values (which :func:`derive_delta` checks on its
    example); None when the program is anything else (a length clamped or read from values). Read off the graph, exactly: placeholders, integer sums, differences and multiples, casts between
    integer types, per-user values put one after another and read back as the rows of a matrix, the offsets of
    lengths (a running sum padded with a zero; fbgemm's complete cumsum; a range
    over the users times a count) and their sums; then :func:`sequence_counts` of offsets."""
    known: dict[torch.fx.Node, Any] = {}

    def scalar(a: Any) -> int | None:
        return a if isinstance(a, int) and not isinstance(a, bool) else None

    def combine(x: Any, y: Any, sign: int) -> Any:
        if isinstance(y, int) and isinstance(x, _Sum):
            return x.plus(_Sum((), y), sign)
        if isinstance(x, int) and isinstance(y, _Sum) and sign == 1:
            return y.plus(_Sum((), x))
        if type(x) is type(y) and isinstance(x, (_Sum, _Offsets)):
            return x.plus(y, sign) if isinstance(x, _Sum) else _Offsets(x.lengths.plus(y.lengths, sign))
        if isinstance(x, _Users) and isinstance(y, int):
            return _Users(x.extra + sign * y)
        return None

    def scale(x: Any, k: int) -> Any:
        if isinstance(x, _Sum):
            return x.times(k)
        if isinstance(x, _Offsets):
            return _Offsets(x.lengths.times(k))
        return None

    for n in counts.graph.nodes:
        if any(a not in known for a in n.all_input_nodes):
            return None  # an input of unknown kind
        args = list(torch.fx.node.map_aggregate(n.args, lambda a: known[a] if isinstance(a, torch.fx.Node) else a))
        kwargs = dict(torch.fx.node.map_aggregate(n.kwargs, lambda a: known[a] if isinstance(a, torch.fx.Node) else a))
        value: Any = None
        target = n.target
        if n.op == "placeholder":
            value = _Sum(((str(target), 1),), 0)
        elif n.op == "output":
            out = args[0]
            if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(o, _Sum) for o in out)):
                return None
            return {"seq_lengths": out[0].as_dict(), "num_targets": out[1].as_dict()}
        elif target in (operator.add, torch.add) or (n.op == "call_method" and target == "add"):
            value = combine(args[0], args[1], 1) if len(args) == 2 and not kwargs else None
        elif target in (operator.sub, torch.sub) or (n.op == "call_method" and target == "sub"):
            value = combine(args[0], args[1], -1) if len(args) == 2 and not kwargs else None
        elif target in (operator.mul, torch.mul) or (n.op == "call_method" and target == "mul"):
            if len(args) == 2 and not kwargs:
                x, y = args
                value = scale(x, y) if scalar(y) is not None else scale(y, x) if scalar(x) is not None else None
        elif target is operator.neg:
            value = scale(args[0], -1)
        elif n.op == "call_method" and target in ("to", "long", "int", "contiguous"):
            # integer casts and moves: every other argument a dtype of integers or a device
            rest = [*args[1:], *(v for k, v in kwargs.items() if k not in ("non_blocking", "copy"))]
            plain = all(a in _INTEGER_DTYPES if isinstance(a, torch.dtype) else a == "device" or isinstance(
                a, torch.device) for a in rest)
            value = args[0] if plain and isinstance(args[0], (_Sum, _Offsets)) else None
        elif (target is torch.cumsum or (n.op == "call_method" and target == "cumsum")) and isinstance(args[0], _Sum):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            value = _Running(args[0]) if dim in (0, -1) and kwargs.get("dtype", torch.int64) in _INTEGER_DTYPES else None
        elif target is F.pad and isinstance(args[0], _Running):
            pad = kwargs.get("pad", args[1] if len(args) > 1 else None)
            mode, fill = kwargs.get("mode", "constant"), kwargs.get("value", args[3] if len(args) > 3 else None)
            value = _Offsets(args[0].lengths) if tuple(pad or ()) == (1, 0) and mode == "constant" and not fill else None
        elif "asynchronous_complete_cumsum" in str(target) and isinstance(args[0], _Sum):
            value = _Offsets(args[0])
        elif n.op == "call_method" and target in ("numel", "size") and isinstance(args[0], (_Sum, _Offsets)):
            if target == "numel" or kwargs.get("dim", args[1] if len(args) > 1 else None) in (0, -1):
                value = _Users(1 if isinstance(args[0], _Offsets) else 0)
        elif target is torch.arange and len(args) == 1 and isinstance(args[0], _Users) and args[0].extra == 1 and (
                kwargs.get("dtype", torch.int64) in _INTEGER_DTYPES):
            value = _Offsets(_Sum((), 1))  # 0, 1, ..., B: the offsets of one row a user
        elif target in (torch.cat, torch.concat) and isinstance(args[0], (list, tuple)) and all(
                isinstance(a, _Sum) for a in args[0]) and kwargs.get("dim", args[1] if len(args) > 1 else 0) in (0, -1):
            value = _Stacked(tuple(args[0]))
        elif n.op == "call_method" and target in ("view", "reshape") and isinstance(args[0], _Stacked) and (
                tuple(args[1:]) == (len(args[0].parts), -1) and not args[0].rows):
            value = _Stacked(args[0].parts, rows=True)  # row i: the i-th part
        elif target is operator.getitem and isinstance(args[0], _Stacked) and args[0].rows and scalar(args[1]) is not None:
            value = args[0].parts[args[1]] if -len(args[0].parts) <= args[1] < len(args[0].parts) else None
        elif target is getattr and len(args) == 2 and args[1] in ("device", "dtype"):
            value = args[1]
        elif target is sequence_counts and isinstance(args[0], _Offsets):
            targets = args[1] if len(args) > 1 else kwargs.get("num_targets")
            if targets is None:
                targets = _Sum((), 0)
            value = (args[0].lengths, targets) if isinstance(targets, _Sum) else None
        if value is None:
            return None
        known[n] = value
    return None


def counts_on_host(terms: dict[str, dict[str, Any]], inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(sequence length, target count) per user from :func:`host_counts`' sums and their inputs by name (on the
    host: int64)."""

    def total(part: dict[str, Any]) -> Tensor:
        out = None
        for name, k in part["terms"].items():
            value = inputs[name].to(torch.int64).cpu().reshape(-1) * int(k)
            if out is not None and value.shape != out.shape:
                raise RequestError(f"{name} has {value.numel()} values where the other lengths have {out.numel()}: "
                                   f"one a user")
            out = value if out is None else out + value
        if out is None:
            raise ConfigError("the counts' sums name no input: nothing says how many users a request has")
        return out + int(part["constant"])

    lengths = total(terms["seq_lengths"])
    targets = total(terms["num_targets"]) if terms["num_targets"]["terms"] else torch.full_like(
        lengths, int(terms["num_targets"]["constant"]))
    return lengths, targets


def _counts_program(gm: torch.fx.GraphModule, seq_offsets: torch.fx.Node, num_targets: Any) -> torch.fx.GraphModule:
    """The slice of ``gm`` that computes the attentions' sequence offsets and target counts."""
    needed = _ancestors(_nodes_in((seq_offsets, num_targets)))
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(graph.call_function(sequence_counts, (env[seq_offsets],
                                                       env[num_targets] if num_targets is not None else None)))
    counts = torch.fx.GraphModule(gm, graph)
    counts.recompile()
    return counts


def generic_ops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Our Triton ops in ``gm`` (and its submodules) back to the generic ops of the same schema (map_ops'
    ``triton`` target keeps the attention one node; the derived program is lowered to its own target
    afterwards)."""
    for module in (m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)):
        for node in module.graph.nodes:
            parts = str(node.target).split(".")  # hstu_export.<op>_triton[.default]
            if node.op == "call_function" and parts[0] == "hstu_export" and parts[1].endswith("_triton"):
                packet = getattr(torch.ops.hstu_export, parts[1].removesuffix("_triton"))
                node.target = packet.default if parts[2:] == ["default"] else packet
        ungate(module)  # the zoo's gated attention: the attention one node, as other models' are
        module.recompile()
    return gm


GATED = "hstu_export.hstu_mha_gated.default"


def ungate(gm: torch.fx.GraphModule) -> None:
    """Each gated attention (``hstu_mha_gated``: the STU layer between its projections, one op) written as
    what it computes: the split of uvqk, ``hstu_mha``, and the gate (:func:`~hstu_export.ops.reference.stu_gate`,
    row-local): the attention is then one node the derivation reads."""
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in (GATED, GATED.removesuffix(".default"))]:
        op = torch.ops.hstu_export.hstu_mha_gated.default  # the node's target, or its packet's overload
        b = normalize_function(op, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        h, dqk, dv = b["num_heads"], b["attention_dim"], b["linear_dim"]
        g = gm.graph
        with g.inserting_before(node):
            parts = g.call_function(torch.split, (b["uvqk"], [dv * h, dv * h, dqk * h, dqk * h]), {"dim": -1})
            u, v, q, k = (g.call_function(operator.getitem, (parts, i)) for i in range(4))
            q, k, v = (g.call_method("reshape", (t, -1, h, d)) for t, d in ((q, dqk), (k, dqk), (v, dv)))
            a = g.call_function(torch.ops.hstu_export.hstu_mha.default, (q, k, v, b["seq_offsets"], b["max_seq_len"],
                                b["scaling_seqlen"], b["alpha"], b.get("causal", True), b.get("num_targets"),
                                b.get("contextual_seq_len", 0), b.get("max_attn_len", 0)))  # fmt: skip
            a = g.call_method("reshape", (a, -1, h * dv))
            out = g.call_function(stu_gate, (u, a, b["norm_weight"], b["norm_bias"], b.get("eps", 1e-6)))
        node.replace_all_uses_with(out)
        g.erase_node(node)
