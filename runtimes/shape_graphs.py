"""CUDA graphs keyed by a call's exact input shapes, for programs that read nothing back to the host.

A derived delta program (``runtimes/kv_derived.py``) takes the dense half's inputs under the model's own
names, so the zoo's shape buckets (``runtimes/kv_graphs.py``: a padding user appended) do not apply to it; nor
do they to a whole request without the cache (``Predictor``, ``runtimes/predictor.py``), whose answers a padding
user would change. What does apply: a program whose compiled code reads no value from the device
(``kv_cache.device_reads`` is 0; for a whole request, a prechecked sparse half and
``backend.meta.dense_device_reads`` 0) launches the same kernels with the same grids for every call of the same
input shapes, so such a call can be captured once and replayed. The key is each input's shape and dtype, and the addresses of the
inputs that are the same tensors on every call (the cache's pages). Re-ranking the same users with as
many candidates as before repeats its shapes; a request of shapes not seen before runs as it is.

A call whose inputs (those copied into buffers) exceed ``max_bytes`` (160 MiB by default) runs as it is: the
copies then cost more than the launches a graph saves. Measured on an H200 (docs/PERF.md, the zoo's derived
program re-ranking, 16.5 MiB of inputs a user: ``benchmarks/investigations/shape_graph_bound.py``): the call from
a graph against as it is, 0.33 / 0.62 ms at 1 user, 0.42 / 0.87 at 2 (33 MiB), 0.58 / 0.91 at 4, even at 8
(132 MiB), 1.32 / 1.22 at 16 (265 MiB) and 2.41 / 2.20 at 32.

A key is captured the second time it is seen, into a pool shared by every graph; at most ``max_graphs``
are kept (least recently used first out; with ``evict=False``, the first ones, and later keys run as they are). Before a replay the call's tensors are copied into the graph's
buffers: the floating ones (the embeddings, a row per token) each on its own, a device memcpy at the memory's
speed, the others one ``_foreach_copy_`` per dtype (CUDA's multi-tensor copy is one kernel for many small
tensors, but slow on large ones: ``runtimes/kv_graphs.py``); after it the outputs are copied out, so that the next replay
cannot overwrite what a caller holds. A capture that fails (a program that syncs after all) leaves its key to
run as it is from then on, counted as ``refused``, and the call is answered without a graph. Captures and
replays are serialised under one lock; a call run as it is runs outside it. ``capture=False`` keeps the
same bookkeeping and buffers without CUDA (a replay calls the program on the buffers), which is how it is
tested on a CPU.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError
from hstu_export.settings import parse_size

_MAX_SEEN = 4096
# Calls whose copied inputs exceed this run as they are (module docstring).
MAX_COPY_BYTES = 160 << 20
# The same bound for whole requests without the cache (runtimes/predictor.py): their tensors are ids, a few bytes a
# token, so it bounds the request's tokens. Measured on an H200 (docs/PERF.md, "Whole-request CUDA graphs"; the zoo's
# dlrmv3 shapes, about 0.1 MiB a user of 4352 tokens): a request from a graph against as it is, 0.633 / 0.719 ms at
# 1 user, 3.418 / 3.345 at 8, 13.055 / 13.058 at 32. Past a few such users the GPU's work bounds the request.
REQUEST_COPY_BYTES = 512 << 10


def copy_limit(value: int | str) -> int:
    """A copy limit given as bytes or a size such as ``"64MiB"`` (``ShapeGraphs``' ``max_bytes``); ConfigError
    naming it when it is neither."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"graph_copy_limit must be bytes or a size such as '64MiB', got {value!r}")
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"graph_copy_limit: {exc}") from None


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph | None  # None: a replay calls the program on the buffers
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    # The buffers copied into one by one (floating), and those of each other dtype, copied together.
    singles: tuple[tuple[str, Tensor], ...]
    groups: tuple[tuple[tuple[str, ...], list[Tensor]], ...]


def shape_key(inputs: dict[str, Tensor], static: Iterable[str]) -> tuple[Any, ...]:
    """What identifies a call's graph: every input's name, shape and dtype, and the addresses of ``static``."""
    fixed = set(static)
    return tuple((name, tuple(value.shape), value.dtype, value.data_ptr() if name in fixed else None)
                 for name, value in sorted(inputs.items()))


