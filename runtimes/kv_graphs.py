"""CUDA graphs for delta requests: shape buckets and a graph per bucket.

The delta program is launch-bound at a few users (on the H100 its host time is about four times its GPU
time at one user) and its first, small kernels are at any batch: CUDA graphs remove that. A graph
replays fixed shapes, so a request is run in a *bucket*: a padding user is appended whose history and
candidates round the token counts up to fixed multiples (it may have none), and the page table's width
is rounded up to a power of two. The padding user has nothing cached and attends only to itself, so the
real users' answers are those of the unpadded request; its outputs are dropped (its rows come last), and
its K/V go to the pool's scratch page (the last page: its table row, and every padded column, point
there).

A bucket is captured the second time it is seen (one-off shapes run eagerly, unpadded, and so do
requests whose bucket would be beyond the program's exported bounds), into a pool shared by every
graph, and at most ``max_graphs`` are kept (least recently used first out). The graph's first nodes copy
the request into its input buffers: before each replay they are pointed at the request's tensors
(:mod:`~hstu_export.runtimes.graph_copies`), so that a call is one launch. Where that cannot be done (no
CUDA runtime found in the process, an input not contiguous), the request is written into the buffers
before the replay instead (:func:`fill_bucket`: a copy of each embedding, one for the other inputs of each
dtype). The padding user's rows keep whatever an earlier request left there (finite values that only the
padding user reads). Its two token counts are the bucket's rows, written once, where the program fits each
user's counts to its tables (``kv_cache.fits_counts``: the padding user, last, then takes what the others
leave); for a program without that flag, the graph computes them on the device at each replay
(:func:`padding_counts`, four kernels). Replays are serialised under one lock; the real rows of the outputs
are copied out before it is released. The run itself writes the new K/V into the pages, so they are not
outputs to copy.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.models.cached import scratch_page
from hstu_export.models.ranking import CANDIDATE_LENGTHS, HISTORY_LENGTHS
from hstu_export.runtimes.graph_copies import GraphCopies, cuda_runtime, graph_copies

# The pages are the cache itself: the same tensors on every call, never copied (their address is part
# of a bucket's key).
STATIC_INPUTS = ("kv_k_pages", "kv_v_pages")
_MAX_SEEN = 4096
# A capture forbids, while it runs, the CUDA calls that could break it (a synchronising copy, cudaMalloc, an
# event query) to its own thread only: in CUDA's default (global) mode it forbids them to every thread of the
# process, so another worker or another device's replica reading an answer back mid-capture fails, and the
# capture with it (benchmarks/investigations/capture_threads.py measures both modes). Our captures run on a
# stream of their own and their thread makes no such call, so the narrower mode is safe.
CAPTURE_MODE = "thread_local"


class _CollectorPause:
    """Counts the blocks that hold the collector off, from any thread: the first turns it off, the last turns
    it back on if it was on (captures in two threads overlap)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    def enter(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1

    def leave(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                gc.enable()


_PAUSE = _CollectorPause()


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's garbage collector held off for the block (a capture). A collection inside a capture runs
    the finalisers of whatever it frees on the capturing thread, so an unreachable predictor's compiled
    program would be torn down there: CUDA refuses that teardown's calls mid-capture, and AOTInductor, whose
    destructor raises the error, ends the process. The garbage waits for the next collection instead."""
    _PAUSE.enter()
    try:
        yield
    finally:
        _PAUSE.leave()


@dataclass(frozen=True)
class Buckets:
    """Round new history tokens up to a multiple of ``history``, candidates to one of ``candidates``;
    the page table's width up to a power of two, at most ``max_width`` (the program's bound). A request
    whose bucket would take more users, history tokens or candidates than the program's bounds
    (``max_batch``, ``max_history``, ``max_candidates``: ``kv_cache.bounds``; None: unbounded) runs as it
    is: beyond them the program's answers are not defined (on the H100 a 33-user bucket of a program
    exported for 32 gave answers off by up to 0.06)."""

    history: int
    candidates: int
    max_width: int
    max_batch: int | None = None
    max_history: int | None = None
    max_candidates: int | None = None
    # The program fits the counts to its tables (kv_cache.fits_counts): the padding user's counts are the
    # bucket's rows, the same on every call; else they are what the real users leave (padding_counts).
    fitted_counts: bool = False


def _rounded(n: int, step: int) -> int:
    return -(-n // step) * step if n else step


def _bucket_sizes(inputs: dict[str, Tensor], buckets: Buckets) -> tuple[int, int, int]:
    """(padding history tokens, padding candidates, page-table width) of a request's bucket."""
    hist = inputs["uih_item_emb"].shape[0]
    cand = inputs["candidate_item_emb"].shape[0]
    width = inputs["kv_page_table"].shape[1]
    # The padding user takes what rounds the counts up, often nothing; a request without history tokens still
    # gets a block of them (``_rounded(0)``), so that the program's history input is never empty.
    pad_h = _rounded(hist, buckets.history) - hist
    pad_c = _rounded(cand, buckets.candidates) - cand
    return pad_h, pad_c, bucket_width(width, buckets)


