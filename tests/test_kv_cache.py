"""KV-cached serving of the zoo model (hstu_export/serving/kv_cache.py): every answer equals the full
model's, whatever the cache did — hit, miss, a history that grows, a changed history, a later query
time, eviction, a cache too small, the same user twice in a batch, and requests for one user from
several threads at once — and the counters say what it did."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from kv_requests import Users, products_rows_independent

from hstu_export.errors import ConfigError, RequestError
from hstu_export.models.cached import GatedAttention, KVLayout
from hstu_export.models.config import HSTUConfig
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.models.transducer import bucket_edges, time_buckets
from hstu_export.serving.kv_cache import MAX_RUNS, CachedRanker, valid_query_times

# Same shapes as the tiny preset, with and without contextual tokens.
CONTEXT = HSTUConfig()
NO_CONTEXT = HSTUConfig(contextual_features=(), contextual_vocab_sizes=())
EXACT = dict(rtol=1e-5, atol=1e-6)


def _model(config: HSTUConfig) -> HstuRankingModel:
    torch.manual_seed(0)
    return HstuRankingModel(config).eval()


def _check(ranker: CachedRanker, request: dict[str, torch.Tensor], users: list[str]) -> None:
    got = ranker(request, users)
    want = ranker.runner.delta.model(request)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **EXACT)


@pytest.mark.parametrize("config", [NO_CONTEXT, CONTEXT], ids=["no-context", "context"])
def test_every_kind_of_delta_equals_the_full_model(config: HSTUConfig) -> None:
    check_every_kind_of_delta(config)  # also run on the Triton kernel by tests/interpreted_cases.py


def check_every_kind_of_delta(config: HSTUConfig, gated_attention: GatedAttention | None = None) -> None:
    """``gated_attention``: the delta run's layers through it (DeltaRanker's argument of that name)."""
    model = _model(config)
    ranker = CachedRanker(model, budget_bytes=1 << 22, page_size=16)
    if gated_attention is not None:
        ranker.runner.delta.gated_attention = gated_attention  # type: ignore[attr-defined]
    users = Users(config)
    for user, length in (("a", 20), ("b", 7), ("c", 1)):
        users.grow(user, length)
    _check(ranker, users.request(["a", "b", "c"], [3, 1, 16]), ["a", "b", "c"])  # prefill
    assert ranker.cache.stats()["misses"] == 3
    _check(ranker, users.request(["a", "b", "c"], [5, 2, 1]), ["a", "b", "c"])  # only candidates are new
    assert ranker.cache.stats()["hits"] == 3
    _check(ranker, users.request(["c", "a"], [1, 1]), ["c", "a"])  # other order, one candidate each
    users.grow("a", 1)  # a delta of one history token (and one candidate)
    users.grow("b", 30)  # two pages more
    _check(ranker, users.request(["a", "b"], [1, 4]), ["a", "b"])
    stats = ranker.cache.stats()
    if config.contextual_seq_len:
        assert stats["stale"] == 2  # contextual tokens see the whole history: recomputed
    else:
        assert stats["hits"] == 7 and stats["stale"] == 0
    # A history whose cached part changed is recomputed, not reused.
    users.history["b"][0] = (1, 1, users.history["b"][0][2])
    before = ranker.cache.stats()["stale"]
    _check(ranker, users.request(["b"], [2]), ["b"])
    assert ranker.cache.stats()["stale"] == before + 1


def test_a_history_grown_request_by_request_is_kept_as_runs_and_merged() -> None:
    """Each hit that adds tokens appends them as a run of the entry's record (the cached ones are not copied);
    past MAX_RUNS the record is one run again. A token changed in any run makes the entry stale."""
    model = _model(NO_CONTEXT)
    ranker = CachedRanker(model, budget_bytes=1 << 24, page_size=16)
    users = Users(NO_CONTEXT, seed=6)
    users.grow("u", 5)
    _check(ranker, users.request(["u"], [2]), ["u"])
    counts = []
    for _ in range(MAX_RUNS + 1):
        first = ranker.cache.entry("u").record.runs[0]
        users.grow("u", 2)
        _check(ranker, users.request(["u"], [1]), ["u"])
        record = ranker.cache.entry("u").record
        counts.append(len(record.runs))
        assert record.history == len(users.history["u"])
        if len(record.runs) > 1:
            assert record.runs[0] is first  # shared with the record before, not copied
    assert counts == [*range(2, MAX_RUNS + 1), 1, 2]
    assert ranker.cache.stats()["hits"] == MAX_RUNS + 1 and ranker.cache.stats()["stale"] == 0
    for at in (0, len(users.history["u"]) - 1):  # in the first run, then in the last
        item, action, stamp = users.history["u"][at]
        users.history["u"][at] = (item + 1, action, stamp)
        _check(ranker, users.request(["u"], [1]), ["u"])
        assert ranker.cache.stats()["stale"] == (1 if at == 0 else 2)


def test_cached_path_equals_the_full_model_in_fp32_on_cpu() -> None:
    """Within fp32's last bits everywhere, and bit for bit where the matrix products allow it (the delta
    run is the same arithmetic on fewer rows)."""
    model = _model(NO_CONTEXT)
    ranker = CachedRanker(model, budget_bytes=1 << 22, page_size=16)
    users = Users(NO_CONTEXT, seed=3)
    users.grow("u", 30)
    ranker(users.request(["u"], [4]), ["u"])
    request = users.request(["u"], [6])
    got, want = ranker(request, ["u"]), model(request)
    assert ranker.cache.stats()["hits"] == 1
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    if products_rows_independent():
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_later_query_time_is_exact_by_default_and_bounded_when_allowed() -> None:
    model = _model(NO_CONTEXT)
    exact = CachedRanker(model, budget_bytes=1 << 22, page_size=16)
    drifting = CachedRanker(model, budget_bytes=1 << 22, page_size=16, max_time_drift=3600)
    users = Users(NO_CONTEXT, seed=4)
    users.grow("u", 12, now=10_000)
    for ranker in (exact, drifting):
        ranker(users.request(["u"], [3], query_time=10_000), ["u"])
    later = users.request(["u"], [3], query_time=13_000)  # many buckets move (log scale)
    _check(exact, later, ["u"])
    assert exact.cache.stats()["stale"] == 1 and exact.cache.stats()["hits"] == 0
    got, want = drifting(later, ["u"]), model(later)
    assert drifting.cache.stats()["hits"] == 1
    assert any(not torch.allclose(got[k], want[k], **EXACT) for k in want)  # reused: old buckets
    much_later = users.request(["u"], [3], query_time=20_000)  # beyond the allowed drift: recomputed
    _check(drifting, much_later, ["u"])
    assert drifting.cache.stats()["stale"] == 1


@pytest.mark.parametrize("base,num_buckets", [(0.301, 128), (0.5, 8), (1.0, 64)])
def test_valid_query_times_are_where_no_bucket_moves(base: float, num_buckets: int) -> None:
    """An entry is reused exactly when the query time lies in its valid interval: that must be exactly
    when every cached token's time bucket is the one it was computed with."""
    edges = bucket_edges(base, num_buckets)
    zero = torch.zeros(1, dtype=torch.int64)
    inner = edges[1:-1][edges[1:-1] < (1 << 40)]
    for k in range(num_buckets):  # each edge is where the bucket steps up
        if -(1 << 61) < edges[k] < (1 << 40) and edges[k] < edges[k + 1]:
            assert int(time_buckets(edges[k:k + 1], zero, base, num_buckets)) == k
            assert int(time_buckets(edges[k:k + 1] - 1, zero, base, num_buckets)) < k
    gen = torch.Generator().manual_seed(5)
    now = 1_700_000_000
    layout = KVLayout(1, 1, 8, 8, (), base, num_buckets, torch.float32)
    for _ in range(20):
        # Histories whose time differences sit on and next to the edges, and anywhere.
        picks = inner[torch.randint(0, inner.numel(), (12,), generator=gen)]
        stamps = torch.cat([now - picks + torch.randint(-2, 3, (12,), generator=gen),
                            now - torch.randint(0, 10**7, (12,), generator=gen)])
        users = torch.randint(0, 3, (24,), generator=gen)
        lo, hi = valid_query_times(stamps, torch.full_like(stamps, now), users, 3, layout)
        at_now = time_buckets(now, stamps, base, num_buckets)
        for u in range(3):
            mine = users == u
            for q in {now, lo[u] - 1, lo[u], hi[u] - 1, hi[u], now + 1, now + 1000, now - 1}:
                if abs(q) >= 1 << 61:
                    continue
                same = bool((time_buckets(q, stamps[mine], base, num_buckets) == at_now[mine]).all())
                assert same == (lo[u] <= q < hi[u]), (u, q, lo[u], hi[u])
    empty = torch.zeros(0, dtype=torch.int64)
    assert valid_query_times(empty, empty, empty, 2, layout) == ([-(1 << 62)] * 2, [1 << 62] * 2)


