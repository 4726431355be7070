"""The C++ runtime's KV cache on the GPU (``hstu-export-run --kv-cache``), against the no-cache package and
against Python's cache (``predictor.kv_cache``), same run, whole requests sent from the host.

    PYTHONPATH=$PWD python benchmarks/cpp_kv_cache.py --out $OUT [--workloads long dlrm] [--batches 1 8 32]

Builds runtimes/cpp against this machine's torch and exports the dlrmv3-shaped package of
benchmarks/kv_cache.py (bf16, Triton kernels, --kv-cache). Per workload and batch size it serves the same
sequence of requests again and again, with the users' ids fixed:
  long  [prefix (the first 3968 history tokens), whole (4096 history + 256 candidates)]: each pass the
        prefix is recomputed (it is shorter than the cached history: stale) and the whole request is a
        hit with 384 new tokens per user; its latency is the one reported;
  dlrm  [whole (1024 history + 2048 candidates)]: after the first pass every request is a hit with 2048
        new tokens per user.
Baselines, same run: the same whole request through the package without cache (C++ and Python). The dense
half alone is timed too (``--phase-times``): the C++ no-cache dense program against the C++ delta program as
served (its shape bucket's copies and CUDA-graph replay), the device synchronised around each. Both
caches are timed with CUDA graphs (their default; the C++ runtime's when built with CUDA headers) and
without; each C++ run writes every timed request's latency to latencies_*.txt.
The Python paths (``hstu_export.load`` with and without its cache, and ``NativePredictor``) are timed in a
fresh process, as a serving process is (``python_*``), and in this one, which has just exported
(``python_*_exporting_process``).
Outputs: the C++ cache's first whole answer without graphs against Python's cache without graphs (the
same program on the same inputs: bit for bit) and against the package without cache (relative L2).
With ``--baseline-src DIR`` it also builds a baseline runtime and, per batch, runs both runtimes' requests in
turn, three times each, without cache and cached, with --phase-times and without (``same_run_ab``): a change
against its baseline in the same run; where both serve one package, their answers are compared bit for bit
(``--ab-cached-only``: the cached requests alone, for a change to the cached path).
DIR is either a copy of runtimes/cpp from another commit (a runtime change: both runtimes serve
this code's package) or a whole checkout of another commit (``git archive REV | tar -x -C DIR``; a change to
the exported program too): its runtimes/cpp is built and its own code exports the baseline package, in a
subprocess alongside this code's export. ``--ab-kv-program derived`` runs the same A/B between two packages this
code exports, one runtime: the zoo's delta program derived by the compiler (``new``) against the hand-written one
(``baseline``). ``--ab-held-rows`` serves ``new`` with held rows and adds the derived package without them
(``held_off``); ``--ab-unseen-shapes`` adds it without CUDA graphs (``unseen``: a request of shapes the derived
program has not seen and no bucket holds, as each request of a history growing by varying amounts is without
shape buckets; the written program's graphs are per shape bucket); ``--ab-exact-shapes`` adds it without shape
buckets (``exact``: ``--kv-shape-buckets off``, a graph per exact shape, which this workload's two shapes replay). ``--ab-graphs`` runs it between one runtime's request without the cache with whole-request CUDA
graphs (``--graphs auto``, ``new``) and without (``--graphs off``, ``baseline``), the cache timed once, and times
Python's no-cache paths with and without them in a fresh process. ``--ab-python DIR`` (a whole checkout of another
commit) times Python's paths of this code and of DIR's, in fresh processes in turns, on one package (the written
program's), and the C++ runtime's requests on it beside them; four fresh processes a batch size took about 200 s on
an H100 (the dlrmv3 shapes), so one or two batch sizes fit a call of the GPU machine with the export.
``--ab-pin CPUS`` runs that A/B within this code, between fresh processes pinned to CPUS (``new``) and not pinned
(``baseline``), and the C++ CLI's requests pinned and not, in turns.
``--ab-only`` times nothing else per batch. ``--reuse`` keeps the work folder of an earlier run on the same machine
(a GPU machine kept warm between calls): its runtime and each workload's package as exported then (with that run's
``--kv-program`` and largest batch size) are used as they are; a baseline's package is exported again.
Writes cpp_kv_cache.json (after the export and after every batch size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_cache import PAGE, WORKLOADS, failure, request

import hstu_export
from hstu_export.models.config import preset_config
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.package.tensor_dir import load_tensors, save_tensors
from hstu_export.runtimes.native import LIBRARY_NAME, NativePredictor

REPO = Path(__file__).resolve().parent.parent
LATENCY = re.compile(r"p50 ([0-9.]+) ms, p99 ([0-9.]+) ms")
PHASES = re.compile(r"request (\d+) phases \(device synchronised between them\), p50: before the dense half "
                    r"([\d.]+) ms, dense half ([\d.]+) ms, after it ([\d.]+) ms"
                    r"(?:; the dense half's launch returned after ([\d.]+) ms)?"
                    r"(?:; before the dense half, the request to the device ([\d.]+) ms"
                    r"(?: and the sparse half ([\d.]+) ms)?)?")


def prefix_of(whole: dict[str, torch.Tensor], work: dict, batch: int) -> dict[str, torch.Tensor]:
    """``whole`` with each user's first ``cached`` history tokens only."""
    keep = torch.cat([torch.arange(b * work["history"], b * work["history"] + work["cached"]) for b in range(batch)])
    out = dict(whole)
    for key in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
        out[key] = whole[key][keep]
    out["uih_lengths"] = torch.full_like(whole["uih_lengths"], work["cached"])
    return out


