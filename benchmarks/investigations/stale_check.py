"""The GPU time of the derived delta program's stale check, by the way its per-row flags become per-user ones (GPU).

    PYTHONPATH=$PWD python benchmarks/investigations/stale_check.py --out $OUT/stale_check.json [--batches 1 8 32]

``delta_rows`` (hstu_export/kv_derive.py) compares each cached row of a request with the row stored in the pages
and flags the users with a differing row. Three ways to make the per-row flags per-user ones, each compiled alone by
``torch.compile`` with dynamic shapes, on the re-ranking workload's sizes (each user 4096 cached rows and 256 new
ones, pages of 64, a page table 128 pages wide, rows of 10 fp32 values, nothing changed):

- ``atomics``: the flags added up by user (``index_put_`` with ``accumulate``), every row's on its user's place;
- ``spread``: the same, a row that does not differ adding its zero to a place of its own, as ``delta_rows`` does;
- ``per_page``: a grid of (user, page, place in page), each place reading its row's flag or a false one past the
  user's cached rows, reduced over each page and then over each user's pages.

GPU time per call: the sum of the kernels' device times in a ``torch.profiler`` trace of 20 calls, divided by 20.
The three give the same flags (checked, also with one row changed per user).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.kv_derive import _frontier_parts, _rows_differ
from hstu_export.ops.jagged import jagged_positions_by_search

CACHED, NEW, PAGE, WIDTH, ROW = 4096, 256, 64, 128, 10


def _row_flags(offsets: Tensor, frontier: Tensor, x_pages: Tensor, table: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    total = frontier.shape[0]
    user, pos = jagged_positions_by_search(offsets, total)
    width, scratch = table.shape[1], x_pages.shape[0] - 1
    page = table.to(torch.int64)[user, (pos // PAGE).clamp(0, width - 1)].clamp(0, scratch)
    return user, pos, _rows_differ(x_pages[page, pos % PAGE], _frontier_parts([frontier], x_pages.dtype))


def atomics(offsets: Tensor, cached: Tensor, frontier: Tensor, x_pages: Tensor, table: Tensor) -> Tensor:
    user, pos, differs = _row_flags(offsets, frontier, x_pages, table)
    counted = (differs & (pos < cached[user]) & (pos // PAGE < table.shape[1])).to(torch.int32)
    return counted.new_zeros(cached.shape[0]).index_put_((user,), counted, accumulate=True) > 0


def spread(offsets: Tensor, cached: Tensor, frontier: Tensor, x_pages: Tensor, table: Tensor) -> Tensor:
    user, pos, differs = _row_flags(offsets, frontier, x_pages, table)
    differs = differs & (pos < cached[user]) & (pos // PAGE < table.shape[1])
    users, total = cached.shape[0], frontier.shape[0]
    places = torch.where(differs, user, users + torch.arange(total, device=user.device))
    counted = differs.new_zeros(users + total, dtype=torch.int32).index_put_((places,), differs.to(torch.int32),
                                                                           accumulate=True)
    return counted[:users] > 0


def per_page(offsets: Tensor, cached: Tensor, frontier: Tensor, x_pages: Tensor, table: Tensor) -> Tensor:
    _, _, differs = _row_flags(offsets, frontier, x_pages, table)
    users, width = table.shape
    places = torch.arange(width * PAGE, dtype=torch.int64, device=offsets.device)
    grid = torch.where(places[None, :] < cached[:, None], offsets[:-1, None] + places[None, :], frontier.shape[0])
    flags = torch.cat([differs, differs.new_zeros(1)]).index_select(0, grid.reshape(-1))
    return flags.reshape(users, width, PAGE).any(dim=2).any(dim=1)


def inputs(users: int, device: str) -> tuple[Tensor, ...]:
    generator = torch.Generator(device="cpu").manual_seed(users)
    lengths = torch.full((users,), CACHED + NEW, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    frontier = torch.randn(int(offsets[-1]), ROW, generator=generator)
    x_pages = torch.zeros(users * WIDTH + 1, PAGE, ROW)
    table = torch.arange(users * WIDTH, dtype=torch.int32).reshape(users, WIDTH)
    for b in range(users):  # the cached rows stored where the table points
        rows = frontier[int(offsets[b]):int(offsets[b]) + CACHED]
        x_pages[table[b, :CACHED // PAGE].long()] = rows.reshape(CACHED // PAGE, PAGE, ROW)
    cached = torch.full((users,), CACHED, dtype=torch.int64)
    return tuple(t.to(device) for t in (offsets, cached, frontier, x_pages, table))


def gpu_us(fn: Any, args: tuple[Tensor, ...], calls: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    device = "cuda"
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d"), "gpu_us": {}}
    compiled = {fn.__name__: torch.compile(fn, dynamic=True) for fn in (atomics, spread, per_page)}
    for users in args.batches:
        given = inputs(users, device)
        changed = given[2].clone()
        changed[given[0][:-1] + 7] += 1.0  # row 7 of each user: cached
        row = result["gpu_us"][str(users)] = {}
        for name, fn in compiled.items():
            assert not fn(*given).any() and fn(given[0], given[1], changed, *given[3:]).all(), name
            row[name] = round(gpu_us(fn, given), 1)
        print(users, row, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
