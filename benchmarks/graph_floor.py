"""What a chain of near-empty kernels costs in a CUDA graph (GPU only): the floor under a program of many small
dependent launches, such as the delta program's forty-odd kernels a call.

    PYTHONPATH=$PWD python benchmarks/graph_floor.py --out $OUT/graph_floor.json

Each graph holds N kernels in a chain (each reads the values the one before wrote and writes its own: 128
elements a program, P programs), captured once and replayed. Two timings per (N, P), from CUDA events:
replays back to back (the GPU never waits for the host), and one replay at a time with the GPU idle before
each (as a served request finds it). Printed and written as µs per graph and per kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

_BLOCK = 128


@triton.jit
def _step(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=ok, other=0.0) + 1.0, mask=ok)


def chain_graph(kernels: int, programs: int) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    n = programs * _BLOCK
    bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]

    def run() -> None:
        for i in range(kernels):
            _step[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=_BLOCK)

    run()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph, bufs


def time_graph(graph: torch.cuda.CUDAGraph, back_to_back: int = 200, alone: int = 200) -> dict:
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(back_to_back):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    chained = start.elapsed_time(end) * 1e3 / back_to_back
    singles = []
    for _ in range(alone):
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        singles.append(start.elapsed_time(end) * 1e3)
    return {"back_to_back_us": chained, "alone_p50_us": statistics.median(singles)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kernels", type=int, nargs="+", default=[1, 10, 40])
    parser.add_argument("--programs", type=int, nargs="+", default=[1, 132, 264, 528])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_floor.py needs a CUDA GPU")
    rows = []
    for kernels in args.kernels:
        for programs in args.programs:
            graph, bufs = chain_graph(kernels, programs)
            timing = time_graph(graph)
            # From zeros, one replay adds 1 per kernel to every element if the chain ran whole and in order.
            for buf in bufs:
                buf.zero_()
            graph.replay()
            torch.cuda.synchronize()
            correct = bool(torch.all(bufs[kernels % 2] == kernels).item())
            row = {"kernels": kernels, "programs": programs, **timing, "chain_ok": correct,
                   "back_to_back_us_per_kernel": timing["back_to_back_us"] / kernels,
                   "alone_us_per_kernel": timing["alone_p50_us"] / kernels}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
