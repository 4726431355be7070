"""What a chain of near-empty kernels costs in a CUDA graph (GPU only): the floor under a program of many small
dependent launches, such as the delta program's forty-odd kernels a call.

    PYTHONPATH=$PWD python benchmarks/investigations/graph_floor.py --out $OUT/graph_floor.json

Each graph holds N kernels in a chain (each reads the values the one before wrote and writes its own: 128
elements a program, P programs), captured once and replayed. Two timings per (N, P), from CUDA events:
replays back to back (the GPU never waits for the host), and one replay at a time with the GPU idle before
each (as a served request finds it). Printed and written as µs per graph and per kernel.

With ``--persistent`` each graph is instead one kernel of P programs that runs the same N steps itself, a
grid-wide barrier between two steps (an atomic count in memory that every program adds to and then waits on):
what a persistent kernel pays where a graph pays a launch. Each step reads what another program wrote in the
step before (the next program's elements), so a barrier that let a program through early shows in the check.
P must not exceed the programs the GPU holds at once (a program that never starts would leave the others
waiting): each wait gives up after a bounded number of polls (seconds) and marks the kernel failed, and a size
whose first run failed is reported as such and not timed.
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


# Polls of the barrier's count before a program gives up (far more than any barrier takes: a run that gives up
# is marked failed instead of hanging the GPU).
_MAX_POLLS = tl.constexpr(1 << 22)


@triton.jit
def _grid_barrier(counter, target, failed):
    """Every program's stores before it are visible to every program after it, once all ``target`` arrivals
    are counted. The count only grows (see _persistent_steps for where its base comes from)."""
    tl.debug_barrier()  # this program's threads have all stored
    seen = tl.atomic_add(counter, 1, sem="release", scope="gpu") + 1
    polls = 0
    while (seen < target) & (polls < _MAX_POLLS):
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        polls += 1
    if polls >= _MAX_POLLS:
        tl.atomic_add(failed, 1)
    tl.debug_barrier()


@triton.jit
def _persistent_steps(buf, counter, failed, steps, BLOCK: tl.constexpr):
    """``steps`` chained steps in one launch on ``buf``'s two halves: step i reads half i % 2 at the next
    program's elements and writes its own elements of the other, plus 1."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    per_launch = steps * programs
    # The count is left at a multiple of steps x programs by every launch, and no program passes the first
    # barrier before all have arrived, so any program's first read lies within programs of that multiple.
    start = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    base = start - start % per_launch
    own = pid * BLOCK + tl.arange(0, BLOCK)
    other = ((pid + 1) % programs) * BLOCK + tl.arange(0, BLOCK)
    half = programs * BLOCK
    for i in range(0, steps):
        src = buf + (i % 2) * half
        dst = buf + ((i + 1) % 2) * half
        tl.store(dst + own, tl.load(src + other, cache_modifier=".cg") + 1.0)
        _grid_barrier(counter, base + (i + 1) * programs, failed)


def persistent_graph(steps: int, programs: int) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor] | None:
    """The graph, its two buffers and the failure count; None when the first run failed (the GPU did not hold all
    ``programs`` at once)."""
    buf = torch.zeros(2, programs * _BLOCK, device="cuda")
    bufs = list(buf.unbind(0))
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    failed = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run() -> None:
        _persistent_steps[(programs,)](buf, counter, failed, steps, BLOCK=_BLOCK)

    run()  # compiles
    torch.cuda.synchronize()
    if int(failed.item()) > 0:
        return None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph, bufs, failed


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


def back_to_back_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """µs a replay, over ``replays`` replays launched back to back (the GPU never waits for the host)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def time_graph(graph: torch.cuda.CUDAGraph, back_to_back: int = 200, alone: int = 200) -> dict:
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    chained = back_to_back_us(graph, back_to_back)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
    parser.add_argument("--persistent", action="store_true",
                        help="one kernel a graph, its N steps apart by grid-wide barriers (see above)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_floor.py needs a CUDA GPU")
    rows = []
    for kernels in args.kernels:
        for programs in args.programs:
            row = {"persistent": args.persistent, "kernels": kernels, "programs": programs}
            made = persistent_graph(kernels, programs) if args.persistent else (*chain_graph(kernels, programs), None)
            if made is None:
                row.update(chain_ok=False, error="a barrier timed out: the GPU did not hold all the programs at once")
            else:
                graph, bufs, failed = made
                timing = time_graph(graph)
                # From zeros, one replay adds 1 per kernel (or step) to every element if the chain ran whole and in
                # order.
                for buf in bufs:
                    buf.zero_()
                graph.replay()
                torch.cuda.synchronize()
                correct = bool(torch.all(bufs[kernels % 2] == kernels).item())
                if failed is not None:
                    correct = correct and int(failed.item()) == 0
                row.update(timing, chain_ok=correct, back_to_back_us_per_kernel=timing["back_to_back_us"] / kernels,
                           alone_us_per_kernel=timing["alone_p50_us"] / kernels)
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
