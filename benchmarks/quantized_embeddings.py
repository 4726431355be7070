"""Quantized embedding tables on CPU: package size and sparse-half latency, fp32 vs int8 vs int4 (and
fp16 with --modes), same run.

    PYTHONPATH=$PWD python benchmarks/quantized_embeddings.py --out results/quantized_embeddings.json

For each mode, on the zoo preset (tzrec by default: item and user tables of 100k x 512):
  1. the sparse artifact the aoti/onnx/trt backends ship (sparse/sparse.ts, written by the same
     function they use) and its bytes; its latency on one request of the largest size the export
     accepts (every user at the maximum lengths), timed with torch.utils.benchmark on the loaded file,
     the modes taking turns over --rounds rounds (median of the round medians);
  2. a whole torchscript package (sparse + dense in one file), verified against the fp32 model, with
     its bytes, worst max abs error and per-user Kendall tau from its manifest.
The limits are modest on purpose (B=4, history 1024, 256 candidates: 9,224 ids per request): the
tables, not the attention, are measured, and verification on CPU pads every user to the model's static
max length (4096). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils.benchmark as tbench

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch, save_bundle
from hstu_export.exporter import _compile_inputs, capture, export_ranges, probe_batch
from hstu_export.models import build_preset
from hstu_export.runtimes.sparse_torchscript import compile_sparse
from hstu_export.settings import EmbeddingQuantization
from hstu_export.sources.bundle import load_bundle


def sparse_half(bundle: Any, settings: ExportSettings, out_dir: Path) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Writes the sparse artifact for ``settings``; returns its figures, the loaded artifact and the largest
    request the export accepts (its sparse inputs)."""
    captured = capture(bundle, settings, "aten")
    result, schema, ranges = captured.result, captured.schema, captured.ranges
    inputs = _compile_inputs(result, schema.to_graph_inputs(captured.example), schema, ranges, settings)
    relpath, _ = compile_sparse(inputs, out_dir)
    path = out_dir / relpath
    module = torch.jit.load(str(path)).eval()  # as the backends' load_sparse does
    request = schema.to_graph_inputs(probe_batch(schema, ranges, seed=5))
    request = {n: request[n] for n in inputs.sparse_input_names}
    ids = sum(int(request[f.graph_name].numel()) for f in schema.features
              if f.graph_name in request and f.kind in ("jagged", "per_user") and f.semantic != "timestamp")
    return ({"sparse_artifact_bytes": path.stat().st_size, "request_batch_size": ranges.max_batch_size,
             "request_ids_looked_up": ids, "tables": captured.quantized_tables}, module, request)


def time_interleaved(runs: dict[str, tuple[Any, dict[str, Any]]], rounds: int, threads: int) -> dict[str, dict[str, Any]]:
    """Median latency of each mode's sparse artifact over ``rounds`` rounds, the modes taking turns within
    a round (a busy machine then slows them alike); each round is torch.utils.benchmark's blocked_autorange."""
    medians: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(rounds):
        for mode, (module, request) in runs.items():
            timer = tbench.Timer("with torch.no_grad(): run(**request)",
                                 globals={"run": module, "request": request, "torch": torch}, num_threads=threads)
            medians[mode].append(timer.blocked_autorange(min_run_time=1.0).median * 1e3)
    return {mode: {"sparse_p50_ms": statistics.median(values), "sparse_round_medians_ms": values}
            for mode, values in medians.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tzrec")
    parser.add_argument("--modes", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--max-candidates", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="Timing rounds (the modes take turns in each).")
    parser.add_argument("--no-package", action="store_true", help="Only the sparse artifact (no whole package).")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    report: dict[str, Any] = {
        "preset": args.preset, "machine": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
        "limits": {"max_batch_size": args.max_batch_size, "max_seq_len": args.max_seq_len,
                   "max_candidates": args.max_candidates},
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_preset(args.preset, seed=1).eval()
        bundle_path = save_bundle(model, root / "model.pt", generate_batch(model.input_schema(), 3, seed=2))
        del model
        bundle = load_bundle(bundle_path)
        runs: dict[str, tuple[Any, dict[str, Any]]] = {}
        for mode in args.modes:
            settings = ExportSettings(backend="torchscript", max_batch_size=args.max_batch_size,
                                      max_seq_len=args.max_seq_len, max_candidates=args.max_candidates,
                                      verify=VerifySettings(num_random_batches=1), quantization=EmbeddingQuantization(mode))
            export_ranges(bundle.input_schema, settings)  # refuses limits beyond the model's before any work
            row, module, request = sparse_half(bundle, settings, root / f"sparse-{mode}")
            runs[mode] = (module, request)
            if not args.no_package:
                start = time.perf_counter()
                result = hstu_export.export(bundle, root / f"pkg-{mode}", settings)
                files = [p for p in result.path.rglob("*") if p.is_file()]
                parity = result.parity
                row.update({"package_bytes": sum(p.stat().st_size for p in files),
                            "export_s": round(time.perf_counter() - start, 1),
                            "parity_passed": parity["passed"], "worst_max_abs": parity["worst"]["max_abs"],
                            "worst_rel_l2": parity["worst"]["rel_l2"], "tolerances": parity["tolerances"],
                            "rank_agreement": parity.get("rank_agreement", {})})
            report["modes"][mode] = row
            print(json.dumps({mode: {k: v for k, v in row.items() if k != "tables"}}), flush=True)
        for mode, timing in time_interleaved(runs, args.rounds, args.threads).items():
            report["modes"][mode].update(timing)
    base = report["modes"].get("none")
    if base:
        for row in report["modes"].values():
            row["sparse_size_ratio"] = base["sparse_artifact_bytes"] / row["sparse_artifact_bytes"]
            row["sparse_speedup"] = base["sparse_p50_ms"] / row["sparse_p50_ms"]
            if "package_bytes" in row:
                row["package_size_ratio"] = base["package_bytes"] / row["package_bytes"]
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