def python_latency(call, iters: int, before=None) -> dict:  # type: ignore[no-untyped-def]
    """p50/p99 of ``call()`` (synchronised), ``before()`` run untimed ahead of each call."""
    times = []
    for i in range(iters + 5):
        if before is not None:
            before()
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {"p50_ms": statistics.median(times), "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))]}


def pinned_to(cpus: frozenset[int] | None):  # type: ignore[no-untyped-def]
    """A ``preexec_fn`` that pins the child process to ``cpus`` (None: left where the scheduler puts it)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def cpu_list(text: str) -> frozenset[int]:
    """``--ab-pin``'s CPUs, as taskset writes them ("0-3,8"), checked against the CPUs this process may use."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPUs such as 0-3,8, got {text!r}") from None
    if not cpus or not cpus <= os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(f"CPUs {text!r} are not all among this process's "
                                         f"{sorted(os.sched_getaffinity(0))}")
    return frozenset(cpus)


def cpp(runner: Path, *args: object, pin: frozenset[int] | None = None) -> tuple[subprocess.CompletedProcess[str], dict]:
    done = subprocess.run([str(runner), *map(str, args)], capture_output=True, text=True, timeout=600,
                          preexec_fn=pinned_to(pin))
    if done.returncode != 0:
        return done, {"error": done.stderr.strip()[-2000:]}
    found = LATENCY.findall(done.stdout)
    if not found:
        return done, {"error": done.stdout[-2000:]}
    p50, p99 = found[-1]  # with several requests, the last request's own line comes last
    stats = re.findall(r"kv cache: .*", done.stdout)
    phases = PHASES.findall(done.stdout)  # --phase-times: the last request's
    return done, {"p50_ms": float(p50), "p99_ms": float(p99), **({"cache": stats[-1]} if stats else {}),
                  **({"phases_p50_ms": {name: float(value) for name, value in
                                        zip(("before_dense", "dense", "after_dense", "dense_launch", "to_device", "sparse"),
                                            phases[-1][1:])
                                        if value}} if phases else {})}  # fmt: skip


def rel_l2(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).norm() / b[k].float().norm()) for k in b)


def same_run_ab(setups: dict[str, tuple[Path, Path]], request_args: list[object], kv_args: list[object],
                iters: int, answers_dir: Path, kinds: tuple[str, ...] = ("no_cache", "kv"),
                no_cache_args: dict[str, tuple[object, ...]] | None = None, kv_labels: set[str] | None = None,
                kv_extra: dict[str, tuple[object, ...]] | None = None) -> dict:
    """Each (runtime, package)'s requests, without cache and cached, in turn, three times: p50s by label, with
    --phase-times (``<label>_no_cache``, ``<label>_kv``: the device synchronised between phases) and without
    (``..._whole``: the request as served). ``request_args``: the request's folders (the last one is the one
    sent without cache); ``kv_args``: what follows them for the cache. The first round writes every answer
    under ``answers_dir``; where all setups serve one package, ``answers_equal`` says whether their answers are
    equal bit for bit, and otherwise ``answers_rel_l2`` how far apart they are. ``kinds``: which of the two to time;
    ``no_cache_args``: more arguments of a label's no-cache runs; ``kv_labels``: the labels whose cache is timed
    (default: all); ``kv_extra``: more arguments of a label's cached runs."""
    out: dict = {}
    for round_ in range(3):
        for label, (runner, package) in setups.items():
            for name, args in (("no_cache", [package, request_args[-1], *(no_cache_args or {}).get(label, ())]),
                               ("kv", [package, *request_args, *kv_args, "--kv-graphs", "auto",
                                       *(kv_extra or {}).get(label, ())])):
                if name not in kinds or (name == "kv" and kv_labels is not None and label not in kv_labels):
                    continue
                keep = ("--out", answers_dir / f"{label}_{name}") if round_ == 0 else ()
                _, got = cpp(runner, *args, "--repeat", iters, "--warmup", 5, "--phase-times", *keep)
                out.setdefault(f"{label}_{name}", []).append(got)
                _, got = cpp(runner, *args, "--repeat", iters, "--warmup", 5)
                out.setdefault(f"{label}_{name}_whole", []).append(got)
    if len({package for _, package in setups.values()}) == 1:
        out["answers_equal"] = {name: answers_equal([answers_dir / f"{label}_{name}" for label in setups
                                                     if (answers_dir / f"{label}_{name}").exists()])
                                for name in kinds}
    else:  # two programs: how far apart their answers are
        first, *others = setups
        out["answers_rel_l2"] = {f"{other}_{name}": answers_rel_l2(answers_dir / f"{first}_{name}",
                                                                   answers_dir / f"{other}_{name}")
                                 for other in others for name in kinds}
    return out


