"""Matrix-product work of the TorchEasyRec-style test model against the zoo's dlrmv3, module by module, on the CPU:
where the first does more than the second outside the HSTU layers. Both at DLRMv3's dense shape (5 layers of d512,
4 heads of 128; ``benchmarks/gpu_gr_dlrmv3.py``'s), run eagerly in fp32 on a small batch under
``torch.utils.flop_counter``; each module's FLOPs are scaled to the timed workload of ``gpu_gr_dlrmv3.py`` by the
rows it runs on: a layer's, every row; another's, the history's, the users' or the candidates', as its name says
(both models name their preprocessing of the history ``uih``/``history``; the rest runs on the candidates).

    GR_SRC=.gr PYTHONPATH=$PWD python benchmarks/investigations/model_products.py --out DIR   # GR_SRC: gpu_gr_dlrmv3.py's

Writes DIR/model_products.json: per model, each innermost module's GFLOP on the small batch and scaled, and the
totals inside and outside the layers. The attention is left out of both: the zoo's is one op the counter does not
see, the test model's batched products run in its layer's own forward, outside the projections counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # user_models
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_gr_dlrmv3 import DLRMV3, sizes, workload  # noqa: E402
from user_models import tzrec_style  # noqa: E402

import hstu_export  # noqa: E402
from hstu_export.models import build_preset  # noqa: E402

HISTORY, CANDIDATES = [192, 320], [96, 160]  # the small batch: 512 history rows, 256 candidate rows


def products(model: torch.nn.Module, inputs: tuple[Any, ...], root: str) -> dict[str, float]:
    """FLOPs of matrix products (mm, addmm, bmm) by module path (a module's include its children's), the model's
    own name ``root`` cut off."""
    with torch.no_grad(), FlopCounterMode(display=False, depth=None) as counter:
        model(*inputs)
    out = {}
    for path, ops in counter.get_flop_counts().items():
        if path.startswith(root + "."):
            out[path[len(root) + 1:]] = float(sum(ops.values()))
    return out


def scaled(flops: dict[str, float], layer_prefix: str, rows: dict[str, int], full: dict[str, int]) -> dict[str, Any]:
    """Per innermost module (one with products and no child with any): GFLOP on the small batch, and scaled to
    ``full`` by the rows it runs on (a module's FLOPs per row are fixed): a layer's run on every row, the others
    on those their names say."""
    leaves = [p for p in flops if flops[p] and not any(q.startswith(p + ".") and flops[q] for q in flops)]
    table: dict[str, Any] = {}
    for path in leaves:
        kind = "every row" if path.startswith(layer_prefix) else _rows_of(path)
        table[path] = {"rows": kind, "gflop_small": flops[path] / 1e9,
                       "gflop_workload": flops[path] * full[kind] / rows[kind] / 1e9}
    layers = sum(v["gflop_workload"] for k, v in table.items() if k.startswith(layer_prefix))
    outside = sum(v["gflop_workload"] for k, v in table.items() if not k.startswith(layer_prefix))
    return {"modules": table, "layers_gflop": layers, "outside_layers_gflop": outside}


def _rows_of(path: str) -> str:
    # Both models' module names say which rows they see: the preprocessing of the history, of the users' own
    # features, or else of the candidates (their projections, MLPs and heads).
    lowered = path.lower()
    if "uih" in lowered or "history" in lowered:
        return "history"
    if "contextual" in lowered or "dense_proj" in lowered:
        return "users"
    return "candidates"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    history, candidates = workload(False)
    full = {"history": sum(history), "candidates": sum(candidates), "users": len(history)}
    full["every row"] = full["history"] + full["candidates"]
    small = {"history": sum(HISTORY), "candidates": sum(CANDIDATES), "users": len(HISTORY)}
    small["every row"] = small["history"] + small["candidates"]
    torch.manual_seed(0)
    kwargs = {key: DLRMV3[key] for key in ("dim", "heads", "layers")}
    tzrec = tzrec_style.build_ranker(**kwargs).eval()
    zoo = build_preset("dlrmv3").eval()
    zoo_batch = hstu_export.generate_batch(zoo.input_schema(), len(HISTORY), seed=1,
                                           lengths={"uih_lengths": HISTORY, "candidate_lengths": CANDIDATES})
    out: dict[str, Any] = {"workload": {**full, "ranges": sizes(False)}, "small_batch": small}
    out["tzrec_style"] = scaled(products(tzrec, (tzrec_style.example_batch(HISTORY, CANDIDATES, seed=1),),
                                         "TzrecStyleRanker"), "layers.", small, full)
    out["zoo_dlrmv3"] = scaled(products(zoo, (zoo_batch,), "HstuRankingModel"), "transducer.stu.layers.", small, full)
    (args.out / "model_products.json").write_text(json.dumps(out, indent=1))
    for name in ("tzrec_style", "zoo_dlrmv3"):
        print(name, f"layers {out[name]['layers_gflop']:.0f} GFLOP, outside them {out[name]['outside_layers_gflop']:.0f}")
        for path, row in sorted(out[name]["modules"].items(), key=lambda kv: -kv[1]["gflop_workload"]):
            print(f"  {path:40s} {row['rows']:10s} {row['gflop_workload']:8.1f} GFLOP")


if __name__ == "__main__":
    main()