class ShapeGraphs:
    """``graphs(inputs) -> dict``: ``fn(**inputs)``, replayed from a CUDA graph once its shapes were seen
    before. ``static``: the inputs that are the same tensors on every call (used in place, never copied).
    ``evict=False``: once ``max_graphs`` are kept, a new shape runs as it is instead of displacing one, so that
    requests whose shapes keep changing cost at most ``max_graphs`` captures (whole requests, ``Predictor``)."""

    def __init__(self, fn: Callable[..., dict[str, Tensor]], static: Iterable[str], *, max_graphs: int = 16,
                 capture: bool = True, max_bytes: int = MAX_COPY_BYTES, evict: bool = True) -> None:
        self._fn = fn
        self._static = frozenset(static)
        self._max = max_graphs
        self._max_bytes = max_bytes
        self._evict = evict
        self._capture_cuda = capture
        self._graphs: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._seen: dict[tuple[Any, ...], int] = {}
        self._pool: Any = None
        self._lock = threading.Lock()
        self._refused: set[tuple[Any, ...]] = set()
        self.counts = {"replays": 0, "captures": 0, "eager": 0, "refused": 0}

    def __call__(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        copied = sum(value.numel() * value.element_size() for name, value in inputs.items()
                     if name not in self._static)
        if copied > self._max_bytes:
            with self._lock:
                self.counts["eager"] += 1
            return self._fn(**inputs)
        key = shape_key(inputs, self._static)
        with self._lock:
            entry = self._graphs.get(key)
            eager = False
            if entry is None:
                if len(self._seen) > _MAX_SEEN:  # shapes seen once (or refused), long ago, are forgotten
                    self._seen.clear()
                    self._refused.clear()
                self._seen[key] = self._seen.get(key, 0) + 1
                eager = (self._seen[key] < 2 or key in self._refused
                         or (not self._evict and len(self._graphs) >= self._max))
                if eager:
                    self.counts["eager"] += 1
            if not eager:
                return self._replay(key, entry, inputs)
        return self._fn(**inputs)  # outside the lock: calls of other shapes run meanwhile

    def _replay(self, key: tuple[Any, ...], entry: _Entry | None, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """The call from ``key``'s graph (captured now when ``entry`` is None), under the lock."""
        if entry is None:
            try:
                entry = self._capture(inputs)
            except Exception:  # any failure to capture: the call runs as it is
                self._refused.add(key)
                self.counts["refused"] += 1
                if self._capture_cuda:
                    torch.cuda.synchronize()  # the warm-up's work done before the call runs again
                return self._fn(**inputs)
            self._graphs[key] = entry
            if len(self._graphs) > self._max:
                self._graphs.popitem(last=False)
        else:
            for name, target in entry.singles:
                target.copy_(inputs[name])
            for names, targets in entry.groups:
                torch._foreach_copy_(targets, [inputs[name] for name in names])
        self._graphs.move_to_end(key)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.outputs = self._fn(**entry.inputs)
        self.counts["replays"] += 1
        from hstu_export.runtimes.kv_graphs import first_rows  # here: kv_graphs imports the zoo's model code

        return first_rows(entry.outputs)

    def _capture(self, inputs: dict[str, Tensor]) -> _Entry:
        from hstu_export.runtimes.kv_graphs import CAPTURE_MODE, collection_paused

        buffers = {name: value if name in self._static else value.clone() for name, value in inputs.items()}
        singles: list[tuple[str, Tensor]] = []
        by_dtype: dict[torch.dtype, tuple[list[str], list[Tensor]]] = {}
        for name, value in buffers.items():
            if name in self._static or not value.numel():
                continue
            if value.is_floating_point():
                singles.append((name, value))
            else:
                names, targets = by_dtype.setdefault(value.dtype, ([], []))
                names.append(name)
                targets.append(value)
        groups = tuple((tuple(names), targets) for names, targets in by_dtype.values())
        if not self._capture_cuda:
            return _Entry(None, buffers, {}, tuple(singles), groups)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture (allocations, lazy initialisation)
            for _ in range(2):
                self._fn(**buffers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_MODE):
            outputs = self._fn(**buffers)
        self.counts["captures"] += 1
        return _Entry(graph, buffers, outputs, tuple(singles), groups)