def test_a_later_query_time_that_moves_no_bucket_is_still_a_hit() -> None:
    model = _model(NO_CONTEXT)
    ranker = CachedRanker(model, budget_bytes=1 << 22, page_size=16)
    users = Users(NO_CONTEXT, seed=6)
    users.grow("u", 12, now=10_000)
    ranker(users.request(["u"], [3], query_time=10_000), ["u"])
    record = ranker.cache._entries["u"].record
    assert record is not None
    low, high = record.valid
    assert low <= 10_000 < high
    users.grow("u", 2, now=high - 1)  # two new tokens; the first twelve keep their buckets until `high`
    _check(ranker, users.request(["u"], [3], query_time=high - 1), ["u"])
    assert ranker.cache.stats()["hits"] == 1 and ranker.cache.stats()["stale"] == 0
    _check(ranker, users.request(["u"], [3], query_time=high), ["u"])  # a bucket moves: recomputed
    assert ranker.cache.stats()["stale"] == 1


def test_an_entry_keeps_its_own_copy_of_the_history() -> None:
    """The records compare and extend views of the request (NumPy): what they keep must be copies, so that
    a caller reusing its request's buffers afterwards changes nothing in the cache."""
    model = _model(NO_CONTEXT)
    ranker = CachedRanker(model, budget_bytes=1 << 22, page_size=16)
    users = Users(NO_CONTEXT, seed=8)
    users.grow("u", 10)
    users.grow("v", 7)
    first = users.request(["u", "v"], [2, 1])
    ranker(first, ["u", "v"])
    for name in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
        first[name].add_(1)  # the caller's buffers, reused
    users.grow("u", 3)  # u's history grows: its entry is extended (a second copy path)
    _check(ranker, users.request(["u", "v"], [2, 1]), ["u", "v"])
    assert ranker.cache.stats()["hits"] == 2 and ranker.cache.stats()["stale"] == 0
    second = users.request(["u", "v"], [1, 1])
    second["uih_item_ids"][-1] += 1  # v's last token changed: its entry no longer matches
    _check(ranker, second, ["u", "v"])
    assert ranker.cache.stats()["hits"] == 3 and ranker.cache.stats()["stale"] == 1


