"""KV-cached serving through a delta program derived from the model's graph (:mod:`hstu_export.kv_derive`),
for any HSTU model whose attention hstu-export maps.

Per request: the runner computes the dense half's inputs and each user's sequence length and target count;
each user is given its cached token count (its entry's, when it is no longer than the user's non-target
tokens now) and pages for all its non-target tokens; the delta program runs, storing the new K/V and
frontier rows, and says which users' cached prefix no longer matches (*stale*). Those users are run again
from scratch, in one more call for the whole batch, so a stale K/V is never served. Counters and pages
are :class:`~hstu_export.serving.kv_cache.PagedKVCache`'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from hstu_export.errors import ConfigError, RequestError
from hstu_export.kv_derive import counts_on_host, delta_row_inputs
from hstu_export.runtimes.predictor import to_device
from hstu_export.serving.kv_cache import CacheFull, PagedKVCache, user_keys
from hstu_export.serving.kv_padding import Padded

__all__ = ["DerivedCachedRanker", "DerivedRunner", "EagerDerived"]


class DerivedRunner(Protocol):
    """What runs a derived delta program: over the traced graphs (:class:`EagerDerived`) or a package's."""

    layout: dict[str, Any]
    device: torch.device
    dtype: torch.dtype

    def dense_inputs(self, request: dict[str, Tensor]) -> dict[str, Tensor]:
        """The dense half's inputs for a request (validated; its sparse half run)."""

    def counts(self, dense: dict[str, Tensor], request: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(sequence length, target count) per user, as the model's attentions see them, for ``request`` (whose
        dense inputs are ``dense``)."""

    def delta(self, dense: dict[str, Tensor], cached: Tensor, k_pages: Tensor, v_pages: Tensor, x_pages: Tensor,
              page_table: Tensor, rows: dict[str, Tensor]) -> dict[str, Tensor]:
        """The delta program: the outputs and ``kv_stale``. ``rows``: the row lists by input name
        (:func:`~hstu_export.kv_derive.delta_row_inputs`; the program takes those it lists)."""


class EagerDerived:
    """A :class:`DerivedRunner` over graphs in this process: ``dense_inputs`` (a request -> the dense half's
    inputs) and a :class:`~hstu_export.kv_derive.DerivedDelta`."""

    def __init__(self, dense_inputs: Any, derived: Any, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self._dense_inputs, self._derived = dense_inputs, derived
        self.layout = derived.layout()
        self.dtype, self.device = dtype, torch.device(device)
        self._count_inputs = [n.target for n in derived.counts.graph.nodes if n.op == "placeholder"]

    def dense_inputs(self, request: dict[str, Tensor]) -> dict[str, Tensor]:
        with torch.no_grad():
            return self._dense_inputs(request)

    def counts(self, dense: dict[str, Tensor], request: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        if self._derived.host_counts is not None:  # added up from the dense inputs it names, as a package's runtime does
            return counts_on_host(self._derived.host_counts, dense)
        with torch.no_grad():
            return self._derived.counts(**{name: dense[name] for name in self._count_inputs})

    def delta(self, dense: dict[str, Tensor], cached: Tensor, k_pages: Tensor, v_pages: Tensor, x_pages: Tensor,
              page_table: Tensor, rows: dict[str, Tensor]) -> dict[str, Tensor]:
        takes = {n.target for n in self._derived.program.graph.nodes if n.op == "placeholder"}
        with torch.no_grad():
            # ``dense`` may hold the request too: the program takes the ids its frontier rows are compared as
            return self._derived.program(**{name: value for name, value in dense.items() if name in takes},
                                         kv_cached=cached, kv_k_pages=k_pages, kv_v_pages=v_pages,
                                         kv_x_pages=x_pages, kv_page_table=page_table,
                                         **{name: value for name, value in rows.items() if name in takes})


class DerivedCachedRanker:
    """``ranker(request, user_ids)`` returns what the model returns on ``request``, computing each user's
    layers only past its cached prefix (the users' frontier rows prove the prefix unchanged)."""

    def __init__(self, runner: DerivedRunner, *, budget_bytes: int | str, page_size: int = 64) -> None:
        fixed = getattr(runner, "page_size", None)  # an exported program reads pages of one size
        if fixed is not None and fixed != page_size:
            raise ConfigError(f"the delta program reads pages of {fixed} tokens; use page_size={fixed} "
                              f"(or export again with --kv-page-size {page_size})")
        self.runner = runner
        self.padded_calls = 0  # calls run with a padding user (shape buckets: serving/kv_padding.py)
        layout = runner.layout
        self.cache = PagedKVCache(layout["num_layers"], layout["num_heads"], layout["attention_dim"],
                                  layout["linear_dim"], budget_bytes=budget_bytes, dtype=runner.dtype,
                                  device=runner.device, page_size=page_size, row_width=layout["row_width"],
                                  row_dtype=getattr(torch, layout["row_dtype"]))  # fmt: skip

    def __call__(self, request: dict[str, Tensor], user_ids: Sequence[Hashable] | Tensor) -> dict[str, Tensor]:
        ids = user_keys(user_ids)
        padded = self._padded(request, len(ids))
        whole = request if padded is None else padded.request
        dense = self.runner.dense_inputs(whole)
        lengths, targets = self.runner.counts(dense, whole)
        # One read (none where they were added up on the host): pages are reserved, and the new rows listed, there.
        lengths, targets = torch.stack([lengths.to(torch.int64), targets.to(torch.int64)]).cpu()
        seq_lengths, stored = lengths.tolist(), (lengths - targets).tolist()
        batch = len(stored) - (padded is not None)
        if len(ids) != batch:
            raise RequestError(f"{len(ids)} user ids for a batch of {batch} users")
        seen: dict[Hashable, int] = {}
        for user in ids:
            seen[user] = seen.get(user, 0) + 1
        cache = self.cache
        with cache.using(ids):
            cached = [0] * batch
            tables: list[list[int]] = [[] for _ in range(batch)]
            kept = [False] * batch  # stored after this request
            for b, user in enumerate(ids):
                if seen[user] > 1:  # the same user twice in one batch: served, not stored
                    continue
                entry = cache.entry(user)
                reuse = entry.length if entry is not None and 0 < entry.length <= stored[b] else 0
                cache.count("misses" if entry is None or entry.length == 0 else "hits" if reuse else "stale")
                try:
                    tables[b] = cache.reserve(user, stored[b], reuse)
                except CacheFull:
                    continue
                cached[b], kept[b] = reuse, True
            if not all(kept):
                cache.count("bypassed", kept.count(False))
            outputs = self._run(dense, seq_lengths, stored, cached, tables, padded)
            stale = outputs.pop("kv_stale")  # read back (waited for) only where a user has something cached
            again = [b for b, s in enumerate(stale.cpu().tolist()) if s and cached[b]] if any(cached) else []
            if again:  # their frontier rows changed: recompute them from nothing
                cache.count("hits", -len(again))
                cache.count("stale", len(again))
                for b in again:
                    cached[b] = 0
                    tables[b] = cache.reserve(ids[b], stored[b], 0)
                outputs = self._run(dense, seq_lengths, stored, cached, tables, padded)
                outputs.pop("kv_stale")
            for b, user in enumerate(ids):
                if kept[b]:
                    cache.commit(user, stored[b], None)
            return outputs

    def _padded(self, request: dict[str, Tensor], users: int) -> Padded | None:
        """``request`` with a padding user, where the runner pads requests into shape buckets and this one has
        room for it (checked first: an error names the request as it was sent)."""
        padding = getattr(self.runner, "padding", None)
        if padding is None:
            return None
        padded = padding.pad(padding.check(request), users)
        self.padded_calls += padded is not None
        return padded

    def _run(self, dense: dict[str, Tensor], seq_lengths: list[int], stored: list[int], cached: list[int],
             tables: list[list[int]], padded: Padded | None = None) -> dict[str, Tensor]:
        """The delta program on the users' cached counts and pages; with ``padded``, the padding user (last in
        ``seq_lengths`` and ``stored``) is given the cached count that puts the new rows on a step, the scratch
        page for each of its pages, and a table of a bucket's width; its rows of the outputs are dropped."""
        cache, device = self.cache, self.runner.device
        width = max(1, *(len(t) for t in tables))
        if padded is not None:
            padding = self.runner.padding
            cached = [*cached, padding.cached(seq_lengths, stored, cached)]
            width = padding.width(max(width, -(-stored[-1] // cache.page_size)))
        table = np.full((len(seq_lengths), width), cache.scratch_page, dtype=np.int32)
        for b, pages in enumerate(tables):
            table[b, :len(pages)] = pages
        rows = delta_row_inputs(seq_lengths, stored, cached)
        outputs = self.runner.delta(dense, to_device(torch.tensor(cached, dtype=torch.int64), device), cache.k,
                                    cache.v, cache.x, to_device(torch.from_numpy(table), device),
                                    {name: to_device(value, device) for name, value in rows.items()})
        if padded is None:
            return outputs
        return padding.unpad(outputs, padded, seq_lengths[-1] - stored[-1])
