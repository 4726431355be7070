"""Where the exact-shape CUDA graphs' bound on copied inputs should lie (``runtimes/shape_graphs.py``
``MAX_COPY_BYTES``, C++ ``kMaxCopyBytes``): the zoo's derived delta program (``gpu_kv_derived.py``'s package:
dlrmv3 shapes, each user's 4096 items cached, then 256 new candidates), one hit's call replayed from a graph with
no bound against the same call run as it is, and the whole request served both ways, three rounds in turn at each
batch size.

    PYTHONPATH=$PWD python benchmarks/investigations/shape_graph_bound.py --out DIR [--users 1 2 4 8 16 32]

Writes DIR/shape_graph_bound.json: per batch size the bytes a call copies into the graph's buffers, and the
medians (ms, CUDA events) of each round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_kv_derived import bench, export_zoo, hit, workload, zoo_requests

import hstu_export
from hstu_export.runtimes.shape_graphs import ShapeGraphs


def time_users(package: object, users: int, w: dict, iters: int) -> dict:
    first, second = zoo_requests(package, users, w)
    ranker, ids, _, _, inputs = hit(package, first, second)
    runner = ranker.runner
    graphs = ShapeGraphs(runner._call, runner.STATIC_INPUTS, max_bytes=1 << 62)
    row: dict = {"copied_bytes": sum(t.numel() * t.element_size() for name, t in inputs.items()
                                     if name not in runner.STATIC_INPUTS),
                 "call_ms": {"graph": [], "as_it_is": []}, "request_ms": {"graph": [], "as_it_is": []}}
    for _ in range(3):
        row["call_ms"]["graph"].append(bench(lambda: graphs(inputs), iters))
        row["call_ms"]["as_it_is"].append(bench(lambda: runner.run_program(inputs, graphed=False), iters))
        for name, served in (("graph", graphs), ("as_it_is", None)):
            runner.graphs = served
            row["request_ms"][name].append(bench(lambda: ranker(second, ids), iters))
    row["graph_counts"] = dict(graphs.counts)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--users", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    w = {**workload(False), "users": args.users}
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "workload": w, "export_seconds": export_zoo(args.out, "cuda", False, "derived"), "users": {}}
    package = hstu_export.load(args.out / "zoo_derived.aoti")
    for users in args.users:
        report["users"][users] = time_users(package, users, w, args.iters)
        (args.out / "shape_graph_bound.json").write_text(json.dumps(report, indent=2))
        torch.cuda.empty_cache()
    print(json.dumps({u: {k: r[k] for k in ("copied_bytes", "call_ms", "request_ms")} for u, r in report["users"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