def answers_rel_l2(a: Path, b: Path) -> float:
    """The largest relative L2 distance of ``b``'s answers from ``a``'s, over the folders and outputs both wrote."""
    worst = 0.0
    for folder in sorted({p.parent for p in a.rglob("*.pt")}):
        mine, theirs = load_tensors(folder), load_tensors(b / folder.relative_to(a))
        worst = max(worst, rel_l2(theirs, mine))
    return worst


def answers_equal(dirs: list[Path]) -> bool:
    """Whether the answers written under each of ``dirs`` (``--out``: one tensor folder, or one per request) are
    the same folders with equal tensors, bit for bit."""
    def folders(root: Path) -> dict[str, dict[str, torch.Tensor]]:
        found = sorted({p.parent for p in root.rglob("*.pt")})
        return {str(f.relative_to(root)): load_tensors(f) for f in found}

    first, *others = [folders(d) for d in dirs]
    return bool(first) and all(
        other.keys() == first.keys() and all(
            other[f].keys() == first[f].keys() and all(torch.equal(other[f][k], first[f][k]) for k in first[f])
            for f in first)
        for other in others)


def ab_summary(ab: dict) -> dict:
    """The median over rounds of each label's phases and whole-request p50 (``request``), ms; the dense half's
    ratios: no cache over cached per label, and baseline over new, cached; and baseline over new of whole requests
    (``request_baseline_over_new``, without cache and cached)."""
    out: dict = {}
    for label, runs in ab.items():
        if not isinstance(runs, list):
            continue
        phases = [{**r.get("phases_p50_ms", {}), "request": r["p50_ms"]} for r in runs if "p50_ms" in r]
        if phases:
            out[label] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    for label in ("new", "baseline"):
        if f"{label}_no_cache" in out and f"{label}_kv" in out:
            out[f"{label}_dense_no_cache_over_kv"] = out[f"{label}_no_cache"]["dense"] / out[f"{label}_kv"]["dense"]
    if "new_kv" in out and "baseline_kv" in out:
        out["dense_kv_baseline_over_new"] = out["baseline_kv"]["dense"] / out["new_kv"]["dense"]
    for label in ("new", "baseline"):  # the whole-request speed-up of the cache, over this label's no-cache request
        if f"{label}_no_cache_whole" in out and "new_kv_whole" in out:
            out[f"{label}_no_cache_over_new_kv_whole"] = (out[f"{label}_no_cache_whole"]["request"] /
                                                          out["new_kv_whole"]["request"])
    out["request_baseline_over_new"] = {name: out[f"baseline_{name}"]["request"] / out[f"new_{name}"]["request"]
                                        for name in ("no_cache", "kv", "no_cache_whole", "kv_whole")
                                        if f"new_{name}" in out and f"baseline_{name}" in out}
    for label in ("held_off", "unseen", "exact"):  # --ab-held-rows, --ab-unseen-shapes, --ab-exact-shapes
        if f"{label}_kv_whole" in out and "new_kv_whole" in out:
            out[f"request_{label}_over_new"] = {name: out[f"{label}_{name}"]["request"] / out[f"new_{name}"]["request"]
                                                for name in ("kv", "kv_whole")}
    if "unseen_kv_whole" in out and "baseline_kv_whole" in out:
        out["request_baseline_over_unseen"] = out["baseline_kv_whole"]["request"] / out["unseen_kv_whole"]["request"]
    return out


def workload_model(name: str) -> HstuRankingModel:
    """The workload's dlrmv3-shaped model, seeded: every call builds the same model."""
    work = WORKLOADS[name]
    cfg = dataclasses.replace(preset_config("dlrmv3"), max_history_len=work["history"],
                              max_num_candidates=work["candidates"])
    torch.manual_seed(0)
    return HstuRankingModel(cfg).eval()


def export_package(name: str, max_batch: int, work_dir: Path,
                   kv_program: str = "auto") -> tuple[HstuRankingModel, Path, float]:
    """The workload's dlrmv3-shaped model (seeded: every export of it is the same model) and its package
    (bf16, Triton kernels, --kv-cache with ``kv_program``'s delta program), exported under ``work_dir``:
    (model, package, seconds)."""
    work = WORKLOADS[name]
    model = workload_model(name)
    bundle = hstu_export.save_bundle(model, work_dir / f"{name}.pt", request(model, work, 2, 1))
    settings = hstu_export.ExportSettings(backend="aoti", device="cuda", dtype="bf16", op_target="triton",
                                          max_batch_size=max_batch, kv_cache=True, kv_page_size=PAGE,
                                          kv_program=kv_program, verify=hstu_export.VerifySettings(num_random_batches=1))
    t = time.perf_counter()
    result = hstu_export.export(bundle, work_dir / f"{name}.aoti", settings)
    return model, Path(result.path), round(time.perf_counter() - t, 1)


