"""fuse_stu_gate: an HSTU layer's attention and output gate, written out by the model, become our gated op.

Between its two projections an HSTU layer (generative-recommenders' STU, TorchEasyRec's, most users' own)
computes

    u, v, q, k = split(uvqk, [H*Dv, H*Dv, H*Dqk, H*Dqk], dim=1);  u = silu(u)
    a = attention(q.view(-1, H, Dqk), k.view(-1, H, Dqk), v.view(-1, H, Dv)).view(-1, H*Dv)
    out = cat([u, a, u * layer_norm(a)], dim=1)

``hstu_export::hstu_mha_gated`` is that whole block: its attention writes ``a`` straight into the middle
third of ``out`` and one gate kernel writes the outer thirds (hstu_export/ops/_triton/gated.py). Written
out, the attention's output is a separate buffer that Inductor's pointwise kernel copies into the concat
while it normalises, a slower kernel (docs/PERF.md, "generative-recommenders' DlrmHSTU against the zoo's
dlrmv3"). This pass finds the block in the graph map_ops left (the attention is our op by then, whichever
library it came from) and puts the gated op in place of the concat; the nodes nobody reads any more go with
eliminate_dead_code.

Matched exactly as above, looking through dtype casts between the steps (``.to``, ``.float``, the casts
follow_parameter_dtypes inserts): generative-recommenders computes the gate in fp32 and rounds the concat
once, ours rounds SiLU(u) and LN(a) before their product, within the dtype's tolerance. Anything else (a
group norm, another concat order, a value inside the block read elsewhere) stays as traced. Runs for the ``triton`` op target:
the gated op's reason is its kernels, and with ``aten`` the attention is already plain ops.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from hstu_export.capture.graph_functions import to_dtype_of, to_floating_dtype

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

__all__ = ["FuseStuGate"]

# Our attention op on each op target that has a gated form, and that form.
GATED = {"hstu_export.hstu_mha_triton.default": "hstu_mha_gated_triton"}
_SPLITS = {torch.split, torch.functional.split, torch.Tensor.split}
_CASTS = {to_dtype_of, to_floating_dtype}


def _through_casts(node: Any) -> Any:
    """The value ``node`` casts (repeatedly), or ``node``."""
    while isinstance(node, torch.fx.Node):
        if node.op == "call_method" and node.target in ("to", "float", "bfloat16", "half") and not node.kwargs.get(
                "device") and all(not isinstance(a, (str, torch.device)) for a in node.args[1:]):
            node = node.args[0]
        elif node.op == "call_function" and node.target in _CASTS:
            node = node.args[0]
        else:
            break
    return node


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _split_part(node: Any) -> tuple[torch.fx.Node, int] | None:
    """(split node, index) for ``split(...)[index]``."""
    if (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node) and isinstance(node.args[1], int)):
        split = node.args[0]
        if (split.op == "call_function" and split.target in _SPLITS) or (
                split.op == "call_method" and split.target == "split"):
            return split, node.args[1]
    return None


def _heads_view(node: Any) -> tuple[tuple[torch.fx.Node, int], int, int] | None:
    """(split part, H, D) for ``split(...)[i].view(-1, H, D)`` (or reshape)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in ("view", "reshape")):
        return None
    shape = node.args[1:] if len(node.args) > 2 else (node.args[1] if len(node.args) > 1 else ())
    if len(shape) != 3 or shape[0] != -1 or not all(isinstance(s, int) for s in shape[1:]):
        return None
    part = _split_part(node.args[0])
    return (part, shape[1], shape[2]) if part else None


def _flat_attention(node: Any) -> torch.fx.Node | None:
    """The attention node of ``attention(...).view(rows, H*Dv)`` (or reshape, any spelling of a 2-D shape)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in ("view", "reshape")):
        return None
    shape = node.args[1:] if len(node.args) > 2 else (node.args[1] if len(node.args) > 1 else ())
    source = node.args[0]
    if len(shape) == 2 and isinstance(source, torch.fx.Node) and source.op == "call_function" \
            and str(source.target) in GATED:
        return source
    return None


def _layer_norm(gm: torch.fx.GraphModule, node: Any) -> tuple[Any, Any, Any, Any] | None:
    """(input, weight, bias, eps) of an affine layer norm over the last dimension: ``F.layer_norm`` or an
    ``nn.LayerNorm`` module (its weight and bias then as qualified names, read with ``get_attr`` once matched)."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if type(module) is not nn.LayerNorm or module.weight is None or module.bias is None \
                or len(module.normalized_shape) != 1:
            return None
        return node.args[0], f"{node.target}.weight", f"{node.target}.bias", float(module.eps)
    if node.op != "call_function" or node.target not in (F.layer_norm, torch.layer_norm):
        return None
    weight, bias, eps = _arg(node, 2, "weight"), _arg(node, 3, "bias"), _arg(node, 4, "eps", 1e-5)
    shape = _arg(node, 1, "normalized_shape")
    if weight is None or bias is None or not isinstance(eps, float) or not isinstance(shape, (list, tuple)) \
            or len(shape) != 1:
        return None
    return node.args[0], weight, bias, eps


