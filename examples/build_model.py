#!/usr/bin/env python3
"""Build a seeded HSTU ranking model of a named preset and save it as a model bundle.

    python examples/build_model.py --preset tiny -o model.pt
"""

from __future__ import annotations

import argparse
import sys

from hstu_export import generate_batch, save_bundle
from hstu_export.errors import HstuExportError
from hstu_export.models import PRESETS, build_preset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model configuration (default: tiny)")
    parser.add_argument("-o", "--output", default="model.pt", help="bundle path to write (default: model.pt)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the example batch")
    parser.add_argument("--batch-size", type=int, default=4, help="users in the example batch (>= 2)")
    args = parser.parse_args()
    try:
        model = build_preset(args.preset, seed=args.seed)
        batch = generate_batch(model.input_schema(), args.batch_size, seed=args.seed)
        path = save_bundle(model, args.output, batch)
    except HstuExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {path} (preset {args.preset}, {params:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
