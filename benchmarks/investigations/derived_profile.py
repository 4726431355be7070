"""Where the zoo's derived delta program spends its GPU time, against the written one: both "long" packages of
benchmarks/cpp_kv_cache.py (dlrmv3 shapes, bf16, Triton kernels, --kv-cache, max batch 32) exported in this run,
the derived one in a subprocess meanwhile. Per batch size, each package's cache (``hstu_export.load(...).kv_cache()``,
without CUDA graphs, so that each call's kernels are its own) serves a request of the workload's 4096 history tokens and 256 candidates a user, then
the same histories with new candidates (re-ranking: every user a hit) again and again, under torch.profiler.

    PYTHONPATH=$PWD python benchmarks/investigations/derived_profile.py --out DIR [--batches 1 32]

Writes DIR/derived_profile.json (GPU time and kernel launches a call, the p50 of whole calls) and
DIR/derived_profile_<program>_<batch>.txt (the profiler's table by GPU time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpp_kv_cache import export_package
from kv_cache import WORKLOADS, bench, request

import hstu_export

BENCHMARKS = Path(__file__).resolve().parent.parent


def gpu_table(prof: profile, calls: int) -> tuple[float, int, str]:
    """(GPU ms a call, kernel launches a call, the table) of the profiled calls."""
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # the GPU's own events, not the ops launching them
    total_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in kernels)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    try:
        table = events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90)
    except Exception:  # an older profiler's key
        table = events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    return total_us / 1e3 / calls, launches // calls, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp())
    derived_export = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / "cpp_kv_cache.py"), "--out", str(work_dir / "derived"), "--export-only", "long",
         "--batches", "32", "--kv-program", "derived"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    model, written, seconds = export_package("long", 32, work_dir / "written")
    log, _ = derived_export.communicate(timeout=1200)
    (args.out / "derived_export.log").write_text(log)
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "written_export_seconds": seconds,
                 "batches": {}}
    if derived_export.returncode != 0:
        out["derived_export_failed"] = log[-2000:]
        (args.out / "derived_profile.json").write_text(json.dumps(out, indent=2))
        return
    packages = {"written": written, "derived": Path(log.strip().splitlines()[-1])}
    work = dict(WORKLOADS["long"], cached=WORKLOADS["long"]["history"])
    for batch in args.batches:
        whole = request(model, work, batch, 100 + batch)
        users = list(range(batch))
        row: dict = {}
        for name, package in packages.items():
            ranker = hstu_export.load(package).kv_cache(cuda_graphs=False)
            with torch.no_grad():
                ranker(whole, users)  # a miss: the histories cached

                def hit(r=ranker, w=whole, u=users) -> None:  # type: ignore[no-untyped-def]
                    r(w, u)

                row[f"{name}_p50_ms"] = bench(hit, 30)["p50_ms"]
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        hit()
                    torch.cuda.synchronize()
            gpu_ms, launches, table = gpu_table(prof, args.calls)
            row[f"{name}_gpu_ms_a_call"] = gpu_ms
            row[f"{name}_launches_a_call"] = launches
            row[f"{name}_stats"] = ranker.cache.stats()
            (args.out / f"derived_profile_{name}_{batch}.txt").write_text(table)
            del ranker
            torch.cuda.empty_cache()
        out["batches"][batch] = row
        (args.out / "derived_profile.json").write_text(json.dumps(out, indent=2))
        print(batch, json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