def _reads_metadata(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("shape", "dtype", "device", "ndim")
    return node.op == "call_method" and node.target in ("size", "dim")


def _read_only_by(node: torch.fx.Node, readers: set[torch.fx.Node]) -> bool:
    """Whether every user of ``node``, looking through casts, is one of ``readers`` or reads only its metadata
    (``.shape``, ``.dtype``, ``.size()``: resolved when the graph is compiled, they compute nothing)."""
    pending, seen = [node], set()
    while pending:
        for user in pending.pop().users:
            if user in readers or user in seen or _reads_metadata(user):
                continue
            if _through_casts(user) is not user:  # a cast: its own users count
                seen.add(user)
                pending.append(user)
            else:
                return False
    return True


def _split_sizes(split: torch.fx.Node) -> list[int] | None:
    """The four sections of a split into u, v, q, k: a list, or one size for all four."""
    sizes = _arg(split, 1, "split_size_or_sections")
    if isinstance(sizes, int):
        return [sizes] * 4
    if isinstance(sizes, (list, tuple)) and len(sizes) == 4 and all(isinstance(x, int) for x in sizes):
        return list(sizes)
    return None


def _match(gm: torch.fx.GraphModule, cat: torch.fx.Node) -> dict[str, Any] | None:
    """The gated op's arguments if ``cat`` ends an attention-and-gate block, else None."""
    parts, dim = _arg(cat, 0, "tensors"), _arg(cat, 1, "dim", 0)
    if dim not in (1, -1) or not isinstance(parts, (list, tuple)) or len(parts) != 3:
        return None
    u_cast, a_cast, gated = parts
    u, flat = _through_casts(u_cast), _through_casts(a_cast)
    attention = _flat_attention(flat)
    if not (isinstance(u, torch.fx.Node) and u.op == "call_function" and u.target in (F.silu, torch.nn.functional.silu)
            and attention is not None):
        return None
    u_part = _split_part(u.args[0])
    # u * layer_norm(a), in either order, on the same values the concat takes.
    product = _through_casts(gated)
    if not (isinstance(product, torch.fx.Node) and product.op == "call_function"
            and product.target in (operator.mul, torch.mul)):
        return None
    left, right = (_through_casts(a) for a in product.args[:2])
    if left is not u and right is not u:
        return None
    norm_node = right if left is u else left
    norm = _layer_norm(gm, norm_node)
    if norm is None or _through_casts(norm[0]) is not flat:
        return None
    # Nothing else reads the block's inside (it would keep the unfused attention alive beside the gated op).
    if not (_read_only_by(attention, {flat}) and _read_only_by(flat, {norm_node, cat})
            and _read_only_by(u, {product, cat}) and _read_only_by(norm_node, {product})
            and _read_only_by(product, {cat})):
        return None
    q, k, v = (_heads_view(attention.args[i]) for i in range(3))
    if u_part is None or q is None or k is None or v is None:
        return None
    split = u_part[0]
    if {p[0][0] for p in (q, k, v)} != {split} or (u_part[1], v[0][1], q[0][1], k[0][1]) != (0, 1, 2, 3):
        return None
    heads, dqk, dv = q[1], q[2], v[2]
    if k[1:] != (heads, dqk) or v[1] != heads or _arg(split, 2, "dim", 0) not in (1, -1) or \
            _split_sizes(split) != [heads * dv, heads * dv, heads * dqk, heads * dqk]:
        return None
    (offsets, max_seq_len, scaling_seqlen, alpha, causal, num_targets, contextual_seq_len,
     max_attn_len) = attention.args[3:11]
    return {"target": GATED[str(attention.target)],
            "args": (split.args[0], offsets, norm[1], norm[2], heads, dqk, dv, max_seq_len, scaling_seqlen, alpha,
                     causal, num_targets, contextual_seq_len, max_attn_len, norm[3])}


class FuseStuGate:
    name = "fuse_stu_gate"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        if ctx.op_target != "triton":
            return gm
        fused = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not torch.cat:
                continue
            found = _match(gm, node)
            if found is None:
                continue
            with gm.graph.inserting_before(node):
                # A norm module's weight and bias, named by _layer_norm, read here.
                args = tuple(gm.graph.get_attr(a) if i in (2, 3) and isinstance(a, str) else a
                             for i, a in enumerate(found["args"]))
                gated = gm.graph.call_function(getattr(torch.ops.hstu_export, found["target"]).default, args)
            gated.meta.update({k: v for k, v in node.meta.items() if k in ("value_kind", "example_shape",
                                                                          "max_shape")})
            node.replace_all_uses_with(gated)
            gm.graph.erase_node(node)
            fused += 1
        ctx.add_stat("fused", fused)
        return gm
