"""Forward speed of the Triton HSTU attention kernel against PyTorch baselines, on one GPU.

(a) B=128, H=4, Dqk=Dv=128, full-length causal sequences, N in {256, ..., 4096};
    FLOPs = sum_b H * n_b^2 * (Dqk + Dv) (the causal half of both products, 2 FLOPs per MAC).
(b) dlrmv3 profile: B=32, H=4, Dqk=Dv=128, history lengths uniform in [1, 2048] (mean ~1024),
    2048 candidates per user as targets (sequence = history + candidates), block skipping on vs
    off; FLOPs = 2 * H * (Dqk + Dv) * (number of valid (i, j) pairs).
Baselines, measured in the same run on a leading subset of the batch where the full batch would
not fit (the subset is reported):
  * ``reference``: hstu_export.ops.reference.hstu_mha_reference, the project's pure-torch op
    (padded to max_seq_len, fp32 compute), i.e. what the ``aten`` mapping target runs;
  * ``torch_bf16``: the same math in bf16 on padded tensors with the mask precomputed (untimed).
Timing: triton.testing.do_bench, median, after a warm-up run; inputs are random normal, never zeros.

    PYTHONPATH=$PWD python benchmarks/attention.py --out $OUT [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_imports import import_kernels

kernels, reference = import_kernels()
from hstu_export.ops._triton.attention import _launch_attention  # noqa: E402

DTYPE = torch.bfloat16
H, D = 4, 128
# Largest score tensor a baseline may allocate: elements of [B_sub, H, N, N].
BASELINE_SCORE_ELEMENTS = 2**30


def bench_ms(fn: Any) -> float:
    fn()  # compile / warm up outside the timed region
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_ms(fn: Any) -> float:
    """GPU time alone: the launches replayed from a CUDA graph (no Python launch overhead)."""
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def make_inputs(lengths: list[int], seed: int, d: int = D) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    L = int(offsets[-1])
    return {
        "q": torch.randn(L, H, d, generator=gen, device="cuda", dtype=DTYPE),
        "k": torch.randn(L, H, d, generator=gen, device="cuda", dtype=DTYPE),
        "v": torch.randn(L, H, d, generator=gen, device="cuda", dtype=DTYPE),
        "offsets": offsets,
    }


def triton_fn(x: dict[str, torch.Tensor], max_len: int, targets: torch.Tensor | None, **knobs: Any) -> Any:
    fast_silu = knobs.pop("fast_silu", None)
    alpha = 1.0 / math.sqrt(x["q"].shape[2])
    if fast_silu is None:
        return lambda: kernels.hstu_mha_triton_fwd(
            x["q"], x["k"], x["v"], x["offsets"], max_len, max_len, alpha, True, targets, 0, 0, **knobs
        )
    return lambda: _launch_attention(
        x["q"], x["k"], x["v"], x["offsets"], x["q"].shape[0], max_len, 0, max_len, alpha, True, targets, 0, 0,
        is_delta=False, block_skipping=knobs.get("block_skipping", True), config=knobs.get("config"),
        traceable=False, fast_silu=fast_silu,
    )  # fmt: skip


def subset(x: dict[str, torch.Tensor], lengths: list[int], b_sub: int) -> dict[str, torch.Tensor]:
    end = sum(lengths[:b_sub])
    return {
        "q": x["q"][:end], "k": x["k"][:end], "v": x["v"][:end], "offsets": x["offsets"][: b_sub + 1],
    }  # fmt: skip


def baseline_fns(
    x: dict[str, torch.Tensor], lengths: list[int], max_len: int, targets: torch.Tensor | None
) -> tuple[int, dict[str, Any]]:
    """The two PyTorch baselines on the leading ``b_sub`` sequences."""
    b_sub = max(1, min(len(lengths), BASELINE_SCORE_ELEMENTS // (H * max_len * max_len)))
    xs = subset(x, lengths, b_sub)
    ts = None if targets is None else targets[:b_sub]
    alpha = 1.0 / math.sqrt(D)

    def reference_fn() -> torch.Tensor:
        return reference.hstu_mha_reference(
            xs["q"], xs["k"], xs["v"], xs["offsets"], max_len, max_len, alpha, True, ts, 0, 0
        )

    # bf16 padded baseline: q, k, v padded once (untimed), mask precomputed (untimed).
    lengths_t = torch.tensor(lengths[:b_sub], device="cuda")
    padded = [
        reference.jagged_to_padded_dense_reference(t.flatten(1), xs["offsets"], max_len).view(b_sub, max_len, H, D).transpose(1, 2)
        for t in (xs["q"], xs["k"], xs["v"])
    ]  # fmt: skip
    rows = torch.arange(max_len, device="cuda").unsqueeze(0)
    mask = reference.hstu_attention_mask(rows, max_len, lengths_t, ts, True, 0, 0).unsqueeze(1)

    def torch_bf16_fn() -> torch.Tensor:
        q, k, v = padded
        scores = torch.nn.functional.silu(torch.matmul(q, k.transpose(-1, -2)) * alpha) * (1.0 / max_len)
        return torch.matmul(scores * mask, v)

    return b_sub, {"reference": reference_fn, "torch_bf16": torch_bf16_fn}


def full_length_flops(lengths: list[int], d: int = D) -> float:
    return float(sum(H * n * n * (d + d) for n in lengths))


def target_flops(histories: list[int], targets: int) -> float:
    pairs = sum(h * (h + 1) // 2 + targets * (h + 1) for h in histories)
    return float(2 * H * (D + D) * pairs)


def case_a(n: int, baselines: bool) -> dict[str, Any]:
    lengths = [n] * 128
    x = make_inputs(lengths, seed=n)
    flops = full_length_flops(lengths)
    ms = bench_ms(triton_fn(x, n, None))
    gms = graph_ms(triton_fn(x, n, None))
    row: dict[str, Any] = {
        "case": f"a_N{n}",
        "B": 128,
        "N": n,
        "triton_ms": ms,
        "triton_tflops": flops / ms * 1e-9,
        "triton_graph_ms": gms,
        "triton_graph_tflops": flops / gms * 1e-9,
    }
    if baselines:
        b_sub, fns = baseline_fns(x, lengths, n, None)
        time_baselines(row, fns, b_sub, full_length_flops(lengths[:b_sub]), row["triton_tflops"])
    print(json.dumps(row), flush=True)
    return row


def time_baselines(row: dict[str, Any], fns: dict[str, Any], b_sub: int, sub_flops: float,
                   triton_tflops: float) -> None:
    """Times each baseline on the leading ``b_sub`` sequences; adds its ms, TFLOP/s and the Triton
    kernel's speed-up (a ratio of rates) to ``row``. A baseline that runs out of memory is marked OOM."""
    row["baseline_batch"] = b_sub
    for name, fn in fns.items():
        try:
            bms = bench_ms(fn)
            row[f"{name}_ms"] = bms
            row[f"{name}_tflops"] = sub_flops / bms * 1e-9
            row[f"speedup_vs_{name}"] = triton_tflops / row[f"{name}_tflops"]
        except torch.OutOfMemoryError:
            row[f"{name}_ms"] = "OOM"
        torch.cuda.empty_cache()


