#!/usr/bin/env python3
"""A release script that uses only the Python API: load a bundle, add a pass of our own to the
pipeline, export, verify, print the manifest summary.

    python examples/release.py model.pt --out release/model.aoti
"""

from __future__ import annotations

import argparse
import sys

import torch

import hstu_export


class CountMatmuls:
    """A custom pass: counts the matrix multiplies in each graph and records it in the report.

    Custom passes are objects with a ``name`` and ``run(gm, ctx) -> gm``; they see every graph
    (the top graph and, after the split, ``sparse`` and ``dense``) and report through ``ctx.add_stat``.
    """

    name = "count_matmuls"
    kinds = ("matmul", "addmm", "mm", "bmm", "linear")

    def run(self, gm: torch.fx.GraphModule, ctx: hstu_export.PassContext) -> torch.fx.GraphModule:
        count = 0
        for node in gm.graph.nodes:
            if node.op == "call_function":
                count += getattr(node.target, "__name__", str(node.target)).split(".")[0] in self.kinds
            elif node.op == "call_module":
                count += isinstance(gm.get_submodule(node.target), torch.nn.Linear)
        ctx.add_stat("matmuls", count)
        return gm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", help="model bundle (model.pt)")
    parser.add_argument("--out", required=True, help="package directory to write")
    parser.add_argument("--backend", default="aoti", choices=["aoti", "torchscript", "onnx"])
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()

    try:
        bundle = hstu_export.load_bundle(args.bundle)
        settings = hstu_export.ExportSettings(
            backend=args.backend, max_batch_size=args.max_batch_size, force=args.force,
            verify=hstu_export.VerifySettings(num_random_batches=4),
        )
        result = hstu_export.export(bundle, args.out, settings, extra_passes=[CountMatmuls()])
        # An independent check on fresh batches, through a freshly loaded predictor.
        report = hstu_export.verify_package(args.out, args.bundle, num_random=4, seed=2026)
    except hstu_export.HstuExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code

    m = result.manifest
    custom = next(p for p in m["passes"] if p["name"] == CountMatmuls.name)
    print(f"package   {result.path}")
    print(f"model     {m['model']['name']}  backend {m['backend']['name']}  device {m['device']['type']}  "
          f"dtype {m['dtype']}  ops -> {m['op_target']}")
    print("versions  " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v))
    print("passes    " + " > ".join(p["name"] for p in m["passes"]))
    print(f"custom    {CountMatmuls.name}: {custom['stats']}")
    print(f"parity    export-time worst rel. L2 {m['parity']['worst']['rel_l2']:.2e}; "
          f"re-check on {len(report['batches'])} fresh batches: {'passed' if report['passed'] else 'FAILED'}")
    print("files     " + ", ".join(m["files"]))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
