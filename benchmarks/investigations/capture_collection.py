"""A garbage collection during a KV cache's CUDA graph capture, with the collector paused for the capture
(``runtimes/kv_graphs.py`` ``collection_paused``, the code as it is) and without.

Each trial runs in a process of its own, so one that aborts is recorded, not fatal. A trial loads the tiny
preset's CUDA package (exported with --kv-cache) a few times, serves each copy's cache until a graph is
captured, and leaves the copies unreachable in reference cycles: garbage that only a collection frees (the
collector's thresholds are set out of reach meanwhile). It then serves a new request three times from a fresh
cache (the third call captures its hits' bucket); inside the capture the thresholds drop to 1 and a few
objects are made, so that a collection falls due there.

    PYTHONPATH=$PWD python benchmarks/investigations/capture_collection.py --out FILE [--package DIR]

Writes each trial's exit status, its last words on stderr, and (when it finished) the captures and its answer's
largest difference from the package without cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_threads import export_kv_package


def trial(package: str, paused: bool) -> dict:
    import gc

    import torch

    import hstu_export
    import hstu_export.runtimes.kv_graphs as kv_graphs

    if not paused:
        kv_graphs.collection_paused = contextlib.nullcontext
    run_bucket = kv_graphs.GraphCache._run_bucket

    def due_in_capture(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if torch.cuda.is_current_stream_capturing():
            gc.set_threshold(1, 1, 1)
            made = [[] for _ in range(100)]
            del made
        return run_bucket(self, *args, **kwargs)

    gc.set_threshold(1 << 30, 1 << 30, 1 << 30)
    predictor = hstu_export.load(package)
    schema = predictor.input_schema
    first = hstu_export.generate_batch(schema, 2, seed=3)
    for _ in range(3):  # copies of the package, unreachable but for their cycles
        copy = hstu_export.load(package)
        ranker = copy.kv_cache(cuda_graphs=True)
        for _ in range(3):  # a miss, then a hit's bucket seen once, then captured
            ranker(first, [0, 1])
        cycle: list = [copy, ranker]
        cycle.append(cycle)
        del copy, ranker, cycle
    torch.cuda.synchronize()
    kv_graphs.GraphCache._run_bucket = due_in_capture
    ranker = predictor.kv_cache(cuda_graphs=True)
    request = hstu_export.generate_batch(schema, 3, seed=4)  # another shape bucket
    with torch.no_grad():
        answers = [ranker(request, [5, 6, 7]) for _ in range(3)]
        full = predictor(request)
    torch.cuda.synchronize()
    gap = max(float((answers[-1][name].float() - full[name].float()).abs().max()) for name in full)
    return {"captures": ranker.runner.graphs.counts["captures"], "max_abs_vs_no_cache": gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--package", help="an exported tiny --kv-cache CUDA package (default: exported here)")
    parser.add_argument("--trial", choices=["paused", "unpaused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(trial(args.package, args.trial == "paused")))
        return
    package = args.package or str(export_kv_package(Path(tempfile.mkdtemp())))
    report: dict = {}
    for name in ("paused", "unpaused", "paused"):
        done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--package", package, "--trial", name],
                              capture_output=True, text=True, timeout=600)
        row: dict = {"returncode": done.returncode, "stderr_tail": done.stderr.strip()[-600:]}
        with contextlib.suppress(IndexError, json.JSONDecodeError):
            row.update(json.loads(done.stdout.strip().splitlines()[-1]))
        report.setdefault(name, []).append(row)
        print(name, row["returncode"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