def dlrmv3_inputs() -> tuple[list[int], list[int], dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(2026)
    histories = torch.randint(1, 2049, (32,), generator=gen).tolist()
    lengths = [h + 2048 for h in histories]
    x = make_inputs(lengths, seed=7)
    targets = torch.full((32,), 2048, dtype=torch.int64, device="cuda")
    return histories, lengths, x, targets


def case_b(baselines: bool) -> dict[str, Any]:
    histories, lengths, x, targets = dlrmv3_inputs()
    flops = target_flops(histories, 2048)
    on_ms = bench_ms(triton_fn(x, 4096, targets))
    off_ms = bench_ms(triton_fn(x, 4096, targets, block_skipping=False))
    on_graph_ms = graph_ms(triton_fn(x, 4096, targets))
    row: dict[str, Any] = {
        "case": "b_dlrmv3", "B": 32, "tokens": sum(lengths), "mean_history": sum(histories) / 32,
        "skip_on_ms": on_ms, "skip_off_ms": off_ms, "skip_speedup": off_ms / on_ms, "skip_on_graph_ms": on_graph_ms,
        "skip_on_tflops": flops / on_ms * 1e-9, "skip_off_tflops": flops / off_ms * 1e-9,
    }  # fmt: skip
    if baselines:
        b_sub, fns = baseline_fns(x, lengths, 4096, targets)
        time_baselines(row, fns, b_sub, target_flops(histories[:b_sub], 2048), row["skip_on_tflops"])
    print(json.dumps(row), flush=True)
    return row


# Candidate configs per head dim (BLOCK_M, BLOCK_N, num_warps, num_stages); the first of each list
# is the table's choice for Hopper at the time of the sweep.
SWEEP: dict[int, list[tuple[int, int, int, int]]] = {
    128: [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (128, 64, 8, 3)],
    64: [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3)],
    256: [(64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2)],
}


