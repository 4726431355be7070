"""A paged K/V cache of users' history tokens, and a ranker that serves the zoo model through it.

Layout (as vLLM's PagedAttention lays out an LLM's cache): one block of ``num_pages`` pages per layer,
``k [layers, pages, page_size, H, Dqk]`` and ``v [..., Dv]``, allocated once from a byte budget at load.
A user owns a list of pages; the attention kernel reads them through a page table, so a growing
history takes one more page, never a copy. Whole users are evicted, least recently used first, and
never while a request uses them (pinned).

:class:`CachedRanker` serves :class:`~hstu_export.models.ranking.HstuRankingModel` with it. A request
names its users (``user_ids``); an entry is reused only when that is exact
(:mod:`hstu_export.models.cached` lists the conditions): otherwise the user is recomputed from scratch,
which is the prefill. Requests for the same user are serialised; different users run concurrently.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, RequestError
from hstu_export.models.cached import DeltaRanker, time_buckets
from hstu_export.models.ranking import CANDIDATE_LENGTHS, HISTORY_LENGTHS, HstuRankingModel
from hstu_export.ops.paged import write_pages

__all__ = ["CacheFull", "CachedRanker", "PagedKVCache"]


class CacheFull(Exception):
    """The pages a request needs cannot be freed (the budget is too small, or every other user is in use)."""


@dataclass
class _Entry:
    pages: list[int]
    length: int = 0  # tokens cached (contextual + history)
    tokens: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # what they were, CPU
    buckets: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # their time buckets
    query_time: int = 0  # the earliest query time whose buckets the entry holds
    pins: int = 0


_STRIPES = 64  # per-user request locks: a fixed set, the user's hash picks one


class PagedKVCache:
    """K/V pages for ``num_layers`` layers within ``budget_bytes``; thread-safe.

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
        budget_bytes: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int = 64,
    ) -> None:
        if page_size < 1:
            raise ConfigError(f"KV cache page size must be >= 1, got {page_size}")
        item = torch.empty(0, dtype=dtype).element_size()
        self.page_size = page_size
        self.page_bytes = num_layers * page_size * num_heads * (attention_dim + linear_dim) * item
        self.num_pages = int(budget_bytes) // self.page_bytes
        if self.num_pages < 1:
            raise ConfigError(
                f"KV cache budget of {budget_bytes} bytes holds no page ({self.page_bytes} bytes each: "
                f"{num_layers} layers x {page_size} tokens x {num_heads} heads x ({attention_dim}+{linear_dim}) "
                f"x {item} bytes); raise the budget"
            )
        self.k = torch.zeros(num_layers, self.num_pages, page_size, num_heads, attention_dim, dtype=dtype,
                             device=device)  # fmt: skip
        self.v = torch.zeros(num_layers, self.num_pages, page_size, num_heads, linear_dim, dtype=dtype, device=device)
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._counts = {"hits": 0, "misses": 0, "stale": 0, "evictions": 0, "bypassed": 0}

    @property
    def bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

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
                        self._free.extend(entry.pages)
                        del self._entries[user]
                    raise CacheFull(f"the KV cache has no room for {tokens} tokens of user {user!r}")
                self._free.extend(self._entries.pop(victim).pages)
                self._counts["evictions"] += 1
            entry.pages.extend(self._free.pop() for _ in range(max(missing, 0)))
            return list(entry.pages)

    def commit(self, user: Hashable, length: int, tokens: Tensor, buckets: Tensor, query_time: int) -> None:
        """Records what the user's pages hold now (after the K/V were written)."""
        with self._lock:
            entry = self._entries[user]
            entry.length, entry.tokens, entry.buckets, entry.query_time = length, tokens, buckets, query_time