class _Counted:
    """A runner that counts its calls and raises on the ones listed in ``fail`` (1-based)."""

    def __init__(self, runner, fail: tuple[int, ...] = ()) -> None:
        self.runner, self.fail, self.calls = runner, fail, 0

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail:
            raise RuntimeError("the device failed")
        return self.runner(*args, **kwargs)


def test_a_history_found_changed_after_the_launch_runs_the_request_again() -> None:
    """Histories are compared while the runner computes: a user run as a hit whose history changed is counted
    stale and the whole request runs again, that user from nothing on the pages it holds; the others stay hits.
    A failure of that second run leaves no entry claiming pages the first run wrote."""
    model = _model(NO_CONTEXT)
    ranker = CachedRanker(model, budget_bytes=1 << 22, page_size=16)
    users = Users(NO_CONTEXT, seed=9)
    for user, length in (("a", 20), ("b", 7), ("c", 33)):
        users.grow(user, length)
    _check(ranker, users.request(["a", "b", "c"], [2, 1, 3]), ["a", "b", "c"])
    pages = {user: list(ranker.cache.entry(user).pages) for user in "abc"}
    ranker.runner = counted = _Counted(ranker.runner)
    item, action, stamp = users.history["c"][5]
    users.history["c"][5] = (item + 1, action, stamp)  # c's cached history changed in its middle
    _check(ranker, users.request(["a", "b", "c"], [1, 2, 1]), ["a", "b", "c"])
    stats = ranker.cache.stats()
    assert (counted.calls, stats["hits"], stats["stale"], stats["misses"]) == (2, 2, 1, 3)
    assert {user: ranker.cache.entry(user).pages for user in "abc"} == pages  # no page changed hands
    assert ranker.cache.entry("c").record.holds_prefix_of(
        [np.asarray([x[i] for x in users.history["c"]], dtype=np.int64) for i in range(3)])
    # Unchanged histories: one run, every user a hit.
    _check(ranker, users.request(["a", "b", "c"], [1, 1, 1]), ["a", "b", "c"])
    assert (counted.calls, ranker.cache.stats()["hits"]) == (3, 5)
    # The run again fails: the changed user's entry claims nothing (a miss next), the others stay as they were.
    users.history["b"][0] = (users.history["b"][0][0] + 1, *users.history["b"][0][1:])
    ranker.runner = _Counted(counted.runner, fail=(2,))
    with pytest.raises(RuntimeError, match="the device failed"):
        ranker(users.request(["a", "b"], [1, 1]), ["a", "b"])
    assert ranker.cache.entry("b").length == 0 and ranker.cache.entry("a").length == 20
    ranker.runner = counted.runner
    before = ranker.cache.stats()
    _check(ranker, users.request(["a", "b"], [2, 2]), ["a", "b"])
    after = ranker.cache.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"], after["stale"] - before["stale"]) == (
        1, 1, 0)