def bucket_width(width: int, buckets: Buckets) -> int:
    """The page table's width in the bucket of a request whose table is ``width`` wide: rounded up to a power
    of two, within the buckets' widest (a wider table keeps its width)."""
    return min(max(1 << (width - 1).bit_length(), width), max(buckets.max_width, width))


def pad_to_bucket(inputs: dict[str, Tensor], buckets: Buckets, contextual: int) -> tuple[dict[str, Tensor], int]:
    """``inputs`` of the delta program with a padding user appended. Returns the padded inputs and the real
    candidate rows (the outputs' first rows, which belong to real users)."""
    cand = inputs["candidate_item_emb"].shape[0]
    pad_h, pad_c, wide = _bucket_sizes(inputs, buckets)
    width = inputs["kv_page_table"].shape[1]

    def rows(t: Tensor, n: int) -> Tensor:
        return torch.cat([t, t.new_zeros((n, *t.shape[1:]))])

    out = dict(inputs)
    for name in ("uih_item_emb", "uih_action_emb", "uih_timestamps"):
        out[name] = rows(inputs[name], pad_h)
    out["candidate_item_emb"] = rows(inputs["candidate_item_emb"], pad_c)
    if contextual:
        out["contextual_emb"] = rows(inputs["contextual_emb"], 1)
    if buckets.fitted_counts:  # the bucket's rows: the program cuts them to what the real users leave
        pad_h, pad_c = out["uih_item_emb"].shape[0], out["candidate_item_emb"].shape[0]
    lengths = inputs[HISTORY_LENGTHS]
    out[HISTORY_LENGTHS] = torch.cat([lengths, lengths.new_full((1,), pad_h)])  # a fill: no host-to-device copy
    counts = inputs[CANDIDATE_LENGTHS]
    out[CANDIDATE_LENGTHS] = torch.cat([counts, counts.new_full((1,), pad_c)])
    out["query_time"] = rows(inputs["query_time"], 1)
    out["kv_cached"] = rows(inputs["kv_cached"], 1)  # nothing cached: it reads no page
    table = inputs["kv_page_table"]
    scratch = scratch_page(inputs["kv_k_pages"])
    out["kv_page_table"] = torch.nn.functional.pad(
        torch.cat([table, table.new_full((1, width), scratch)]), (0, wide - width), value=scratch)
    return out, cand


def bucket_key(inputs: dict[str, Tensor], buckets: Buckets, contextual: int) -> tuple[Any, ...] | None:
    """What identifies a request's bucket: the shapes :func:`pad_to_bucket` gives it, and the pages' addresses;
    None when those shapes are beyond the program's bounds (the request has no bucket)."""
    pad_h, pad_c, wide = _bucket_sizes(inputs, buckets)
    users, hist = inputs["kv_cached"].shape[0] + 1, inputs["uih_item_emb"].shape[0] + pad_h
    cand, fresh = inputs["candidate_item_emb"].shape[0] + pad_c, inputs["contextual_emb"].shape[0] + (1 if contextual else 0)
    if not all(bound is None or n <= bound for n, bound in ((users, buckets.max_batch), (fresh, buckets.max_batch),
                                                            (hist, buckets.max_history), (cand, buckets.max_candidates))):
        return None
    return (users - 1, hist, cand, fresh, wide, *(inputs[name].data_ptr() for name in STATIC_INPUTS if name in inputs))


