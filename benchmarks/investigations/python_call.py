"""What calling a compiled program costs Python, per request: the loader's keyword call (the call spec read
once, runtimes/aoti.py ``_Serialised``) against torch's own wrapper (the spec read and parsed, the arguments
flattened, on every call), same process, in turn.

    PYTHONPATH=$PWD python benchmarks/investigations/python_call.py --out FILE [--batches 1 8 32]

The package and requests are cpp_kv_cache.py's ``long`` workload (dlrmv3 shapes, bf16, --kv-cache; history
4096 of which 3968 cached, 256 candidates). Per batch size: the whole request without cache
(``predictor(request)``) and a KV hit (``predictor.kv_cache()``, the prefix run untimed before each call),
synchronised, p50 of --iters calls, the two ways of calling in turn over three rounds. Also a cProfile of
1-user hits (the keyword call), top 30 by internal time, beside FILE. Writes FILE (JSON).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpp_kv_cache import export_package, prefix_of, python_latency
from kv_cache import WORKLOADS, request

import hstu_export
from hstu_export.runtimes.aoti import _Serialised


def programs() -> list[_Serialised]:
    return [obj for obj in gc.get_objects() if isinstance(obj, _Serialised)]


def calling(keyword: bool, saved: dict[int, object]) -> None:
    """Every loaded program called the keyword way (as loaded) or through torch's wrapper."""
    for program in programs():
        saved.setdefault(id(program), program._keywords)
        program._keywords = saved[id(program)] if keyword else None


def batch_row(predictor, model, batch: int, iters: int, saved: dict[int, object], out: Path) -> dict:  # type: ignore[no-untyped-def]
    work = WORKLOADS["long"]
    whole = request(model, work, batch, 100 + batch)
    prefix, users = prefix_of(whole, work, batch), list(range(batch))
    ranker = predictor.kv_cache(cuda_graphs=True)
    rounds: dict[str, list[float]] = {}
    with torch.no_grad():
        ranker(prefix, users), ranker(whole, users)  # the programs loaded, the buckets captured
        for _ in range(3):
            for keyword in (True, False):
                calling(keyword, saved)
                tag = "keyword" if keyword else "torch_wrapper"
                rounds.setdefault(f"no_cache_{tag}", []).append(
                    python_latency(lambda: predictor(whole), iters)["p50_ms"])
                rounds.setdefault(f"kv_hit_{tag}", []).append(
                    python_latency(lambda: ranker(whole, users), iters, before=lambda: ranker(prefix, users))["p50_ms"])
        calling(True, saved)
        row: dict = {name: {"rounds_p50_ms": [round(v, 3) for v in values], "median_ms": round(statistics.median(values), 3)}
                     for name, values in rounds.items()}
        for path in ("no_cache", "kv_hit"):
            row[f"{path}_wrapper_over_keyword"] = round(
                row[f"{path}_torch_wrapper"]["median_ms"] / row[f"{path}_keyword"]["median_ms"], 3)
        if batch == 1:
            profile = cProfile.Profile()
            for _ in range(50):
                ranker(prefix, users)
                profile.enable()
                ranker(whole, users)
                torch.cuda.synchronize()
                profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
            out.with_name(out.stem + "_profile_1_user_hit.txt").write_text(text.getvalue())
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model, package, result["export_seconds"] = export_package("long", max(args.batches), Path(tmp))
        predictor = hstu_export.load(package)
        saved: dict[int, object] = {}
        for batch in args.batches:
            result["batches"][str(batch)] = batch_row(predictor, model, batch, args.iters, saved, args.out)
            gc.collect()
            torch.cuda.empty_cache()
            args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
