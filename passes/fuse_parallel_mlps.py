"""fuse_parallel_mlps: sibling MLPs that read the same input (multi-task heads, per-task towers) run as one.

A ranking model often ends in one small MLP per task, all on the same rows: ``Linear, act, Linear, act,
Linear`` for ``ctr``, the same shapes again for ``cvr``. Run as written, that is one matrix product, one
bias-and-activation kernel and so on per layer and per task: small launches that the GPU runs one after
another. Here the first layers of the T branches become one Linear (their weights concatenated along the
output), the later layers one batched product each (``bmm`` on the weights stacked ``[T, in, out]``, the
bias added after it, with the activation), and the activations run once on all branches' columns. The
arithmetic is the same products and sums (in a 16-bit dtype a product is rounded before its bias is added,
as a separate addition would do); only their grouping into kernels changes.

A group is fused when at least two chains start at ``nn.Linear`` modules called on the same 2-D tensor
and match node for node (Linear shapes, bias, dtype and device; activation modules of one class and
settings); a chain follows single-user nodes until something else than such a module. Everything else
stays as it was. The fused weights are new tensors made here, at export time (the originals go with dead
code elimination).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn

from .prune_unused import prune_unused_attributes

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

__all__ = ["FuseParallelMlps", "fuse_parallel_mlps", "fused_module"]

# Modules that act on each element alone: applied once to the branches' columns side by side.
ELEMENTWISE = (nn.SiLU, nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Hardswish, nn.Mish,
               nn.Identity)
FUSED_PREFIX = "parallel_mlp"


class FuseParallelMlps:
    name = "fuse_parallel_mlps"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        groups, branches = fuse_parallel_mlps(gm)
        ctx.add_stat("groups", groups)
        ctx.add_stat("branches", branches)
        return gm


def _module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    return gm.get_submodule(str(node.target))


def _step(gm: torch.fx.GraphModule, node: torch.fx.Node, source: torch.fx.Node) -> tuple[Any, ...] | None:
    """What a chain node does, as a comparable key: None when ``node`` is not a module call on ``source``
    alone that this pass can fuse."""
    module = _module(gm, node)
    if module is None or node.args != (source,) or node.kwargs:
        return None
    if type(module) is nn.Linear:
        w = module.weight
        return ("linear", module.in_features, module.out_features, module.bias is not None, w.dtype, w.device)
    if type(module) in ELEMENTWISE or (type(module) is nn.Dropout and not module.training):
        return ("elementwise", type(module).__name__, module.extra_repr())
    return None


def _chain(gm: torch.fx.GraphModule, start: torch.fx.Node, source: torch.fx.Node) -> tuple[list[torch.fx.Node], tuple]:
    """The nodes from ``start`` (a Linear on ``source``) while each has one user that is a fusable module
    call on it, and their keys."""
    nodes, keys = [start], [_step(gm, start, source)]
    while len(nodes[-1].users) == 1:
        (user,) = nodes[-1].users
        key = _step(gm, user, nodes[-1])
        if key is None:
            break
        nodes.append(user)
        keys.append(key)
    return nodes, tuple(keys)


def _is_2d(node: torch.fx.Node) -> bool:
    shape = node.meta.get("example_shape")
    if shape is None and "tensor_meta" in node.meta:
        shape = getattr(node.meta["tensor_meta"], "shape", None)
    return shape is not None and len(shape) == 2


def fuse_parallel_mlps(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """Fuses every group of matching chains in ``gm`` (in place); returns (groups, branches fused). Needs the
    shared input's shape in its node's meta (``example_shape`` from observe_values, or ``tensor_meta`` from
    ShapeProp): only a 2-D input is fused."""
    groups = branches = 0
    for source in list(gm.graph.nodes):
        if not _is_2d(source):
            continue
        by_key: dict[tuple, list[list[torch.fx.Node]]] = defaultdict(list)
        for user in list(source.users):
            step = _step(gm, user, source)
            if step is None or step[0] != "linear":
                continue
            nodes, keys = _chain(gm, user, source)
            by_key[keys].append(nodes)
        for keys, chains in by_key.items():
            if len(chains) < 2:
                continue
            _fuse(gm, source, chains, keys, f"{FUSED_PREFIX}_{groups}")
            groups += 1
            branches += len(chains)
    if groups:
        gm.graph.lint()
        gm.recompile()
    return groups, branches


def _fuse(gm: torch.fx.GraphModule, source: torch.fx.Node, chains: list[list[torch.fx.Node]], keys: tuple,
          name: str) -> None:
    t = len(chains)
    graph = gm.graph
    layers = [[_module(gm, chain[i]) for chain in chains] for i in range(len(keys))]
    holder = nn.Module()
    first: list[nn.Linear] = layers[0]  # type: ignore[assignment]
    fused_first = nn.Linear(first[0].in_features, t * first[0].out_features, bias=first[0].bias is not None,
                            device=first[0].weight.device, dtype=first[0].weight.dtype)
    with torch.no_grad():
        fused_first.weight.copy_(torch.cat([m.weight for m in first], dim=0))
        if fused_first.bias is not None:
            fused_first.bias.copy_(torch.cat([m.bias for m in first], dim=0))
    holder.add_module("first", fused_first)
    stacked: dict[int, tuple[str, str | None]] = {}
    for i, key in enumerate(keys[1:], start=1):
        if key[0] != "linear":
            continue
        mods: list[nn.Linear] = layers[i]  # type: ignore[assignment]
        with torch.no_grad():
            weight = torch.stack([m.weight.t() for m in mods]).contiguous()  # [T, in, out]
            bias = torch.stack([m.bias for m in mods]).unsqueeze(1).contiguous() if mods[0].bias is not None else None
        holder.register_parameter(f"weight_{i}", nn.Parameter(weight, requires_grad=False))
        if bias is not None:
            holder.register_parameter(f"bias_{i}", nn.Parameter(bias, requires_grad=False))
        stacked[i] = (f"{name}.weight_{i}", f"{name}.bias_{i}" if bias is not None else None)
    gm.add_submodule(name, holder)

    starts = {chain[0] for chain in chains}
    earliest = next(node for node in graph.nodes if node in starts)  # the new nodes go before every chain
    width = first[0].out_features
    with graph.inserting_before(earliest):
        value = graph.call_module(f"{name}.first", (source,))  # [M, T * width], branch b in columns b*width...
        batched = False  # from the first batched product on: [T, M, out]
        for i, key in enumerate(keys[1:], start=1):
            if key[0] == "elementwise":
                value = graph.call_module(str(chains[0][i].target), (value,))  # the same module for all columns
                continue
            if not batched:
                value = graph.call_method("reshape", (value, -1, t, width))
                value = graph.call_method("transpose", (value, 0, 1))
                batched = True
            weight_name, bias_name = stacked[i]
            # A product, then the bias as an addition of its own: a compiler runs the addition with the next
            # elementwise work (the activation) in one kernel. As one baddbmm, the bias would be copied into
            # the product's output first (a copy kernel: there is no bias epilogue for batched products).
            value = graph.call_function(torch.bmm, (value, graph.get_attr(weight_name)))
            if bias_name is not None:
                value = graph.call_function(torch.add, (value, graph.get_attr(bias_name)))
            width = key[2]
        outputs = []
        for b in range(t):
            if batched:
                outputs.append(graph.call_method("select", (value, 0, b)))
            else:
                outputs.append(graph.call_method("narrow", (value, -1, b * width, width)))
    for chain, out in zip(chains, outputs):
        chain[-1].replace_all_uses_with(out)
        for node in reversed(chain):
            graph.erase_node(node)


def fused_module(module: nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    """``module`` traced (torch.fx) and its parallel MLPs fused, for a program built from modules rather than
    through the pass pipeline (the KV-cache delta program's task heads); ``example`` is an input of the
    shape it takes."""
    from torch.fx.passes.shape_prop import ShapeProp

    gm = torch.fx.symbolic_trace(module)
    with torch.no_grad():
        ShapeProp(gm).propagate(example)
    fuse_parallel_mlps(gm)
    prune_unused_attributes(gm)  # the branches' own modules, now unused
    return gm
