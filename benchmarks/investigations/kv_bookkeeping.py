"""The KV cache's host-side bookkeeping per request, on the CPU: what CachedRanker does around the delta run.

    PYTHONPATH=$PWD python benchmarks/investigations/kv_bookkeeping.py --out FILE.json [--batches 1 8 32] [--threads 1] [--runs 1]

The request is benchmarks/kv_cache.py's "long" workload on the dlrmv3 shapes: history 4096 per user, of
which the first 3968 tokens are cached, 256 candidates. The ranker's runner returns at once, so what is
timed is the request's validation-free bookkeeping: the comparison with each user's entry, the pages, the
page table, the new tokens' gather and the entries' update. Before each request every user's entry is
put back to its 3968 cached tokens (as in benchmarks/kv_cache.py), so every request is a hit that grows
each history by 128 tokens. ``--runs K`` stores those 3968 tokens with K requests, each adding 128 tokens to the
one before (the last K-1 requests are hits), so that an entry that keeps its history as runs of the tokens each
request added (as Python's EntryRecord and the C++ runtime's records do) holds K of them: 8 is the average over
the 16 requests between two merges, 15 the most.

The script only uses the cache's public pieces and the entries' own fields, so it also runs against another
commit (PYTHONPATH pointing at a checkout of it): two versions are compared in turn on the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

import hstu_export
from hstu_export.models.cached import KVLayout
from hstu_export.models.config import preset_config
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.serving.kv_cache import CachedRanker, EntryRecord

HISTORY, CACHED, CANDIDATES, PAGE = 4096, 3968, 256, 64


class Returns:
    """A delta runner that runs nothing: the ranker's own work is what is left to time."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout, self.device, self.page_size = layout, torch.device("cpu"), PAGE

    def validate(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return features

    def __call__(self, *args: object) -> dict[str, torch.Tensor]:
        return {}

    def table_width(self, width: int) -> int:
        return width


def measure(model: HstuRankingModel, batch: int, iters: int, runs: int = 1) -> dict[str, float]:
    lengths = {"uih_lengths": [HISTORY] * batch, "candidate_lengths": [CANDIDATES] * batch}
    features = hstu_export.generate_batch(model.input_schema(), batch, seed=1, lengths=lengths)
    layout = KVLayout.of(model)
    per_token = layout.num_layers * layout.num_heads * (layout.attention_dim + layout.linear_dim) * 4
    ranker = CachedRanker(Returns(layout), budget_bytes=batch * (HISTORY + 2 * PAGE) * per_token, page_size=PAGE)
    users = list(range(batch))
    for stored in range(CACHED - (runs - 1) * (HISTORY - CACHED), CACHED + 1, HISTORY - CACHED):
        keep = torch.cat([torch.arange(b * HISTORY, b * HISTORY + stored) for b in users])
        prefix = {**features, "uih_lengths": torch.full_like(features["uih_lengths"], stored)}
        for name in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
            prefix[name] = features[name][keep]
        ranker(prefix, users)  # every user stored with its first `stored` tokens (at the end, CACHED)
    fields = [f.name for f in dataclasses.fields(EntryRecord)]

    def snapshot(entry) -> EntryRecord:  # type: ignore[no-untyped-def]
        # Entries keep their record (older commits kept its fields on the entry itself).
        return getattr(entry, "record", None) or EntryRecord(**{name: getattr(entry, name) for name in fields})

    state = {b: (ranker.cache.entry(b).length, snapshot(ranker.cache.entry(b))) for b in users}

    def request() -> None:
        for b, (length, record) in state.items():
            ranker.cache.commit(b, length, record)
        ranker(features, users)

    request()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        request()
        samples.append((time.perf_counter() - t) * 1e3)
    stats = ranker.cache.stats()
    if stats["hits"] != (iters + runs) * batch:
        raise SystemExit(f"expected every request to be a hit, the cache counted {stats}")
    return {"p50_ms": statistics.median(samples), "min_ms": min(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--runs", type=int, default=1, help="requests that store the cached tokens (see above)")
    args = parser.parse_args()
    if not 1 <= args.runs < CACHED // (HISTORY - CACHED):
        parser.error(f"--runs must be from 1 to {CACHED // (HISTORY - CACHED) - 1}, got {args.runs}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = HstuRankingModel(preset_config("dlrmv3")).eval()
    result = {"torch": torch.__version__, "threads": args.threads, "runs": args.runs,
              "date": time.strftime("%Y-%m-%d"), "batches": {}}
    for batch in args.batches:
        result["batches"][batch] = measure(model, batch, args.iters, args.runs)
        print(f"batch {batch}: bookkeeping {result['batches'][batch]['p50_ms']:.3f} ms (median)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
