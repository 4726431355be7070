"""End-to-end speed of the dlrmv3 dense stack (HSTU transducer + task heads) on one GPU.

Workload (seeded): B=32 users, history lengths uniform over [1, 2048] (mean ~1024), 2048 candidates
per user as targets, bf16: about 99k jagged tokens per forward. Variants, measured in one run on the
same dense inputs (the embeddings the sparse half produces):

  eager_reference  our eager model, PyTorch attention (pads to the batch's longest user)
  eager_triton     our eager model, Triton attention and jagged kernels
  compiled         torch.compile of eager_triton
  exported         the AOTInductor package from ``hstu-export --device cuda --op-target triton``,
                   loaded with ``hstu_export.load``; its dense half timed alone

Each: ms per forward (median of ``--iters`` timed runs after warm-up, CUDA events, each call synced:
the latency), tokens/s from it, the same calls back to back without a sync between them (the
throughput of a busy server: ``ms_back_to_back``), host time per call, and peak GPU memory. The FLOP count covers the projections and the attention (causal formula over the valid
pairs) so the bf16 roofline fraction can be stated. Prints a table; writes JSON to --out.

    PYTHONPATH=$PWD python benchmarks/e2e.py --out results/ [--preset dlrmv3] [--skip compiled]
    python benchmarks/e2e.py --preset tiny --device cpu --batch-size 4 --iters 3 --skip compiled exported
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import hstu_export
from hstu_export.models import HstuRankingModel, build_preset
from hstu_export.ops import Kernel

VARIANTS = ("eager_reference", "eager_triton", "compiled", "exported")
H100_BF16_PEAK_TFLOPS = 989.0  # dense bf16, SXM5 spec sheet


def workload(model: HstuRankingModel, batch_size: int, seed: int, mean_history: int | None,
             candidates: int | None) -> dict[str, Tensor]:
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    max_hist = cfg.max_history_len
    hist = torch.randint(1, max_hist + 1, (batch_size,), generator=gen)
    if mean_history is not None:  # rescale to the requested mean, kept inside [1, max]
        hist = (hist.float() * mean_history / hist.float().mean()).round().clamp(1, max_hist).long()
    cand = torch.full((batch_size,), candidates or cfg.max_num_candidates, dtype=torch.int64)
    return hstu_export.generate_batch(model.input_schema(), batch_size, seed=seed,
                                      lengths={"uih_lengths": hist.tolist(), "candidate_lengths": cand.tolist()})


def dense_inputs(model: HstuRankingModel, batch: dict[str, Tensor], device: torch.device,
                 dtype: torch.dtype) -> dict[str, Any]:
    """What the dense half consumes: the sparse half's embeddings plus lengths and timestamps."""
    with torch.no_grad():
        emb = model.sparse_arch(batch)
    to = {k: v.to(device=device, dtype=dtype) for k, v in emb.items()}
    cfg = model.config
    return {
        "history_item": to["uih_item_emb"], "history_action": to["uih_action_emb"],
        "candidate_item": to["candidate_item_emb"],
        "contextual": [to[f"{name}_emb"] for name in cfg.contextual_features],
        "history_lengths": batch["uih_lengths"].to(device), "candidate_lengths": batch["candidate_lengths"].to(device),
        "history_timestamps": batch["uih_timestamps"].to(device), "query_time": batch["query_time"].to(device),
    }


class DenseStack(torch.nn.Module):
    """Transducer + task heads: the model minus its embedding tables."""

    def __init__(self, model: HstuRankingModel) -> None:
        super().__init__()
        self.transducer = model.transducer
        self.task_heads = model.task_heads

    def forward(self, **inputs: Any) -> dict[str, Tensor]:
        return self.task_heads(self.transducer(**inputs))


def set_kernel(module: torch.nn.Module, kernel: Kernel) -> None:
    for sub in module.modules():
        if hasattr(sub, "kernel"):
            sub.kernel = kernel


def flops(cfg: Any, hist: Tensor, cand: Tensor) -> dict[str, float]:
    """Projections (uvqk and output) and attention FLOPs of the STU stack for one forward."""
    c = cfg.contextual_seq_len
    lengths = (hist + cand + c).double()
    tokens = float(lengths.sum())
    d, h, dqk, dv = cfg.embedding_dim, cfg.num_heads, cfg.attention_dim, cfg.linear_dim
    proj = 2 * tokens * d * (2 * dv + 2 * dqk) * h + 2 * tokens * (3 * dv * h) * d
    # Valid pairs per user: history (+context) causal triangle, and each target sees the history and itself.
    n_hist = (hist + c).double()
    pairs = n_hist * (n_hist + 1) / 2 + cand.double() * (n_hist + 1)
    attn = float(2 * h * (dqk + dv) * pairs.sum())
    return {"tokens": tokens, "projection_flops": proj * cfg.num_layers, "attention_flops": attn * cfg.num_layers}


def time_cuda(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        samples = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated() / 2**30
        # Back to back: the calls of a busy server, no sync between them (one event pair around all).
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        back_to_back = start.elapsed_time(end) / iters
        # Host time per call: what the CPU spends (including any wait inside the call).
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        host_ms = (time.perf_counter() - t) * 1e3 / 10
        torch.cuda.synchronize()
    else:
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
        peak = float("nan")
        host_ms = back_to_back = statistics.median(samples)
    return {"ms_median": statistics.median(samples), "ms_min": min(samples), "peak_gib": peak, "iters": iters,
            "ms_back_to_back": back_to_back, "host_ms_per_call": host_ms}


def write_profile(fn: Callable[[], Any], path: Path, iters: int = 5) -> None:
    """GPU kernel time by kernel name over ``iters`` calls (torch.profiler), as a text table."""
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))


