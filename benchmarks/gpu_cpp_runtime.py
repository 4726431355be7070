"""The C++ runtime on the GPU machine: build it against that machine's torch, export CUDA AOTInductor
packages of the zoo's presets, and compare the C++ runtime with ``hstu_export.load`` on the same requests:
outputs (bit for bit) and latency (median and p99 of full calls, request on the host, synchronised),
measured in the same run.

    PYTHONPATH=$PWD python benchmarks/gpu_cpp_runtime.py --out $OUT [--presets tiny dlrmv3] [--iters 50]

Writes gpu_cpp_runtime.json (each step's result or error; written after every step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

import hstu_export
from hstu_export.models import build_preset
from hstu_export.package.tensor_dir import load_tensors, save_tensors
from hstu_export.runtimes.aoti import package_op_libraries

REPO = Path(__file__).resolve().parent.parent
# The dlrmv3 workload (B up to 32, histories up to 2048, 2048 candidates); tiny for a quick check.
SETTINGS = {"tiny": dict(max_batch_size=16, dtype="fp32"), "dlrmv3": dict(max_batch_size=32, dtype="bf16")}
BATCHES = {"tiny": [1, 16], "dlrmv3": [1, 8, 32]}


def python_latency(predictor, request: dict, iters: int, warmup: int) -> dict:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        predictor(request)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        predictor(request)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {"p50_ms": statistics.median(times), "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))]}


def cpp_latency(runner: Path, package: Path, request_dir: Path, iters: int, warmup: int) -> dict:
    done = subprocess.run([str(runner), str(package), str(request_dir), "--repeat", str(iters), "--warmup", str(warmup)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-2000:]}
    found = re.search(r"p50 ([0-9.]+) ms, p99 ([0-9.]+) ms", done.stdout)
    return {"p50_ms": float(found.group(1)), "p99_ms": float(found.group(2))} if found else {"error": done.stdout[-2000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--presets", nargs="+", default=["tiny", "dlrmv3"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/cpp_runtime_gpu")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "tools": {t: shutil.which(t) for t in ("cmake", "c++", "nvcc")}, "presets": {}}

    def save() -> None:
        (args.out / "gpu_cpp_runtime.json").write_text(json.dumps(report, indent=2))

    # 1. Build the runtime against this torch.
    start = time.perf_counter()
    build = subprocess.run(["bash", str(REPO / "runtimes/cpp/build.sh"), str(work / "build")],
                           capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    report["build"] = {"returncode": build.returncode, "seconds": round(time.perf_counter() - start, 1),
                       "tail": (build.stdout + build.stderr)[-3000:]}
    save()
    runner = work / "build" / "hstu-export-run"
    if build.returncode != 0:
        return

    # 2. Per preset: export, then Python vs C++ on the same requests.
    for preset in args.presets:
        entry: dict = {}
        report["presets"][preset] = entry
        try:
            model = build_preset(preset, seed=0)
            bundle = hstu_export.save_bundle(model, work / f"{preset}.pt",
                                             hstu_export.generate_batch(model.input_schema(), 4, seed=1))
            settings = hstu_export.ExportSettings(backend="aoti", device="cuda", op_target="triton",
                                                  verify=hstu_export.VerifySettings(num_random_batches=1),
                                                  **SETTINGS[preset])
            start = time.perf_counter()
            result = hstu_export.export(bundle, work / f"{preset}.aoti", settings)
            entry["export_seconds"] = round(time.perf_counter() - start, 1)
            entry["parity_worst"] = result.parity.get("worst")
            entry["op_libraries"] = result.manifest["op_libraries"]
            entry["dense_calls_at_run_time"] = sorted(package_op_libraries(result.path / "dense" / "dense.pt2"))
            predictor = hstu_export.load(result.path)
            entry["batches"] = []
            save()
            for size in BATCHES[preset]:
                request = hstu_export.generate_batch(predictor.input_schema, size, seed=100 + size)
                request_dir = save_tensors(request, work / f"{preset}-req-{size}")
                candidates = [f.name for f in predictor.input_schema.features if f.semantic == "candidate_count"]
                row: dict = {"batch_size": size, "candidates": sum(int(request[n].sum()) for n in candidates)}
                done = subprocess.run([str(runner), str(result.path), str(request_dir), "--out",
                                       str(work / f"{preset}-out-{size}"), "-q"], capture_output=True, text=True,
                                      timeout=600)
                if done.returncode != 0:
                    row["cpp_error"] = done.stderr.strip()[-2000:]
                    entry["batches"].append(row)
                    save()
                    continue
                cpp = load_tensors(work / f"{preset}-out-{size}")
                python = {k: v.cpu() for k, v in predictor(request).items()}
                row["bit_for_bit"] = all(torch.equal(cpp[k], python[k]) for k in python)
                row["max_abs_diff"] = max(float((cpp[k].float() - python[k].float()).abs().max()) for k in python)
                row["python"] = python_latency(predictor, request, args.iters, args.warmup)
                row["cpp"] = cpp_latency(runner, result.path, request_dir, args.iters, args.warmup)
                if "p50_ms" in row["cpp"]:
                    row["cpp_over_python_p50"] = row["cpp"]["p50_ms"] / row["python"]["p50_ms"]
                entry["batches"].append(row)
                save()
        except Exception as exc:  # recorded, the next preset still runs
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            entry["traceback"] = traceback.format_exc()[-3000:]
            save()


if __name__ == "__main__":
    main()
