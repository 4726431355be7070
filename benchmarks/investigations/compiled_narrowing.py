"""Where Inductor narrows a dynamic dim: the TorchEasyRec-style test model exported at the timed ranges of
benchmarks/gpu_gr_dlrmv3.py (DLRMv3's dims, bf16 on CUDA), with every shrink of a traced dim's range (its
largest value lowered or its smallest raised) recorded while Inductor compiles: the symbol, its range before and
after, and the innermost frames of Inductor's stack that made it.

With ``--aoti-option shape_padding=True`` (Inductor's matmul padding pass on, as it is by default in Inductor)
and torch 2.11 on an H200, it finds the pass's heuristic comparing the symbolic sizes (``K > M`` in
``is_mm_compute_bound``): the dense program compiled for at most 3 users and at least 1024 candidates. Our
compiles leave the pass off (runtimes/compiled_bounds.py); run as it is, it finds no shrink (docs/PERF.md,
"CUDA correctness").

    PYTHONPATH=$PWD python benchmarks/investigations/compiled_narrowing.py --out DIR [--device cpu] [--small] \
        [--aoti-option KEY=VALUE ...]

Writes DIR/compiled_narrowing.json: the shrinks, the export's ``narrowed_dims`` and ``ranges.narrowed`` (or the
export's one-line refusal).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_gr_dlrmv3 as bench
from torch.fx.experimental import symbolic_shapes

import hstu_export
from hstu_export.settings import parse_inductor_option


def recording_shrinks(shrinks: list[dict[str, Any]]) -> Any:
    """Hooks the shape environment's range updates: a traced dim (a backed symbol) whose upper bound shrinks
    with Inductor on the stack is appended to ``shrinks``. Returns the original, to restore."""
    original = symbolic_shapes.ShapeEnv._update_var_to_range

    def update(self: Any, symbol: Any, vr: Any, *args: Any, **kwargs: Any) -> None:
        before = self.var_to_range.get(symbol)
        original(self, symbol, vr, *args, **kwargs)
        after = self.var_to_range.get(symbol)
        backed = getattr(self, "backed_var_to_val", None) or self.var_to_val
        if (before is None or after is None or symbol not in backed
                or not (after.upper < before.upper or after.lower > before.lower)):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "torch/_inductor" in f.filename.replace("\\", "/")]
        if frames:
            shrinks.append({"symbol": str(symbol), "example": int(backed[symbol]), "before": str(before),
                            "after": str(after),
                            "inductor_frames": [f"{Path(f.filename).name}:{f.lineno} {f.name}: {f.line}"
                                                for f in frames[-12:]]})

    symbolic_shapes.ShapeEnv._update_var_to_range = update
    return original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="small dims and ranges (a dry run)")
    parser.add_argument("--aoti-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an Inductor option for the compile, as hstu-export's (shape_padding=True: the pass on)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ranges = bench.sizes(args.small)
    work = Path(tempfile.mkdtemp())
    bundle = bench.tzrec_bundle(work, args.small, ranges, "tzrec_timed")
    shrinks: list[dict[str, Any]] = []
    original = recording_shrinks(shrinks)
    manifest: dict[str, Any] = {}
    error = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            settings = dataclasses.replace(bench.tzrec_settings(args.device, ranges, False),
                                           aoti_options=dict(map(parse_inductor_option, args.aoti_option)))
            manifest = hstu_export.export(bundle, work / "pkg", settings).manifest
    except Exception as exc:  # a narrowing export refuses (a total of rows, a smallest batch): the shrinks still count
        error = f"{type(exc).__name__}: {exc}"
    finally:
        symbolic_shapes.ShapeEnv._update_var_to_range = original
    report = {"ranges": ranges, "aoti_options": args.aoti_option, "shrinks": shrinks, "export_error": error,
              "narrowed_dims": manifest.get("backend", {}).get("meta", {}).get("narrowed_dims", []),
              "narrowed": manifest.get("ranges", {}).get("narrowed", []),
              "warnings": [str(w.message) for w in caught if "narrowed" in str(w.message)]}
    (args.out / "compiled_narrowing.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("narrowed_dims", "warnings", "export_error")}), f"{len(shrinks)} shrinks",
          flush=True)


if __name__ == "__main__":
    main()