def fits_bucket(inputs: dict[str, Tensor], buckets: Buckets, contextual: int) -> bool:
    """Whether the request's bucket (:func:`pad_to_bucket`) stays within the program's bounds."""
    return bucket_key(inputs, buckets, contextual) is not None


# The inputs with a row per token (or per user with nothing cached), and with an entry per user.
ROW_INPUTS = ("uih_item_emb", "uih_action_emb", "uih_timestamps", "candidate_item_emb", "contextual_emb")
USER_INPUTS = (HISTORY_LENGTHS, CANDIDATE_LENGTHS, "query_time", "kv_cached")


# The embeddings (the float inputs with a row per token) are copied each on its own (a device memcpy, at
# the memory's speed), the other inputs of a dtype together (one kernel): CUDA's multi-tensor copy gives each
# block a fixed chunk of elements, so on the embeddings it runs few blocks and is slow (H100 timings:
# docs/PERF_INVESTIGATIONS.md, "KV-cached serving: host round trips"), while the small integer inputs are many
# and cost a launch each.
def copied_alone(name: str, value: Tensor) -> bool:
    """Whether :func:`fill_bucket` copies input ``name`` on its own."""
    return name in ROW_INPUTS and value.is_floating_point()


@dataclass(frozen=True)
class Copies:
    """Where a request's tensors go in its bucket's buffers (:func:`copies_into`): the inputs copied alone
    (:func:`copied_alone`), each with its target; the targets of the others of each dtype, with the inputs they
    take; the page table's real columns; its later columns (a narrower table), or None."""

    singles: tuple[tuple[Tensor, str], ...]
    groups: tuple[tuple[list[Tensor], tuple[str, ...]], ...]
    table: Tensor
    rest: Tensor | None


def copies_into(static: dict[str, Tensor], inputs: dict[str, Tensor]) -> Copies:
    """The :class:`Copies` of ``inputs`` into the buffers ``static`` of their bucket. They depend on the
    request's sizes only (:func:`request_sizes`), so a bucket keeps them for its next request of those sizes."""
    singles: list[tuple[Tensor, str]] = []
    groups: dict[torch.dtype, tuple[list[Tensor], list[str]]] = {}
    for name in (*ROW_INPUTS, *USER_INPUTS):
        value = inputs[name]
        rows = value.shape[0]
        if not rows:
            continue
        if copied_alone(name, value):
            singles.append((static[name][:rows], name))
        else:
            targets, names = groups.setdefault(value.dtype, ([], []))
            targets.append(static[name][:rows])
            names.append(name)
    batch, width = inputs["kv_page_table"].shape
    table = static["kv_page_table"]
    rest = table[:batch, width:] if width < table.shape[1] else None
    return Copies(tuple(singles), tuple((targets, tuple(names)) for targets, names in groups.values()),
                  table[:batch, :width], rest)


def request_sizes(inputs: dict[str, Tensor]) -> tuple[int, ...]:
    """What :func:`copies_into` depends on: the rows of each input, and the page table's width."""
    return (*(inputs[name].shape[0] for name in ROW_INPUTS), *inputs["kv_page_table"].shape)


def fill_bucket(static: dict[str, Tensor], inputs: dict[str, Tensor], copies: Copies | None = None) -> int:
    """Writes a request's real rows into the padded buffers of its bucket (made by :func:`pad_to_bucket` for
    an earlier request of the same bucket), by ``copies`` (default: :func:`copies_into`). The padding user's
    two token counts stay as :func:`pad_to_bucket` wrote them (the bucket's rows, for a program that fits
    them), or are the replay's to write (:func:`padding_counts`, captured with the program). Returns
    what :func:`pad_to_bucket` returns besides the inputs."""
    copies = copies or copies_into(static, inputs)
    for target, name in copies.singles:
        target.copy_(inputs[name])
    # One call per dtype for the others: a served call's host time is mostly such small operations, and
    # tensors of one dtype and layout are copied by one kernel on CUDA (mixed dtypes fall back to a copy each).
    for targets, names in copies.groups:
        torch._foreach_copy_(targets, [inputs[name] for name in names])
    copies.table.copy_(inputs["kv_page_table"])
    if copies.rest is not None:
        # Later columns may hold an earlier request's pages: the scratch page, so that no write lands there.
        copies.rest.fill_(scratch_page(inputs["kv_k_pages"]))
    return inputs["candidate_item_emb"].shape[0]


