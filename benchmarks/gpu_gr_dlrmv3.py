"""generative-recommenders' ``DlrmHSTU`` in DLRMv3's dense shape, exported for CUDA, beside the zoo's dlrmv3
package, timed in the same run.

    GR_SRC=/path/to/generative-recommenders PYTHONPATH=$PWD python benchmarks/gpu_gr_dlrmv3.py --out $OUT \\
        [--steps verify export time] [--work DIR]
    GR_SRC=... python benchmarks/gpu_gr_dlrmv3.py --out /tmp/gr --small --device cpu   # a dry run on a CPU

The model: ``examples/generative_recommenders/gr_ranker.py`` at 5 layers of d512 with 4 heads of 128 and a
256-wide preprocessor (the dense shape of generative-recommenders' dlrm_v3 configuration), small tables.
Its eager code calls fbgemm's jagged ops, which the GPU machine has only for the CPU, so it is traced and
verified on the CPU in fp32 (``--reference-device cpu``) and compiled for CUDA with the ``triton`` op
target.

Steps (each writes into ``--work``, so later steps can run in another call on the same machine):
- ``verify``: exported in fp32 with small ranges (4 users, 64 history items, 16 candidates) and verified on
  every corner against ``DlrmHSTU.forward`` on the CPU in fp32 (the compiled CUDA program, to fp32's tolerance;
  with ``--fp32-precision high`` its products run in TF32, ours and cuBLAS's, and it is held to TF32's).
- ``export``: exported in bf16 with the timed workload's ranges, unverified (its corners on the CPU would
  take hours), then compared with the verified fp32 package on small requests (the same model, other
  ranges and dtype: the difference is bf16's); again for each of ``--variants`` (without the ``fuse_stu_gate``
  pass; with the position and time encodings as the library wrote them; without ``prove_length_reads``, so that
  sizes and length checks are read from the device; without ``align_linear_inputs``); the zoo's dlrmv3 exported
  with the same ranges. ``--variants-only``: the variants and the zoo alone.
- ``time``: the packages' dense halves on the same workload: 32 users, history lengths uniform over
  [1, 2047] (mean about 1024), 2048 candidates each, bf16; median of ``--iters`` synced calls (CUDA events)
  after warm-up, and the same calls back to back. Tokens are history plus candidate tokens (contextual
  tokens not counted), the same for both models. Each variant's answer is compared with its model's default
  package's on that request (``<variant>_vs_<model>_rel_l2``).
- ``tzrec``: the TorchEasyRec-style test model (``tests/user_models/tzrec_style.py``, its ``Batch`` in) at the
  same dims, verified in fp32 at the small ranges against its own forward on the CPU, then exported in bf16
  for the timed ranges; ``time`` times it too when it is there. ``tzrec-verify``: its verification alone;
  ``tzrec-timed``: its timed package alone, and one for each of ``--variants`` that leaves a pass out.
- ``profile``: the GPU kernels of each package ``time`` times, on the same workload, by total time (torch.profiler).

Writes ``gr_dlrmv3.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "generative_recommenders"))
sys.path.insert(0, str(ROOT / "tests"))  # user_models: the TorchEasyRec-style test model
if os.environ.get("GR_SRC"):
    sys.path.insert(0, os.environ["GR_SRC"])

import gr_ranker  # noqa: E402  (after the paths)
from user_models import tzrec_style  # noqa: E402

import hstu_export  # noqa: E402
from hstu_export import ExportSettings, VerifySettings  # noqa: E402
from hstu_export.models import build_preset  # noqa: E402
from hstu_export.sources.schema_inference import flatten_example  # noqa: E402

DLRMV3 = {"dim": 512, "heads": 4, "layers": 5, "head_dim": 128, "preprocessor_dim": 256, "max_seq_len": 8192,
          "max_candidates": 2048}
SMALL = {"dim": 64, "heads": 2, "layers": 2, "head_dim": 32, "preprocessor_dim": 32, "max_seq_len": 512,
         "max_candidates": 64}


def shape(small: bool) -> dict[str, Any]:
    return SMALL if small else DLRMV3


def sizes(small: bool) -> dict[str, int]:
    """The timed workload and the ranges it is exported with."""
    return ({"users": 4, "history": 32, "candidates": 16} if small
            else {"users": 32, "history": 2047, "candidates": 2048})


def gr_bundle(work: Path, small: bool, ranges: dict[str, int], name: str) -> Path:
    model = gr_ranker.build_ranker(**shape(small))
    return hstu_export.save_bundle(
        model, work / f"{name}.pt", example_inputs=gr_ranker.example_inputs([5, 3, 7], [3, 1, 2]),
        factory="gr_ranker:build_ranker", factory_kwargs=shape(small),
        ranges={"uih_features.video_id": (1, ranges["history"]), "uih_features.user_id": (1, 1),
                "candidates_features": (1, ranges["candidates"])})


GR_ATTENTION = "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha"


def tzrec_bundle(work: Path, small: bool, ranges: dict[str, int], name: str) -> Path:
    """tests/user_models/tzrec_style.py (a ``Batch`` dataclass in, TorchEasyRec's layout) at the same dims."""
    kwargs = {key: shape(small)[key] for key in ("dim", "heads", "layers")}
    return hstu_export.save_bundle(
        tzrec_style.build_ranker(**kwargs), work / f"{name}.pt",
        example_inputs=(tzrec_style.example_batch([5, 3, 7], [3, 1, 2]),),
        factory="user_models.tzrec_style:build_ranker", factory_kwargs=kwargs,
        ranges={"batch.sparse_features.uih": (1, ranges["history"]),
                "batch.sparse_features.candidate": (1, ranges["candidates"])})


def tzrec_settings(device: str, ranges: dict[str, int], verify: bool, dtype: str | None = None,
                   **extra: Any) -> ExportSettings:
    return settings(device, ranges, verify, dtype, reference_device="cpu",
                    op_mappings={tzrec_style.ATTENTION: GR_ATTENTION}, **extra)


def step_tzrec_timed(work: Path, device: str, small: bool, variants: list[str]) -> dict[str, Any]:
    """The TorchEasyRec-style model exported for the timed ranges (unverified, as ``tzrec``'s second package), and
    again for each of ``variants`` that leaves a pass out; not the zoo (``export`` writes it, so that this step
    can run beside it in another process)."""
    ranges, out = sizes(small), {}
    bundle = tzrec_bundle(work, small, ranges, "tzrec_timed")
    for variant in ("timed", *[v for v in variants if v in TZREC_VARIANTS]):
        start = time.perf_counter()
        hstu_export.export(bundle, work / f"tzrec_{variant}.aoti",
                           tzrec_settings(device, ranges, False, **VARIANTS.get(variant, {})))
        out[f"tzrec_{variant}_export_seconds"] = round(time.perf_counter() - start, 1)
    return out


def step_tzrec(work: Path, device: str, small: bool, timed: bool = True) -> dict[str, Any]:
    """The TorchEasyRec-style model: verified in fp32 at the small ranges, then (``timed``) exported for the timed
    ones."""
    bundle = tzrec_bundle(work, small, VERIFIED, "tzrec_small")
    start = time.perf_counter()
    result = hstu_export.export(bundle, work / "tzrec_small.aoti", tzrec_settings(device, VERIFIED, True, "float32"))
    parity = result.parity
    out: dict[str, Any] = {
        "verify_seconds": round(time.perf_counter() - start, 1), "passed": parity["passed"], "worst": parity["worst"],
        "batches": len(parity["batches"]),
        "fused": next(p["stats"] for p in result.manifest["passes"] if p["name"] == "fuse_stu_gate"),
        "tolerances": parity["tolerances"], "fp32_precision": torch.get_float32_matmul_precision()}
    if not timed:
        return out
    start = time.perf_counter()
    timed = hstu_export.export(tzrec_bundle(work, small, sizes(small), "tzrec_timed"), work / "tzrec_timed.aoti",
                               tzrec_settings(device, sizes(small), False))
    out["export_seconds"] = round(time.perf_counter() - start, 1)
    # What the programs were compiled for, where Inductor held a dim below the declared ranges.
    out["narrowed"] = timed.manifest["ranges"].get("narrowed", [])
    out["narrowed_dims"] = timed.manifest["backend"]["meta"].get("narrowed_dims", [])
    if not (work / "zoo.aoti").is_dir():
        out["zoo_export_seconds"] = export_zoo(work, device, small)
    return out


def settings(device: str, ranges: dict[str, int], verify: bool, dtype: str | None = None,
             **kwargs: Any) -> ExportSettings:
    """bf16 on CUDA unless ``dtype`` says otherwise; fp32 on the CPU."""
    cuda = device == "cuda"
    return ExportSettings(backend="aoti", device=device, dtype=dtype or ("bfloat16" if cuda else "float32"),
                          max_batch_size=ranges["users"], force=True,
                          verify=VerifySettings(enabled=verify, num_random_batches=2), **kwargs)


VERIFIED = {"users": 4, "history": 64, "candidates": 16}


def step_verify(work: Path, device: str, small: bool) -> dict[str, Any]:
    ranges = VERIFIED
    bundle = gr_bundle(work, small, ranges, "gr_small")
    start = time.perf_counter()
    result = hstu_export.export(bundle, work / "gr_small.aoti",
                                settings(device, ranges, True, dtype="float32", reference_device="cpu"))
    parity = result.parity
    return {"seconds": round(time.perf_counter() - start, 1), "passed": parity["passed"], "worst": parity["worst"],
            "tolerances": parity["tolerances"], "reference": parity["reference"],
            "batches": [(r["batch"], r["passed"]) for r in parity["batches"]],
            "mapped": next(p["stats"] for p in result.manifest["passes"] if p["name"] == "map_ops").get("foreign"),
            "triton_configs": result.manifest.get("triton_configs", {})}


# The same model exported with one step of ours left out, timed beside the default export:
# - unfused: without fuse_stu_gate, each layer's gate as Inductor compiles the model's own code;
# - padded_positions: its position and time encodings traced as the library wrote them (a padded copy and
#   back), not computed on the jagged rows.
POSITIONS = "generative_recommenders.ops.pytorch.pt_position.pytorch_add_timestamp_positional_embeddings"
VARIANTS: dict[str, dict[str, Any]] = {
    "unfused": {"skip_passes": ("fuse_stu_gate",)},
    "padded_positions": {"op_mappings": {POSITIONS: "keep"}},
    "length_reads": {"skip_passes": ("prove_length_reads",)},  # sizes and proven length checks read from the device
    "unaligned": {"skip_passes": ("align_linear_inputs",)},  # Linear inputs as wide as the model made them
}
# The variants that leave a pass out, which the TorchEasyRec-style model is exported with too (``tzrec-timed``).
TZREC_VARIANTS = ("unfused", "length_reads", "unaligned")


def step_export(work: Path, device: str, small: bool, variants: list[str], default: bool = True) -> dict[str, Any]:
    ranges = sizes(small)
    out: dict[str, Any] = {}
    bundle = gr_bundle(work, small, ranges, "gr_timed")
    if default:
        start = time.perf_counter()
        hstu_export.export(bundle, work / "gr_timed.aoti", settings(device, ranges, False, reference_device="cpu"))
        out["gr_export_seconds"] = round(time.perf_counter() - start, 1)
    if default and (work / "gr_small.aoti").is_dir():  # the timed package against the verified one, on requests both take
        out["gr_timed_vs_verified"] = compare_with_verified(work, bundle, ranges)
    for variant in variants:
        start = time.perf_counter()
        hstu_export.export(bundle, work / f"gr_{variant}.aoti",
                           settings(device, ranges, False, reference_device="cpu", **VARIANTS[variant]))
        out[f"gr_{variant}_export_seconds"] = round(time.perf_counter() - start, 1)
    out["zoo_export_seconds"] = export_zoo(work, device, small)
    return out


def export_zoo(work: Path, device: str, small: bool) -> float:
    """The zoo's dlrmv3 package (the baseline) with the timed ranges; seconds taken."""
    ranges = sizes(small)
    zoo_model = build_preset("tiny" if small else "dlrmv3", seed=0)
    schema = zoo_model.input_schema()
    zoo_bundle = hstu_export.save_bundle(zoo_model, work / "zoo.pt", hstu_export.generate_batch(schema, 3, seed=1))
    start = time.perf_counter()
    zoo_settings = settings(device, ranges, False, lengths={"uih_lengths": (1, ranges["history"]),
                                                            "candidate_lengths": (1, ranges["candidates"])})
    hstu_export.export(zoo_bundle, work / "zoo.aoti", zoo_settings)
    return round(time.perf_counter() - start, 1)


def compare_with_verified(work: Path, bundle: Path, ranges: dict[str, int]) -> dict[str, dict[str, float]]:
    """The timed package (bf16 on CUDA) against the verified fp32 one, per output: bf16's own error."""
    timed, verified = hstu_export.load(work / "gr_timed.aoti"), hstu_export.load(work / "gr_small.aoti")
    model = hstu_export.load_bundle(bundle).model
    worst: dict[str, dict[str, float]] = {}
    h, c = min(VERIFIED["history"], ranges["history"]), min(VERIFIED["candidates"], ranges["candidates"])
    for seed, (history, candidates) in enumerate([([1], [1]), ([7, h], [3, c]), ([h] * 4, [c] * 4)]):
        request = flatten_example(timed.input_schema, gr_ranker.example_inputs(history, candidates, seed=seed), None,
                                  model)
        a, b = timed(request), verified(request)
        for k in a:
            got, want = a[k].float(), b[k].float()
            seen = worst.setdefault(k, {"max_abs": 0.0, "rel_l2": 0.0})
            seen["max_abs"] = max(seen["max_abs"], float((got - want).abs().max()))
            seen["rel_l2"] = max(seen["rel_l2"], float((got - want).norm() / want.norm().clamp_min(1e-12)))
    return worst


def workload(small: bool, seed: int = 2026) -> tuple[list[int], list[int]]:
    s = sizes(small)
    gen = torch.Generator().manual_seed(seed)
    history = torch.randint(1, s["history"] + 1, (s["users"],), generator=gen).tolist()
    return history, [s["candidates"]] * s["users"]


def dense_answer(predictor: Any, request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The package's answer to ``request`` (every output)."""
    with torch.no_grad():
        return dict(predictor(request))


def dense_timer(predictor: Any, request: dict[str, torch.Tensor], iters: int, warmup: int) -> dict[str, float]:
    split = predictor.split
    request = predictor.check_request(request)
    features = {f.graph_name: request[f.name].to(predictor.device) for f in predictor.input_schema.features}
    inputs = split.dense_inputs(features)
    cuda = predictor.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        for _ in range(warmup):
            split.dense(**inputs)
        sync()
        times = []
        for _ in range(iters):
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                split.dense(**inputs)
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                start = time.perf_counter()
                split.dense(**inputs)
                times.append((time.perf_counter() - start) * 1000)
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            split.dense(**inputs)
        sync()
        back_to_back = (time.perf_counter() - start) * 1000 / iters
    return {"ms": statistics.median(times), "ms_back_to_back": back_to_back,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}


def timed_sides(work: Path, small: bool) -> tuple[list[tuple[str, Any, Any]], dict[str, Any]]:
    """Every package in ``work`` with the workload's request for it: (name, predictor, request), and notes.

    The zoo first; GR's default and its variants share one request (the variants take the default's inputs);
    the TorchEasyRec-style package when it serves the workload's users."""
    history, candidates = workload(small)
    zoo = hstu_export.load(work / "zoo.aoti")
    zoo_request = hstu_export.generate_batch(zoo.input_schema, len(history), seed=5,
                                             lengths={"uih_lengths": history, "candidate_lengths": candidates})
    sides: list[tuple[str, Any, Any]] = [("zoo", zoo, zoo_request)]
    notes: dict[str, Any] = {}
    gr_packages = [(f"gr_{variant}", work / f"gr_{variant}.aoti") for variant in ("timed", *VARIANTS)]
    gr_packages = [(name.replace("_timed", ""), path) for name, path in gr_packages if path.is_dir()]
    if gr_packages:
        model = hstu_export.load_bundle(work / "gr_timed.pt").model
        predictors = [(name, hstu_export.load(path)) for name, path in gr_packages]
        gr_request = flatten_example(predictors[0][1].input_schema,
                                     gr_ranker.example_inputs(history, candidates, seed=5), None, model)
        sides.extend((name, predictor, gr_request) for name, predictor in predictors)
    if (work / "tzrec_timed.aoti").is_dir():
        tzrec = hstu_export.load(work / "tzrec_timed.aoti")
        tzrec_model = hstu_export.load_bundle(work / "tzrec_timed.pt").model
        served = tzrec.manifest["ranges"]["max_batch_size"]
        if served < len(history):  # export narrowed it to what its programs were compiled for
            notes["tzrec_not_timed"] = f"the package serves at most {served} users: {tzrec.manifest['ranges']['narrowed']}"
        else:
            request = flatten_example(tzrec.input_schema, (tzrec_style.example_batch(history, candidates, seed=5),),
                                      None, tzrec_model)
            sides.append(("tzrec", tzrec, request))
            sides.extend((f"tzrec_{variant}", hstu_export.load(work / f"tzrec_{variant}.aoti"), request)
                         for variant in TZREC_VARIANTS if (work / f"tzrec_{variant}.aoti").is_dir())
    return sides, notes


def step_time(work: Path, small: bool, iters: int, warmup: int) -> dict[str, Any]:
    history, candidates = workload(small)
    tokens = sum(history) + sum(candidates)
    out: dict[str, Any] = {"users": len(history), "history_tokens": sum(history), "candidate_tokens": sum(candidates),
                           "longest_history": max(history), "iters": iters}
    sides, notes = timed_sides(work, small)
    out.update(notes)
    # Alternated twice, so that no package always runs first on a warmer GPU.
    for _ in range(2):
        for name, predictor, request in sides:
            timing = dense_timer(predictor, request, iters, warmup)
            out.setdefault(name, []).append(timing)
    answers = {name: dense_answer(predictor, request) for name, predictor, request in sides if name != "zoo"}
    for name, answer in answers.items():  # a variant against its model's default package, on the same request
        base = name.split("_")[0]
        if name != base and base in answers:
            want = {k: v.float() for k, v in answers[base].items()}
            out[f"{name}_vs_{base}_rel_l2"] = max(
                float((answer[k].float() - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in answer)
    for name, _, _ in sides:
        best = min(out[name], key=lambda t: t["ms"])
        out[f"{name}_ms"] = best["ms"]
        out[f"{name}_mtokens_per_s"] = tokens / best["ms"] / 1e3
        out[f"{name}_vs_zoo_tokens_per_s"] = out[f"{name}_mtokens_per_s"] / out["zoo_mtokens_per_s"]
    return out


def step_profile(work: Path, small: bool, iters: int = 5) -> dict[str, Any]:
    """Where each dense half's time goes: the GPU kernels of ``iters`` calls, by total time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    sides, _ = timed_sides(work, small)
    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {}
    for name, predictor, request in sides:
        dense_timer(predictor, request, 2, 2)  # warm
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            dense_timer(predictor, request, iters, 0)
        rows = []
        for event in prof.key_averages():
            total = event.device_time_total if cuda else event.self_cpu_time_total
            if total > 0:
                rows.append({"kernel": event.key[:160], "calls": event.count, "ms_per_request": total / 1e3 / (2 * iters)})
        rows.sort(key=lambda r: -r["ms_per_request"])
        out[name] = {"kernels_ms_per_request": round(sum(r["ms_per_request"] for r in rows), 3), "top": rows[:25]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None, help="where packages are kept between steps [--out]")
    parser.add_argument("--steps", nargs="+", default=["verify", "export", "time"], choices=["verify", "export", "tzrec", "tzrec-verify", "tzrec-timed", "time", "profile"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="small shapes and sizes (a dry run)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--fp32-precision", default="highest", choices=["highest", "high"],
                        help="torch.set_float32_matmul_precision for the run: high multiplies fp32 in TF32 "
                             "(our kernels' and cuBLAS's), and fp32 exports are held to TF32's tolerances")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                        help="GR exported again with one step left out, timed beside the default [all]")
    parser.add_argument("--variants-only", action="store_true",
                        help="export: the variants and the zoo, not GR's default package (time times what is there)")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.fp32_precision)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out
    work.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "gr_dlrmv3.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}
    results["machine"] = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                          "torch": torch.__version__, "python": platform.python_version(),
                          "date": time.strftime("%Y-%m-%d"), "gr_snapshot": os.environ.get("GR_SNAPSHOT")}
    code = 0
    for step in args.steps:
        start = time.perf_counter()
        try:
            if step == "verify":
                results[step] = step_verify(work, args.device, args.small)
            elif step == "export":
                results[step] = step_export(work, args.device, args.small, args.variants, not args.variants_only)
            elif step == "tzrec-timed":
                results[step] = step_tzrec_timed(work, args.device, args.small, args.variants)
            elif step in ("tzrec", "tzrec-verify"):
                results[step] = step_tzrec(work, args.device, args.small, timed=step == "tzrec")
            elif step == "time":
                results[step] = step_time(work, args.small, args.iters, args.warmup)
            else:
                results[step] = step_profile(work, args.small)
        except Exception as exc:
            results[step] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
            code = 1
        results[step]["step_seconds"] = round(time.perf_counter() - start, 1)
        results_path.write_text(json.dumps(results, indent=2, default=str))
        print(step, json.dumps({k: v for k, v in results[step].items() if k != "traceback"}, default=str)[:1500],
              flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
