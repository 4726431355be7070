"""The whole request through the C++ runtime called from Python (``NativePredictor``) in a fresh process (GPU).

    PYTHONPATH=$PWD python benchmarks/investigations/native_fresh.py WORK OUT.json

``WORK`` is a ``benchmarks/gpu_kv_derived.py --cpp`` run's ``--work``: its packages (``zoo.aoti``,
``zoo_derived.aoti``), the C++ runtime it built (``build/libhstu_export_native.so``) and the two requests of each
batch it saved for the C++ runtime (``requests_<package>_<users>/0`` and ``/1``). For each package and batch: the
second request without the cache, and cached after the first (a hit), median of 20 CUDA-event-timed calls after 5
warm-up calls each. ``gpu_kv_derived.py`` times the same inside its own process, which holds Python's packages too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_kv_derived import time_native

from hstu_export.package.tensor_dir import load_tensors


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    work, result = Path(sys.argv[1]), {}  # type: ignore[var-annotated]
    for name in ("zoo", "zoo_derived"):
        for users in (1, 8, 32):
            where = work / f"requests_{name}_{users}"
            if not (work / f"{name}.aoti").is_dir() or not where.is_dir():
                continue
            row: dict[str, Any]
            try:
                requests = (load_tensors(where / "0"), load_tensors(where / "1"))
                row = time_native(work / "build" / "libhstu_export_native.so", work / f"{name}.aoti", requests, users,
                                  20)
            except Exception as exc:
                row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            result.setdefault(name, {})[str(users)] = row
            print(name, users, row, flush=True)
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
