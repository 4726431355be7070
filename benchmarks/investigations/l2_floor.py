"""What an SM reads from L2 per µs, and the delta program's 1-user products against it (GPU only).

    PYTHONPATH=$PWD python benchmarks/investigations/l2_floor.py --out $OUT/l2_floor.json

A matrix product with few rows (the delta program's at 1 user: 384) is limited by what its programs read: each
reads a block of rows of the activations and a block of columns of the weights, from L2 once the weights are
there. This measures that limit on the GPU at hand, then times the products the way the delta program runs them:

- **Reads**: a kernel of P programs, each summing its own ``distinct`` bytes plus ``shared`` bytes that every
  program reads (the same activation rows, as a product's programs of one row block do), bf16, bypassing L1.
  The whole buffer is read on every replay and stays in L2 (sizes over 30 MB are left out). Ten kernels in a
  CUDA graph, replayed back to back; the figures are a kernel's time, and the bytes an SM read (its programs')
  over that time less the time of the same kernel reading nothing (launch and start; measured in the same run).
- **Products**: ``torch.mm`` (cuBLAS) on the 1-user shapes of the dlrmv3 preset, bf16, ten in a graph: the
  projection [384, 512] x [512, 2048] and the output product [384, 1536] x [1536, 512] (and the last layer's
  [256, 1536] x [1536, 512]); with the bytes each SM would read if the product's tiles were the ones cuBLAS chose
  (given by ``--tiles``, from the profiler's kernel names in the delta program's trace; the kernels cuBLAS ran here
  are recorded beside them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_floor import back_to_back_us

_BLOCK = 4096  # elements a load (8 KB of bf16)
_UNROLL = 4  # loads in flight: 32 KB a program, so sizes are multiples of 32 KB
_KERNELS = 10  # in a graph
_L2_KB = 30 * 1024  # the most a run reads, well under the H100's 50 MB of L2


@triton.jit
def _read(buf, out, distinct, shared, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Program p sums elements [shared + p * distinct, shared + (p + 1) * distinct) of ``buf`` and its first
    ``shared`` elements (what every program reads), and writes the sum (so that the loads are kept). UNROLL loads
    of BLOCK elements are in flight at a time; both counts are multiples of their product."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for start in range(0, shared, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            acc += tl.load(buf + start + u * BLOCK + offs, cache_modifier=".cg").to(tl.float32)
    own = buf + shared + pid.to(tl.int64) * distinct
    for start in range(0, distinct, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            acc += tl.load(own + start + u * BLOCK + offs, cache_modifier=".cg").to(tl.float32)
    tl.store(out + pid, tl.sum(acc, axis=0))


def graph_of(run) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    run()  # compiles, and loads the inputs into L2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(_KERNELS):
            run()
    return graph


def per_kernel_us(graph: torch.cuda.CUDAGraph, rounds: int = 5, replays: int = 100) -> float:
    """The median over ``rounds`` of a kernel's time in back-to-back replays."""
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return statistics.median(back_to_back_us(graph, replays) / _KERNELS for _ in range(rounds))


def read_row(programs: int, distinct_kb: int, shared_kb: int, sms: int, empty_us: float | None) -> dict:
    distinct, shared = distinct_kb * 512, shared_kb * 512  # bf16 elements
    buf = torch.randn(shared + programs * distinct + 1, device="cuda").to(torch.bfloat16)
    out = torch.empty(programs, device="cuda")
    graph = graph_of(lambda: _read[(programs,)](buf, out, distinct, shared, BLOCK=_BLOCK, UNROLL=_UNROLL, num_warps=8))
    us = per_kernel_us(graph)
    expected = torch.stack([buf[:shared].float().sum() + buf[shared + p * distinct: shared + (p + 1) * distinct]
                            .float().sum() for p in range(programs)])
    graph.replay()
    torch.cuda.synchronize()
    ok = bool(torch.allclose(out, expected, rtol=1e-3, atol=1e-2))
    row = {"programs": programs, "distinct_kb": distinct_kb, "shared_kb": shared_kb, "kernel_us": us, "sums_ok": ok}
    if empty_us is not None and distinct_kb + shared_kb > 0:
        # Programs beyond the SMs' count run beside the others on the same SMs.
        per_sm = (distinct_kb + shared_kb) * 1024 * programs / sms
        row["gb_per_s_per_sm"] = per_sm / ((us - empty_us) * 1e-6) / 1e9
    return row


def product_row(m: int, k: int, n: int, tile: tuple[int, int], sms: int) -> dict:
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(k, n, device="cuda") / k**0.5).to(torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    graph = graph_of(lambda: torch.mm(a, w, out=out))
    us = per_kernel_us(graph)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    row = {"m": m, "k": k, "n": n, "kernel_us": us, "tflops": 2 * m * k * n / (us * 1e-6) / 1e12, "kernels": kernels,
           "max_abs_vs_fp32": float((out.float() - a.float() @ w.float()).abs().max())}
    tm, tn = tile
    tiles = triton.cdiv(m, tm) * triton.cdiv(n, tn)
    row.update(tile=f"{tm}x{tn}", tiles=tiles,
               kb_per_tile=(tm * k + k * tn) * 2 / 1024,  # one row block of a, one column block of w
               kb_per_sm=(tm * k + k * tn) * 2 / 1024 * triton.cdiv(tiles, sms))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiles", default="384x512x2048=64x96,384x1536x512=64x40,256x1536x512=32x64",
                        help="MxKxN=TMxTN of the products' tiles (from the profiler's cuBLAS kernel names)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("l2_floor.py needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    reads = []
    empty = read_row(sms, 0, 0, sms, None)
    reads.append(empty)
    print(json.dumps(empty), flush=True)
    # Alone, then as a product's tiles read: the projection's 64 x 96 (64 KB of activations, 96 KB of weights) and
    # the output product's 64 x 40 (192 KB of activations, 120 KB of weights, here 128).
    for distinct_kb, shared_kb in ((32, 0), (64, 0), (160, 0), (96, 64), (128, 192)):
        for programs in (sms, 2 * sms):
            if programs * distinct_kb + shared_kb > _L2_KB:
                continue
            row = read_row(programs, distinct_kb, shared_kb, sms, empty["kernel_us"])
            reads.append(row)
            print(json.dumps(row), flush=True)
    tiles = {}
    for spec in args.tiles.split(","):
        shape, tile = spec.split("=")
        tiles[tuple(int(x) for x in shape.split("x"))] = tuple(int(x) for x in tile.split("x"))
    products = []
    for (m, k, n), tile in tiles.items():
        row = product_row(m, k, n, tile, sms)
        products.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "sms": sms, "reads": reads,
                                    "products": products}, indent=1))


if __name__ == "__main__":
    main()
