"""What calling the C++ runtime from Python costs a request: one package, one request, timed four ways, in turn
over rounds: ``hstu-export-run --repeat`` (the CLI, no Python), ``NativePredictor`` (hstu_export.serving.native),
its custom-class method called bare (no wrapper), and ``hstu_export.load``.

    PYTHONPATH=$PWD python benchmarks/investigations/native_call.py --out DIR [--preset tiny] [--users 1]

The package: the preset exported here on AOTInductor (CUDA when there is one, bf16; else CPU, fp32), the C++
runtime built into DIR/build (or --build). Every call is synchronised after it (the CLI does the same per
request), p50 of --iters calls; a round times each way once, the Python ways in a fresh process (not the one
that exported). Also a torch.profiler table of NativePredictor calls (host side, top 25 by self time) beside
DIR/native_call.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import hstu_export
from hstu_export.cli import main as cli_main
from hstu_export.models import build_preset
from hstu_export.package.tensor_dir import load_tensors
from hstu_export.serving.native import LIBRARY_NAME, NativePredictor

REPO = Path(__file__).resolve().parents[2]
LATENCY = re.compile(r"p50 ([0-9.]+) ms, p99 ([0-9.]+) ms")


def timed(call, iters: int) -> float:  # type: ignore[no-untyped-def]
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_in_child(out: Path, package: Path, library: Path, iters: int, profile: bool) -> None:
    """One round of the Python ways, in this (fresh) process; prints their p50s as one JSON line."""
    cuda = torch.cuda.is_available()
    request = load_tensors(out / "request")
    native = NativePredictor(package, library=library)
    python = hstu_export.load(package)
    bare = dict(request)
    ways = {"native_predictor": lambda: native(request), "custom_class_method": lambda: native._package.run(bare),
            "hstu_export_load": lambda: python(request)}
    for call in ways.values():  # warm-up: kernels loaded, the allocator grown
        timed(call, 30)
    result = {name: round(timed(call, iters), 4) for name, call in ways.items()}
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(50):
                native(request)
                if cuda:
                    torch.cuda.synchronize()
        (out / "native_call_profile.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total",
                                                                                row_limit=25))
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--users", type=int, default=1)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--build", type=Path, help="the C++ runtime's build directory (default: DIR/build)")
    parser.add_argument("--time-in-child", nargs=2, type=Path, metavar=("PACKAGE", "LIBRARY"), help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time_in_child:
        time_in_child(args.out, *args.time_in_child, args.iters, args.profile)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    build = subprocess.Popen(["bash", str(REPO / "runtimes/cpp/build.sh"), str(args.build or args.out / "build")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHON": sys.executable})
    model = build_preset(args.preset, seed=1).eval()
    bundle = hstu_export.save_bundle(model, args.out / "m.pt", hstu_export.generate_batch(model.input_schema(), 2, seed=1))
    settings = hstu_export.ExportSettings(backend="aoti", device="cuda" if cuda else "cpu",
                                          dtype="bf16" if cuda else "fp32", op_target="triton" if cuda else "aten",
                                          max_batch_size=max(4, args.users),
                                          verify=hstu_export.VerifySettings(num_random_batches=1))
    start = time.perf_counter()
    package = Path(hstu_export.export(bundle, args.out / "m.aoti", settings).path)
    report: dict = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "preset": args.preset, "users": args.users,
                    "iters": args.iters, "export_seconds": round(time.perf_counter() - start, 1)}
    built = build.communicate()[0]
    if build.returncode != 0:
        report["build_error"] = built[-3000:]
        (args.out / "native_call.json").write_text(json.dumps(report, indent=2))
        raise SystemExit(built[-3000:])
    runner = (args.build or args.out / "build") / "hstu-export-run"
    assert cli_main(["request", str(package), "--out", str(args.out / "request"), "--batch-size", str(args.users),
                     "--seed", "3"]) == 0
    # The Python ways run in a fresh process each round, as a server's would: not in this one, which exported.
    child = [sys.executable, __file__, "--out", str(args.out), "--iters", str(args.iters), "--time-in-child",
             str(package), str(runner.parent / LIBRARY_NAME)]
    rounds: dict[str, list[float]] = {"cli": []}
    for index in range(args.rounds):
        done = subprocess.run([str(runner), str(package), str(args.out / "request"), "--repeat", str(args.iters),
                               "--warmup", "30"], capture_output=True, text=True, timeout=600)
        found = LATENCY.findall(done.stdout + done.stderr)
        rounds["cli"].append(float(found[-1][0]) if found else float("nan"))
        if not found:
            report["cli_output"] = (done.stdout + done.stderr)[-2000:]
        timed_child = subprocess.run(child + (["--profile"] if index == 0 else []), capture_output=True, text=True,
                                     timeout=600)
        try:
            for name, value in json.loads(timed_child.stdout.strip().splitlines()[-1]).items():
                rounds.setdefault(name, []).append(value)
        except (ValueError, IndexError):
            report["child_output"] = (timed_child.stdout + timed_child.stderr)[-3000:]
    report["p50_ms_per_round"] = rounds
    report["p50_ms"] = {name: statistics.median(values) for name, values in rounds.items()}
    report["over_cli"] = {name: round(value / report["p50_ms"]["cli"], 3) for name, value in report["p50_ms"].items()}
    (args.out / "native_call.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("gpu", "p50_ms", "over_cli")}))


if __name__ == "__main__":
    main()
