"""CUDA exports on the GPU machine: AOTInductor packages of the `tiny` and `dlrmv3` presets with the
`triton` op target, verified against eager at export time and reloaded in a fresh process.

    PYTHONPATH=$PWD python benchmarks/gpu_export_check.py --out $OUT [--presets tiny dlrmv3]

Writes gpu_export_check.json: per preset the export time, the export-time parity report, the fresh
process's comparison against eager on new batches, the GPU and the library versions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

import hstu_export
from hstu_export.models import build_preset

# Export ranges per preset: the dlrmv3 workload (B=32, histories up to 2048, 2048 candidates).
RANGES = {"tiny": dict(max_batch_size=16), "dlrmv3": dict(max_batch_size=32), "tzrec": dict(max_batch_size=8)}
DTYPES = {"tiny": "fp32", "dlrmv3": "bf16", "tzrec": "bf16"}

FRESH = textwrap.dedent("""
    import json, sys, torch, hstu_export
    predictor = hstu_export.load(sys.argv[1])
    batches = torch.load(sys.argv[2], weights_only=True)
    outs = [{k: v.float().cpu() for k, v in predictor(b).items()} for b in batches]
    torch.save(outs, sys.argv[3])
    print(json.dumps({"device": str(predictor.device), "leaked_model_code": "hstu_export.models" in sys.modules}))
""")


def check(preset: str, workdir: Path, fresh_batches: int) -> dict:
    model = build_preset(preset, seed=0)
    bundle = hstu_export.save_bundle(model, workdir / f"{preset}.pt", hstu_export.generate_batch(model.input_schema(), 4, seed=1))
    settings = hstu_export.ExportSettings(
        backend="aoti", device="cuda", dtype=DTYPES[preset], op_target="triton",
        verify=hstu_export.VerifySettings(num_random_batches=2), **RANGES[preset],
    )
    pkg = workdir / f"{preset}.aoti"
    t = time.perf_counter()
    result = hstu_export.export(bundle, pkg, settings)
    seconds = time.perf_counter() - t
    manifest = result.manifest
    # Fresh process: only hstu_export.load, new batches, compared here against eager.
    schema = model.input_schema()
    batches = [hstu_export.generate_batch(schema, 1 + (i * 7) % settings.max_batch_size, seed=500 + i)
               for i in range(fresh_batches)]
    torch.save(batches, workdir / "batches.pt")
    script = workdir / "fresh.py"
    script.write_text(FRESH)
    proc = subprocess.run([sys.executable, str(script), str(pkg), str(workdir / "batches.pt"), str(workdir / "outs.pt")],
                          capture_output=True, text=True, timeout=900)
    fresh: dict = {"returncode": proc.returncode, "stderr_tail": proc.stderr[-1500:]}
    if proc.returncode == 0:
        fresh.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        outs = torch.load(workdir / "outs.pt", weights_only=True)
        eager = model.to(device="cuda", dtype=settings.torch_dtype).eval()
        worst = 0.0
        with torch.no_grad():
            for batch, got in zip(batches, outs):
                ref = eager({k: v.cuda() for k, v in batch.items()})
                for k, r in ref.items():
                    r = r.double().cpu()
                    worst = max(worst, float(torch.linalg.vector_norm(got[k].double() - r) / torch.linalg.vector_norm(r)))
        fresh["worst_rel_l2_vs_eager"] = worst
        fresh["batches"] = fresh_batches
    return {
        "preset": preset, "dtype": settings.dtype, "export_seconds": seconds,
        "parity": {k: manifest["parity"][k] for k in ("passed", "worst", "tolerances")},
        "parity_batches": [(r["batch"], r["batch_size"], r["passed"]) for r in manifest["parity"]["batches"]],
        "op_libraries": manifest["op_libraries"], "device": manifest["device"],
        "triton_configs": manifest.get("triton_configs"),
        "timings": manifest["timings"], "fresh_process": fresh,
        "package_bytes": sum(p.stat().st_size for p in pkg.rglob("*") if p.is_file()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--presets", nargs="+", default=["tiny", "dlrmv3"])
    parser.add_argument("--fresh-batches", type=int, default=5)
    parser.add_argument("--keep", default=None, help="keep the packages in this directory (for benchmarks/e2e.py)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": []}
    for preset in args.presets:
        workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu-export-"))
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            res = check(preset, workdir, args.fresh_batches)
        except Exception as exc:  # keep going: report what failed
            import traceback

            res = {"preset": preset, "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
                   "traceback": traceback.format_exc()[-3000:]}
        results["checks"].append(res)
        print(json.dumps(res, indent=1, default=str)[:3000], flush=True)
        (out / "gpu_export_check.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