def padding_counts(static: dict[str, Tensor], batch: int) -> None:
    """Sets the padding user's history and candidate counts (the entries after the ``batch`` real users')
    so that the counts add up to the bucket's rows: device work only, run at the start of every replay."""
    for name, rows in ((HISTORY_LENGTHS, "uih_item_emb"), (CANDIDATE_LENGTHS, "candidate_item_emb")):
        counts = static[name]
        # The bucket's rows as a host scalar: a CUDA graph keeps it as a kernel argument (two kernels a count).
        total = torch.tensor(static[rows].shape[0], dtype=counts.dtype)
        torch.sub(total, counts[:batch].sum(0, keepdim=True), out=counts[batch:])


def unpad(outputs: dict[str, Tensor], candidates: int) -> dict[str, Tensor]:
    """The real users' rows of a padded run's outputs (a row per candidate)."""
    return {name: value[:candidates] for name, value in outputs.items()}


def first_rows(rows: dict[str, Tensor]) -> dict[str, Tensor]:
    """New tensors holding ``rows`` (views of a graph's buffers, which the next replay overwrites), copied by
    one ``_foreach_copy_``: one kernel on CUDA when they share a dtype, where a clone each is a copy each."""
    out = {name: torch.empty(value.shape, dtype=value.dtype, device=value.device) for name, value in rows.items()}
    torch._foreach_copy_(list(out.values()), list(rows.values()))
    return out


def copy_alone(static: dict[str, Tensor], inputs: dict[str, Tensor], name: str) -> None:
    """Writes input ``name`` of a request into its bucket's buffers ``static``: the page table's real columns,
    and its later columns (a narrower table) set to the scratch page, so that no write lands in an earlier
    request's pages."""
    value = inputs[name]
    if name != "kv_page_table":
        static[name][: value.shape[0]].copy_(value)
        return
    batch, width = value.shape
    rows = static[name][:batch]
    rows[:, :width].copy_(value)
    if width < rows.shape[1]:
        rows[:, width:].fill_(scratch_page(inputs["kv_k_pages"]))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: replays call the function on the buffers (no CUDA)
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    copies: tuple[tuple[int, ...], Copies] | None = None  # the last request's sizes, and its copies
    # The graph's own copies of a request into ``inputs`` (None: requests are copied before the replay), and
    # what they were captured from (kept alive: a node reads it until it is first pointed elsewhere).
    graph_copies: GraphCopies | None = None
    sources: dict[str, Tensor] | None = None