class CachedRanker:
    """Serves the zoo ranking model with a :class:`PagedKVCache` of ``budget_bytes``:
    ``ranker(request, user_ids)`` returns what ``model(request)`` returns, computing for each user only
    the tokens past its cached prefix. ``max_time_drift`` (seconds, default 0: exact) lets cached
    history tokens keep their timestamp buckets for that long after they were computed."""

    def __init__(self, model: HstuRankingModel, *, budget_bytes: int, page_size: int = 64,
                 max_time_drift: int = 0, device: torch.device | str | None = None) -> None:
        cfg = model.config
        self.model = model.eval()
        self.delta = DeltaRanker(model)
        self.device = torch.device(device) if device is not None else model.transducer.post_norm_weight.device
        self.max_time_drift = int(max_time_drift)
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_heads, cfg.attention_dim, cfg.linear_dim,
                                  budget_bytes=budget_bytes, dtype=self.delta.dtype, device=self.device,
                                  page_size=page_size)  # fmt: skip
        self.schema = model.input_schema()

    def _tokens(self, features: dict[str, Tensor], hist_off: Tensor, b: int) -> Tensor:
        """What defines user b's cached tokens: contextual ids, then (item, action, time) per history token."""
        start, end = int(hist_off[b]), int(hist_off[b + 1])
        ctx = [features[name][b:b + 1] for name in self.model.config.contextual_features]
        hist = [features[name][start:end] for name in ("uih_item_ids", "uih_action_ids", "uih_timestamps")]
        return torch.cat([*ctx, torch.stack(hist, 1).flatten()]).to(torch.int64)

    def __call__(self, features: dict[str, Tensor], user_ids: Sequence[Hashable]) -> dict[str, Tensor]:
        cfg = self.model.config
        c = cfg.contextual_seq_len
        self.schema.validate(features)
        host = {name: value.cpu() for name, value in features.items()}
        hist_len = host[HISTORY_LENGTHS].to(torch.int64)
        batch = hist_len.numel()
        if len(user_ids) != batch or host[CANDIDATE_LENGTHS].numel() != batch:
            raise RequestError(f"{len(user_ids)} user ids for a batch of {batch} users")
        enc = self.model.transducer.positional_encoder
        hist_off = torch.cat([torch.zeros(1, dtype=torch.int64), hist_len.cumsum(0)])
        query_time = host["query_time"].to(torch.int64)
        ids = list(user_ids)
        repeated = {u for u in ids if ids.count(u) > 1}
        with self.cache.using(ids):
            cached = torch.zeros(batch, dtype=torch.int64)
            tables: list[list[int]] = []
            plans: list[tuple[Tensor, Tensor, int] | None] = []  # what to record per stored user
            for b, user in enumerate(ids):
                tokens = self._tokens(host, hist_off, b)
                hist_ts = host["uih_timestamps"][int(hist_off[b]):int(hist_off[b + 1])]
                buckets = time_buckets(query_time[b], hist_ts, enc.time_bucket_base, enc.num_time_buckets)
                if user in repeated:
                    tables.append([])
                    plans.append(None)
                    continue
                entry = self.cache.entry(user)
                reuse = self._reusable(entry, tokens, buckets, int(query_time[b]), int(hist_len[b]))
                try:
                    tables.append(self.cache.reserve(user, c + int(hist_len[b]), reuse))
                except CacheFull:
                    tables.append([])
                    plans.append(None)
                    continue
                cached[b] = reuse
                if reuse:  # cached tokens keep the buckets (and time) they were computed with
                    assert entry is not None
                    kept = entry.length - c
                    plans.append((tokens, torch.cat([entry.buckets, buckets[kept:]]), entry.query_time))
                else:
                    plans.append((tokens, buckets, int(query_time[b])))
            bypassed = sum(plan is None for plan in plans)
            if bypassed:
                self.cache.count("bypassed", bypassed)
            width = max(1, *(len(t) for t in tables))
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=self.device)
            result = self.delta.run({k: v.to(self.device) for k, v in features.items()}, cached, self.cache.k,
                                    self.cache.v, table)
            # Store the new history tokens' K/V of the stored users, then record what their pages hold.
            stored = torch.tensor([plan is not None for plan in plans], device=self.device)[result.users]
            for layer in range(result.new_k.size(0)):
                for pages, new in ((self.cache.k, result.new_k), (self.cache.v, result.new_v)):
                    write_pages(pages[layer], table, new[layer][stored], result.positions[stored],
                                result.users[stored])
            for b, (user, plan) in enumerate(zip(ids, plans)):
                if plan is not None:
                    self.cache.commit(user, c + int(hist_len[b]), *plan)
            return result.outputs

    def _reusable(self, entry: _Entry | None, tokens: Tensor, buckets: Tensor, query_time: int, hist_len: int) -> int:
        """Tokens of the entry that may be reused exactly (0: recompute), counting hit, miss or stale."""
        c = self.model.config.contextual_seq_len
        if entry is None or entry.length == 0:
            self.cache.count("misses")
            return 0
        hist = entry.length - c
        ok = hist <= hist_len and torch.equal(entry.tokens, tokens[: c + 3 * hist])
        if ok and c > 0 and hist != hist_len:
            ok = False  # contextual tokens would see the new history
        if ok and not torch.equal(entry.buckets, buckets[:hist]):
            ok = query_time - entry.query_time <= self.max_time_drift
        self.cache.count("hits" if ok else "stale")
        return entry.length if ok else 0
