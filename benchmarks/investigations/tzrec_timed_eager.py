"""The TorchEasyRec-style test model at DLRMv3's dims, its graph as exported for CUDA (bf16, the ``triton`` target,
the timed ranges of benchmarks/gpu_gr_dlrmv3.py) run eagerly, op by op, on the GPU on the timed workload's first
1, 4 and 32 users: which op fails, when a package of it does (run with CUDA_LAUNCH_BLOCKING=1). ``--package``:
the package exported instead (unverified, as the benchmark's), called on the same requests.

    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=$PWD python benchmarks/investigations/tzrec_timed_eager.py --out DIR [--package]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_gr_dlrmv3 as bench
from user_models import tzrec_style

import hstu_export
from hstu_export.exporter import capture
from hstu_export.sources.schema_inference import flatten_example


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (TRITON_INTERPRET=1, fp32)")
    parser.add_argument("--package", action="store_true", help="the exported package rather than the graph")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ranges = bench.sizes(False)
    bundle = bench.tzrec_bundle(Path(tempfile.mkdtemp()), False, ranges, "tzrec_timed")
    loaded = hstu_export.load_bundle(bundle)
    settings = bench.tzrec_settings(args.device, ranges, False)
    captured, predictor = None, None
    if args.package:
        predictor = hstu_export.load(hstu_export.export(bundle, Path(tempfile.mkdtemp()) / "pkg", settings).path)
    else:
        captured = capture(loaded, settings, "triton")
    schema = predictor.input_schema if predictor is not None else captured.schema
    history, candidates = bench.workload(False)
    report: dict = {"history": history, "candidates": candidates, "runs": []}
    for users in args.users:
        request = flatten_example(schema, (tzrec_style.example_batch(history[:users], candidates[:users],
                                                                               seed=5),), None, loaded.model)
        run = {"users": users, "lengths": {k: int(v.numel()) for k, v in request.items()}}
        try:
            with torch.no_grad():
                if predictor is not None:
                    outputs = predictor(request)
                else:
                    inputs = {k: v.to(args.device) for k, v in schema.to_graph_inputs(request).items()}
                    outputs = captured.result.run(inputs)
            if args.device == "cuda":
                torch.cuda.synchronize()
            run["finite"] = {k: bool(torch.isfinite(v).all()) for k, v in outputs.items()}
        except Exception:
            run["error"] = traceback.format_exc()[-6000:]
        report["runs"].append(run)
        (args.out / f"tzrec_timed_{'package' if args.package else 'eager'}.json").write_text(json.dumps(report, indent=1))
        print(json.dumps({k: v for k, v in run.items() if k != "lengths"})[:6000], flush=True)
        if "error" in run:
            break


if __name__ == "__main__":
    main()
