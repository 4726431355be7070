"""Time the copies of a delta request into its shape bucket's buffers: one multi-tensor copy per dtype
against each embedding copied on its own and the integers together
(runtimes/kv_graphs.py's ``copied_alone``), on the long workload's shapes (dlrmv3 dims: fp32 embeddings of
512; 128 new history tokens and 256 candidates a user).

    python benchmarks/investigations/bucket_copies.py --out DIR [--batches 1 8 32]

Writes DIR/bucket_copies.json: per batch and way, the median of CUDA-event timings (host launches and device
copies together, the device synchronised before each timing) and the device's time per fill (the profiler's
kernel and memcpy durations, summed), with the ratios of the two ways."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from hstu_export.runtimes.kv_graphs import Buckets, copies_into, fill_bucket, pad_to_bucket

EMBEDDING = 512
NEW_HISTORY, CANDIDATES, PAGES = 128, 256, 64


def request(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    hist, cand = batch * NEW_HISTORY, batch * CANDIDATES
    ints = dict(dtype=torch.int64, device=device)
    return {
        "uih_item_emb": torch.randn(hist, EMBEDDING, device=device),
        "uih_action_emb": torch.randn(hist, EMBEDDING, device=device),
        "uih_timestamps": torch.arange(hist, **ints),
        "candidate_item_emb": torch.randn(cand, EMBEDDING, device=device),
        "contextual_emb": torch.zeros(0, 0, EMBEDDING, device=device),
        "uih_lengths": torch.full((batch,), NEW_HISTORY, **ints),
        "candidate_lengths": torch.full((batch,), CANDIDATES, **ints),
        "query_time": torch.full((batch,), 10_000, **ints),
        "kv_cached": torch.full((batch,), 3968, **ints),
        "kv_page_table": torch.arange(batch * PAGES, dtype=torch.int32, device=device).view(batch, PAGES),
        "kv_k_pages": torch.zeros(1, batch * PAGES + 1, 1, 1, 1, device=device),
    }


def per_dtype(static: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """Every input of a dtype in one multi-tensor copy."""
    copies = copies_into(static, inputs)
    targets = [t for t, _ in copies.singles] + [t for group, _ in copies.groups for t in group]
    names = [n for _, n in copies.singles] + [n for _, group in copies.groups for n in group]
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, name in zip(targets, names):
        pair = by_dtype.setdefault(target.dtype, ([], []))
        pair[0].append(target)
        pair[1].append(inputs[name])
    for dst, src in by_dtype.values():
        torch._foreach_copy_(dst, src)
    copies.table.copy_(inputs["kv_page_table"])


def timed(fn, iters: int = 200) -> float:  # type: ignore[no-untyped-def]
    for _ in range(10):
        fn()
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000)
    return statistics.median(samples)


def device_us(fn, iters: int = 50) -> float:  # type: ignore[no-untyped-def]
    """The device's time per call of ``fn``: its kernels' and copies' durations, summed (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    device = torch.device("cuda")
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "batches": {}}
    for batch in args.batches:
        inputs = request(batch, device)
        static, _ = pad_to_bucket(inputs, Buckets(history=64, candidates=32, max_width=PAGES), 0)
        copies = copies_into(static, inputs)
        old_way = functools.partial(per_dtype, static, inputs)
        new_way = functools.partial(fill_bucket, static, inputs, copies)
        old, new = timed(old_way), timed(new_way)
        old_device, new_device = device_us(old_way), device_us(new_way)
        for name in ("uih_item_emb", "candidate_item_emb", "uih_timestamps"):
            assert torch.equal(static[name][: inputs[name].shape[0]], inputs[name])
        report["batches"][batch] = {"per_dtype_us": round(old, 1), "embeddings_alone_us": round(new, 1),
                                    "ratio": round(old / new, 2), "per_dtype_device_us": round(old_device, 1),
                                    "embeddings_alone_device_us": round(new_device, 1),
                                    "device_ratio": round(old_device / new_device, 2),
                                    "embedding_mb": round(sum(inputs[n].nbytes for n in ("uih_item_emb", "uih_action_emb",
                                                                                         "candidate_item_emb")) / 2**20, 2)}
        print(batch, report["batches"][batch], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bucket_copies.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
