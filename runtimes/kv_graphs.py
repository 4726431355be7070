"""CUDA graphs for small delta requests: shape buckets and a graph per bucket.

At a few users the delta program is launch-bound (on the H100 its host time is about twice its GPU
time), which is what CUDA graphs remove. Opt-in (``predictor.kv_cache(cuda_graphs=True)``): as built
here, the padding and the copies into and out of the graph's buffers cost what the replay saves
(docs/PERF.md). A graph replays fixed shapes, so a request is first padded to
a *bucket*: a padding user is appended whose history and candidates round the token counts up to fixed
multiples, and the page table's width is rounded up to a power of two. The padding user has nothing
cached and attends only to itself, so the real users' answers are those of the unpadded request; its
outputs are dropped (its rows come last in every output).

A bucket is captured the second time it is seen (one-off shapes stay eager), into a pool shared by
every graph, and at most ``max_graphs`` are kept (least recently used first out). Replays are
serialised: inputs are copied into the graph's buffers and outputs copied out under one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.models.cached import KV_OUTPUTS
from hstu_export.models.ranking import CANDIDATE_LENGTHS, HISTORY_LENGTHS

# The pages are the cache itself: the same tensors on every call, never copied (their address is part
# of a bucket's key).
STATIC_INPUTS = ("kv_k_pages", "kv_v_pages")
_MAX_SEEN = 4096


@dataclass(frozen=True)
class Buckets:
    """Round new history tokens up to a multiple of ``history``, candidates to one of ``candidates``;
    the page table's width up to a power of two, at most ``max_width`` (the program's bound)."""

    history: int
    candidates: int
    max_width: int


def _rounded(n: int, step: int) -> int:
    return -(-n // step) * step if n else step


def pad_to_bucket(inputs: dict[str, Tensor], buckets: Buckets, contextual: int) -> tuple[dict[str, Tensor], int, int]:
    """``inputs`` of the delta program with a padding user appended. Returns the padded inputs, the real
    candidate rows and the real new-K/V rows (the outputs' first rows that belong to real users)."""
    hist = inputs["uih_item_emb"].shape[0]
    cand = inputs["candidate_item_emb"].shape[0]
    fresh = inputs["contextual_emb"].shape[0]
    pad_h = _rounded(hist + 1, buckets.history) - hist  # at least one token, so every bucket has one
    pad_c = _rounded(cand + 1, buckets.candidates) - cand
    width = inputs["kv_page_table"].shape[1]
    wide = min(max(1 << (width - 1).bit_length(), width), max(buckets.max_width, width))

    def rows(t: Tensor, n: int) -> Tensor:
        return torch.cat([t, t.new_zeros((n, *t.shape[1:]))])

    out = dict(inputs)
    for name in ("uih_item_emb", "uih_action_emb", "uih_timestamps"):
        out[name] = rows(inputs[name], pad_h)
    out["candidate_item_emb"] = rows(inputs["candidate_item_emb"], pad_c)
    if contextual:
        out["contextual_emb"] = rows(inputs["contextual_emb"], 1)
    lengths = inputs[HISTORY_LENGTHS]
    out[HISTORY_LENGTHS] = torch.cat([lengths, lengths.new_full((1,), pad_h)])  # a fill: no host-to-device copy
    counts = inputs[CANDIDATE_LENGTHS]
    out[CANDIDATE_LENGTHS] = torch.cat([counts, counts.new_full((1,), pad_c)])
    out["query_time"] = rows(inputs["query_time"], 1)
    out["kv_cached"] = rows(inputs["kv_cached"], 1)  # nothing cached: it reads no page
    table = inputs["kv_page_table"]
    out["kv_page_table"] = torch.nn.functional.pad(rows(table, 1), (0, wide - width))
    return out, cand, hist + fresh * contextual


def unpad(outputs: dict[str, Tensor], candidates: int, kept: int) -> dict[str, Tensor]:
    """The real users' rows of a padded run's outputs."""
    trimmed = {}
    for name, value in outputs.items():
        if name in ("kv_new_k", "kv_new_v"):
            trimmed[name] = value[:, :kept]
        elif name in KV_OUTPUTS:
            trimmed[name] = value[:kept]
        else:
            trimmed[name] = value[:candidates]
    return trimmed


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]


class GraphCache:
    """``fn(**inputs) -> dict`` replayed from CUDA graphs, one per input-shape key."""

    def __init__(self, fn: Callable[..., dict[str, Tensor]], max_graphs: int = 16) -> None:
        self._fn = fn
        self._max = max_graphs
        self._graphs: OrderedDict[Any, _Graph] = OrderedDict()
        self._seen: dict[Any, int] = {}
        self._pool: Any = None
        self._lock = threading.Lock()
        self.counts = {"replays": 0, "captures": 0, "eager": 0}

    def __call__(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        key = tuple((name, tuple(t.shape), t.dtype, t.data_ptr() if name in STATIC_INPUTS else 0)
                    for name, t in inputs.items())
        with self._lock:
            entry = self._graphs.get(key)
            if entry is None:
                if len(self._seen) > _MAX_SEEN:  # shapes seen once, long ago, are forgotten
                    self._seen.clear()
                self._seen[key] = self._seen.get(key, 0) + 1
                if self._seen[key] < 2:
                    self.counts["eager"] += 1
                    return self._fn(**inputs)
                entry = self._capture(inputs)
                self._graphs[key] = entry
                if len(self._graphs) > self._max:
                    self._graphs.popitem(last=False)
            self._graphs.move_to_end(key)
            for name, value in inputs.items():
                if name not in STATIC_INPUTS:
                    entry.inputs[name].copy_(value, non_blocking=True)
            entry.graph.replay()
            self.counts["replays"] += 1
            return {name: value.clone() for name, value in entry.outputs.items()}

    def _capture(self, inputs: dict[str, Tensor]) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = {name: value if name in STATIC_INPUTS else value.clone() for name, value in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture (allocations, lazy initialisation)
            for _ in range(2):
                self._fn(**static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._fn(**static)
        self.counts["captures"] += 1
        return _Graph(graph, static, outputs)