def kv_parity(package: Path) -> dict:
    """What the export's own check of the package's cached path found (manifest ``parity.kv_cache``): passed,
    the worst difference from the model, the tolerances."""
    found = json.loads((package / "manifest.json").read_text()).get("parity", {}).get("kv_cache", {})
    return {key: found.get(key) for key in ("passed", "worst", "tolerances")}


def python_paths(predictor, native: NativePredictor, steps: list[dict[str, torch.Tensor]], users: list[int],  # type: ignore[no-untyped-def]
                 iters: int, without_graphs: tuple | None = None) -> tuple[dict, dict]:
    """The Python paths on the same requests (the last one timed, the others run untimed before each call):
    ``hstu_export.load``'s predictor without cache and its cache with CUDA graphs and without, and the C++
    runtime called from Python (``NativePredictor``) without cache and cached. ``without_graphs``: the same two
    predictors opened without whole-request graphs, timed without cache too (``*_no_graphs``; the graphs' counts
    beside them). Returns the timings (with the caches' counters) and each cache's first answer to the last
    request."""
    whole = steps[-1]
    timed: dict = {}
    first: dict = {}
    with torch.no_grad():
        timed["python_no_cache"] = python_latency(lambda: predictor(whole), iters)
        if without_graphs is not None:
            plain, plain_native = without_graphs
            timed["python_no_cache_graph_counts"] = dict(predictor.graphs.counts) if predictor.graphs else None
            timed["python_no_cache_no_graphs"] = python_latency(lambda: plain(whole), iters)
            timed["python_native_no_cache_no_graphs"] = python_latency(lambda: plain_native(whole), iters)
            got, want = predictor(whole), plain(whole)
            timed["python_no_cache_graphs_equal"] = all(torch.equal(got[k], want[k]) for k in want)
        rankers = {"python_kv": lambda: predictor.kv_cache(cuda_graphs=True),
                   "python_kv_no_graphs": lambda: predictor.kv_cache(cuda_graphs=False),
                   "python_native_kv": native.kv_cache}
        for name, make in rankers.items():
            if name == "python_native_kv":
                timed["python_native_no_cache"] = python_latency(lambda: native(whole), iters)
            ranker = make()
            first[name] = [ranker(step, users) for step in steps][-1]
            before = (lambda r=ranker: r(steps[0], users)) if len(steps) > 1 else None
            timed[name] = python_latency(lambda r=ranker: r(whole, users), iters, before=before)
            timed[f"{name}_stats"] = ranker.cache.stats()
            del ranker
            torch.cuda.empty_cache()
    return timed, first


def fresh_python(row: dict, package_root: Path, dirs: list[Path], ids: str, iters: int, work_dir: Path,
                 ab_graphs: bool = False, checkout: Path | None = None, pin: frozenset[int] | None = None) -> None:
    """The Python paths timed in a fresh process, as a serving process is (``python_paths``), into ``row``;
    ``checkout``: another commit's whole tree, whose own code and script time them; ``pin``: the CPUs the process
    runs on."""
    script, env = Path(__file__), None
    if checkout is not None:
        script = checkout / "benchmarks" / script.name
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    fresh = subprocess.run([sys.executable, str(script), "--out", str(work_dir), "--time-python", str(package_root),
                            "--iters", str(iters), "--users", ids, *(["--ab-graphs"] if ab_graphs else []),
                            *map(str, dirs)], capture_output=True, text=True, timeout=900, env=env,
                           preexec_fn=pinned_to(pin))  # fmt: skip
    if fresh.returncode == 0:
        row.update(json.loads(fresh.stdout.strip().splitlines()[-1]))
    else:
        row["python_fresh_process"] = {"error": (fresh.stdout + fresh.stderr)[-2000:]}


PYTHON_PATHS = ("python_no_cache", "python_kv", "python_kv_no_graphs", "python_native_no_cache", "python_native_kv")


@dataclasses.dataclass(frozen=True)
class PythonAB:
    """Python's A/B in fresh processes on one package: ``new`` is this code, unpinned unless ``pin``; ``baseline``
    is ``checkout``'s code (another commit), or this code unpinned (``--ab-pin``)."""

    package: Path
    checkout: Path | None
    pin: frozenset[int] | None
    rounds: int


def python_ab(ab: PythonAB, dirs: list[Path], ids: str, iters: int, work_dir: Path) -> dict:
    """Python's paths of the two sides of ``ab``, each in a fresh process, in turns, ``rounds`` times: every round's
    timings, and per path the median over rounds of the p50s with the cache's whole-request speed-up (no cache over
    cached) per side."""
    runs: dict[str, list[dict]] = {"new": [], "baseline": []}
    for _ in range(ab.rounds):
        for label, src, pin in (("new", None, ab.pin), ("baseline", ab.checkout, None)):
            row: dict = {}
            fresh_python(row, ab.package, dirs, ids, iters, work_dir, checkout=src, pin=pin)
            runs[label].append(row)
    summary: dict = {}
    for label, rows in runs.items():
        p50s = {name: statistics.median(r[name]["p50_ms"] for r in rows) for name in PYTHON_PATHS
                if rows and all(name in r for r in rows)}
        if "python_no_cache" in p50s and "python_kv" in p50s:
            p50s["python_speed_up"] = p50s["python_no_cache"] / p50s["python_kv"]
        summary[label] = p50s
    return {"rounds": runs, "p50_of_rounds": summary}


