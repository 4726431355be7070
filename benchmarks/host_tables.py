"""Tables in host memory for a CUDA package (``load(PKG, tables_device="cpu")``, ``hstu-export-run --tables-device
cpu``): a table larger than the process's GPU memory budget serves, and what each request costs against tables on
the device, same run.

    PYTHONPATH=$PWD python benchmarks/host_tables.py --out $OUT [--rows 8000000] [--dim 64] [--budget-gib 1]
        [--max-history 46] [--max-candidates 16] [--no-cpp]

Exports the tiny preset on CUDA (aoti, fp32) with its item table widened to ROWS x DIM (8M x 64: 2 GiB), and its
users' history and candidates up to MAX_HISTORY and MAX_CANDIDATES items (the rows each request gathers), then:
  1. Python, no budget: the whole request at 1 / 8 / 32 users, tables on the device against tables in pinned host
     memory (the program's gathers read them over the bus); answers compared bit for bit.
  2. A process whose GPU memory is capped below the table (torch.cuda.set_per_process_memory_fraction): tables on
     the device must fail to load; tables on the host must serve, with the answers of step 1.
  3. The item table's gather alone, per request: on the device, by the GPU over the bus, and by the CPU into a
     pinned buffer shipped to the device (the two ways host tables can be read).
  4. The C++ runtime (built here), both ways, same requests: its answers against Python's, and its latency.
Writes host_tables.json to OUT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32)


def _requests(schema, batches):  # type: ignore[no-untyped-def]
    import hstu_export

    return {b: hstu_export.generate_batch(schema, b, seed=100 + b) for b in batches}


def _timed(predictor, request, iters: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        predictor(request)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        predictor(request)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 4)


def export_package(work: Path, rows: int, dim: int, max_history: int, max_candidates: int) -> Path:
    import dataclasses

    import hstu_export
    from hstu_export import ExportSettings, VerifySettings
    from hstu_export.models import HstuRankingModel, preset_config

    config = dataclasses.replace(preset_config("tiny"), item_vocab_size=rows, embedding_dim=dim,
                                 max_history_len=max_history, max_num_candidates=max_candidates)
    torch.manual_seed(0)
    model = HstuRankingModel(config).eval()
    bundle = hstu_export.save_bundle(model, work / "model.pt",
                                     hstu_export.generate_batch(model.input_schema(), 4, seed=6))
    settings = ExportSettings(backend="aoti", device="cuda", max_batch_size=32,
                              verify=VerifySettings(num_random_batches=1))
    return Path(hstu_export.export(bundle, work / "pkg", settings).path)


def gathers(package: Path, requests: dict, iters: int) -> dict:
    """The item table's gather alone, three ways, per request: on the device; by the GPU from pinned host memory
    over the bus (what tables_device="cpu" does); by the CPU into a pinned buffer then copied to the device."""
    from hstu_export.package.directory import load_manifest
    from hstu_export.package.tables import read_tables
    from hstu_export.runtimes.aoti import _pinned_for

    constants = load_manifest(package).artifacts["sparse"]["constants"]
    spec = next(t for t in constants["tensors"] if t["name"].endswith("item.weight"))
    table = read_tables(package / constants["file"], constants["tensors"], "tables")[spec["name"]].clone()  # resident
    on_device, over_bus = table.cuda(), _pinned_for(table, torch.device("cuda"))

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return round(statistics.median(times), 4)

    def cpu_gather(ids: torch.Tensor, shipped: torch.Tensor) -> torch.Tensor:
        torch.index_select(table, 0, ids, out=shipped)
        return shipped.to("cuda", non_blocking=True)

    out: dict = {"cpu_threads": torch.get_num_threads()}
    for b, request in requests.items():
        ids = torch.cat([request["uih_item_ids"], request["candidate_item_ids"]]).long().cpu()
        ids_cuda = ids.cuda()
        shipped = torch.empty((ids.numel(), table.size(1)), dtype=table.dtype).pin_memory()
        reference = on_device.index_select(0, ids_cuda).cpu()
        assert torch.equal(cpu_gather(ids, shipped).cpu(), reference)
        assert torch.equal(over_bus.index_select(0, ids_cuda).cpu(), reference)
        out[b] = {"rows": ids.numel(), "mib": round(ids.numel() * table.size(1) * table.element_size() / 2**20, 2),
                  "device_ms": timed(lambda i=ids_cuda: on_device.index_select(0, i)),
                  "gpu_over_bus_ms": timed(lambda i=ids_cuda: over_bus.index_select(0, i)),
                  "cpu_gather_and_copy_ms": timed(lambda i=ids, o=shipped: cpu_gather(i, o))}
    return out


def budget_child(package: Path, answers_file: Path, budget_gib: float, iters: int) -> dict:
    """Step 2, in its own process: the budget applies to everything this process allocates on the GPU."""
    import hstu_export

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget_gib * (1 << 30) / total)
    out: dict = {"budget_gib": budget_gib}
    try:
        hstu_export.load(package)
        out["device_tables"] = "loaded (the budget did not stop it)"
    except Exception as exc:  # the expected failure: the table does not fit the budget
        out["device_tables"] = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    torch.cuda.empty_cache()
    predictor = hstu_export.load(package, tables_device="cpu")
    expected = torch.load(answers_file)
    requests = _requests(predictor.input_schema, BATCHES)
    out["host_tables"] = {}
    for b, request in requests.items():
        answers = predictor(request)
        same = all(torch.equal(answers[n].cpu(), expected[b][n]) for n in expected[b])
        out["host_tables"][b] = {"equal_to_unbudgeted": same, "p50_ms": _timed(predictor, request, iters)}
    out["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / (1 << 30), 3)
    return out


def cpp_runs(package: Path, work: Path, requests: dict, expected: dict, report: dict) -> None:
    from hstu_export.package.tensor_dir import load_tensors, save_tensors

    built = subprocess.run(["bash", str(REPO / "runtimes/cpp/build.sh"), str(work / "build")], capture_output=True,
                           text=True)
    report["cpp_build"] = {"returncode": built.returncode, "tail": (built.stdout + built.stderr)[-800:]}
    if built.returncode != 0:
        return
    runner = work / "build" / "hstu-export-run"
    report["cpp"] = {}
    for b, request in requests.items():
        folder = save_tensors({k: v.cpu() for k, v in request.items()}, work / f"request{b}")
        for where in ("cuda", "cpu"):
            out_dir = work / f"cpp-{where}-{b}"
            done = subprocess.run([str(runner), str(package), str(folder), "--tables-device", where, "--out",
                                   str(out_dir), "--repeat", "100", "--warmup", "10"],
                                  capture_output=True, text=True, timeout=300)
            latency = [line for line in done.stdout.splitlines() if line.startswith("latency over")]
            row = {"returncode": done.returncode, "latency": latency[-1] if latency else None,
                   "stderr": done.stderr[-400:]}
            if done.returncode == 0:
                answers = load_tensors(out_dir)
                row["equal_to_python"] = all(torch.equal(answers[n], expected[b][n]) for n in expected[b])
            report["cpp"][f"{where}-{b}"] = row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=8_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--max-history", type=int, default=46, help="most history items a user (the tiny preset's)")
    parser.add_argument("--max-candidates", type=int, default=16, help="most candidates a user (the tiny preset's)")
    parser.add_argument("--no-cpp", action="store_true", help="leave out step 4 (building the C++ runtime)")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--package", type=Path, help="serve this package (exported by an earlier run) instead")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # PACKAGE ANSWERS: step 2
    args = parser.parse_args()
    if args.child:
        print(json.dumps(budget_child(Path(args.child[0]), Path(args.child[1]), args.budget_gib, args.iters)))
        return

    import hstu_export

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/host_tables_work")  # the package and the bundle are GiBs: not under OUT, which comes back
    work.mkdir(exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "rows": args.rows, "dim": args.dim,
                    "max_history": args.max_history, "max_candidates": args.max_candidates,
                    "table_gib": round(args.rows * args.dim * 4 / (1 << 30), 3)}

    def save() -> None:
        (args.out / "host_tables.json").write_text(json.dumps(report, indent=2))

    start = time.perf_counter()
    package = args.package or export_package(work, args.rows, args.dim, args.max_history, args.max_candidates)
    report["export_s"] = round(time.perf_counter() - start, 1)
    save()

    device = hstu_export.load(package)
    allocated_device = torch.cuda.memory_allocated()
    requests = _requests(device.input_schema, BATCHES)
    expected = {b: {n: v.cpu() for n, v in device(r).items()} for b, r in requests.items()}
    host = hstu_export.load(package, tables_device="cpu")
    report["python"] = {}
    for b, request in requests.items():
        answers = host(request)
        report["python"][b] = {
            "equal": all(torch.equal(answers[n].cpu(), expected[b][n]) for n in expected[b]),
            "item_rows_gathered": int(request["uih_item_ids"].numel() + request["candidate_item_ids"].numel()),
            "device_tables_p50_ms": _timed(device, request, args.iters),
            "host_tables_p50_ms": _timed(host, request, args.iters),
        }
        row = report["python"][b]
        row["host_over_device"] = round(row["host_tables_p50_ms"] / row["device_tables_p50_ms"], 3)
    report["device_tables_allocated_gib"] = round(allocated_device / (1 << 30), 3)
    save()
    del device, host
    torch.cuda.empty_cache()

    torch.save(expected, work / "answers.pt")
    child = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--budget-gib", str(args.budget_gib),
                            "--iters", str(args.iters), "--child", str(package), str(work / "answers.pt")],
                           capture_output=True, text=True, timeout=600)
    try:
        report["budget"] = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        report["budget"] = {"returncode": child.returncode, "stderr": child.stderr[-1500:]}
    save()
    report["gathers"] = gathers(package, requests, args.iters)
    save()
    if not args.no_cpp:
        cpp_runs(package, work, requests, expected, report)
        save()
    print(json.dumps({k: v for k, v in report.items() if k != "cpp_build"}, indent=1))


if __name__ == "__main__":
    main()
