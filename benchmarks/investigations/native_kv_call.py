"""Where a KV hit served through ``NativePredictor`` spends the time the C++ CLI does not: the "long" package of
benchmarks/cpp_kv_cache.py (dlrmv3 shapes, history 4096 of which 3968 cached, 256 candidates), the same two
requests (the prefix, recomputed each pass; the whole request, a hit, timed), three rounds in turn of

  cli        hstu-export-run --kv-cache auto --repeat N (the whole request's p50);
  native     NativePredictor(...).kv_cache() in a fresh process, the prefix run untimed before each call;
  threads1   the same with torch.set_num_threads(1);
  bare       the custom class's run method called directly (no wrapper, no dict copies);

then, in a fresh process, torch.profiler over N native calls: the host's operators by self time, and the calls'
device activity.

    PYTHONPATH=$PWD python benchmarks/investigations/native_kv_call.py --out DIR [--batch 1] [--iters 30]

Writes DIR/native_kv_call.json (each way's p50 per round) and DIR/native_kv_call_profile.txt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpp_kv_cache import LATENCY, REPO, export_package, prefix_of, python_latency
from kv_cache import WORKLOADS, request

from hstu_export.package.tensor_dir import load_tensors, save_tensors
from hstu_export.runtimes.native import LIBRARY_NAME, NativePredictor

WAYS = ("native", "threads1", "bare")


def serve(way: str, package: str, library: str, requests: list[str], iters: int, profile: Path | None) -> dict:
    """One way's p50 in this (fresh) process; with ``profile``, torch.profiler's tables written there."""
    if way == "threads1":
        torch.set_num_threads(1)
    steps = [load_tensors(path) for path in requests]
    users = list(range(int(steps[-1]["uih_lengths"].numel())))
    ranker = NativePredictor(package, library=library).kv_cache()
    for step in steps:
        ranker(step, users)
    if way == "bare":
        method = ranker._ranker.run
        whole, prefix = dict(steps[-1]), dict(steps[0])
        timed = python_latency(lambda: method(whole, users), iters, before=lambda: method(prefix, users))
    else:
        timed = python_latency(lambda: ranker(steps[-1], users), iters, before=lambda: ranker(steps[0], users))
    if profile is not None:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(iters):
                ranker(steps[0], users)
                torch.cuda.synchronize()
                with torch.profiler.record_function("whole_request"):
                    ranker(steps[-1], users)
                    torch.cuda.synchronize()
        table = prof.key_averages()
        profile.write_text("by self CPU time\n" + table.table(sort_by="self_cpu_time_total", row_limit=40) +
                           "\n\nby device time\n" + table.table(sort_by="self_device_time_total", row_limit=25))
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--serve", choices=[*WAYS, "profile"], help=argparse.SUPPRESS)
    parser.add_argument("--package", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    parser.add_argument("requests", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:  # in a fresh process: its p50 as JSON, last line
        profile = args.out / "native_kv_call_profile.txt" if args.serve == "profile" else None
        way = "native" if profile is not None else args.serve
        print(json.dumps(serve(way, args.package, args.library, args.requests, args.iters, profile)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    work_dir = Path("/tmp/native_kv_call")
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir()
    building = subprocess.Popen(["bash", str(REPO / "runtimes/cpp/build.sh"), str(work_dir / "build")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    model, package, _ = export_package("long", args.batch, work_dir)
    log = building.communicate()[0]
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
                    "iters": args.iters, "rounds": []}
    if building.returncode != 0:
        report["build"] = log[-2000:]
        (args.out / "native_kv_call.json").write_text(json.dumps(report, indent=2))
        return
    runner, library = work_dir / "build" / "hstu-export-run", work_dir / "build" / LIBRARY_NAME
    work = WORKLOADS["long"]
    whole = request(model, work, args.batch, 100 + args.batch)
    dirs = [str(save_tensors(step, work_dir / f"request{k}")) for k, step in enumerate([prefix_of(whole, work, args.batch),
                                                                                       whole])]
    ids = ",".join(str(u) for u in range(args.batch))

    def fresh(way: str) -> dict:
        done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--serve", way, "--package",
                               str(package), "--library", str(library), "--iters", str(args.iters), *dirs],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        try:
            return json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            return {"error": (done.stdout + done.stderr)[-1500:]}

    for _ in range(3):
        row: dict = {}
        done = subprocess.run([str(runner), str(package), *dirs, "--kv-cache", "auto", "--user-ids", ids, "--user-ids",
                               ids, "--repeat", str(args.iters), "--warmup", "5"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        found = LATENCY.findall(done.stdout)
        row["cli"] = {"p50_ms": float(found[-1][0])} if found else {"error": (done.stdout + done.stderr)[-1500:]}
        for way in WAYS:
            row[way] = fresh(way)
        report["rounds"].append(row)
        (args.out / "native_kv_call.json").write_text(json.dumps(report, indent=2))
    report["profile"] = fresh("profile")
    (args.out / "native_kv_call.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