def sweep(only: set[str] | None = None, configs: list[tuple[int, int, int, int]] | None = None) -> list[dict[str, Any]]:
    """Block configs (and the exact-SiLU variant) on several shapes, per head dim; ``configs``
    replaces the candidate list of head dim 128."""
    rows = []
    shapes = []  # (name, head dim, inputs, max_len, targets, flops)
    for n in (256, 1024, 4096):
        lengths = [n] * 128
        shapes.append((f"a_N{n}", 128, make_inputs(lengths, seed=n), n, None, full_length_flops(lengths)))
    histories, _, x, targets = dlrmv3_inputs()
    shapes.append(("b_dlrmv3", 128, x, 4096, targets, target_flops(histories, 2048)))
    for d, batch in ((64, 64), (256, 32)):
        lengths = [2048] * batch
        shapes.append(
            (
                f"d{d}_N2048_B{batch}",
                d,
                make_inputs(lengths, 11, d),
                2048,
                None,
                full_length_flops(lengths, d),
            )
        )
    for shape_name, d, x, max_len, tg, flops in shapes:
        if only and shape_name not in only:
            continue
        variants: list[tuple[str, dict[str, Any]]] = [
            (f"{bm}x{bn}x{w}x{s}", {"config": kernels.AttentionConfig(bm, bn, w, s)})
            for bm, bn, w, s in (configs if configs and d == 128 else SWEEP[d])
        ]
        if d == 128:
            variants.append(("table_exact_silu", {"fast_silu": False}))
        for name, knobs in variants:
            try:
                ms = bench_ms(triton_fn(x, max_len, tg, **dict(knobs)))
                row = {"shape": shape_name, "variant": name, "ms": ms, "tflops": flops / ms * 1e-9}
            except Exception as exc:  # e.g. out of shared memory on this GPU
                row = {"shape": shape_name, "variant": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--sweep", action="store_true", help="also time the candidate block configs")
    parser.add_argument(
        "--sweep-shapes", default="", help="comma-separated shape names to sweep (default: all)"
    )
    parser.add_argument(
        "--sweep-configs", default="",
        help="comma-separated BLOCK_MxBLOCK_Nxwarpsxstages candidates for head dim 128, e.g. 64x64x4x3,128x64x8x2",
    )
    parser.add_argument("--sweep-only", action="store_true", help="run the sweep and nothing else")
    parser.add_argument("--no-baselines", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    env = {
        "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "triton": triton.__version__,
        "config": str(kernels.attention_config(torch.cuda.get_device_capability(), D, D, DTYPE)),
    }  # fmt: skip
    print(json.dumps(env), flush=True)
    report: dict[str, Any] = {"env": env}
    if args.sweep:
        configs = [tuple(int(x) for x in c.split("x")) for c in args.sweep_configs.split(",") if c]
        report["sweep"] = sweep({name for name in args.sweep_shapes.split(",") if name}, configs)  # type: ignore[arg-type]
        torch.cuda.empty_cache()
        if args.sweep_only:
            (args.out / "attention_sweep.json").write_text(json.dumps(report, indent=2))
            for row in report["sweep"]:
                print(f"  {row['shape']:18s} {row['variant']:18s} {row.get('tflops', row.get('error'))}")
            return
    report["a"] = [case_a(n, not args.no_baselines) for n in (256, 512, 1024, 2048, 4096)]
    torch.cuda.empty_cache()
    report["b"] = case_b(not args.no_baselines)
    report["chosen_configs"] = kernels.chosen_configs()
    (args.out / "attention_bench.json").write_text(json.dumps(report, indent=2))

    def fmt(value: Any, spec: str = ".1f") -> str:
        return format(value, spec) if isinstance(value, float) else str(value if value is not None else "-")

    print(f"\n== HSTU attention forward, {env['gpu']}, bf16, H={H}, Dqk=Dv={D} ==")
    if args.sweep:
        print("sweep (TFLOP/s):")
        for row in report["sweep"]:
            print(f"  {row['shape']:18s} {row['variant']:18s} {fmt(row.get('tflops'))}")
    print(
        "| case | triton ms | TFLOP/s | graph ms | graph TFLOP/s | reference ms (B) | reference TFLOP/s "
        "| torch bf16 TFLOP/s | x reference | x torch bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in report["a"]:
        print(
            f"| N={row['N']} B=128 | {fmt(row['triton_ms'], '.3f')} | {fmt(row['triton_tflops'])} | "
            f"{fmt(row['triton_graph_ms'], '.3f')} | {fmt(row['triton_graph_tflops'])} | "
            f"{fmt(row.get('reference_ms'), '.2f')} ({row.get('baseline_batch', '-')}) | "
            f"{fmt(row.get('reference_tflops'))} | {fmt(row.get('torch_bf16_tflops'))} | "
            f"{fmt(row.get('speedup_vs_reference'))} | {fmt(row.get('speedup_vs_torch_bf16'))} |"
        )
    b = report["b"]
    print(
        f"| dlrmv3 skip on | {fmt(b['skip_on_ms'], '.3f')} | {fmt(b['skip_on_tflops'])} | "
        f"{fmt(b['skip_on_graph_ms'], '.3f')} | | "
        f"{fmt(b.get('reference_ms'), '.2f')} ({b.get('baseline_batch', '-')}) | {fmt(b.get('reference_tflops'))} | "
        f"{fmt(b.get('torch_bf16_tflops'))} | {fmt(b.get('speedup_vs_reference'))} | "
        f"{fmt(b.get('speedup_vs_torch_bf16'))} |"
    )
    print(f"| dlrmv3 skip off | {fmt(b['skip_off_ms'], '.3f')} | {fmt(b['skip_off_tflops'])} | | | | | | | |")
    print(f"dlrmv3 skipping speedup: {b['skip_speedup']:.2f}x")


if __name__ == "__main__":
    main()
