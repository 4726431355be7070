#!/usr/bin/env python3
"""Export TorchEasyRec's DlrmHSTU with hstu-export, unedited, and check it against the model.

    PYTHONPATH=/path/to/TorchEasyRec python examples/torcheasyrec/export_dlrm_hstu.py \
        --out out/tzrec [--backend aoti torchscript onnx] [--kv-cache]

The user code is tzrec_ranker.py (factory + example inputs) and the few lines of main() below that save a
bundle and export it. It is not run in CI: TorchEasyRec is not on the package index.
Results are recorded in docs/TORCHEASYREC.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tzrec_ranker, the factory the bundle names

import torch
import tzrec_ranker

import hstu_export
from hstu_export.sources.output_plan import OutputPlan
from hstu_export.sources.outputs import call_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/tzrec"))
    parser.add_argument("--backend", nargs="+", default=["aoti", "torchscript", "onnx"])
    parser.add_argument("--kv-cache", action="store_true", help="export with --kv-cache (its derived delta program, "
                        "verified through the package's cache); results go to results_kv_cache.json")
    args = parser.parse_args()

    # --- user code: a bundle naming the factory, with the lengths the serving requests may have ---
    model = tzrec_ranker.build_ranker()
    bundle = hstu_export.save_bundle(
        model, args.out / "dlrm_hstu.pt", example_inputs=(tzrec_ranker.example_batch([5, 3, 7], [2, 1, 3]),),
        factory="tzrec_ranker:build_ranker", ranges={"batch.sparse_features.__BASE__.uih_seq__video_id": (1, 40),
                                                     "batch.sparse_features.__BASE__.cand_seq__video_id": (1, 8)})
    results = {}
    for backend in args.backend:
        settings = hstu_export.ExportSettings(backend=backend, max_batch_size=8, force=True, kv_cache=args.kv_cache)
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
            "tolerances": result.parity["tolerances"],
            "batches": [(r["batch"], r["batch_size"]) for r in result.parity["batches"]],
            "boundary": passes["mark_sparse_dense"].get("automatic_marks"),
            "mapped": passes["map_ops"].get("foreign"), "not_mapped": passes["map_ops"].get("foreign_kept"),
            "opaque": result.manifest["capture"]["opaque_calls"], "backend_meta": result.manifest["backend"]["meta"],
            "files": dict(result.manifest["backend"]["files"]),
            "narrowed": result.manifest["ranges"].get("narrowed", []),
            "corners": serve_corners(result.path, model),
        }
        if args.kv_cache:
            section, checked = result.manifest["kv_cache"], result.parity["kv_cache"]
            results[backend]["kv_cache"] = {
                **{k: section.get(k) for k in ("kind", "layout", "frontier", "layer_nodes")},
                **{k: checked.get(k) for k in ("passed", "worst", "cache", "not_checked")}}
        print(f"{backend}: ok in {results[backend]['seconds']} s, worst rel. L2 {result.parity['worst']['rel_l2']:.2e}")
    name = "results_kv_cache.json" if args.kv_cache else "results.json"
    (args.out / name).write_text(json.dumps(results, indent=2, default=str))
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
                                              (tzrec_ranker.example_batch([history], [candidates], seed=history),),
                                              None, model)
        with torch.no_grad():
            expected = call_model(model, predictor.input_schema, request, OutputPlan.from_manifest(predictor.manifest))
        got = predictor(request)
        worst[f"1 user, {history} history, {candidates} candidates"] = max(
            float((got[k].double() - expected[k].double()).abs().max()) for k in expected)
    return worst


if __name__ == "__main__":
    sys.exit(main())