def test_eviction_keeps_answers_right_and_counts() -> None:
    model = _model(NO_CONTEXT)
    cfg = NO_CONTEXT
    page_bytes = cfg.num_layers * 16 * cfg.num_heads * (cfg.attention_dim + cfg.linear_dim) * 4
    ranker = CachedRanker(model, budget_bytes=5 * page_bytes, page_size=16)  # 64 tokens, and the scratch page
    users = Users(cfg, seed=5)
    for user in ("a", "b", "c"):
        users.grow(user, 24)  # two pages each: room for two users
    for user in ("a", "b", "c", "a"):
        _check(ranker, users.request([user], [2]), [user])
    stats = ranker.cache.stats()
    assert stats["evictions"] == 2 and stats["misses"] == 4 and stats["users"] == 2
    assert "a" in ranker.cache and "c" in ranker.cache and "b" not in ranker.cache  # least recently used left


def test_a_cache_too_small_or_full_of_users_in_use_serves_without_storing() -> None:
    model = _model(NO_CONTEXT)
    cfg = NO_CONTEXT
    page_bytes = cfg.num_layers * 16 * cfg.num_heads * (cfg.attention_dim + cfg.linear_dim) * 4
    ranker = CachedRanker(model, budget_bytes=3 * page_bytes, page_size=16)  # two pages, and the scratch page
    users = Users(cfg, seed=6)
    users.grow("big", 40)  # three pages: never fits
    users.grow("small", 20)  # both pages
    _check(ranker, users.request(["big", "small"], [2, 3]), ["big", "small"])
    stats = ranker.cache.stats()
    assert stats["bypassed"] == 1 and stats["users"] == 1 and "small" in ranker.cache
    # Every page belongs to a user of the same batch (pinned): the newcomer is served, not stored.
    users.grow("other", 10)
    _check(ranker, users.request(["small", "other"], [1, 1]), ["small", "other"])
    assert ranker.cache.stats()["bypassed"] == 2 and "small" in ranker.cache and "other" not in ranker.cache
    # A hit that no longer fits (grown to three pages) is served from its entry and keeps it; grown and changed in
    # its cached part, it is compared at once: stale, and the entry dropped.
    users.grow("small", 20)
    before = ranker.cache.stats()
    _check(ranker, users.request(["small"], [1]), ["small"])
    after = ranker.cache.stats()
    assert (after["hits"] - before["hits"], after["bypassed"] - before["bypassed"]) == (1, 1)
    assert ranker.cache.entry("small").length == 20
    users.history["small"][3] = (users.history["small"][3][0] + 1, *users.history["small"][3][1:])
    _check(ranker, users.request(["small"], [1]), ["small"])
    final = ranker.cache.stats()
    assert (final["stale"] - after["stale"], final["hits"] - after["hits"], final["bypassed"] - after["bypassed"]) == (
        1, 0, 1)
    assert "small" not in ranker.cache and final["pages_used"] == 0


