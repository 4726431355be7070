"""One delta layer's gated paged attention (the attention, which stores the new K/V, and the gate: the package's
op on the Triton path) on the GPU, swept over the launch choices the op makes by rule (GPU only).

    PYTHONPATH=$PWD python benchmarks/investigations/paged_gated_sweep.py --out $OUT/slices.json --sweep slices
    PYTHONPATH=$PWD python benchmarks/investigations/paged_gated_sweep.py --out $OUT/gate_rows.json --sweep gate-rows

Shapes: benchmarks/kv_cache.py's long workload on the dlrmv3 dims (4 heads of 128, bf16, pages of 64 in a
shuffled table, 3968 cached + 384 new tokens a user, 256 of them targets), at 1, 8 and 32 users. Each launch is
captured in a CUDA graph and its replays timed (``kv_cache.bench_graph``: p50 µs).

- ``slices``: key slices (0: the rule, ``split_count``) x tile configs (BLOCK_M x BLOCK_N, warps, stages); each
  output's largest difference from the first launch's (the default tile, the rule's slices).
- ``gate-rows``: the attention alone (its slices summed by ``_sum_slices``) against the gated op with the gate's
  rows a program forced to 1, 2, 4 and 8; whether the gated op's middle third equals the attention alone bit for
  bit, and its largest difference from the attention followed by the reference gate.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: kv_cache's bench_graph
from kv_cache import bench_graph

import hstu_export.ops._triton.paged as paged
from hstu_export.ops._triton.configs import AttentionConfig
from hstu_export.ops.reference import stu_gate

HEADS, DIM, PAGE, LAYER = 4, 128, 64, 2
CACHED, NEW, TARGETS = 3968, 384, 256
TILES = {"64x64w4s3": (64, 64, 4, 3), "64x64w4s2": (64, 64, 4, 2), "64x64w4s4": (64, 64, 4, 4),
         "128x64w8s3": (128, 64, 8, 3), "128x64w8s2": (128, 64, 8, 2), "64x32w4s3": (64, 32, 4, 3),
         "32x64w4s3": (32, 64, 4, 3), "128x32w8s3": (128, 32, 8, 3)}
SLICES = {1: (0, 1, 2, 3, 4, 6, 8, 11, 14, 17), 8: (0, 1, 2, 3), 32: (0, 1, 2)}


def layer_inputs(batch: int, device: torch.device) -> dict[str, Any]:
    """Random inputs of one layer for ``batch`` users (seeded), the pages in a shuffled order."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = CACHED + NEW
    per_user = -(-n // PAGE)
    table = torch.randperm(batch * per_user, device=device, generator=gen).to(torch.int32).reshape(batch, per_user)
    pool_k = torch.randn(5, batch * per_user + 1, PAGE, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    return {
        "uvqk": torch.randn(batch * NEW, 4 * HEADS * DIM, device=device, dtype=torch.bfloat16, generator=gen),
        "q_offsets": torch.arange(batch + 1, device=device) * NEW,
        "pool_k": pool_k,
        "pool_v": torch.randn_like(pool_k),
        "table": table,
        "seq_lens": torch.full((batch,), n, device=device),
        "targets": torch.full((batch,), TARGETS, device=device),
        "weight": torch.randn(HEADS * DIM, device=device),
        "bias": torch.randn(HEADS * DIM, device=device),
    }


def gated(x: dict[str, Any], **options: Any) -> torch.Tensor:
    n = CACHED + NEW
    return paged.paged_hstu_mha_gated_triton_fwd(
        x["uvqk"], x["q_offsets"], x["pool_k"], x["pool_v"], LAYER, x["table"], x["seq_lens"], x["targets"],
        x["weight"], x["bias"], 1e-6, HEADS, DIM, DIM, n, 0.1, max_seq_len=n, max_query_len=NEW, **options)


def attention_alone(x: dict[str, Any]) -> torch.Tensor:
    """The paged attention alone (its slices summed by ``_sum_slices``), on the q, k, v views of uvqk."""
    n, width = CACHED + NEW, HEADS * DIM
    v, q, k = (x["uvqk"][:, i * width:(i + 1) * width].unflatten(-1, (HEADS, DIM)) for i in (1, 2, 3))
    return paged.paged_hstu_mha_triton_fwd(
        q, k, v, x["q_offsets"], x["pool_k"], x["pool_v"], x["table"], x["seq_lens"], x["targets"], n, 0.1,
        max_seq_len=n, max_query_len=NEW, layer=LAYER)


def sweep_slices(device: torch.device) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    default = paged.attention_config
    try:
        for batch, slice_counts in SLICES.items():
            x = layer_inputs(batch, device)
            first = None
            for name, (block_m, block_n, warps, stages) in TILES.items():
                config = AttentionConfig(block_m, block_n, warps, stages)
                paged.attention_config = lambda *_, c=config: c
                for splits in slice_counts:
                    row: dict[str, Any] = {"batch": batch, "config": name, "splits": splits}
                    try:
                        got = gated(x, splits=splits or None).float()
                        first = got if first is None else first
                        row["max_abs_vs_default"] = float((got - first).abs().max())
                        launch = functools.partial(gated, x, splits=splits or None)
                        row["p50_us"] = bench_graph(launch, iters=100)["p50_ms"] * 1e3
                    except Exception as exc:  # a tile that does not compile for these sizes is recorded
                        row["error"] = str(exc)[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    finally:
        paged.attention_config = default
    return rows


def sweep_gate_rows(device: torch.device) -> dict[int, dict[str, Any]]:
    result: dict[int, dict[str, Any]] = {}
    width = HEADS * DIM
    for batch in SLICES:
        x = layer_inputs(batch, device)
        row: dict[str, Any] = {"alone": bench_graph(functools.partial(attention_alone, x))}
        for rows in (1, 2, 4, 8):
            row[f"gated_rows{rows}"] = bench_graph(functools.partial(gated, x, gate_rows=rows))
        got, attention = gated(x), attention_alone(x).flatten(1)
        want = stu_gate(x["uvqk"][:, :width], attention, x["weight"], x["bias"], 1e-6)
        row["gated_vs_alone_then_gate_max_abs"] = float((got.float() - want.float()).abs().max())
        row["attention_third_equal"] = bool(torch.equal(got[:, width:2 * width], attention))
        result[batch] = row
        print(batch, json.dumps(row), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write.")
    parser.add_argument("--sweep", choices=("slices", "gate-rows"), required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("paged_gated_sweep.py needs a CUDA GPU")
    device = torch.device("cuda")
    result = sweep_slices(device) if args.sweep == "slices" else sweep_gate_rows(device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": result} if args.sweep == "slices" else result, indent=1))


if __name__ == "__main__":
    main()
