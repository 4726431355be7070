"""Latency and throughput of a package against the eager model, measured in the same run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

Run = Callable[[dict[str, Tensor]], dict[str, Tensor]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clamp_batch_size(requested: int | None, maximum: int) -> tuple[int, str | None]:
    """The batch size to benchmark (``requested``, at most the package's ``maximum``; the maximum when
    nothing was requested) and, when the request was cut down, a note saying so."""
    if requested is None or requested <= maximum:
        return requested or maximum, None
    return maximum, (f"--batch-size {requested} is beyond the package's maximum batch size {maximum}; "
                     f"benchmarking batches of {maximum} users")


def time_calls(run: Run, batch: dict[str, Tensor], iters: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Per-call latency (ms) statistics over ``iters`` timed calls after ``warmup`` calls."""
    with torch.no_grad():
        for _ in range(warmup):
            run(batch)
        _sync(device)
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            run(batch)
            _sync(device)
            samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()

    def pct(p: float) -> float:
        return samples[min(len(samples) - 1, round(p / 100 * (len(samples) - 1)))]

    return {"p50_ms": pct(50), "p99_ms": pct(99), "mean_ms": statistics.fmean(samples), "iters": iters}


def benchmark(exported: Run, eager: Run, batch: dict[str, Tensor], num_users: int, num_candidates: int,
              iters: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """Interleaves nothing: eager first, then exported, each with its own warm-up."""
    results = {}
    for name, run in (("eager", eager), ("exported", exported)):
        stats = time_calls(run, batch, iters, warmup, device)
        stats["users_per_s"] = num_users / (stats["p50_ms"] / 1e3)
        stats["candidates_per_s"] = num_candidates / (stats["p50_ms"] / 1e3)
        results[name] = stats
    results["speedup_p50"] = results["eager"]["p50_ms"] / results["exported"]["p50_ms"]
    return results