class GraphCache:
    """``fn(**inputs) -> dict`` for delta requests, replayed from CUDA graphs, one per bucket; returns the
    real users' rows of the outputs (copies, not the graph's buffers). ``capture=False`` keeps the buckets'
    buffers without capturing graphs (a replay calls ``fn`` on them): the same bookkeeping, on any device."""

    def __init__(self, fn: Callable[..., dict[str, Tensor]], buckets: Buckets, contextual: int,
                 max_graphs: int = 16, capture: bool = True, copy_nodes: bool = True) -> None:
        self._fn = fn
        self._cuda = capture
        self._buckets = buckets
        self._contextual = contextual
        self._max = max_graphs
        self._graphs: OrderedDict[Any, _Graph] = OrderedDict()
        self._seen: dict[Any, int] = {}
        self._pool: Any = None
        self._copy_nodes = copy_nodes
        self._lock = threading.Lock()
        # copying: graphs that copy the requests in themselves; repointed: their copy nodes pointed anew.
        self.counts = {"replays": 0, "captures": 0, "eager": 0, "copying": 0, "repointed": 0}

    def __call__(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        key = bucket_key(inputs, self._buckets, self._contextual)
        if key is None:  # padded, it would be beyond the program's bounds
            with self._lock:
                self.counts["eager"] += 1
            return self._fn(**inputs)
        with self._lock:
            entry = self._graphs.get(key)
            if entry is None:
                if len(self._seen) > _MAX_SEEN:  # shapes seen once, long ago, are forgotten
                    self._seen.clear()
                self._seen[key] = self._seen.get(key, 0) + 1
                if self._seen[key] < 2:
                    self.counts["eager"] += 1
                    return self._fn(**inputs)
                padded, candidates = pad_to_bucket(inputs, self._buckets, self._contextual)
                entry = self._capture(padded)
                self._graphs[key] = entry
                if len(self._graphs) > self._max:
                    self._graphs.popitem(last=False)
            elif entry.graph_copies is not None:
                candidates = self._point(entry, inputs)
            else:
                candidates = self._fill(entry, inputs)
            self._graphs.move_to_end(key)
            if entry.graph is not None:
                entry.graph.replay()
            else:
                entry.outputs = self._run_bucket(entry.inputs)
            self.counts["replays"] += 1
            return first_rows(unpad(entry.outputs, candidates))

    @staticmethod
    def _fill(entry: _Graph, inputs: dict[str, Tensor]) -> int:
        """:func:`fill_bucket` into ``entry``'s buffers, with the copies of its last request when the sizes are
        the same (the steady state: no view made again)."""
        sizes = request_sizes(inputs)
        if entry.copies is None or entry.copies[0] != sizes:
            entry.copies = (sizes, copies_into(entry.inputs, inputs))
        return fill_bucket(entry.inputs, inputs, entry.copies[1])

    def _point(self, entry: _Graph, inputs: dict[str, Tensor]) -> int:
        """Points the graph's copy nodes at the request's tensors; copies before the replay the inputs a node
        cannot take as they are, and those the capture had no rows of (so no node). Returns what
        :meth:`_fill` returns."""
        assert entry.graph_copies is not None and entry.sources is not None
        before = entry.graph_copies.repointed
        for name in entry.graph_copies.point(entry.inputs, inputs):
            copy_alone(entry.inputs, inputs, name)
        self.counts["repointed"] += entry.graph_copies.repointed - before
        for name, value in inputs.items():
            if name not in STATIC_INPUTS and value.numel() > 0 and name not in entry.sources:
                copy_alone(entry.inputs, inputs, name)
        return inputs["candidate_item_emb"].shape[0]

    def _run_bucket(self, static: dict[str, Tensor]) -> dict[str, Tensor]:
        """What a replay runs: the program, after the padding user's counts (its row is the last) where the
        program does not fit them itself."""
        if not self._buckets.fitted_counts:
            padding_counts(static, static["kv_cached"].shape[0] - 1)
        return self._fn(**static)

    def _capture(self, inputs: dict[str, Tensor]) -> _Graph:
        if not self._cuda:
            return _Graph(None, {name: value if name in STATIC_INPUTS else value.clone() for name, value in
                                 inputs.items()}, {})
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = {name: value if name in STATIC_INPUTS else value.clone() for name, value in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture (allocations, lazy initialisation)
            for _ in range(2):
                self._run_bucket(static)
        torch.cuda.current_stream().wait_stream(side)
        self.counts["captures"] += 1
        if self._copy_nodes and cuda_runtime() is not None:
            # The graph's first nodes copy the request into the buffers (memcpys, pointed at each request's
            # tensors before its replay: runtimes/graph_copies.py).
            sources = {name: value for name, value in inputs.items() if name not in STATIC_INPUTS and value.numel()}
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with collection_paused(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_MODE):
                for name, value in sources.items():
                    static[name].copy_(value)
                outputs = self._run_bucket(static)
            copies = graph_copies(graph, static, sources)
            if copies is not None:
                self.counts["copying"] += 1
                return _Graph(graph, static, outputs, graph_copies=copies, sources=sources)
            # A copy that is not a memcpy node: captured again without them.
        graph = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_MODE):
            outputs = self._run_bucket(static)
        return _Graph(graph, static, outputs)
