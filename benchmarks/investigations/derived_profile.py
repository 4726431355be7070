"""Where the zoo's derived delta program spends its GPU time, against the written one: both "long" packages of
benchmarks/cpp_kv_cache.py (dlrmv3 shapes, bf16, Triton kernels, --kv-cache, max batch 32) exported in this run,
the derived one in a subprocess meanwhile. Per batch size, each package's cache (``hstu_export.load(...).kv_cache()``,
without CUDA graphs, so that each call's kernels are its own) serves a request of the workload's 4096 history tokens and 256 candidates a user, then
the same histories with new candidates (re-ranking: every user a hit) again and again, under torch.profiler.
With ``--runtime native`` the caches are the C++ runtime's (``NativePredictor(...).kv_cache()``, CUDA graphs as
served), built in this run: the profiler sees the runtime's own operators on the host too, so the tables and a
trace of a few calls (``derived_profile_<program>_<batch>.trace.json``) show where a call's host time goes.
With ``--grown`` each timed call is the grown-history hit of cpp_kv_cache.py's "long" workload instead: each user's
first 3968 history tokens served (untimed, outside the profile's count), then the whole 4096 and 256 candidates, 384
new rows a user; only the kernels that run between the whole request's start and its synchronised end are counted
(the host's table by self CPU time, with ``--runtime native``, holds the shorter requests too).

    PYTHONPATH=$PWD python benchmarks/investigations/derived_profile.py --out DIR [--batches 1 32] [--runtime native]
        [--grown]

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
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpp_kv_cache import export_package, prefix_of
from kv_cache import WORKLOADS, bench, request

import hstu_export
from hstu_export.runtimes.native import LIBRARY_NAME, NativePredictor

BENCHMARKS = Path(__file__).resolve().parent.parent
TIMED = "timed_call"  # the range of a --grown call's whole request


def timed_only(prof: profile, label: str) -> tuple[float, int, str]:
    """(GPU ms a call, kernels a call, the table by GPU time) of the profile's kernels that ran inside the ``label``
    ranges."""
    events = prof.events()
    # the host's ranges (the profiler also shows each on the GPU's timeline, spanning its kernels: left out)
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == label
              and e.device_type == DeviceType.CPU]
    totals: dict[str, list[float]] = {}
    for e in events:
        if (e.device_type == DeviceType.CUDA and e.name != label
                and any(lo <= e.time_range.start <= hi for lo, hi in ranges)):
            got = totals.setdefault(e.name, [0, 0.0])
            got[0] += 1
            got[1] += e.time_range.end - e.time_range.start
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
    calls = max(1, len(ranges))
    copies = [v for name, v in rows if name.startswith("Memcpy") or name.startswith("Memset")]
    copy_count, copy_us = sum(v[0] for v in copies), sum(v[1] for v in copies)
    kernels = int(sum(v[0] for _, v in rows) - copy_count) // calls
    total = sum(v[1] for _, v in rows)
    lines = [f"{len(ranges)} calls; a call: {(total - copy_us) / calls:.1f} µs in {kernels} kernels, "
             f"{copy_us / calls:.1f} µs in {int(copy_count) // calls} copies",
             "µs a call, in all, name"]
    lines += [f"{us / calls:9.2f} {n:6d}  {name[:110]}" for name, (n, us) in rows]
    return total / calls / 1e3, kernels, "\n".join(lines)


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
    parser.add_argument("--runtime", choices=["python", "native"], default="python")
    parser.add_argument("--grown", action="store_true", help="time the grown-history hit (3968 of 4096 cached)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp())
    building = subprocess.Popen(["bash", str(BENCHMARKS.parent / "runtimes/cpp/build.sh"), str(work_dir / "build")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if args.runtime == "native" else None
    derived_export = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / "cpp_kv_cache.py"), "--out", str(work_dir / "derived"), "--export-only", "long",
         "--batches", "32", "--kv-program", "derived"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    model, written, seconds = export_package("long", 32, work_dir / "written")
    log, _ = derived_export.communicate(timeout=1200)
    (args.out / "derived_export.log").write_text(log)
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "written_export_seconds": seconds,
                 "runtime": args.runtime, "batches": {}}
    if building is not None:
        build_log = building.communicate()[0]
        if building.returncode != 0:
            out["build_failed"] = build_log[-2000:]
            (args.out / "derived_profile.json").write_text(json.dumps(out, indent=2))
            return
    if derived_export.returncode != 0:
        out["derived_export_failed"] = log[-2000:]
        (args.out / "derived_profile.json").write_text(json.dumps(out, indent=2))
        return
    packages = {"written": written, "derived": Path(log.strip().splitlines()[-1])}
    work = dict(WORKLOADS["long"]) if args.grown else dict(WORKLOADS["long"], cached=WORKLOADS["long"]["history"])
    out["workload"] = work
    for batch in args.batches:
        whole = request(model, work, batch, 100 + batch)
        short = prefix_of(whole, work, batch) if args.grown else None
        users = list(range(batch))
        row: dict = {}
        for name, package in packages.items():
            if args.runtime == "native":
                ranker = NativePredictor(package, library=work_dir / "build" / LIBRARY_NAME).kv_cache()
            else:
                ranker = hstu_export.load(package).kv_cache(cuda_graphs=False)
            with torch.no_grad():
                ranker(whole, users)  # a miss: the histories cached

                def hit(r=ranker, w=whole, u=users) -> None:  # type: ignore[no-untyped-def]
                    r(w, u)

                def one_call(r=ranker, u=users, s=short) -> None:  # type: ignore[no-untyped-def]
                    """A hit; with ``--grown`` the shorter history first, outside the timed range."""
                    if s is None:
                        hit()
                        return
                    r(s, u)  # shorter than the cached history: stale, so that the whole request is a hit again
                    torch.cuda.synchronize()
                    with record_function(TIMED):
                        hit()
                        torch.cuda.synchronize()

                if short is None:
                    row[f"{name}_p50_ms"] = bench(hit, 30)["p50_ms"]
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        one_call()
                    torch.cuda.synchronize()
            gpu_ms, launches, table = gpu_table(prof, args.calls) if short is None else timed_only(prof, TIMED)
            if args.runtime == "native":
                table += "\n\nby self CPU time\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40,
                                                                             max_name_column_width=90)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as few:
                    for _ in range(3):
                        one_call()
                        torch.cuda.synchronize()
                few.export_chrome_trace(str(args.out / f"derived_profile_{name}_{batch}.trace.json"))
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
