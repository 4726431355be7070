"""KV-cached serving of generative-recommenders' ``DlrmHSTU`` through its derived delta program, beside the zoo's
dlrmv3 through its own, on the "same history, new candidates" workload, timed in the same run.

    GR_SRC=/path/to/generative-recommenders PYTHONPATH=$PWD python benchmarks/gpu_kv_derived.py --out $OUT
    GR_SRC=... python benchmarks/gpu_kv_derived.py --out /tmp/kvd --small --device cpu   # a dry run on a CPU

- Packages: ``examples/generative_recommenders/gr_ranker.py`` at DLRMv3's dense shape (5 layers of d512, 4 heads
  of 128), exported with ``--kv-cache --attention-scale fixed:N`` (N: the longest sequence the ranges allow),
  traced on the CPU in fp32 (``--reference-device cpu``; its eager code needs fbgemm's CUDA ops, which the GPU
  machine lacks); the zoo's dlrmv3 with ``--kv-cache``. Both bf16, CUDA, the same ranges, the sparse half's
  prechecked model (on CUDA by default; asked for here so that a CPU dry run builds the same programs: a derived
  delta program then holds the sparse half), unverified at export
  (the corners on the CPU would take hours); checked here instead.
- Workload: per user a history of 4096 items, all cached by a first request, then a request with the same
  history and 256 new candidates (re-ranking: the case generative-recommenders' positions, counted from the end
  of the history, leave exact), at 1, 8 and 32 users.
- Check: the cached answer against the same package without the cache on the second request (rel. L2).
- Timed (median of CUDA-event-timed calls after warm-up): each package's no-cache dense half on the second
  request, and its cached dense half on it (the delta program alone on a filled cache; also replayed from its
  CUDA graph, as served, where there is one: the zoo's bucket graph, the GR program's exact-shape graph when it
  reads nothing from the device). The ratio per model, and the GR ratio over the zoo's. The whole request from
  Python, with and without the GR program's graphs.
- ``--only zoo zoo_derived``: the zoo's model also exported with ``--kv-program derived`` and timed as GR's is; its
  written program's served call over the derived one's (``zoo_derived_over_written``).
- ``--export-only``: export into ``--work`` and stop; processes exporting one model each side by side, then one
  ``--reuse`` run that times them all, fit the device's command limit.
- ``--cpp``: also the whole request through the C++ runtime (``hstu-export-run``, built in this run), p50 of
  ``--iters`` calls of the second request without the cache and cached (after the first request), with the phase
  times of a cached call (``cpp``, per users); and the same two through the C++ runtime called from Python in this
  process (``NativePredictor``, ``hstu_export.load(path, runtime="native")``; ``native``, per users).

Writes ``kv_derived.json`` into ``--out`` after every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "generative_recommenders"))
if os.environ.get("GR_SRC"):
    sys.path.insert(0, os.environ["GR_SRC"])

import gr_ranker  # noqa: E402  (after the paths)

import hstu_export  # noqa: E402
from hstu_export import ExportSettings, VerifySettings  # noqa: E402
from hstu_export.kv_derive import delta_row_inputs  # noqa: E402
from hstu_export.models.config import preset_config  # noqa: E402
from hstu_export.models.ranking import HstuRankingModel  # noqa: E402
from hstu_export.sources.schema_inference import flatten_example  # noqa: E402

DLRMV3 = {"dim": 512, "heads": 4, "layers": 5, "head_dim": 128, "preprocessor_dim": 256, "max_seq_len": 8192,
          "max_candidates": 2048}
SMALL = {"dim": 64, "heads": 2, "layers": 2, "head_dim": 32, "preprocessor_dim": 32, "max_seq_len": 512,
         "max_candidates": 64}
GR_CONTEXTUAL = 2  # gr_ranker's contextual features: user_id, user_active_degree


def workload(small: bool) -> dict[str, Any]:
    return ({"history": 32, "candidates": 8, "users": [1, 2, 4]} if small
            else {"history": 4096, "candidates": 256, "users": [1, 8, 32]})


def settings(device: str, w: dict[str, Any], **kwargs: Any) -> ExportSettings:
    return ExportSettings(backend="aoti", device=device, dtype="bfloat16" if device == "cuda" else "float32",
                          max_batch_size=max(w["users"]), force=True, kv_cache=True, prechecked_sparse="on",
                          verify=VerifySettings(enabled=False), **kwargs)


def export_gr(work: Path, device: str, small: bool, skip_passes: tuple[str, ...] = ()) -> float:
    w, shape = workload(small), SMALL if small else DLRMV3
    bundle = hstu_export.save_bundle(
        gr_ranker.build_ranker(**shape), work / "gr.pt", example_inputs=gr_ranker.example_inputs([5, 3, 7], [3, 1, 2]),
        factory="gr_ranker:build_ranker", factory_kwargs=shape,
        ranges={"uih_features.video_id": (1, w["history"]), "uih_features.user_id": (1, 1),
                "candidates_features": (1, w["candidates"])})
    longest = w["history"] + w["candidates"] + GR_CONTEXTUAL
    start = time.perf_counter()
    hstu_export.export(bundle, work / "gr.aoti", settings(device, w, reference_device="cpu",
                                                          attention_scale=f"fixed:{longest}", skip_passes=skip_passes))
    return round(time.perf_counter() - start, 1)


def export_zoo(work: Path, device: str, small: bool, kv_program: str = "auto") -> float:
    """The zoo's dlrmv3 with ``kv_program``'s delta program, into ``zoo.aoti`` (``zoo_derived.aoti`` for the derived
    one)."""
    w = workload(small)
    config = dataclasses.replace(preset_config("tiny" if small else "dlrmv3"), max_history_len=w["history"],
                                 max_num_candidates=w["candidates"])
    torch.manual_seed(0)
    model = HstuRankingModel(config).eval()
    bundle = hstu_export.save_bundle(model, work / "zoo.pt", hstu_export.generate_batch(model.input_schema(), 3, seed=1))
    start = time.perf_counter()
    name = "zoo_derived.aoti" if kv_program == "derived" else "zoo.aoti"
    hstu_export.export(bundle, work / name, settings(device, w, kv_program=kv_program, lengths={
        "uih_lengths": (1, w["history"]), "candidate_lengths": (1, w["candidates"])}))
    return round(time.perf_counter() - start, 1)


def gr_requests(package: Any, users: int, w: dict[str, Any]) -> tuple[dict, dict]:
    """(first, second): the same histories; the second's candidates drawn again."""
    model = hstu_export.load_bundle(package.root.parent / "gr.pt").model
    history, candidates = [w["history"]] * users, [w["candidates"]] * users
    first = flatten_example(package.input_schema, gr_ranker.example_inputs(history, candidates, seed=5), None, model)
    other = flatten_example(package.input_schema, gr_ranker.example_inputs(history, candidates, seed=6), None, model)
    return first, {k: other[k] if k.startswith("candidates_features.") else v for k, v in first.items()}


