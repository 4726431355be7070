"""CUDA graph captures beside a thread that serves: what each of CUDA's capture modes lets the other thread do.

One thread captures and replays small graphs without pause (as a KV cache's graph cache does for each new
shape bucket); another serves: a product, its sum read back to the host, and a fresh allocation (as a worker
reading its answer does). In CUDA's global mode, torch's default, a capture forbids every thread of the process
the calls that could break it; in thread-local mode (runtimes/kv_graphs.py CAPTURE_MODE, the C++ runtime's
kv_graphs.cpp) only its own. Each pairing runs in a process of its own, so one that aborts is recorded, not fatal.

    PYTHONPATH=$PWD python benchmarks/investigations/capture_threads.py --out FILE [--seconds 10] [--serving DIR]

Pairings: both threads on cuda:0, and with two GPUs the capturing thread on cuda:0 and the serving one on cuda:1
(a ReplicaSet's replicas as threads). Writes, per mode and pairing, each side's calls and failures, the first
failures' messages, and the process's exit status. With --serving, also the real thing in each mode: the tiny
preset exported with --kv-cache into DIR, served by a ReplicaSet of three worker threads with CUDA graphs on,
four clients sending requests of random users and sizes (new shape buckets keep being captured while the other
workers run sparse halves, whose range checks read back to the host).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


def run_for(threads: list[threading.Thread], stop: threading.Event, seconds: float) -> None:
    """Starts ``threads``, lets them run ``seconds``, then sets ``stop`` and waits for them."""
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()


def trial(mode: str, capture_device: int, serve_device: int, seconds: float) -> dict:
    stop = threading.Event()
    counts = {"captures": 0, "capture_failures": 0, "served": 0, "serve_failures": 0}
    messages: dict[str, list[str]] = {"capture": [], "serve": []}
    lock = threading.Lock()
    ready = threading.Event()  # the capturing thread has warmed up

    def failed(side: str, exc: BaseException) -> None:
        with lock:
            counts[f"{side}_failures"] += 1
            if len(messages[side]) < 3:
                messages[side].append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    def body(x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(20):
            y = torch.tanh(y @ x)
        return y

    def capture() -> None:
        torch.cuda.set_device(capture_device)
        x = torch.randn(256, 256, device="cuda") / 16
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warmed up outside a capture (cuBLAS's handle and workspace), as documented
            body(x)
        torch.cuda.current_stream().wait_stream(side)
        ready.set()
        while not stop.is_set():
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode=mode):
                    body(x)
                graph.replay()
                with lock:
                    counts["captures"] += 1
            except Exception as exc:
                failed("capture", exc)

    def serve() -> None:
        torch.cuda.set_device(serve_device)
        a = torch.randn(512, 512, device="cuda")
        (a @ a).sum().item()
        ready.wait()
        size = 1
        while not stop.is_set():
            try:
                (a @ a).sum().item()
                size = size * 3 % 10007 + 1
                torch.empty(size * 1024, device="cuda")
                with lock:
                    counts["served"] += 1
            except Exception as exc:
                failed("serve", exc)

    run_for([threading.Thread(target=capture), threading.Thread(target=serve)], stop, seconds)
    try:
        torch.cuda.synchronize()
        after = "ok"
    except Exception as exc:  # a capture left unfinished on its stream
        after = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return {**counts, "messages": messages, "synchronize_after": after}


def serving_trial(mode: str, package: str, seconds: float) -> dict:
    import random

    import hstu_export
    import hstu_export.runtimes.kv_graphs as kv_graphs
    from hstu_export.serving.replicas import ReplicaSet

    kv_graphs.CAPTURE_MODE = mode
    schema = hstu_export.load(package).input_schema
    counts = {"answered": 0, "failed": 0}
    messages: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    with ReplicaSet(package, ["cuda:0"], kv_cache_bytes="1GiB", kv_cuda_graphs=True, workers=3) as replicas:
        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                users = rng.randint(1, 4)
                request = hstu_export.generate_batch(schema, users, seed=rng.randrange(1 << 30))
                try:
                    replicas.submit(request, [rng.randrange(64) for _ in range(users)]).result(timeout=120)
                    with lock:
                        counts["answered"] += 1
                except Exception as exc:
                    with lock:
                        counts["failed"] += 1
                        if len(messages) < 3:
                            messages.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

        run_for([threading.Thread(target=client, args=(seed,)) for seed in range(4)], stop, seconds)
        stats = replicas.stats()
    return {**counts, "messages": messages, "kv_cache": stats[0].get("kv_cache")}


def export_kv_package(work: Path) -> Path:
    import hstu_export
    from hstu_export import ExportSettings, VerifySettings
    from hstu_export.models import build_preset

    model = build_preset("tiny", seed=0)
    bundle = hstu_export.save_bundle(model, work / "model.pt", hstu_export.generate_batch(model.input_schema(), 4, seed=1))
    settings = ExportSettings(backend="aoti", device="cuda", max_batch_size=8, kv_cache=True, kv_page_size=16,
                              verify=VerifySettings(num_random_batches=1))
    return Path(hstu_export.export(bundle, work / "tiny_kv.aoti", settings).path)


def run_trial(args: argparse.Namespace, trial_args: list[str]) -> dict:
    """One trial in a process of its own: its JSON line, or how the process ended."""
    done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--seconds", str(args.seconds),
                           *trial_args], capture_output=True, text=True, timeout=args.seconds + 300)
    row: dict = {"returncode": done.returncode}
    lines = done.stdout.strip().splitlines()
    try:
        row.update(json.loads(lines[-1]))
    except (IndexError, json.JSONDecodeError):
        row["stderr"] = done.stderr[-1500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--serving", type=Path, help="also serve a KV package exported into this folder")
    parser.add_argument("--trial", nargs=3, help=argparse.SUPPRESS)  # MODE CAPTURE_DEVICE SERVE_DEVICE: one pairing
    parser.add_argument("--serving-trial", nargs=2, help=argparse.SUPPRESS)  # MODE PACKAGE
    args = parser.parse_args()
    if args.trial:
        mode, capture_device, serve_device = args.trial
        print(json.dumps(trial(mode, int(capture_device), int(serve_device), args.seconds)))
        return
    if args.serving_trial:
        print(json.dumps(serving_trial(args.serving_trial[0], args.serving_trial[1], args.seconds)))
        return
    pairings = [(0, 0)] + ([(0, 1)] if torch.cuda.device_count() > 1 else [])
    report: dict = {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "seconds": args.seconds,
                    "trials": []}
    for mode in ("global", "thread_local"):
        for capture_device, serve_device in pairings:
            row = {"mode": mode, "capture_device": capture_device, "serve_device": serve_device,
                   **run_trial(args, ["--trial", mode, str(capture_device), str(serve_device)])}
            report["trials"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("messages", "stderr")}), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    if args.serving:
        args.serving.mkdir(parents=True, exist_ok=True)
        package = export_kv_package(args.serving)
        report["serving"] = []
        for mode in ("global", "thread_local"):
            row = {"mode": mode, **run_trial(args, ["--serving-trial", mode, str(package)])}
            report["serving"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "stderr"}), file=sys.stderr)
            args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