def test_the_same_user_twice_in_a_batch() -> None:
    model = _model(CONTEXT)
    ranker = CachedRanker(model, budget_bytes=1 << 22, page_size=16)
    users = Users(CONTEXT, seed=7)
    users.grow("u", 9)
    users.grow("v", 4)
    _check(ranker, users.request(["u", "v", "u"], [2, 2, 5]), ["u", "v", "u"])
    assert ranker.cache.stats()["bypassed"] == 2 and "u" not in ranker.cache and "v" in ranker.cache
    # u's K/V went to the scratch page; no page but v's and the scratch page was written.
    cache = ranker.cache
    written = (cache.k != 0).flatten(2).any(-1).any(0).nonzero()[:, 0].tolist()
    assert written == sorted([*cache.entry("v").pages, cache.scratch_page])


def test_requests_for_one_user_from_many_threads() -> None:
    model = _model(NO_CONTEXT)
    ranker = CachedRanker(model, budget_bytes=1 << 22, page_size=16)
    users = Users(NO_CONTEXT, seed=8)
    for user in ("u", "w"):
        users.grow(user, 15)
    requests = [users.request(["u", "w"] if i % 2 else ["u"], [1 + i % 3, 2] if i % 2 else [3]) for i in range(12)]
    names = [["u", "w"] if i % 2 else ["u"] for i in range(12)]
    wanted = [model(r) for r in requests]
    errors: list[str] = []

    def work(i: int) -> None:
        try:
            got = ranker(requests[i], names[i])
            for k in wanted[i]:
                if not torch.allclose(got[k], wanted[i][k], **EXACT):
                    errors.append(f"request {i}: {k} differs")
        except Exception as exc:  # reported below
            errors.append(f"request {i}: {exc!r}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = ranker.cache.stats()
    assert stats["misses"] == 2 and stats["hits"] == 16  # 18 user lookups, each user computed once


def test_bad_settings_and_requests_are_clear() -> None:
    model = _model(NO_CONTEXT)
    with pytest.raises(ConfigError, match="holds no page"):
        CachedRanker(model, budget_bytes=100)
    with pytest.raises(ConfigError, match="power of two >= 16"):
        CachedRanker(model, budget_bytes=1 << 20, page_size=24)
    ranker = CachedRanker(model, budget_bytes=1 << 20)
    users = Users(NO_CONTEXT)
    users.grow("u", 3)
    with pytest.raises(RequestError, match="2 user ids for a batch of 1"):
        ranker(users.request(["u"], [1]), ["u", "v"])
    with pytest.raises(RequestError, match="missing"):
        ranker({"uih_lengths": torch.tensor([1])}, ["u"])