def batch_row(runner: Path, package_root: Path, predictor, model: HstuRankingModel, work: dict, batch: int,  # type: ignore[no-untyped-def]
              iters: int, work_dir: Path, log_dir: Path, baseline: tuple[Path, Path] | None = None,
              ab_only: bool = False, ab_kinds: tuple[str, ...] = ("no_cache", "kv"), ab_graphs: bool = False,
              ab_python: PythonAB | None = None, ab_held_rows: bool = False, ab_unseen: bool = False,
              ab_exact: bool = False) -> dict:
    row: dict = {}
    whole = request(model, work, batch, 100 + batch)  # on the host, as from a client
    steps = [prefix_of(whole, work, batch), whole] if work["cached"] < work["history"] else [whole]
    dirs = [save_tensors(step, work_dir / f"b{batch}_request{k}") for k, step in enumerate(steps)]
    ids = ",".join(str(u) for u in range(batch))
    users = list(range(batch))
    ab_kv_args: list[object] = ["--kv-cache", "auto", *(a for _ in dirs for a in ("--user-ids", ids))]
    if baseline is not None:
        # With ab_held_rows, the new package served with held rows (new) and without (held_off), in turns; with
        # ab_unseen, as new but without CUDA graphs (unseen): each request then runs as one of shapes the derived
        # program has not seen does (its graphs are keyed by exact shapes), while the written baseline replays
        # the graph of its shape bucket; with ab_exact, as new without shape buckets (exact).
        held = ("--kv-held-rows", "on") if ab_held_rows else ()
        setups = {"new": (runner, package_root), "baseline": baseline,
                  **({"held_off": (runner, package_root)} if ab_held_rows else {}),
                  **({"unseen": (runner, package_root)} if ab_unseen else {}),
                  **({"exact": (runner, package_root)} if ab_exact else {})}
        row["same_run_ab"] = same_run_ab(setups, dirs, ab_kv_args, iters, work_dir / f"b{batch}_ab_answers", ab_kinds,
                                         kv_extra={"new": held, "unseen": (*held, "--kv-graphs", "off"),
                                                   "exact": (*held, "--kv-shape-buckets", "off")})
        row["same_run_ab_p50_of_rounds"] = ab_summary(row["same_run_ab"])
    if ab_graphs:  # whole-request graphs without the cache against none: one runtime, one package
        row["same_run_ab"] = same_run_ab({"new": (runner, package_root), "baseline": (runner, package_root)}, dirs,
                                         ab_kv_args, iters, work_dir / f"b{batch}_ab_answers", ("no_cache", "kv"),
                                         {"new": ("--graphs", "auto"), "baseline": ("--graphs", "off")}, {"new"})
        row["same_run_ab_p50_of_rounds"] = ab_summary(row["same_run_ab"])
        graphed = subprocess.run([str(runner), str(package_root), str(dirs[-1]), "--repeat", str(iters), "--graphs",
                                  "auto"], capture_output=True, text=True, timeout=600)
        row["cpp_graphs_line"] = [line for line in graphed.stdout.splitlines() if "graphs" in line][-1:]
        fresh_python(row, package_root, dirs, ids, iters, work_dir, ab_graphs=True)
    kv_args: list[object] = [package_root, *dirs, "--kv-cache", "auto"]
    for _ in dirs:
        kv_args += ["--user-ids", ids]
    if ab_python is not None:
        row["python_ab"] = python_ab(ab_python, dirs, ids, iters, work_dir)
    if ab_only:
        if ab_python is not None and ab_python.pin is None:  # C++ on the same package, beside Python's speed-up
            _, row["cpp_no_cache"] = cpp(runner, package_root, dirs[-1], "--repeat", iters, "--warmup", 5)
            _, row["cpp_kv"] = cpp(runner, *kv_args, "--kv-graphs", "auto", "--repeat", iters, "--warmup", 5)
        elif ab_python is not None:  # C++ pinned (new) and not (baseline), in turns
            for _ in range(ab_python.rounds):
                for label, pin in (("new", ab_python.pin), ("baseline", None)):
                    for name, args in (("no_cache", (package_root, dirs[-1])), ("kv", (*kv_args, "--kv-graphs", "auto"))):
                        _, timed = cpp(runner, *args, "--repeat", iters, "--warmup", 5, pin=pin)
                        row.setdefault("cpp_pin_ab", {}).setdefault(f"{label}_{name}", []).append(timed)
        return row

    _, row["cpp_no_cache"] = cpp(runner, package_root, dirs[-1], "--repeat", iters, "--warmup", 5)
    out = work_dir / f"b{batch}_out"
    shutil.rmtree(out, ignore_errors=True)
    for name, graphs in (("cpp_kv_no_graphs", "off"), ("cpp_kv", "auto")):
        log = log_dir / f"latencies_{name}_{work['history']}_{batch}.txt"
        done, row[name] = cpp(runner, *kv_args, "--kv-graphs", graphs, "--repeat", iters, "--warmup", 5,
                              "--latency-log", log, *(("--out", out) if graphs == "off" else ()))
        row[f"{name}_stdout_tail"] = done.stdout[-700:]
    # The dense half alone, as each path serves it (--phase-times: the device synchronised before and after
    # it): the no-cache dense program against the delta program with its bucket's copies and graph replay.
    _, row["cpp_no_cache_phases"] = cpp(runner, package_root, dirs[-1], "--repeat", iters, "--warmup", 5,
                                        "--phase-times")
    _, row["cpp_kv_phases"] = cpp(runner, *kv_args, "--kv-graphs", "auto", "--repeat", iters, "--warmup", 5,
                                  "--phase-times")
    dense = [row[name].get("phases_p50_ms", {}).get("dense") for name in ("cpp_no_cache_phases", "cpp_kv_phases")]
    if all(dense):
        row["cpp_dense_no_cache_over_cpp_dense_kv"] = dense[0] / dense[1]

    # Answers replayed from CUDA graphs: the sequence three times (a bucket's graph is captured the second
    # time it is seen), through the C++ and the Python cache; every whole request's answer is compared with
    # the package without cache, and the two caches' answers with each other.
    replayed = work_dir / f"b{batch}_replayed"
    shutil.rmtree(replayed, ignore_errors=True)
    again: list[object] = [package_root, *(dirs * 3), "--kv-cache", "auto", "--kv-graphs", "auto", "--out", replayed]
    for _ in range(3 * len(dirs)):
        again += ["--user-ids", ids]
    done = subprocess.run([str(runner), *map(str, again)], capture_output=True, text=True, timeout=600)
    row["cpp_kv_replayed_stdout_tail"] = (done.stdout + done.stderr)[-700:]

    with torch.no_grad():
        full = predictor(whole)
        if done.returncode == 0:
            ranker = predictor.kv_cache(cuda_graphs=True)
            python_answers = [ranker(step, users) for step in steps * 3]
            wholes = [k for k in range(3 * len(steps)) if k % len(steps) == len(steps) - 1]
            cpp_answers = {k: load_tensors(replayed / str(k + 1)) for k in wholes}
            row["graphs_replayed"] = {
                "python_graph_counts": dict(ranker.runner.graphs.counts),
                "rel_l2_cpp_vs_no_cache": [rel_l2({n: v.cuda() for n, v in cpp_answers[k].items()}, full) for k in wholes],
                "max_abs_cpp_vs_no_cache": [max(float((cpp_answers[k][n].cuda().float() - full[n].float()).abs().max())
                                                for n in full) for k in wholes],
                "rel_l2_python_vs_no_cache": [rel_l2(python_answers[k], full) for k in wholes],
                "cpp_equal_python": [all(torch.equal(cpp_answers[k][n], python_answers[k][n].cpu()) for n in full)
                                     for k in wholes],
            }
            del ranker
        # The Python paths timed in this process, which has just exported (their first answers are checked here),
        # and in a fresh one, as a serving process is (what the python_* keys report).
        timed, first = python_paths(predictor, NativePredictor(package_root, library=runner.parent / LIBRARY_NAME),
                                    steps, users, iters)
        row.update({f"{name}_exporting_process": value for name, value in timed.items()})
        for name in ("python_kv", "python_kv_no_graphs", "python_native_kv"):
            row[f"rel_l2_{name}_vs_no_cache"] = rel_l2(first[name], full)
        if out.exists():
            cpp_first = load_tensors(out / str(len(steps)) if len(steps) > 1 else out)
            row["cpp_kv_equal_python_kv_no_graphs"] = all(torch.equal(cpp_first[k], first["python_kv_no_graphs"][k].cpu())
                                                          for k in cpp_first)
            row["rel_l2_cpp_kv_vs_no_cache"] = rel_l2({k: v.cuda() for k, v in cpp_first.items()}, full)
    torch.cuda.empty_cache()
    fresh_python(row, package_root, dirs, ids, iters, work_dir)
    ratios = {"cpp_no_cache_over_cpp_kv": ("cpp_no_cache", "cpp_kv"),
              "python_no_cache_over_python_kv": ("python_no_cache", "python_kv"),
              "python_no_cache_over_cpp_kv": ("python_no_cache", "cpp_kv"),
              "python_kv_over_cpp_kv": ("python_kv", "cpp_kv"),
              "python_kv_no_graphs_over_cpp_kv": ("python_kv_no_graphs", "cpp_kv"),
              "cpp_no_cache_over_cpp_kv_no_graphs": ("cpp_no_cache", "cpp_kv_no_graphs"),
              "cpp_kv_no_graphs_over_cpp_kv": ("cpp_kv_no_graphs", "cpp_kv"),
              "python_native_no_cache_over_python_native_kv": ("python_native_no_cache", "python_native_kv"),
              "python_native_kv_over_cpp_kv": ("python_native_kv", "cpp_kv"),
              "python_native_no_cache_over_cpp_no_cache": ("python_native_no_cache", "cpp_no_cache"),
              "python_kv_exporting_process_over_python_kv": ("python_kv_exporting_process", "python_kv"),
              "python_native_kv_exporting_process_over_python_native_kv": ("python_native_kv_exporting_process",
                                                                           "python_native_kv")}
    for name, (base, new) in ratios.items():
        if "p50_ms" in row.get(base, {}) and "p50_ms" in row.get(new, {}):
            row[name] = row[base]["p50_ms"] / row[new]["p50_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", nargs="+", default=["long", "dlrm"], choices=sorted(WORKLOADS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--baseline-src", type=Path,
                        help="a copy of runtimes/cpp, or a whole checkout, of the commit to time against (same run)")
    parser.add_argument("--ab-kv-program", choices=["derived"],
                        help="A/B the zoo's delta program derived by the compiler against its written one (same run)")
    parser.add_argument("--ab-held-rows", action="store_true",
                        help="with --ab-kv-program derived: the derived package served with --kv-held-rows on (new) "
                             "and also without (held_off), in the same turns")
    parser.add_argument("--ab-unseen-shapes", action="store_true",
                        help="with --ab-kv-program derived: the derived package also served without CUDA graphs "
                             "(unseen), as a request of shapes it has not seen is (a history growing by varying "
                             "amounts), against the written one's bucket graphs")
    parser.add_argument("--ab-exact-shapes", action="store_true",
                        help="with --ab-kv-program derived: the derived package also served without shape buckets "
                             "(exact: --kv-shape-buckets off, a CUDA graph per exact shape)")
    parser.add_argument("--ab-graphs", action="store_true",
                        help="A/B whole-request CUDA graphs without the cache: one runtime and package, --graphs auto "
                             "(new) against --graphs off (baseline), the cache timed once; Python's paths in a fresh "
                             "process with and without them")
    parser.add_argument("--ab-python", type=Path, metavar="DIR",
                        help="a whole checkout of another commit: Python's paths (hstu_export.load with and without "
                             "its cache, NativePredictor) of this code and of DIR's on one package, each in a fresh "
                             "process, in turns (a change to Python's serving)")
    parser.add_argument("--ab-pin", type=cpu_list, metavar="CPUS",
                        help="CPUs such as 0-3: Python's paths and the C++ CLI on one package, pinned to CPUS (new) "
                             "and not pinned (baseline), each in a fresh process, in turns (how much of the spread "
                             "between processes is where they run)")
    parser.add_argument("--ab-rounds", type=int, default=2,
                        help="--ab-python's and --ab-pin's rounds (the same code's p50 differed by up to 1.6x between fresh processes "
                             "on an H100: docs/PERF_INVESTIGATIONS.md)")
    parser.add_argument("--ab-cached-only", action="store_true",
                        help="with --baseline-src: time the cached requests only (a change to the cached path)")
    parser.add_argument("--ab-only", action="store_true",
                        help="with --baseline-src, --ab-kv-program, --ab-graphs, --ab-python or --ab-pin: time only "
                             "the same-run A/B")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the work folder (/tmp/cpp_kv_cache) of an earlier run on this machine: its runtime "
                             "and its package of each workload, when there, are used as they are")
    parser.add_argument("--export-only", metavar="WORKLOAD", help=argparse.SUPPRESS)  # the baseline's export
    parser.add_argument("--kv-program", default="auto", choices=["auto", "derived"],
                        help="the packages' delta program (auto: the zoo's written one); with --baseline-src, the "
                             "baseline's too")
    parser.add_argument("--time-python", metavar="PACKAGE", help=argparse.SUPPRESS)  # the fresh process's timings
    parser.add_argument("--users", help=argparse.SUPPRESS)
    parser.add_argument("requests", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ab_pin is not None and args.ab_python is not None:
        parser.error("--ab-pin and --ab-python are two A/Bs: give one")
    if (args.ab_held_rows or args.ab_unseen_shapes or args.ab_exact_shapes) and not args.ab_kv_program:
        parser.error("--ab-held-rows, --ab-unseen-shapes and --ab-exact-shapes serve the derived package: give "
                     "--ab-kv-program derived")
    if args.time_python:  # in a fresh process, as a serving process is: the timings as JSON, last line
        steps = [load_tensors(path) for path in args.requests]
        library = args.out / "build" / LIBRARY_NAME
        native = NativePredictor(args.time_python, library=library)
        without = (hstu_export.load(args.time_python, cuda_graphs=False),
                   NativePredictor(args.time_python, library=library, cuda_graphs=False)) if args.ab_graphs else None
        timed, _ = python_paths(hstu_export.load(args.time_python), native, steps,
                                [int(u) for u in args.users.split(",")], args.iters, without)
        print(json.dumps(timed))
        return
    if args.export_only:  # in a subprocess whose hstu_export is the baseline's: the package's path, last line
        args.out.mkdir(parents=True, exist_ok=True)
        print(export_package(args.export_only, max(args.batches), args.out, args.kv_program)[1])
        return
    args.out.mkdir(parents=True, exist_ok=True)
    work_dir = Path("/tmp/cpp_kv_cache")
    if not args.reuse:
        shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "page_size": PAGE, "iters": args.iters, "workloads": {}}

    def save() -> None:
        (args.out / "cpp_kv_cache.json").write_text(json.dumps(report, indent=2))

    runner = work_dir / "build" / "hstu-export-run"
    if args.reuse and runner.is_file():
        report["build"] = {"reused": str(runner)}
    else:
        start = time.perf_counter()
        build = subprocess.run(["bash", str(REPO / "runtimes/cpp/build.sh"), str(work_dir / "build")],
                               capture_output=True, text=True)
        report["build"] = {"returncode": build.returncode, "seconds": round(time.perf_counter() - start, 1),
                           "tail": (build.stdout + build.stderr)[-1500:]}
        save()
        if build.returncode != 0:
            return
    baseline_runner, checkout = None, None
    if args.baseline_src is not None:
        src = args.baseline_src.resolve()
        checkout = src if (src / "hstu_export").is_dir() else None
        built = subprocess.run(["bash", str((src / "runtimes/cpp" if checkout else src) / "build.sh"),
                                str(work_dir / "baseline_build")], capture_output=True, text=True)
        report["baseline_build"] = {"src": str(src), "checkout": checkout is not None, "returncode": built.returncode,
                                    "tail": (built.stdout + built.stderr)[-1500:]}
        save()
        if built.returncode != 0:
            return
        baseline_runner = work_dir / "baseline_build" / "hstu-export-run"
    for name in args.workloads:
        work = WORKLOADS[name]
        entry: dict = {"shape": work, "batches": {}}
        report["workloads"][name] = entry
        try:
            exporting = None
            if checkout is not None or args.ab_kv_program:  # the other package, exported meanwhile
                # The baseline's own code exports its package; or this code, with the derived delta program.
                env = None if checkout is None else {
                    **os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
                other = ["--kv-program", args.ab_kv_program or args.kv_program]
                exporting = subprocess.Popen(
                    [sys.executable, __file__, "--out", str(work_dir / "baseline"), "--export-only", name,
                     "--batches", *map(str, args.batches), *other],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
            kept = work_dir / f"{name}.aoti"
            if args.reuse and (kept / "manifest.json").is_file():  # an earlier run's export, on this machine
                model, package, entry["export_seconds"] = workload_model(name), kept, None
            else:
                model, package, entry["export_seconds"] = export_package(name, max(args.batches), work_dir,
                                                                         args.kv_program)
            entry["kv_parity"] = kv_parity(package)
            save()  # the export's time, should a later step run out of time
            baseline = None
            if exporting is not None:
                stdout, stderr = exporting.communicate(timeout=1800)
                entry["baseline_export"] = {"returncode": exporting.returncode, "tail": (stdout + stderr)[-1500:]}
                (args.out / f"{name}_other_export.log").write_text(stdout + stderr)  # whole: a failure's traceback
                save()
                if exporting.returncode != 0:
                    continue
                other_package = Path(stdout.strip().splitlines()[-1])
                if args.ab_kv_program:  # new: the derived program; baseline: the written one, one runtime
                    entry["derived_kv_parity"] = kv_parity(other_package)
                    package, baseline = other_package, (runner, package)
                else:
                    baseline = (baseline_runner, other_package)
                    entry["baseline_kv_parity"] = kv_parity(baseline[1])
            elif baseline_runner is not None:
                baseline = (baseline_runner, package)
            # Python's A/B serves the zoo's written program (with --ab-kv-program, the baseline's package).
            ab_python = None
            if args.ab_python is not None or args.ab_pin is not None:
                ab_python = PythonAB(baseline[1] if args.ab_kv_program and baseline is not None else package,
                                     args.ab_python.resolve() if args.ab_python else None, args.ab_pin, args.ab_rounds)
            predictor = None if args.ab_only else hstu_export.load(package)
            for batch in args.batches:
                try:
                    entry["batches"][batch] = batch_row(runner, package, predictor, model, work, batch, args.iters,
                                                        work_dir, args.out, baseline, args.ab_only,
                                                        ("kv",) if args.ab_kv_program or args.ab_cached_only
                                                        else ("no_cache", "kv"),
                                                        args.ab_graphs, ab_python, args.ab_held_rows,
                                                        args.ab_unseen_shapes, args.ab_exact_shapes)
                except Exception as exc:  # recorded; the rest still runs
                    entry["batches"][batch] = failure(exc)
                save()
                torch.cuda.empty_cache()
        except Exception as exc:
            entry.update(failure(exc, tail=3000))
        save()


if __name__ == "__main__":
    main()