def rel_error(out: dict[str, Tensor], ref: dict[str, Tensor]) -> float:
    worst = 0.0
    for k, r in ref.items():
        o, r = out[k].double().cpu(), r.double().cpu()
        worst = max(worst, float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30)))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="dlrmv3")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--mean-history", type=int, default=1024)
    parser.add_argument("--candidates", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=2026, help="seed of the workload")
    parser.add_argument("--model-seed", type=int, default=0, help="seed of the weights")
    parser.add_argument("--skip", nargs="*", default=[], choices=VARIANTS)
    parser.add_argument("--package", default=None,
                        help="reuse this exported package, or export to this path when it does not exist yet")
    parser.add_argument("--out", default=None, help="directory for e2e.json")
    parser.add_argument("--profile", nargs="*", default=[], choices=VARIANTS,
                        help="also write a torch.profiler kernel table for these variants")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # Same weights as benchmarks/gpu_export_check.py (seed 0), so a package it kept can be reused.
    model = build_preset(args.preset, seed=args.model_seed)
    batch = workload(model, args.batch_size, args.seed, args.mean_history, args.candidates)
    cfg = model.config
    work = flops(cfg, batch["uih_lengths"], batch["candidate_lengths"])
    inputs = dense_inputs(model, batch, device, dtype)
    print(f"{args.preset}: B={args.batch_size}, {work['tokens']:,.0f} tokens, longest user "
          f"{int((batch['uih_lengths'] + batch['candidate_lengths']).max())}, {args.dtype} on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)

    results: dict[str, Any] = {"workload": {**work, "batch_size": args.batch_size, "preset": args.preset,
                                            "dtype": args.dtype, "seed": args.seed}}
    eager = DenseStack(copy.deepcopy(model)).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        reference_out = eager(**inputs)

    runs: dict[str, Callable[[], Any]] = {}
    if "eager_reference" not in args.skip:
        runs["eager_reference"] = lambda: eager(**inputs)
    if not {"eager_triton", "compiled"} <= set(args.skip):
        triton_stack = DenseStack(copy.deepcopy(model)).to(device=device, dtype=dtype).eval()
        set_kernel(triton_stack, Kernel.TRITON)
        if "eager_triton" not in args.skip:
            runs["eager_triton"] = lambda: triton_stack(**inputs)
    if "exported" not in args.skip:
        pkg = args.package
        if pkg is None or not Path(pkg).exists():
            pkg = pkg or str(Path(tempfile.mkdtemp(prefix="e2e-")) / "dlrmv3.aoti")
            bundle_path = Path(pkg).with_suffix(".pt")
            hstu_export.save_bundle(model, bundle_path, hstu_export.generate_batch(model.input_schema(), 4, seed=1))
            settings = hstu_export.ExportSettings(
                backend="aoti", device=args.device, dtype=args.dtype,
                op_target="triton" if device.type == "cuda" else "aten",
                max_batch_size=args.batch_size, verify=hstu_export.VerifySettings(num_random_batches=1))
            t = time.perf_counter()
            result = hstu_export.export(bundle_path, pkg, settings)
            results["export"] = {"seconds": time.perf_counter() - t, "parity": result.manifest["parity"]["worst"],
                                 "tolerances": result.manifest["parity"]["tolerances"]}
            print(f"exported in {results['export']['seconds']:.0f}s, parity {results['export']['parity']}", flush=True)
        predictor = hstu_export.load(pkg)
        split = predictor.split
        features = {k: v.to(device) for k, v in batch.items()}
        dense_in = split.dense_inputs(features)
        runs["exported"] = lambda: split.dense(**dense_in)

    if "compiled" not in args.skip:
        compiled = torch.compile(triton_stack, dynamic=False)
        runs["compiled"] = lambda: compiled(**inputs)
    for name, fn in runs.items():
        with torch.no_grad():
            out = fn()
            if name == "exported":
                out = dict(zip(predictor.output_names, out)) if not isinstance(out, dict) else out
            stats = time_cuda(fn, args.iters, args.warmup, device)
        stats["tokens_per_s"] = work["tokens"] / (stats["ms_median"] / 1e3)
        stats["tokens_per_s_back_to_back"] = work["tokens"] / (stats["ms_back_to_back"] / 1e3)
        total = work["projection_flops"] + work["attention_flops"]
        stats["tflops"] = total / (stats["ms_median"] / 1e3) / 1e12
        stats["roofline_fraction"] = stats["tflops"] / H100_BF16_PEAK_TFLOPS
        stats["rel_error_vs_eager_reference"] = rel_error(out, reference_out)
        results[name] = stats
        print(f"{name:16s} {stats['ms_median']:8.2f} ms  {stats['tokens_per_s'] / 1e6:7.2f} M tok/s  "
              f"{stats['tflops']:7.1f} TFLOP/s  back-to-back {stats['ms_back_to_back']:.2f} ms "
              f"({stats['tokens_per_s_back_to_back'] / 1e6:.2f} M tok/s)  peak {stats['peak_gib']:.2f} GiB  host {stats['host_ms_per_call']:.2f} ms  "
              f"rel.err {stats['rel_error_vs_eager_reference']:.2e}", flush=True)
        if name in args.profile and args.out:
            write_profile(fn, Path(args.out) / f"profile_{name}.txt")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:  # after every variant, so a run cut short still leaves its numbers
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "e2e.json").write_text(json.dumps(results, indent=2))

    if "eager_reference" in results:
        for name in runs:
            results[name]["speedup_vs_eager_reference"] = (
                results["eager_reference"]["ms_median"] / results[name]["ms_median"])
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "e2e.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