def zoo_requests(package: Any, users: int, w: dict[str, Any]) -> tuple[dict, dict]:
    lengths = {"uih_lengths": [w["history"]] * users, "candidate_lengths": [w["candidates"]] * users}
    first = hstu_export.generate_batch(package.input_schema, users, seed=5, lengths=lengths)
    other = hstu_export.generate_batch(package.input_schema, users, seed=6, lengths=lengths)
    return first, {k: other[k] if k.startswith("candidate") else v for k, v in first.items()}


def bench(fn: Any, iters: int, warmup: int = 5) -> float:
    cuda = torch.cuda.is_available()
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
        samples = []
        for _ in range(iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def rel_l2(got: dict, want: dict) -> float:
    return max(float((got[k].float() - want[k].float()).norm() / want[k].float().norm().clamp_min(1e-12)) for k in want)


def time_gr(package: Any, users: int, w: dict[str, Any], iters: int) -> dict[str, Any]:
    return time_derived(package, users, w, iters, gr_requests, "candidates_features.")


def time_zoo_derived(package: Any, users: int, w: dict[str, Any], iters: int) -> dict[str, Any]:
    return time_derived(package, users, w, iters, zoo_requests, "candidate")


def hit(package: Any, first: dict, second: dict) -> tuple[Any, list[int], dict, dict, dict]:
    """``first`` then ``second`` (the same users, new candidates: a hit) served through the package's cache:
    (ranker, user ids, the hit's answers, its dense inputs, the delta program's inputs for that hit)."""
    ranker = package.kv_cache()
    runner = ranker.runner
    given = runner.dense_inputs(second)  # with the request ids the program compares, where it takes them
    features = package.check_request(second)
    request = {f.graph_name: features[f.name].to(package.device) for f in package.input_schema.features}
    dense = package.split.dense_inputs(request)  # the dense half's inputs, to time it alone
    if runner.whole_request:  # the program's call takes the request and looks it up; timed here as it is
        given = {**request, **dense}
    lengths, targets = runner.counts(dense, second)
    ids = list(range(lengths.shape[0]))
    ranker(first, ids)
    got = ranker(second, ids)  # a hit: the candidates only
    seq_lengths, stored = lengths.cpu().tolist(), (lengths - targets).cpu().tolist()
    width = max(len(ranker.cache.entry(u).pages) for u in ids)
    table = torch.tensor([ranker.cache.entry(u).pages + [ranker.cache.scratch_page] * (width - len(ranker.cache.entry(u).pages))
                          for u in ids], dtype=torch.int32, device=package.device)
    c = ranker.cache
    inputs = runner.program_inputs(given, torch.tensor(stored, dtype=torch.int64, device=package.device), c.k, c.v, c.x,
                                   table, {name: rows.to(package.device) for name, rows in
                                           delta_row_inputs(seq_lengths, stored, stored).items()})
    return ranker, ids, got, dense, inputs


def time_derived(package: Any, users: int, w: dict[str, Any], iters: int, requests: Any,
                 candidates: str) -> dict[str, Any]:
    """A package with a derived delta program; ``requests`` makes its two requests, ``candidates`` starts the names
    of the candidates' features."""
    first, second = requests(package, users, w)
    ranker, ids, got, dense, inputs = hit(package, first, second)
    row: dict[str, Any] = {"stats": ranker.cache.stats(), "rel_l2_cached_vs_package": rel_l2(got, package(second))}
    runner = ranker.runner
    section = package.manifest["kv_cache"]
    row["device_reads"] = section.get("device_reads")
    row["row_width"], row["row_dtype"] = section["layout"]["row_width"], section["layout"]["row_dtype"]
    row["compared_ids"] = section.get("compared_ids")
    row["no_cache_ms"] = bench(lambda: package.split.dense(**dense), iters)
    row["cached_ms"] = bench(lambda: runner.run_program(inputs, graphed=False), iters)
    if runner.graphs is not None:  # replayed from a CUDA graph, as served
        row["cached_served_ms"] = bench(lambda: runner.run_program(inputs), iters)
        row["ratio_served"] = row["no_cache_ms"] / row["cached_served_ms"]
    row["ratio"] = row["no_cache_ms"] / row["cached_ms"]
    # The whole request from Python, as served (sparse half, counts, bookkeeping, delta program), against the
    # package without the cache.
    row["request_no_cache_ms"] = bench(lambda: package(second), iters)
    row["request_cached_ms"] = bench(lambda: ranker(second, ids), iters)
    row["request_ratio"] = row["request_no_cache_ms"] / row["request_cached_ms"]
    if runner.graphs is not None:  # the same with every delta call run as it is, in turns with the graphs
        graphs, rounds = runner.graphs, {"graphs": [], "no_graphs": []}
        for _ in range(2):
            for name in rounds:
                runner.graphs = graphs if name == "graphs" else None
                rounds[name].append(bench(lambda: ranker(second, ids), iters))
        runner.graphs = graphs
        row["request_cached_rounds_ms"] = rounds
        row["request_cached_ms"] = min(rounds["graphs"])
        row["request_cached_no_graphs_ms"] = min(rounds["no_graphs"])
        row["request_ratio"] = row["request_no_cache_ms"] / row["request_cached_ms"]
        row["graph_counts"] = dict(graphs.counts)
    # The same histories with half as many candidates: a batch of another shape, whose rows before the layers
    # come out in other bits; still hits.
    before = ranker.cache.stats()
    drawn = requests(package, users, {**w, "candidates": max(1, w["candidates"] // 2)})[1]
    fewer = {k: drawn[k] if k.startswith(candidates) else v for k, v in first.items()}
    got = ranker(fewer, ids)
    after = ranker.cache.stats()
    row["other_shape"] = {"hits": after["hits"] - before["hits"], "stale": after["stale"] - before["stale"],
                          "rel_l2_cached_vs_package": rel_l2(got, package(fewer))}
    if PROFILE:
        row["profile_cached"] = kernels(lambda: runner.run_program(inputs, graphed=False))
        row["profile_no_cache"] = kernels(lambda: package.split.dense(**dense))
    return row


def time_cpp(runner: Path, package: Path, requests: tuple[dict, dict], users: int, iters: int,
             where: Path) -> dict[str, Any]:
    """The second of ``requests`` through the C++ runtime: without the cache, and cached after the first (a hit),
    p50 of ``iters`` calls each; the cached call's phase times."""
    from cpp_kv_cache import cpp

    from hstu_export.package.tensor_dir import save_tensors

    first, second = (save_tensors(r, where / str(k)) for k, r in enumerate(requests))
    ids = ",".join(map(str, range(users)))
    row: dict[str, Any] = {}
    _, row["no_cache"] = cpp(runner, package, second, "--repeat", iters, "--warmup", 5)
    _, row["cached"] = cpp(runner, package, first, second, "--kv-cache", "auto", "--user-ids", ids, "--user-ids", ids,
                           "--repeat", iters, "--warmup", 5)
    _, row["cached_phases"] = cpp(runner, package, first, second, "--kv-cache", "auto", "--user-ids", ids,
                                  "--user-ids", ids, "--repeat", iters, "--warmup", 5, "--phase-times")
    if "p50_ms" in row["no_cache"] and "p50_ms" in row["cached"]:
        row["request_ratio"] = row["no_cache"]["p50_ms"] / row["cached"]["p50_ms"]
    return row


def time_native(library: Path, package: Path, requests: tuple[dict, dict], users: int, iters: int) -> dict[str, Any]:
    """The second of ``requests`` through the C++ runtime called from Python (``NativePredictor``, in this process):
    without the cache, and cached after the first (a hit), p50 of ``iters`` calls each."""
    from hstu_export.runtimes.native import NativePredictor

    predictor = NativePredictor(package, library=library)
    first, second = requests
    ids = list(range(users))
    ranker = predictor.kv_cache()
    ranker(first, ids)
    row: dict[str, Any] = {"no_cache_ms": bench(lambda: predictor(second), iters),
                           "cached_ms": bench(lambda: ranker(second, ids), iters), "stats": ranker.stats()}
    row["request_ratio"] = row["no_cache_ms"] / row["cached_ms"]
    return row


PROFILE = False


def kernels(fn: Any, calls: int = 5, top: int = 25) -> dict[str, Any]:
    """GPU kernels of ``calls`` calls by total time (torch.profiler), per call."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / calls
    rows = [(e.key, e.device_time_total / calls, e.count / calls) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    rows.sort(key=lambda r: -r[1])
    return {"wall_ms_per_call": wall, "gpu_us_per_call": sum(r[1] for r in rows),
            "kernels_per_call": sum(r[2] for r in rows),
            "top": [{"name": k[:120], "us": round(us, 1), "count": n} for k, us, n in rows[:top]]}


def time_zoo(package: Any, users: int, w: dict[str, Any], iters: int) -> dict[str, Any]:
    first, second = zoo_requests(package, users, w)
    ranker = package.kv_cache()
    ids = list(range(users))
    ranker(first, ids)
    got = ranker(second, ids)
    row: dict[str, Any] = {"stats": ranker.cache.stats(), "rel_l2_cached_vs_package": rel_l2(got, package(second))}
    runner = ranker.runner
    features = package.check_request(second)
    graph = {f.graph_name: features[f.name].to(package.device) for f in package.input_schema.features}
    dense = package.split.dense_inputs(graph)
    table = torch.tensor([ranker.cache.entry(u).pages for u in ids], dtype=torch.int32, device=package.device)
    cached = torch.full((users,), w["history"], dtype=torch.int64)
    delta = {**second, "uih_lengths": torch.zeros_like(second["uih_lengths"])}
    for key in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
        delta[key] = second[key][:0]
    inputs = runner.program_inputs(delta, cached, ranker.cache.k, ranker.cache.v, table)
    row["no_cache_ms"] = bench(lambda: package.split.dense(**dense), iters)
    row["cached_ms"] = bench(lambda: runner.run_program(inputs, bucketed=False), iters)
    if runner.graphs is not None:
        row["cached_served_ms"] = bench(lambda: runner.run_program(inputs), iters)
    row["ratio"] = row["no_cache_ms"] / row["cached_ms"]
    if "cached_served_ms" in row:
        row["ratio_served"] = row["no_cache_ms"] / row["cached_served_ms"]
    if PROFILE:
        row["profile_cached"] = kernels(lambda: runner.run_program(inputs, bucketed=False))
        row["profile_no_cache"] = kernels(lambda: package.split.dense(**dense))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--reuse", action="store_true", help="keep packages already in --work")
    parser.add_argument("--export-only", action="store_true",
                        help="export into --work and stop (several processes can export side by side, then one times)")
    parser.add_argument("--only", nargs="+", default=["zoo", "gr"], choices=["zoo", "gr", "zoo_derived"],
                        help="zoo_derived: the zoo's model with --kv-program derived, against its written program "
                             "(with zoo)")
    parser.add_argument("--profile", action="store_true", help="also the GPU kernels of each package's calls")
    parser.add_argument("--cpp", action="store_true", help="also the whole request through the C++ runtime")
    parser.add_argument("--skip-passes", nargs="*", default=[], metavar="PASS",
                        help="export the GR package without these passes (an A/B of a pass: run once with, once without)")
    args = parser.parse_args()
    global PROFILE
    PROFILE = args.profile
    work = args.work or args.out
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")},
        "workload": workload(args.small), "gr_skip_passes": args.skip_passes}

    def save() -> None:
        (args.out / "kv_derived.json").write_text(json.dumps(result, indent=2, default=str))

    building = subprocess.Popen(["bash", str(ROOT / "runtimes/cpp/build.sh"), str(work / "build")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if args.cpp else None

    for model, step in (("zoo", lambda: export_zoo(work, args.device, args.small)),
                        ("zoo_derived", lambda: export_zoo(work, args.device, args.small, "derived")),
                        ("gr", lambda: export_gr(work, args.device, args.small, tuple(args.skip_passes)))):
        name = f"{model}_export_seconds"
        if model not in args.only or (args.reuse and (work / f"{model}.aoti").is_dir()):
            continue
        try:
            result[name] = step()
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
        save()
    if args.export_only:
        if building is not None:  # built into --work too, for the run that times
            log = building.communicate()[0]  # read to the end before the exit code: a full pipe would block wait()
            result["cpp_build"] = log[-2000:] if building.returncode else "built"
            save()
        return 0
    w = workload(args.small)
    runner = None
    if building is not None:
        log = building.communicate()[0]
        runner = work / "build" / "hstu-export-run"
        if building.returncode != 0:
            result["cpp_build"], runner = log[-2000:], None
    for name, timer in (("zoo", time_zoo), ("zoo_derived", time_zoo_derived), ("gr", time_gr)):
        if name not in args.only or not (work / f"{name}.aoti").is_dir():
            continue
        package = hstu_export.load(work / f"{name}.aoti")
        for users in w["users"]:
            try:
                result.setdefault(name, {})[str(users)] = row = timer(package, users, w, args.iters)
                if runner is not None:
                    made = {"zoo": zoo_requests, "zoo_derived": zoo_requests, "gr": gr_requests}[name](package, users, w)
                    row["cpp"] = time_cpp(runner, work / f"{name}.aoti", made, users, args.iters,
                                          work / f"requests_{name}_{users}")
                    try:
                        row["native"] = time_native(runner.parent / "libhstu_export_native.so",
                                                    work / f"{name}.aoti", made, users, args.iters)
                    except Exception as exc:
                        row["native"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            except Exception as exc:
                result.setdefault(name, {})[str(users)] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                                                           "trace": traceback.format_exc()[-3000:]}
            save()
    for users in map(str, w["users"]):
        zoo, gr = result.get("zoo", {}).get(users, {}), result.get("gr", {}).get(users, {})
        if "ratio" in zoo and "ratio" in gr:
            result.setdefault("gr_ratio_over_zoo", {})[users] = {
                "vs_zoo_program": gr["ratio"] / zoo["ratio"],
                "vs_zoo_served": gr.get("ratio_served", gr["ratio"]) / zoo.get("ratio_served", zoo["ratio"])}
        written, derived = zoo.get("cached_served_ms"), result.get("zoo_derived", {}).get(users, {})
        if written and "cached_ms" in derived:  # the zoo's written program over its derived one, both as served
            result.setdefault("zoo_derived_over_written", {})[users] = written / derived.get("cached_served_ms",
                                                                                           derived["cached_ms"])
    save()
    print(json.dumps({k: result.get(k) for k in ("gr_ratio_over_zoo", "zoo_derived_over_written", "zoo_export_seconds",
                                                 "zoo_derived_export_seconds", "gr_export_seconds")}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
