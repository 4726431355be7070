"""Users' own models (tests/user_models) exported for CUDA on the GPU machine, AOTInductor with the triton
op target, verified against the model itself at export time and again on a fresh batch.

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/gpu_user_models.py --out $OUT

Writes gpu_user_models.json: per model the export time, parity, what map_ops did, the triton configs
the package recorded, or the error. The DLRM-HSTU model's own helpers call fbgemm's jagged ops in eager
mode, which need fbgemm's CUDA build (the GPU machine has the CPU build only), so its CUDA run is
expected to stop at the first eager call there; the error is recorded as it is.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch
from user_models import dlrm_hstu, pooled

import hstu_export
from hstu_export.sources.schema_inference import flatten_example

GR_ATTENTION = "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha"
CASES = {
    "pooled": (pooled.build_pooled, "user_models.pooled:build_pooled", pooled.example_inputs,
               {"sparse_features": (1, 6)}, {}),
    "dlrm_hstu": (dlrm_hstu.build_ranker, "user_models.dlrm_hstu:build_ranker", dlrm_hstu.example_inputs,
                  {"uih_features": (1, 64), "candidates_features": (1, 16)},
                  {"user_models.dlrm_hstu.jagged_hstu_attention": GR_ATTENTION}),
}


def run(name: str, out: Path) -> dict:
    build, factory, examples, ranges, mappings = CASES[name]
    model = build()
    bundle = hstu_export.save_bundle(model, out / f"{name}.pt", example_inputs=examples(3, seed=0), factory=factory,
                                     ranges=ranges)
    settings = hstu_export.ExportSettings(backend="aoti", device="cuda", max_batch_size=8, op_mappings=mappings,
                                          force=True)
    start = time.perf_counter()
    result = hstu_export.export(bundle, out / f"{name}.aoti", settings)
    seconds = time.perf_counter() - start
    predictor = hstu_export.load(result.path)
    request = flatten_example(predictor.input_schema, examples(5, seed=42), None, model)
    eager = model.to("cuda")
    with torch.no_grad():
        args, kwargs = predictor.input_schema.assemble({k: v.cuda() for k, v in request.items()})
        expected = hstu_export.sources.outputs.flatten_outputs(eager(*args, **kwargs))
    got = predictor(request)
    passes = {p["name"]: p["stats"] for p in result.manifest["passes"]}
    return {
        "ok": True, "export_s": round(seconds, 1), "parity": result.parity["worst"],
        "tolerances": result.parity["tolerances"], "fresh_batch_max_abs": {
            k: float((got[k].float() - expected[k].float()).abs().max()) for k in expected},
        "op_target": result.manifest["op_target"], "foreign": passes["map_ops"].get("foreign"),
        "mapped": passes["map_ops"].get("mapped"), "triton_configs": result.manifest["triton_configs"],
        "boundary": passes["mark_sparse_dense"].get("automatic_marks"), "device": result.manifest["device"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=list(CASES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import hstu_export.sources.outputs  # noqa: F401

    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    for name in args.models:
        try:
            results[name] = run(name, args.out / "work")
        except Exception as exc:  # recorded, not raised: the other model still runs
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}",
                             "traceback": traceback.format_exc()[-3000:]}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "traceback"}, default=str)[:1500])
    (args.out / "gpu_user_models.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
