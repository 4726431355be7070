"""quantize_embeddings: store the sparse half's embedding tables as ``ctx.quantization`` asks
(``--quantize-embeddings``, ``--quantize-table``): each torchrec EmbeddingCollection /
EmbeddingBagCollection the sparse graph calls becomes torchrec's quantized inference module (row-wise
int8/int4 with fp16 scale and bias, or fp16), traced and scripted (the only way torchrec's quantized
modules compile to TorchScript), so it sits in the graph as a scripted submodule.

It runs after the rewrites (``recursive = False``): what the passes before it do to the graph (operator
mapping, dead-code elimination) is done by then, lower_embeddings after it keeps a quantized collection, and a scripted lookup is no graph they could rewrite anyway. It changes the numbers
on purpose (``approximate``): with ``--check-each-pass`` its error is recorded, not held to the exact
tolerance. ``ctx.quantized_tables`` gets one record per table (mode, fp32 bytes, stored bytes).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch.fx

from hstu_export.embedding_quantization import find_collections, plan_tables, quantize_collection
from hstu_export.passes.boundary import SPARSE

if TYPE_CHECKING:
    from hstu_export.passes.context import PassContext

NAME = "quantize_embeddings"


class QuantizeEmbeddings:
    name = NAME
    recursive = False  # finds the sparse half itself
    approximate = True

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        quantization = ctx.quantization
        if quantization is None or not quantization.requested:
            return gm
        sparse = getattr(gm, SPARSE, None)
        half = sparse if isinstance(sparse, torch.fx.GraphModule) else gm
        called = {str(n.target) for n in half.graph.nodes if n.op == "call_module"}
        collections = {path: m for path, m in find_collections(half).items() if path in called}
        tables = plan_tables(collections, quantization)
        by_module: dict[str, dict[str, str]] = {}
        for table in tables:
            by_module.setdefault(table.module, {})[table.name] = table.mode
        records = []
        for path, modes in by_module.items():
            if all(mode == "none" for mode in modes.values()):
                records += [t for t in tables if t.module == path]
                continue
            quantized, stored = quantize_collection(half.get_submodule(path), modes)
            half.set_submodule(path, quantized)
            for table in (t for t in tables if t.module == path):
                records.append(dataclasses.replace(table, bytes=stored.get(table.name, table.bytes)))
        ctx.quantized_tables = [t.to_json() for t in records]
        ctx.add_stat("tables", {t.name: t.mode for t in records})
        ctx.add_stat("fp32_bytes", sum(t.fp32_bytes for t in records))
        ctx.add_stat("stored_bytes", sum(t.bytes for t in records))
        return gm
