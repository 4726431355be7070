#!/usr/bin/env python3
"""Check the sparse/dense split on the tzrec preset (D=512, 3 layers; too big for CI).

Traces the model, runs the default passes and compares ``dense(**sparse(batch), **passthrough)`` with
the eager model on a few small batches of varied sizes and lengths. Exit code 0 when every batch is
within tolerance.

    python examples/check_split_tzrec.py [--tolerance 1e-5] [--seed 0] [--skip-pass map_ops]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hstu_export import PassContext, generate_batch, run_passes, trace
from hstu_export.errors import HstuExportError
from hstu_export.models import build_preset
from hstu_export.passes.manager import max_rel_error, parameter_totals

# (batch size, uih lengths, candidate lengths); None draws lengths up to the given caps.
CASES: list[tuple[int, list[int] | int, list[int] | int]] = [
    (1, [5], [3]),
    (2, 64, 32),
    (3, [512, 1, 40], [256, 1, 7]),
    (4, 128, 64),
    (1, [1], [1]),
]


def _lengths(value: list[int] | int, batch_size: int, gen: torch.Generator) -> list[int]:
    if isinstance(value, list):
        return value
    return torch.randint(1, value + 1, (batch_size,), generator=gen).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max relative error (default 1e-5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-pass", action="append", default=[], metavar="NAME", help="leave out a pass (repeatable)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    try:
        start = time.perf_counter()
        model = build_preset("tzrec", seed=args.seed)
        schema = model.input_schema()
        example = generate_batch(schema, 2, seed=args.seed, lengths={"uih_lengths": [20, 33], "candidate_lengths": [4, 9]})
        gm = trace(model, example)
        result = run_passes(gm, PassContext(example_inputs=example, model=model), skip=args.skip_pass)
        print(f"tzrec: traced and split in {time.perf_counter() - start:.1f}s")
        for r in result.report:
            print(f"  {r.index:02d} {r.name:<22} {r.status:<7} {r.time_s * 1000:8.1f} ms  nodes {r.nodes_before} -> {r.nodes_after}")
        assert result.sparse is not None and result.dense is not None and result.boundary is not None
        for name, gm_half in (("sparse", result.sparse), ("dense", result.dense)):
            count, nbytes = parameter_totals(gm_half)
            print(f"  {name}: {count:,} parameters ({nbytes / 2**20:.1f} MiB), {len(gm_half.graph.nodes)} nodes")
        print("  boundary: " + ", ".join(f"{t.name}{list(t.shape)}" for t in result.boundary.sparse_outputs))

        gen = torch.Generator().manual_seed(args.seed)
        worst = 0.0
        for index, (batch_size, uih, cand) in enumerate(CASES):
            lengths = {"uih_lengths": _lengths(uih, batch_size, gen), "candidate_lengths": _lengths(cand, batch_size, gen)}
            batch = generate_batch(schema, batch_size, seed=args.seed + 1 + index, lengths=lengths)
            t0 = time.perf_counter()
            expected = model(batch)
            t1 = time.perf_counter()
            actual = result.run(batch)
            t2 = time.perf_counter()
            error = max_rel_error(actual, expected)
            if error is None:
                print(f"  batch {index}: output structure differs: {list(actual)} vs {list(expected)}")
                return 1
            worst = max(worst, error)
            status = "ok" if error <= args.tolerance else "FAIL"
            print(f"  batch {index}: B={batch_size} uih={sum(lengths['uih_lengths'])} "
                  f"candidates={sum(lengths['candidate_lengths'])}  max rel err {error:.3g}  "
                  f"(eager {t1 - t0:.2f}s, split {t2 - t1:.2f}s)  {status}")
    except HstuExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    ok = worst <= args.tolerance
    print(f"{'PASS' if ok else 'FAIL'}: worst max relative error {worst:.3g} (tolerance {args.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
