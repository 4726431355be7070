"""A paged K/V cache of users' history tokens, and a ranker that serves the zoo model through it.

Layout (as vLLM's PagedAttention lays out an LLM's cache): one block of ``num_pages`` pages per layer,
``k [layers, pages, page_size, H, Dqk]`` and ``v [..., Dv]``, allocated once from a byte budget at load.
A user owns a list of pages; the attention kernel reads them through a page table, so a growing
history takes one more page, never a copy. Whole users are evicted, least recently used first, and
never while a request uses them (pinned). The delta run writes its new K/V into the pages itself, where
the page table points: the pool's last page is a scratch page, owned by no user and never read, where
the K/V of users that are not stored go (their table rows point only at it).

:class:`CachedRanker` serves :class:`~hstu_export.models.ranking.HstuRankingModel` with it. A request
names its users (``user_ids``); an entry is reused only when that is exact
(:mod:`hstu_export.models.cached` lists the conditions): otherwise the user is recomputed from scratch,
which is the prefill. Requests for the same user are serialised; different users run concurrently.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import numbers
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from hstu_export.errors import ConfigError, RequestError
from hstu_export.models.cached import DeltaRanker, KVLayout, scratch_page
from hstu_export.models.ranking import HISTORY_LENGTHS, HISTORY_TOKEN_FEATURES, HstuRankingModel
from hstu_export.models.transducer import UNBOUNDED, bucket_edges, time_buckets
from hstu_export.settings import check_time_drift, format_bytes, machine_memory, parse_size

__all__ = ["CacheFull", "CachedRanker", "DeltaRunner", "EagerDelta", "EntryRecord", "PagedKVCache"]


class DeltaRunner(Protocol):
    """What runs a delta request for :class:`CachedRanker`: the eager model (:class:`EagerDelta`) or a
    package's exported delta program (``hstu_export.runtimes.kv_delta``)."""

    layout: KVLayout
    device: torch.device

    def validate(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        """``features`` as the runner takes them; RequestError when it is not a request the model accepts."""

    def __call__(self, features: dict[str, Tensor], cached: Tensor, k_pages: Tensor, v_pages: Tensor,
                 page_table: Tensor) -> dict[str, Tensor]:
        """:meth:`hstu_export.models.cached.DeltaRanker.run`'s contract (the model's outputs; the new K/V
        written into the pages); ``features`` and ``page_table`` may be on the host (the runner moves them to its
        device)."""

    def table_width(self, width: int) -> int:
        """The width to build a page table of ``width`` pages at (later columns: the scratch page)."""


class EagerDelta:
    """The zoo model's delta path, run eagerly."""

    def __init__(self, model: HstuRankingModel, device: torch.device | str | None = None) -> None:
        self.delta = DeltaRanker(model.eval())
        self.layout = self.delta.layout
        self.device = torch.device(device) if device is not None else model.transducer.post_norm_weight.device
        self.schema = model.input_schema()

    def validate(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        self.schema.validate(features)
        return features

    def __call__(self, features: dict[str, Tensor], cached: Tensor, k_pages: Tensor, v_pages: Tensor,
                 page_table: Tensor) -> dict[str, Tensor]:
        on_device = {name: value.to(self.device, non_blocking=True) for name, value in features.items()}
        return self.delta.run(on_device, cached, k_pages, v_pages, page_table.to(self.device, non_blocking=True))

    def table_width(self, width: int) -> int:
        return width


class CacheFull(Exception):
    """The pages a request needs cannot be freed (the budget is too small, or every other user is in use)."""


# The rows of a cache entry's history tokens: HISTORY_TOKEN_FEATURES.
TOKEN_ROWS = HISTORY_TOKEN_FEATURES


# A run of a user's consecutive history tokens, one ``bytes`` per TOKEN_ROWS row (native int64): what one
# request added, never changed once made. Bytes compare with the request's tokens by one copy and a memcmp
# (a 4096-token row: 1.5 µs, against 6.6 µs by np.array_equal; 2-core VM).
Run = tuple[bytes, ...]

# Runs a record keeps before they are merged into one (from the request, which holds the whole history): a
# merge copies the history once every this many requests, as the C++ runtime's records do.
MAX_RUNS = 16


def token_run(rows: Sequence[np.ndarray]) -> Run:
    """The tokens of ``rows`` (TOKEN_ROWS, each int64 [n]) as a run."""
    return tuple(row.tobytes() for row in rows)


@dataclass
class EntryRecord:
    """What a user's pages hold, left by the request that wrote them (:meth:`PagedKVCache.commit`). Held on
    the host as plain bytes and numbers: each request compares and extends them user by user, where a NumPy
    call costs a fraction of a PyTorch one and a memcmp a fraction of a NumPy call (docs/PERF_INVESTIGATIONS.md,
    "KV-cached serving: host round trips")."""

    context: np.ndarray  # contextual ids [c], int64
    runs: tuple[Run, ...]  # the cached history's tokens, in order: successive records share their earlier runs
    query_time: int  # the earliest query time whose buckets the entry holds
    # The query times [lo, hi) at which every cached token falls in the time bucket it was computed with.
    valid: tuple[int, int]

    @property
    def history(self) -> int:
        """History tokens the record holds."""
        return sum(len(run[0]) for run in self.runs) // 8

    def holds_prefix_of(self, tokens: Sequence[np.ndarray]) -> bool:
        """Whether the record's history is the start of ``tokens`` (TOKEN_ROWS, each int64 [history]): each row
        read out once (one copy of the cached part), each run compared where it lies (a memcmp)."""
        history = self.history
        if history > tokens[0].shape[0]:
            return False
        for i, row in enumerate(tokens):
            whole, start = row[:history].tobytes(), 0
            for run in self.runs:
                if not whole.startswith(run[i], start):
                    return False
                start += len(run[i])
        return True


@dataclass
class _Entry:
    pages: list[int]
    length: int = 0  # tokens cached (contextual + history)
    record: EntryRecord | None = None  # what they were (set with length)
    pins: int = 0


def valid_query_times(timestamps: np.ndarray | Tensor, query_time: np.ndarray | Tensor, users: np.ndarray | Tensor,
                      batch: int, layout: KVLayout) -> tuple[list[int], list[int]]:
    """For each of ``batch`` users, the query times [lo, hi) at which its tokens among ``timestamps`` (user
    ``users[i]``'s, its query time ``query_time[i]``; int64 arrays or host tensors) keep the time bucket they
    have at that query time: the intersection of each token's bucket
    (:func:`~hstu_export.models.transducer.bucket_edges`) shifted by its timestamp. A user without tokens
    gets every query time. In NumPy, each bucket found among the edges (as the C++ runtime does): a few
    numbers a user, where each PyTorch op on the host costs more than the work."""
    stamps = np.asarray(timestamps, dtype=np.int64)
    owner = np.asarray(users, dtype=np.int64)
    edges = _bucket_edges(layout.time_bucket_base, layout.num_time_buckets)
    difference = np.maximum(np.asarray(query_time, dtype=np.int64) - stamps, 1)  # wrapping, as tensors subtract
    if difference.size and int(difference.max()) >= UNBOUNDED:  # beyond the edges' range: the function itself
        bucket = time_buckets(torch.from_numpy(np.asarray(query_time, dtype=np.int64)), torch.from_numpy(stamps),
                              layout.time_bucket_base, layout.num_time_buckets).numpy()
    else:
        bucket = np.searchsorted(edges[1:-1], difference, side="right")
    lo = np.full(batch, -UNBOUNDED, dtype=np.int64)
    hi = np.full(batch, UNBOUNDED, dtype=np.int64)
    np.maximum.at(lo, owner, stamps + edges[bucket])
    np.minimum.at(hi, owner, stamps + edges[bucket + 1])
    return lo.tolist(), hi.tolist()


@functools.cache
def _bucket_edges(base: float, num_buckets: int) -> np.ndarray:
    return bucket_edges(base, num_buckets).numpy()


_STRIPES = 64  # per-user request locks: a fixed set, the user's hash picks one


def page_bytes(num_layers: int, num_heads: int, attention_dim: int, linear_dim: int, page_size: int,
               dtype: torch.dtype) -> int:
    """Bytes of one page: K and V of ``page_size`` tokens in every layer."""
    item = torch.empty(0, dtype=dtype).element_size()
    return num_layers * page_size * num_heads * (attention_dim + linear_dim) * item


def budget_in_bytes(budget: int | str) -> int:
    """A KV-cache budget as bytes: a positive integer, or a size as the CLI reads them (``"512MiB"``,
    ``"4GiB"``, ``"2GB"``: :func:`~hstu_export.settings.parse_size`). ConfigError otherwise."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral | str):
        raise ConfigError(f"KV cache budget_bytes must be a number of bytes or a size such as '512MiB' or '4GiB', "
                          f"got {budget!r} ({type(budget).__name__})")
    try:
        return parse_size(budget if isinstance(budget, str) else int(budget))
    except ConfigError as exc:
        raise ConfigError(f"KV cache budget_bytes: {exc}") from None


def memory_for_pages(device: torch.device) -> tuple[int, int]:
    """(available, total) bytes where a cache's pages are allocated: the GPU's free memory (with what
    PyTorch's allocator holds unused), else the host's (:func:`~hstu_export.settings.machine_memory`)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total
    total, available = machine_memory()
    return available, total


def user_keys(user_ids: object) -> list[Hashable]:
    """``user_ids`` as cache keys, one per user: a sequence of hashable ids (ints, strings, ...) or a 1-d
    integer tensor or array. Ids held in tensors or NumPy scalars become Python numbers, so that ``7``,
    ``torch.tensor(7)`` and ``np.int64(7)`` are the same user (a tensor hashes by identity: as a key it
    would never be found again). RequestError when they cannot be keys."""
    if isinstance(user_ids, Tensor | np.ndarray):
        if user_ids.ndim != 1:
            raise RequestError(f"user_ids as a tensor or array must be 1-d (one id per user), got shape "
                               f"{list(user_ids.shape)}")
        _check_integral_ids(user_ids.dtype)
        return user_ids.tolist()
    if isinstance(user_ids, str | bytes) or not isinstance(user_ids, Iterable):
        raise RequestError(f"user_ids must be a sequence of one id per user (a list of ints or strings, or a 1-d "
                           f"integer tensor), got {type(user_ids).__name__}")
    ids = list(user_ids)
    for i, user in enumerate(ids):
        if type(user) is int or type(user) is str:  # the common case, checked first
            continue
        if isinstance(user, Tensor | np.generic | np.ndarray):
            count = user.numel() if isinstance(user, Tensor) else user.size
            if count != 1:
                raise RequestError(f"user id at position {i} is a {type(user).__name__} of shape "
                                   f"{list(user.shape)}; give one id per user")
            _check_integral_ids(user.dtype, f"user id at position {i}")
            ids[i] = user.item()
            continue
        try:
            hash(user)
        except TypeError:
            raise RequestError(f"user id at position {i} is a {type(user).__name__}, which cannot be a cache key "
                               f"(unhashable); use ints, strings or tuples of them") from None
    return ids


def _check_integral_ids(dtype: torch.dtype | np.dtype, what: str = "user_ids") -> None:
    integral = (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
                if isinstance(dtype, torch.dtype) else np.issubdtype(dtype, np.integer))
    if not integral:
        raise RequestError(f"{what} must hold integers, got dtype {dtype}")


class PagedKVCache:
    """K/V pages for ``num_layers`` layers within ``budget_bytes``; thread-safe. One page of the budget is
    the scratch page (``scratch_page``, the last), where the K/V of tokens that are not stored are written.

    Counters (:meth:`stats`): ``hits``, ``misses`` (nothing cached), ``stale`` (an entry that could not
    be reused exactly and was recomputed), ``evictions``, ``bypassed`` (users served without storing:
    no room, or the same user twice in one batch)."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        attention_dim: int,
        linear_dim: int,
        *,
        budget_bytes: int | str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int = 64,
        row_width: int = 0,
        row_dtype: torch.dtype | None = None,
    ) -> None:
        if (isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral) or page_size < 16
                or page_size & (page_size - 1)):
            raise ConfigError(f"KV cache page size must be a power of two >= 16 (a key block of the attention kernel "
                              f"never straddles a page), got {page_size!r}")
        self.page_size = page_size = int(page_size)
        # A derived delta program also keeps each cached token's frontier row (``row_width`` values of
        # ``row_dtype``: hstu_export.kv_derive), to tell whether the cached K/V still hold.
        row_dtype = row_dtype or dtype
        row_item = torch.empty(0, dtype=row_dtype).element_size()
        self.page_bytes = page_bytes(num_layers, num_heads, attention_dim, linear_dim, page_size, dtype) + (
            page_size * row_width * row_item)
        item = torch.empty(0, dtype=dtype).element_size()
        budget_bytes = budget_in_bytes(budget_bytes)
        self.num_pages = budget_bytes // self.page_bytes - 1  # users' pages; then the scratch page
        if self.num_pages < 1:
            raise ConfigError(
                f"KV cache budget of {budget_bytes} bytes holds no page for users ({self.page_bytes} bytes each: "
                f"{num_layers} layers x {page_size} tokens x {num_heads} heads x ({attention_dim}+{linear_dim}) "
                f"x {item} bytes, and one more for the scratch page); raise the budget"
            )
        # Checked before allocating: beyond the memory there, the allocator fails with its own error (or, on the
        # host, the process is killed while the pages are zeroed).
        device = torch.device(device)
        needed = (self.num_pages + 1) * self.page_bytes
        available, total = memory_for_pages(device)
        if needed > available:
            raise ConfigError(f"KV cache budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) is more than the "
                              f"memory available on {device}: {format_bytes(available)} free of {format_bytes(total)}; "
                              f"lower the budget")
        try:
            self.k = torch.zeros(num_layers, self.num_pages + 1, page_size, num_heads, attention_dim, dtype=dtype,
                                 device=device)  # fmt: skip
            self.v = torch.zeros(num_layers, self.num_pages + 1, page_size, num_heads, linear_dim, dtype=dtype,
                                 device=device)  # fmt: skip
            self.x = torch.zeros(self.num_pages + 1, page_size, row_width, dtype=row_dtype, device=device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"cannot allocate a KV cache of {format_bytes(needed)} ({needed} bytes) on {device}: "
                              f"{first}; lower the budget") from None
        self.scratch_page = scratch_page(self.k)
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._counts = {"hits": 0, "misses": 0, "stale": 0, "evictions": 0, "bypassed": 0}

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.x))

    def stats(self) -> dict[str, int]:
        with self._lock:
            used = self.num_pages - len(self._free)
            return {**self._counts, "users": len(self._entries), "pages_used": used, "pages": self.num_pages}

    def count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._counts[name] += by

    def __contains__(self, user: Hashable) -> bool:
        with self._lock:
            return user in self._entries

    @contextlib.contextmanager
    def using(self, users: Sequence[Hashable]) -> Iterator[None]:
        """Serialises requests per user (striped locks taken in index order: no deadlock) and pins the
        users' entries against eviction while the block runs."""
        distinct = set(users)
        stripes = sorted({hash(user) % _STRIPES for user in distinct})
        with contextlib.ExitStack() as stack:
            for index in stripes:
                stack.enter_context(self._stripes[index])
            with self._lock:
                for user in distinct:
                    if user in self._entries:
                        self._entries[user].pins += 1
            try:
                yield
            finally:
                with self._lock:
                    for user in distinct:
                        if user in self._entries:
                            self._entries[user].pins = max(0, self._entries[user].pins - 1)

    def entry(self, user: Hashable) -> _Entry | None:
        """The user's entry (marked most recently used), or None."""
        with self._lock:
            found = self._entries.get(user)
            if found is not None:
                self._entries.move_to_end(user)
            return found

    def reserve(self, user: Hashable, tokens: int, keep: int) -> list[int]:
        """Pages for ``tokens`` tokens of ``user``, the first ``keep`` of them already cached (0: start
        afresh, the old entry's pages are released). Evicts least recently used users that are not in
        use; raises :class:`CacheFull` (leaving a kept entry as it was). Call inside :meth:`using`."""
        needed = -(-tokens // self.page_size)
        with self._lock:
            entry = self._entries.get(user)
            if entry is not None and keep == 0:
                self._free.extend(entry.pages)
                entry.pages, entry.length = [], 0
            if entry is None:
                entry = self._entries[user] = _Entry(pages=[], pins=1)
            self._entries.move_to_end(user)
            missing = needed - len(entry.pages)
            while missing > len(self._free):
                victim = next((u for u, e in self._entries.items() if e.pins == 0 and u != user), None)
                if victim is None:
                    if entry.length == 0:
                        self._release(user)
                    raise CacheFull(f"the KV cache has no room for {tokens} tokens of user {user!r}")
                self._release(victim)
                self._counts["evictions"] += 1
            entry.pages.extend(self._free.pop() for _ in range(max(missing, 0)))
            return list(entry.pages)

    def drop(self, user: Hashable) -> None:
        """Removes the user's entry and releases its pages (a stale entry that finds no room)."""
        with self._lock:
            if user in self._entries:
                self._release(user)

    def _release(self, user: Hashable) -> None:
        """The user's entry gone, its pages free (the lock held)."""
        self._free.extend(self._entries.pop(user).pages)

    def restart(self, user: Hashable) -> None:
        """Marks the user's entry empty, its pages kept (a request about to write them from the first token)."""
        with self._lock:
            entry = self._entries[user]
            entry.length, entry.record = 0, None

    def commit(self, user: Hashable, length: int, record: EntryRecord | None) -> None:
        """Records what the user's pages hold now (after the K/V were written)."""
        with self._lock:
            entry = self._entries[user]
            entry.length, entry.record = length, record


class CachedRanker:
    """Serves the zoo ranking model, or a package exported with its delta program, with a
    :class:`PagedKVCache` of ``budget_bytes`` (bytes, or a size such as ``"4GiB"``; refused beyond the memory
    available where the pages go): ``ranker(request, user_ids)`` returns what ``model(request)`` returns,
    computing for each user only the tokens past its cached prefix. ``max_time_drift`` (seconds, default 0:
    exact) lets cached history tokens keep their timestamp buckets for that long after they were computed."""

    def __init__(self, source: HstuRankingModel | DeltaRunner, *, budget_bytes: int | str, page_size: int = 64,
                 max_time_drift: int = 0, device: torch.device | str | None = None) -> None:
        if not isinstance(source, HstuRankingModel) and not hasattr(source, "layout"):
            raise ConfigError(f"CachedRanker serves the zoo's HstuRankingModel or a package's delta program, got "
                              f"{type(source).__name__}; for a loaded package use predictor.kv_cache(budget_bytes)")
        check_time_drift(max_time_drift)
        self.runner: DeltaRunner = EagerDelta(source, device) if isinstance(source, HstuRankingModel) else source
        fixed = getattr(self.runner, "page_size", None)  # an exported program reads pages of one size
        if fixed is not None and fixed != page_size:
            raise ConfigError(f"the delta program reads pages of {fixed} tokens; use page_size={fixed} "
                              f"(or export again with --kv-page-size {page_size})")
        self.layout = layout = self.runner.layout
        self.device = self.runner.device
        self.max_time_drift = int(max_time_drift)
        self.cache = PagedKVCache(layout.num_layers, layout.num_heads, layout.attention_dim, layout.linear_dim,
                                  budget_bytes=budget_bytes, dtype=layout.dtype, device=self.device,
                                  page_size=page_size)  # fmt: skip

    def __call__(self, features: dict[str, Tensor], user_ids: Sequence[Hashable] | Tensor) -> dict[str, Tensor]:
        """``user_ids``: one id per user of the batch, in batch order (:func:`user_keys`)."""
        layout = self.layout
        c = layout.contextual_seq_len
        ids = user_keys(user_ids)
        features = self.runner.validate(features)
        # On the host: what the bookkeeping reads (lengths, history, query time, contextual ids). Per user
        # it compares each token row with the entry's in one call, and its time buckets in O(1) (the
        # entry's valid query times); buckets are computed for the request's new tokens only. The per-user
        # work is NumPy's (see EntryRecord); the request's tensors are read through it without a copy.
        host = {name: features[name].cpu() for name in (HISTORY_LENGTHS, *HISTORY_TOKEN_FEATURES, "query_time",
                                                         *layout.contextual_features)}
        lengths = host[HISTORY_LENGTHS].to(torch.int64).tolist()
        batch = len(lengths)
        if len(ids) != batch:
            raise RequestError(f"{len(ids)} user ids for a batch of {batch} users")
        hist_off = [0, *itertools.accumulate(lengths)]
        times = host["query_time"].to(torch.int64).tolist()
        rows = [host[name].numpy().astype(np.int64, copy=False) for name in TOKEN_ROWS]  # views when int64
        context = (np.stack([host[name].numpy() for name in layout.contextual_features], 1).astype(np.int64)
                   if c else np.empty((batch, 0), dtype=np.int64))
        counts: dict[Hashable, int] = {}
        for user in ids:
            counts[user] = counts.get(user, 0) + 1
        with self.cache.using(ids):
            cached = [0] * batch
            tables: list[list[int]] = []
            stored: list[EntryRecord | bool | None] = []  # per user: the record reused, True (stored afresh), None
            mine: list[list[np.ndarray]] = []  # per user: its history's rows (views)
            unchecked: dict[int, EntryRecord] = {}  # users run as hits: their records, compared while the runner computes
            for b, user in enumerate(ids):
                mine.append([row[hist_off[b]:hist_off[b + 1]] for row in rows])
                if counts[user] > 1:  # the same user twice in one batch: served, not stored
                    tables.append([])
                    stored.append(None)
                    continue
                entry = self.cache.entry(user)
                reuse = self._reusable(entry, context[b] if c else None, mine[b], times[b])
                record = entry.record if reuse and entry is not None else None
                try:
                    tables.append(self.cache.reserve(user, c + lengths[b], reuse))
                except CacheFull:
                    # No room: compared now, so that a changed history is counted stale and its entry dropped.
                    if record is not None and not record.holds_prefix_of(mine[b]):
                        self.cache.count("stale")
                        self.cache.drop(user)
                    elif record is not None:
                        self.cache.count("hits")
                    tables.append([])
                    stored.append(None)
                    continue
                cached[b] = reuse
                stored.append(record if record is not None else True)
                if record is not None:
                    unchecked[b] = record
            bypassed = sum(kept is None for kept in stored)
            if bypassed:
                self.cache.count("bypassed", bypassed)
            outputs, new_counts, fresh = self._launch(features, host, lengths, hist_off, cached, tables)
            # The histories of the users run as hits, compared with their entries while the device computes. A
            # user whose history changed is stale: the whole request runs again with that user from nothing, on
            # the pages it holds (marked empty first, so that a failure leaves no entry claiming them).
            changed = [b for b, record in unchecked.items() if not record.holds_prefix_of(mine[b])]
            self.cache.count("hits", len(unchecked) - len(changed))
            if changed:
                self.cache.count("stale", len(changed))
                for b in changed:
                    cached[b], stored[b] = 0, True
                    self.cache.restart(ids[b])
                outputs, new_counts, fresh = self._launch(features, host, lengths, hist_off, cached, tables)
            if bypassed < batch:
                owner = np.repeat(np.arange(batch), new_counts)
                stamps = rows[TOKEN_ROWS.index("uih_timestamps")][fresh]  # the new tokens'
                lo, hi = valid_query_times(stamps, np.asarray(times, dtype=np.int64)[owner], owner, batch, layout)
                for b, (user, kept) in enumerate(zip(ids, stored)):
                    if kept is not None:
                        record = self._record(kept if isinstance(kept, EntryRecord) else None, context[b], mine[b],
                                              times[b], (lo[b], hi[b]))
                        self.cache.commit(user, c + lengths[b], record)
            return outputs

    def _launch(self, features: dict[str, Tensor], host: dict[str, Tensor], lengths: list[int], hist_off: list[int],
                cached: list[int], tables: list[list[int]]) -> tuple[dict[str, Tensor], np.ndarray, np.ndarray]:
        """Runs the delta request of ``features`` (each user's history past its ``cached`` tokens), writing the
        new K/V into the pages of ``tables``; returns the outputs (as the runner leaves them: on a CUDA device
        the work may still be running), each user's new history tokens and their rows in the request."""
        c = self.layout.contextual_seq_len
        batch = len(lengths)
        # As wide as the request's shape bucket, if the runner has them: the graph then copies it as it is.
        width = self.runner.table_width(max(1, *(len(t) for t in tables)))
        scratch = self.cache.scratch_page  # the rest of a row, and the whole row of a user not stored
        rows_of_table = np.full((batch, width), scratch, dtype=np.int32)
        for b, pages in enumerate(tables):
            rows_of_table[b, :len(pages)] = pages
        table = torch.from_numpy(rows_of_table)  # the runner moves it with the request, without a synchronisation
        # The delta request: each user's history after its cached prefix (one gather of the new tokens).
        new_counts = np.asarray([n - max(k - c, 0) for n, k in zip(lengths, cached)], dtype=np.int64)
        starts = np.asarray(hist_off[1:], dtype=np.int64) - new_counts
        fresh = np.repeat(starts - (np.cumsum(new_counts) - new_counts), new_counts) + np.arange(new_counts.sum())
        # Where the request's tensors are (the runner moves them): lengths stay on the host, so that the
        # runner's host-side work reads them without waiting for the device.
        delta = {name: value for name, value in features.items() if name not in HISTORY_TOKEN_FEATURES}
        delta.update({name: torch.from_numpy(host[name].numpy()[fresh]) for name in HISTORY_TOKEN_FEATURES})
        delta[HISTORY_LENGTHS] = torch.from_numpy(new_counts)
        outputs = self.runner(delta, torch.tensor(cached, dtype=torch.int64), self.cache.k, self.cache.v, table)
        return outputs, new_counts, fresh

    def _reusable(self, entry: _Entry | None, context: np.ndarray | None, tokens: list[np.ndarray],
                  query_time: int) -> int:
        """Tokens of the entry that may be reused exactly (0: recompute, counted as a miss or stale) but for its
        history's tokens, which :meth:`__call__` compares with ``tokens`` while the device computes: the hit or
        stale is counted then. ``context`` (None without contextual features) and ``tokens`` (TOKEN_ROWS, each
        [history]): the user's in this request (views)."""
        c = self.layout.contextual_seq_len
        if entry is None or entry.length == 0 or entry.record is None:
            self.cache.count("misses")
            return 0
        record = entry.record
        hist = entry.length - c
        # Contextual tokens see the whole history: with them, only an unchanged history is reused.
        ok = hist <= tokens[0].shape[0] and not (c > 0 and hist != tokens[0].shape[0])
        ok = ok and (context is None or np.array_equal(record.context, context))
        ok = ok and record.history == hist
        # In the same time buckets, or within the allowed drift (none by default: exact).
        low, high = record.valid
        drift = query_time - record.query_time
        ok = ok and (low <= query_time < high or (0 < self.max_time_drift and drift <= self.max_time_drift))
        if not ok:
            self.cache.count("stale")
        return entry.length if ok else 0

    @staticmethod
    def _record(reused: EntryRecord | None, context: np.ndarray, tokens: list[np.ndarray], query_time: int,
                valid: tuple[int, int]) -> EntryRecord:
        """What a stored user's entry holds after this request: its own copies (never views of the request),
        and, where an entry was reused, its tokens' buckets and query time. ``valid``: the query times at
        which the request's new tokens keep their buckets."""
        if reused is None:
            return EntryRecord(context.copy(), (token_run(tokens),), query_time, valid)
        hist = reused.history
        if tokens[0].shape[0] == hist:  # nothing new: the entry stays as it is
            return reused
        # Cached tokens keep the buckets (and time) they were computed with.
        both = (max(reused.valid[0], valid[0]), min(reused.valid[1], valid[1]))
        runs = ((*reused.runs, token_run([t[hist:] for t in tokens])) if len(reused.runs) < MAX_RUNS
                else (token_run(tokens),))
        return EntryRecord(reused.context, runs, reused.query_time, both)
