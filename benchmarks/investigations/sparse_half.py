"""Where the sparse half's time goes on the GPU, scripted (as onnx and trt packages store it; aoti packages compile
it, cpp_kv_cache.py times that): as exported, without the range checks (the gathers alone), and without the
lowering (torchrec's KeyedJaggedTensor code).

    PYTHONPATH=$PWD python benchmarks/investigations/sparse_half.py --out FILE [--batches 1 8 32]

The model and requests are cpp_kv_cache.py's ``long`` workload (dlrmv3 shapes, bf16, history 4096 + 256
candidates). Each variant is the pipeline's sparse graph (no compile of the dense half), scripted as the
package scripts it; the request is on the device, and each call is synchronised (CUDA events), p50 of --iters
calls after warm-ups, the variants in turn over three rounds. Writes FILE (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kv_cache import WORKLOADS, bench, request

import hstu_export
from hstu_export.exporter import capture
from hstu_export.models.config import preset_config
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.runtimes.graph_io import script_graph_module

VARIANTS = {
    "as exported": (),
    "without range checks": ("guard_ranges",),
    "not lowered (torchrec)": ("lower_embeddings",),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    work = WORKLOADS["long"]
    cfg = dataclasses.replace(preset_config("dlrmv3"), max_history_len=work["history"],
                              max_num_candidates=work["candidates"])
    torch.manual_seed(0)
    model = HstuRankingModel(cfg).eval()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        bundle = hstu_export.load_bundle(hstu_export.save_bundle(model, Path(tmp) / "m.pt", request(model, work, 2, 1)))
        halves = {}
        for name, skip in VARIANTS.items():
            settings = hstu_export.ExportSettings(backend="aoti", device=device.type, dtype="bf16",
                                                  max_batch_size=max(args.batches), skip_passes=skip)
            sparse = capture(bundle, settings, "triton" if device.type == "cuda" else "aten").result.sparse
            names = [n.target for n in sparse.graph.nodes if n.op == "placeholder"]
            halves[name] = (script_graph_module(sparse, "sparse"), names)
    for batch in args.batches:
        features = {k: v.to(device) for k, v in request(model, work, batch, 100 + batch).items()}
        rows: dict = {name: [] for name in halves}
        with torch.no_grad():
            for _ in range(3):
                for name, (module, names) in halves.items():
                    kwargs = {k: features[k] for k in names}
                    rows[name].append(bench(lambda m=module, kw=kwargs: m(**kw), args.iters, warmup=10)["p50_ms"])
        report["variants"][str(batch)] = {name: {"rounds_ms": [round(t, 4) for t in times],
                                                 "median_ms": round(statistics.median(times), 4)}
                                          for name, times in rows.items()}
        print(batch, {name: round(statistics.median(times), 3) for name, times in rows.items()}, flush=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
