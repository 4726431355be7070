"""Python's whole request with the compiled sparse half's prechecked model against its checked one, same run,
same package (``--prechecked-sparse``; docs/PERF.md).

    PYTHONPATH=$PWD python benchmarks/prechecked_sparse.py --out $OUT [--batches 1 8 32]

The package is benchmarks/kv_cache.py's dlrmv3-shaped one ("long" workload: history 4096, 256 candidates; bf16,
Triton kernels, --kv-cache), exported here on CUDA, where it gets the prechecked model by default. One predictor
runs the model the loader picks ("prechecked"); the other is the same predictor with its sparse half loaded as the
checked model ("model", what a stock loader runs). Per batch size,
three rounds in turn: the whole request from host tensors without cache (``predictor(request)``), and through each
predictor's own KV cache, the same request again (every user a hit: the 256 candidates are its new tokens).
Writes prechecked_sparse.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpp_kv_cache import export_package
from kv_cache import WORKLOADS, bench, request

import hstu_export
from hstu_export.runtimes.aoti import _sparse_constants, load_sparse_program


def checked_twin(package: Path):  # type: ignore[no-untyped-def]
    """``package`` loaded with its sparse half as the checked model."""
    predictor = hstu_export.load(package)
    split = predictor.split
    if split is None or split.sparse_model != "prechecked":
        raise SystemExit(f"{package}: its sparse half has no prechecked model to compare (export on CUDA, or with "
                         "--prechecked-sparse on)")
    manifest = predictor.manifest
    from hstu_export.package.manifest import backend_fields

    fields = backend_fields(manifest, package)
    split.sparse = load_sparse_program(package, fields, manifest["backend"]["meta"].get("sparse_program"),
                                       _sparse_constants(manifest), predictor.device)
    split.sparse_model = "model"
    return predictor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = WORKLOADS["long"]
    model, package, seconds = export_package("long", max(args.batches), Path(tempfile.mkdtemp()))
    predictors = {"prechecked": hstu_export.load(package), "model": checked_twin(package)}
    assert predictors["prechecked"].split.sparse_model == "prechecked"
    out: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "torch": torch.__version__, "export_s": seconds, "iters": args.iters, "batches": {}}
    for batch in args.batches:
        whole = request(model, work, batch, 100 + batch)
        users = list(range(batch))
        rankers = {label: p.kv_cache(budget_bytes=8 << 30) for label, p in predictors.items()}
        answers = {label: p(whole) for label, p in predictors.items()}
        rounds: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for label, predictor in predictors.items():
                rounds.setdefault(f"{label}_no_cache", []).append(
                    bench(lambda p=predictor, w=whole: p(w), args.iters)["p50_ms"])
                ranker = rankers[label]
                ranker(whole, users)  # the first call fills the cache; the timed ones are hits
                rounds.setdefault(f"{label}_kv", []).append(
                    bench(lambda r=ranker, w=whole, u=users: r(w, u), args.iters)["p50_ms"])
        row = {"rounds_p50_ms": rounds, "p50_ms": {k: statistics.median(v) for k, v in rounds.items()},
               "answers_equal": all(torch.equal(answers["prechecked"][k], answers["model"][k]) for k in answers["model"]),
               "hits": {label: r.cache.stats()["hits"] for label, r in rankers.items()}}
        row["model_over_prechecked"] = {what: row["p50_ms"][f"model_{what}"] / row["p50_ms"][f"prechecked_{what}"]
                                        for what in ("no_cache", "kv")}
        out["batches"][str(batch)] = row
        (args.out / "prechecked_sparse.json").write_text(json.dumps(out, indent=1))
        print(batch, json.dumps(row["p50_ms"]), row["model_over_prechecked"], flush=True)


if __name__ == "__main__":
    main()
