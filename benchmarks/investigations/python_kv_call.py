"""Where a KV hit's host time goes in Python (``hstu_export.load(...).kv_cache()``): the "long" package of
benchmarks/kv_cache.py (dlrmv3 shapes, history 4096 of which 3968 cached, 256 candidates), one request served
again and again (after the first call each is a hit with the candidates as new tokens), timed, then under cProfile.
Also an A/B of how validation reads a feature's extremes (``hstu_export.package.schema._LISTED``: up to that many
values through a Python list, longer ones by a tensor reduction): three rounds in turn of the KV hit and the
no-cache call with 4096 (a 1-user history of 4096 read as lists) and with the code's value.

    PYTHONPATH=$PWD python benchmarks/investigations/python_kv_call.py --out DIR [--batches 1 8] [--cpu]

``--cpu`` serves the tiny preset exported on the CPU instead (fp32, --kv-cache; each user's whole history, 46
tokens, and 16 candidates): a package whose own runs are short, so that the tables show Python's work around them.

Writes DIR/python_kv_call.json (p50s) and DIR/python_kv_call_<batch>.txt (cProfile by own time and by cumulative
time, and torch.profiler's host table of the same calls).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpp_kv_cache import export_package
from kv_cache import WORKLOADS, bench, request

import hstu_export
from hstu_export.models.config import preset_config
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.package import schema


def tiny_cpu_package(work_dir: Path) -> tuple[HstuRankingModel, Path, dict]:
    """The tiny preset exported on the CPU with --kv-cache (AOTInductor, fp32), and its whole-request workload."""
    torch.manual_seed(0)
    model = HstuRankingModel(preset_config("tiny")).eval()
    cfg = model.config
    work = dict(history=cfg.max_history_len, cached=cfg.max_history_len, candidates=cfg.max_num_candidates)
    bundle = hstu_export.save_bundle(model, work_dir / "tiny.pt", request(model, work, 2, 1))
    settings = hstu_export.ExportSettings(backend="aoti", device="cpu", max_batch_size=8, kv_cache=True,
                                          verify=hstu_export.VerifySettings(num_random_batches=1))
    return model, Path(hstu_export.export(bundle, work_dir / "tiny.aoti", settings).path), work


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cpu", action="store_true", help="the tiny preset on the CPU (see above)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        model, package, work = tiny_cpu_package(Path(tempfile.mkdtemp()))
    else:
        (model, package, _), work = export_package("long", 32, Path(tempfile.mkdtemp())), WORKLOADS["long"]
    predictor = hstu_export.load(package)
    out: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "batches": {}}
    for batch in args.batches:
        whole = request(model, work, batch, 100 + batch)
        users = list(range(batch))
        ranker = predictor.kv_cache(budget_bytes=(64 << 20) if args.cpu else (8 << 30))
        ranker(whole, users)

        def hit(r=ranker, w=whole, u=users) -> None:  # type: ignore[no-untyped-def]
            r(w, u)

        row: dict = {"listed_ab": {}}
        code_value = schema._LISTED
        for _ in range(3):
            for listed in (4096, code_value):
                schema._LISTED = listed
                ab = row["listed_ab"].setdefault(str(listed), {"kv_p50_ms": [], "no_cache_p50_ms": []})
                ab["kv_p50_ms"].append(bench(hit, 50)["p50_ms"])
                ab["no_cache_p50_ms"].append(bench(lambda w=whole: predictor(w), 50)["p50_ms"])
        schema._LISTED = code_value
        text = io.StringIO()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            hit()
        synchronize()
        profile.disable()
        for order in ("tottime", "cumulative"):
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(45)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                hit()
            synchronize()
        text.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        (args.out / f"python_kv_call_{batch}.txt").write_text(text.getvalue())
        row["stats"] = ranker.cache.stats()
        out["batches"][str(batch)] = row
        (args.out / "python_kv_call.json").write_text(json.dumps(out, indent=1))
        print(batch, row, flush=True)


if __name__ == "__main__":
    main()
