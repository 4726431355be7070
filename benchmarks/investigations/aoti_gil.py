"""Whether a call of an AOTInductor program holds Python's interpreter lock (GIL) while it runs: a pure-Python
counting loop timed alone for a second, then beside a thread that calls the program over and over, and beside a
thread that calls ``torch.mm`` (which releases the lock). A call that releases the lock leaves the counting thread
what the machine's cores leave it; one that holds it, only the gaps between calls. Both of the loader's entries are
tried (``boxed_run``, which the Python runtime calls, and ``run``), in rounds.

    PYTHONPATH=$PWD python benchmarks/investigations/aoti_gil.py --out DIR [--package PKG] [--rounds 3]

PKG: a CPU AOTInductor package (default: the zoo's tiny model, exported on the CPU into DIR); its dense program is
called with the inputs a request of 4 users gives it. CUDA programs are not covered: there a call returns once its
kernels are launched, and a thread of its own first needs the device's context made current. Writes
DIR/aoti_gil.json: per round and entry, the counting loop's count beside the calls divided by its count alone, and
each entry's mean call in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hstu_export
from hstu_export.models import build_preset


def count_for(seconds: float) -> int:
    end, count = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        count += 1
    return count


def share_beside(call: Callable[[], Any], seconds: float) -> float:
    """The counting loop's count beside a thread looping on ``call``, over its count alone."""
    alone = count_for(seconds)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            call()

    worker = threading.Thread(target=loop)
    worker.start()
    time.sleep(0.05)
    beside = count_for(seconds)
    stop.set()
    worker.join()
    return beside / alone


def mean_ms(call: Callable[[], Any], times: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(times):
        call()
    return (time.perf_counter() - start) / times * 1e3


def dense_call(package: Path) -> tuple[Any, list[torch.Tensor]]:
    """The package's compiled dense program (AOTInductor's loader) and the inputs a 4-user request gives it."""
    predictor = hstu_export.load(package)
    runner = predictor._runner
    program = runner.dense
    seen: dict[str, torch.Tensor] = {}

    def record(**inputs: torch.Tensor) -> Any:
        seen.update(inputs)
        return program(**inputs)

    runner.dense = record
    predictor(hstu_export.generate_batch(predictor.input_schema, 4, seed=1))
    runner.dense = program
    return program._fn.loader, [seen[name] for name in program._keywords]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--package", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    package = args.package
    if package is None:
        model = build_preset("tiny", seed=0)
        bundle = hstu_export.save_bundle(model, args.out / "tiny.pt",
                                         hstu_export.generate_batch(model.input_schema(), 3, seed=1))
        package = hstu_export.export(bundle, args.out / "tiny.aoti", hstu_export.ExportSettings(max_batch_size=4)).path
    loader, inputs = dense_call(package)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    calls: dict[str, Callable[[], Any]] = {
        "boxed_run": lambda: loader.boxed_run(list(inputs)),
        "run": lambda: loader.run(list(inputs)),
        "torch_mm": lambda: torch.mm(a, b),
    }
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    results: dict[str, Any] = {"machine": {"cpu_count": os.cpu_count(), "gpu": gpu, "platform": platform.platform(),
                                           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")},
                               "package": str(package), "call_ms": {name: mean_ms(call) for name, call in calls.items()},
                               "rounds": []}
    for _ in range(args.rounds):
        results["rounds"].append({name: round(share_beside(call, args.seconds), 3) for name, call in calls.items()})
    results["median_share"] = {name: statistics.median(r[name] for r in results["rounds"]) for name in calls}
    (args.out / "aoti_gil.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({"call_ms": results["call_ms"], "median_share": results["median_share"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
