#!/usr/bin/env python3
"""Export generative-recommenders' DlrmHSTU with hstu-export, unedited, and check it against the model.

    GR_SRC=/path/to/generative-recommenders python examples/generative_recommenders/export_dlrm_hstu.py \
        --out out/gr [--backend aoti torchscript onnx] [--quantize-embeddings int8]

The user code is gr_ranker.py (factory + example inputs) and the few lines of main() below that save a
bundle and export it. It is not run in CI: generative-recommenders is not on the package index.
Results are recorded in docs/GENERATIVE_RECOMMENDERS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gr_ranker, the factory the bundle names

import gr_ranker
import torch

import hstu_export
from hstu_export.sources.output_plan import OutputPlan
from hstu_export.sources.outputs import call_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/gr"))
    parser.add_argument("--backend", nargs="+", default=["aoti", "torchscript", "onnx"])
    parser.add_argument("--attention-scale", default="batch")
    parser.add_argument("--quantize-embeddings", default="none", choices=["none", "fp16", "int8", "int4"])
    parser.add_argument("--prechecked-sparse", default="auto", choices=["auto", "on", "off"])
    args = parser.parse_args()

    # --- user code: a bundle naming the factory, with the lengths the serving requests may have ---
    model = gr_ranker.build_ranker()
    bundle = hstu_export.save_bundle(
        model, args.out / "dlrm_hstu.pt", example_inputs=gr_ranker.example_inputs([10, 5, 7], [3, 1, 2]),
        factory="gr_ranker:build_ranker",
        ranges={"uih_features.video_id": (1, 40), "uih_features.user_id": (1, 1), "candidates_features": (1, 8)})
    results = {}
    for backend in args.backend:
        # DlrmHSTU returns a tuple: its tasks' predictions are named for the tasks it lists, the embeddings here.
        settings = hstu_export.ExportSettings(backend=backend, max_batch_size=8, force=True,
                                              attention_scale=args.attention_scale,
                                              output_names={"output_0": "user_embeddings", "output_1": "item_embeddings"},
                                              quantization=args.quantize_embeddings,
                                              prechecked_sparse=args.prechecked_sparse if backend == "aoti" else "auto")
        start = time.perf_counter()
        try:
            result = hstu_export.export(bundle, args.out / f"dlrm_hstu.{backend}", settings)
        except hstu_export.HstuExportError as exc:
            results[backend] = {"ok": False, "error": str(exc)}
            print(f"{backend}: FAILED: {exc}")
            continue
        # --- end of user code ---
        passes = {p["name"]: p["stats"] for p in result.manifest["passes"]}
        results[backend] = {
            "ok": True, "seconds": round(time.perf_counter() - start, 1), "parity": result.parity["worst"],
            "outputs": {o["name"]: o["kind"] for o in result.manifest["outputs"]},
            "worst_per_output": worst_per_output(result.parity),
            "tolerances": {"scores": result.parity["tolerances"], **result.parity.get("output_tolerances", {})},
            "rank_agreement": result.parity.get("rank_agreement"),
            "batches": [(r["batch"], r["batch_size"]) for r in result.parity["batches"]],
            "boundary": passes["mark_sparse_dense"].get("automatic_marks"),
            "mapped": passes["map_ops"].get("foreign"), "not_mapped": passes["map_ops"].get("foreign_kept"),
            "opaque": result.manifest["capture"]["opaque_calls"], "backend_meta": result.manifest["backend"]["meta"],
            "files": {k: v for k, v in result.manifest["backend"]["files"].items()},
            "narrowed": result.manifest["ranges"].get("narrowed", []),
            # With fixed:N the model's own scale differs by design; verification compared the corners with the
            # model run with the same divisor.
            "corners": serve_corners(result.path, model) if args.attention_scale == "batch" else "in parity",
            "sparse_model": getattr(hstu_export.load(result.path).split, "sparse_model", None),
        }
        print(f"{backend}: ok in {results[backend]['seconds']} s, worst rel. L2 {result.parity['worst']['rel_l2']:.2e}")
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(r["ok"] for r in results.values()) else 1


def worst_per_output(parity: dict) -> dict[str, dict[str, float]]:
    """The largest errors of each output over the verification batches."""
    worst: dict[str, dict[str, float]] = {}
    for row in parity["batches"]:
        for name, errors in row["errors"].items():
            for key, value in errors.items():
                worst.setdefault(name, {})[key] = max(worst.get(name, {}).get(key, 0.0), value)
    return worst


def serve_corners(package: Path, model: torch.nn.Module) -> dict[str, float]:
    """The package against ``DlrmHSTU.forward`` on single-user requests at the ranges' minima: the worst
    absolute difference per request (history items, candidates)."""
    predictor = hstu_export.load(package)
    worst = {}
    for history, candidates in [(1, 1), (1, 8), (40, 1), (3, 1)]:
        request = hstu_export.flatten_example(predictor.input_schema,
                                              gr_ranker.example_inputs([history], [candidates], seed=history),
                                              None, model)
        with torch.no_grad():
            expected = call_model(model, predictor.input_schema, request, OutputPlan.from_manifest(predictor.manifest))
        got = predictor(request)
        worst[f"1 user, {history} history, {candidates} candidates"] = max(
            float((got[k] - expected[k]).abs().max()) for k in expected)
    return worst


if __name__ == "__main__":
    sys.exit(main())
