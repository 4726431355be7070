"""observe_values: run the traced graph on the example batch (and, when the graph computes Python ints
from tensor data, on batches at the export's maxima) and write what each node produced into its meta:

- ``value_kind``: "tensor", "int", "kjt" (a torchrec KeyedJaggedTensor, JaggedTensor or KeyedTensor,
  or a container holding one), "none" or "other";
- ``tensor_meta``-like ``example_shape``/``example_dtype`` for tensors (on the example batch, whose
  dynamic sizes are pairwise distinct, so a dim can be told apart by its size);
- ``int_max``/``int_min``: the range of an int over every batch run (the static bound that mapped
  foreign attention pads to), and ``max_shape`` of every tensor;
- ``longest_sequence`` on a foreign attention call (one the mapping tables scale by a max length): the
  longest sequence its ``seq_offsets`` held, so at the export's maxima the longest sequence the exported
  ranges allow as that attention sees it (contextual tokens + history + candidates); the largest is the
  pass's ``longest_sequence`` statistic, which export holds against the model's limits and
  ``--attention-scale fixed:N``.

The batches at the maxima run only when something needs them: data-dependent ints, foreign attention,
or a boundary that ``mark_sparse_dense`` will find (its sizes need ranges).

Later passes read these (``mark_sparse_dense``, ``map_ops``); ``Node.meta`` travels with nodes through
the split. The pass changes nothing in the graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import Tensor

from hstu_export.errors import PassError

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

STRUCTURED_TYPES = ("KeyedJaggedTensor", "JaggedTensor", "KeyedTensor")


def value_kind(value: Any) -> str:
    if isinstance(value, Tensor):
        return "tensor"
    if isinstance(value, bool):
        return "other"
    if isinstance(value, int):
        return "int"
    if value is None:
        return "none"
    if _is_structured(value):
        return "kjt"
    return "other"


def _is_structured(value: Any, depth: int = 0) -> bool:
    if type(value).__name__ in STRUCTURED_TYPES:
        return True
    if depth > 3:
        return False
    if isinstance(value, dict):
        return any(_is_structured(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_is_structured(v, depth + 1) for v in value)
    return False


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, first: bool, attention: dict[torch.fx.Node, torch.fx.Node]) -> None:
        super().__init__(gm)
        self.first = first
        self.attention = attention  # attention call -> its seq_offsets argument

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        kind = value_kind(value)
        if self.first:
            n.meta["value_kind"] = kind
            if kind == "tensor":
                n.meta["example_shape"] = tuple(value.shape)
                n.meta["example_dtype"] = str(value.dtype).removeprefix("torch.")
        if kind == "tensor":
            old = n.meta.get("max_shape")
            shape = tuple(value.shape)
            n.meta["max_shape"] = shape if old is None or len(old) != len(shape) else tuple(map(max, old, shape))
        if kind == "int":
            n.meta["int_max"] = max(n.meta.get("int_max", value), value)
            n.meta["int_min"] = min(n.meta.get("int_min", value), value)
        offsets = self.env.get(self.attention[n]) if n in self.attention else None
        if isinstance(offsets, Tensor) and offsets.dim() == 1 and offsets.numel() >= 2:
            longest = int((offsets[1:] - offsets[:-1]).max())
            n.meta["longest_sequence"] = max(n.meta.get("longest_sequence", longest), longest)
        return value


def foreign_attention(gm: torch.fx.GraphModule, op_mappings: dict[str, str]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Calls of foreign attention functions (those ``hstu_export/ops/mappings`` scales by a max length),
    each with the node of its ``seq_offsets`` argument."""
    from hstu_export.errors import UnmappedOpsError
    from hstu_export.ops.mappings import bind_call, function_key, function_mappings

    functions = function_mappings(op_mappings)
    found = {}
    for node in gm.graph.nodes:
        mapping = functions.get(function_key(node.target) or "") if node.op == "call_function" else None
        if mapping is None or not mapping.attention:
            continue
        try:
            arguments = bind_call(getattr(node.target, "__hstu_export_opaque__", node.target), mapping, node.args,
                                  dict(node.kwargs))
        except UnmappedOpsError:  # map_ops says so
            continue
        if isinstance(arguments.get("seq_offsets"), torch.fx.Node):
            found[node] = arguments["seq_offsets"]
    return found


def has_data_dependent_ints(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph turns tensor data into Python ints (``int(x)``, ``x.item()``, ``len``)."""
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in ("item", "tolist"):
            return True
        if node.op == "call_function" and node.target in (int, float, len):
            return True
    return False


def has_marks(gm: torch.fx.GraphModule) -> bool:
    from hstu_export.capture.graph_functions import sparse_boundary

    return any(n.op == "call_function" and n.target is sparse_boundary for n in gm.graph.nodes)


class ObserveValues:
    name = "observe_values"
    recursive = False

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        batches = [ctx.example_inputs]
        attention = foreign_attention(gm, ctx.op_mappings)
        if ctx.probe_inputs and (has_data_dependent_ints(gm) or not has_marks(gm) or attention):
            batches += list(ctx.probe_inputs)
        names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
        for i, batch in enumerate(batches):
            try:
                with torch.no_grad():
                    _Recorder(gm, first=i == 0, attention=attention).run(*(batch[name] for name in names))
            except Exception as exc:
                what = "the example batch" if i == 0 else f"probe batch {i} (every length at its maximum)"
                raise PassError(f"{self.name}: the traced graph fails on {what}: {type(exc).__name__}: "
                                f"{(str(exc).strip().splitlines() or [''])[0]}") from exc
        kinds: dict[str, int] = {}
        for node in gm.graph.nodes:
            kind = node.meta.get("value_kind", "")
            if kind:
                kinds[kind] = kinds.get(kind, 0) + 1
        ctx.add_stat("batches", len(batches))
        ctx.add_stat("value_kinds", kinds)
        ints = {n.name: n.meta["int_max"] for n in gm.graph.nodes if "int_max" in n.meta and n.op != "placeholder"}
        if ints:
            ctx.add_stat("int_maxima", ints)
        longest = [n.meta["longest_sequence"] for n in attention if "longest_sequence" in n.meta]
        if longest and len(batches) > 1:  # only the batches at the maxima say how long a sequence may be
            ctx.add_stat("longest_sequence", max(longest))
        return gm
