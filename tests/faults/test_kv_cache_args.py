"""Fault campaign, issue 37 items 1-3: the KV cache's arguments (hstu_export/serving/kv_cache.py).

- A budget beyond memory is refused before anything is allocated, naming the budget and the memory there:
  real (a petabyte-sized budget against this machine), and simulated (the available memory monkeypatched
  below a budget that fits the machine; the allocator itself failing after the check).
- Budgets as the CLI reads sizes ("4MiB"), and budgets, page sizes and drifts that are not numbers: a
  ConfigError naming the argument.
- ``user_ids`` that cannot be cache keys (None, an int, a string, unhashable ids, tensors of another shape or
  dtype): a RequestError, before the cache counts anything.
- User ids given as a tensor (or its 0-d elements, or a NumPy array) are the same users as the same ints:
  the second request hits, and the answers equal those of the ints.

The eager zoo model serves here (no export); the tests marked slow serve a package exported with --kv-cache
(``kv_package``, tests/conftest.py) through ``predictor.kv_cache``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_requests import CONFIGS, Users

import hstu_export
import hstu_export.serving.kv_cache as kv_cache_module
from hstu_export.errors import ConfigError, RequestError
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.serving.kv_cache import CachedRanker, page_bytes

CONFIG = CONFIGS["no-context"]
PAGE = 16
PAGE_BYTES = page_bytes(CONFIG.num_layers, CONFIG.num_heads, CONFIG.attention_dim, CONFIG.linear_dim, PAGE,
                        torch.float32)


@pytest.fixture(scope="module")
def model() -> HstuRankingModel:
    torch.manual_seed(0)
    return HstuRankingModel(CONFIG).eval()


def _request(users: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    made = Users(CONFIG, seed=seed)
    for i, user in enumerate(users):
        made.grow(user, 5 + 3 * i)
    return made.request(users, [2] * len(users))


def _nothing_counted(ranker: CachedRanker) -> bool:
    stats = ranker.cache.stats()
    return all(stats[k] == 0 for k in ("hits", "misses", "stale", "evictions", "bypassed", "users", "pages_used"))


# ------------------------------------------------------------------ item 1: a budget beyond memory


@pytest.mark.parametrize("budget", [1 << 50, "1024TiB"], ids=["int", "size"])
def test_a_budget_beyond_this_machines_memory_is_refused_naming_both(model, budget) -> None:
    """Real: a petabyte of pages is more than this machine has; before, the allocator's own error came."""
    with pytest.raises(ConfigError) as refused:
        CachedRanker(model, budget_bytes=budget, page_size=PAGE)
    message = str(refused.value)
    assert "KV cache budget of 1.0 PiB (1125899906842624 bytes) is more than the memory available on cpu" in message
    assert " free of " in message and message.endswith("lower the budget")


def test_the_budget_is_checked_against_the_memory_available_now(model, monkeypatch) -> None:
    """Simulated: with 1 MiB available (of 2 GiB), a 4 MiB budget is refused, naming both; with 64 MiB
    available the same budget is allocated."""
    monkeypatch.setattr(kv_cache_module, "machine_memory", lambda: (2 << 30, 1 << 20))
    with pytest.raises(ConfigError, match=r"KV cache budget of 4\.0 MiB \(4194304 bytes\) is more than the memory "
                                          r"available on cpu: 1\.0 MiB free of 2\.0 GiB; lower the budget"):
        CachedRanker(model, budget_bytes=4 << 20, page_size=PAGE)
    monkeypatch.setattr(kv_cache_module, "machine_memory", lambda: (2 << 30, 64 << 20))
    ranker = CachedRanker(model, budget_bytes=4 << 20, page_size=PAGE)
    assert ranker.cache.bytes == (4 << 20) // PAGE_BYTES * PAGE_BYTES


def test_an_allocator_failing_after_the_check_is_one_clear_error(model, monkeypatch) -> None:
    """Simulated: memory taken by another process between the check and the allocation."""

    def fail(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 4194304 bytes.\nmore")

    monkeypatch.setattr(kv_cache_module.torch, "zeros", fail)
    with pytest.raises(ConfigError) as refused:
        CachedRanker(model, budget_bytes=4 << 20, page_size=PAGE)
    assert str(refused.value) == ("cannot allocate a KV cache of 4.0 MiB (4194304 bytes) on cpu: DefaultCPUAllocator: "
                                  "not enough memory: you tried to allocate 4194304 bytes.; lower the budget")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's memory needs a CUDA device")
def test_a_budget_beyond_the_gpus_memory_is_refused(model) -> None:
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(ConfigError, match=r"is more than the memory available on cuda(:0)?: .* free of .*; lower the "
                                          r"budget"):
        CachedRanker(model, budget_bytes=total + (1 << 30), page_size=PAGE, device="cuda")
    assert torch.cuda.mem_get_info()[0] >= free - (64 << 20)  # nothing of that size was allocated


# ------------------------------------------------------------------ item 2: budgets and other arguments


def test_a_budget_given_as_a_size_is_read_as_the_cli_reads_it(model) -> None:
    by_size = CachedRanker(model, budget_bytes="4MiB", page_size=PAGE)
    by_int = CachedRanker(model, budget_bytes=4 << 20, page_size=PAGE)
    assert by_size.cache.num_pages == by_int.cache.num_pages == (4 << 20) // PAGE_BYTES - 1
    assert CachedRanker(model, budget_bytes=np.int64(4 << 20), page_size=PAGE).cache.num_pages == by_int.cache.num_pages
    request = _request(["a", "b"])
    by_size(request, ["a", "b"])
    assert by_size(request, ["a", "b"]).keys() == model(request).keys()
    assert by_size.cache.stats()["hits"] == 2


@pytest.mark.parametrize(("budget", "message"), [
    ("1GiB!", "KV cache budget_bytes: cannot read size '1GiB!': use bytes or a unit such as 512MiB"),
    ("12XB", "KV cache budget_bytes: cannot read size '12XB'"),
    ("", "KV cache budget_bytes: cannot read size ''"),
    (0, "KV cache budget_bytes: size must be positive, got 0"),
    (-(1 << 20), "KV cache budget_bytes: size must be positive"),
    (None, "budget_bytes must be a number of bytes or a size such as '512MiB' or '4GiB', got None (NoneType)"),
    (1.5e6, "got 1500000.0 (float)"),
    (True, "got True (bool)"),
    ([1 << 20], "got [1048576] (list)"),
])
def test_a_budget_that_is_no_size_is_refused(model, budget, message) -> None:
    with pytest.raises(ConfigError) as refused:
        CachedRanker(model, budget_bytes=budget, page_size=PAGE)
    assert message in str(refused.value)


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(page_size="16"), "page size must be a power of two >= 16 (a key block of the attention kernel never "
                           "straddles a page), got '16'"),
    (dict(page_size=16.0), "got 16.0"),
    (dict(max_time_drift="1h"), "max_time_drift must be a whole number of seconds, 0 or more, got '1h'"),
    (dict(max_time_drift=-5), "got -5"),
    (dict(max_time_drift=None), "got None"),
])
def test_other_arguments_that_are_not_numbers_are_refused(model, arguments, message) -> None:
    with pytest.raises(ConfigError) as refused:
        CachedRanker(model, budget_bytes=1 << 20, **{"page_size": PAGE, **arguments})
    assert message in str(refused.value)


def test_a_source_that_is_no_model_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="CachedRanker serves the zoo's HstuRankingModel or a package's delta program, "
                                          "got str; for a loaded package use predictor.kv_cache"):
        CachedRanker(str(tmp_path), budget_bytes=1 << 20)


@pytest.mark.parametrize(("user_ids", "message"), [
    (None, "user_ids must be a sequence of one id per user (a list of ints or strings, or a 1-d integer tensor), "
           "got NoneType"),
    (7, "got int"),
    ("ab", "got str"),  # two characters for two users: refused, not read as users 'a' and 'b'
    ([[1], [2]], "user id at position 0 is a list, which cannot be a cache key (unhashable)"),
    ([3, {"id": 4}], "user id at position 1 is a dict, which cannot be a cache key (unhashable)"),
    ([(1, [2]), 3], "user id at position 0 is a tuple, which cannot be a cache key (unhashable)"),
    (torch.tensor([[7, 8]]), "user_ids as a tensor or array must be 1-d (one id per user), got shape [1, 2]"),
    (torch.tensor(7), "must be 1-d (one id per user), got shape []"),
    (torch.tensor([7.0, 8.0]), "user_ids must hold integers, got dtype torch.float32"),
    (torch.tensor([True, False]), "user_ids must hold integers, got dtype torch.bool"),
    (np.array([7.5, 8.5]), "user_ids must hold integers, got dtype float64"),
    ([torch.tensor([7, 8]), 9], "user id at position 0 is a Tensor of shape [2]; give one id per user"),
    ([7, torch.tensor(8.0)], "user id at position 1 must hold integers, got dtype torch.float32"),
])
def test_user_ids_that_cannot_be_keys_are_refused_before_anything_is_counted(model, user_ids, message) -> None:
    ranker = CachedRanker(model, budget_bytes=1 << 20, page_size=PAGE)
    with pytest.raises(RequestError) as refused:
        ranker(_request(["a", "b"]), user_ids)
    assert message in str(refused.value)
    assert _nothing_counted(ranker)


def test_too_few_or_too_many_user_ids_are_refused(model) -> None:
    ranker = CachedRanker(model, budget_bytes=1 << 20, page_size=PAGE)
    with pytest.raises(RequestError, match="3 user ids for a batch of 2 users"):
        ranker(_request(["a", "b"]), torch.tensor([1, 2, 3]))
    with pytest.raises(RequestError, match="0 user ids for a batch of 2 users"):
        ranker(_request(["a", "b"]), [])
    assert _nothing_counted(ranker)


# ------------------------------------------------------------------ item 3: user ids in tensors


@pytest.mark.parametrize("as_given", [
    lambda ids: torch.tensor(ids),
    lambda ids: torch.tensor(ids, dtype=torch.int32),
    lambda ids: list(torch.tensor(ids)),  # 0-d tensors, each hashed by identity before
    lambda ids: np.array(ids),
    lambda ids: [np.int64(i) for i in ids],
], ids=["tensor", "int32-tensor", "0-d-tensors", "array", "numpy-scalars"])
def test_user_ids_in_tensors_hit_as_the_same_ints(model, as_given) -> None:
    """The second request of the same users is served from the cache (2 hits) and its answers equal those of a
    cache keyed by the plain ints, bit for bit; ints afterwards find the same entries."""
    first, second = _request(["a", "b"], seed=1), _request(["a", "b"], seed=1)
    by_tensor = CachedRanker(model, budget_bytes=1 << 20, page_size=PAGE)
    by_int = CachedRanker(model, budget_bytes=1 << 20, page_size=PAGE)
    answers = []
    for request in (first, second):
        got, want = by_tensor(request, as_given([7, 8])), by_int(request, [7, 8])
        answers.append((got, want))
    stats = by_tensor.cache.stats()
    assert (stats["misses"], stats["hits"], stats["users"]) == (2, 2, 2)
    assert by_tensor.cache.stats() == by_int.cache.stats()
    for got, want in answers:
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert 7 in by_tensor.cache and 8 in by_tensor.cache
    by_tensor(second, [7, 8])
    assert by_tensor.cache.stats()["hits"] == 4  # plain ints find the same entries


# ------------------------------------------------------------------ the same through a package


@pytest.mark.slow
@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_a_packages_cache_takes_sizes_and_tensor_ids(kv_package) -> None:
    """``predictor.kv_cache``: a budget as a size, a budget beyond memory refused before anything is
    allocated, bad user ids refused, tensor ids hitting as ints do."""
    _, root, _ = kv_package
    predictor = hstu_export.load(root)
    ranker = predictor.kv_cache("1MiB")
    assert ranker.cache.bytes == (1 << 20) // ranker.cache.page_bytes * ranker.cache.page_bytes
    with pytest.raises(ConfigError, match=r"KV cache budget of 1\.0 PiB .* is more than the memory available on cpu"):
        predictor.kv_cache("1024TiB")
    with pytest.raises(ConfigError, match="KV cache budget_bytes: cannot read size '1 gigabyte'"):
        predictor.kv_cache("1 gigabyte")
    request = _request(["a", "b"], seed=2)
    with pytest.raises(RequestError, match="user id at position 0 is a list"):
        ranker(request, [[7], [8]])
    first = ranker(request, torch.tensor([7, 8]))
    second = ranker(request, torch.tensor([7, 8]))
    stats = ranker.cache.stats()
    assert (stats["misses"], stats["hits"]) == (2, 2)
    full = predictor(request)
    for name in full:
        torch.testing.assert_close(first[name], full[name], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second[name], full[name], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_the_cpp_runtime_refuses_a_budget_beyond_memory(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``hstu-export-run --kv-cache``: the same check, in one line; before, the allocator's error, or on the host
    a budget the allocator granted (Linux overcommits) killed the process while its pages were zeroed."""
    from hstu_export.package.tensor_dir import save_tensors

    _, root, _ = kv_package
    request = save_tensors(_request(["a", "b"]), tmp_path / "request")
    done = cpp_runtime.run(root, request, "--kv-cache", "1048576GiB", "--user-ids", "1,2", "--out", tmp_path / "out")
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("hstu-export-run: error: KV cache budget of 1.0 PiB (1125899906842624 bytes) is "
                                  "more than the memory available on cpu: "), done.stderr
    assert " free of " in done.stderr and done.stderr.rstrip().endswith("; lower the budget")
    assert not (tmp_path / "out").exists()
    done = cpp_runtime.run(root, request, "--kv-cache", "1MiB", "--user-ids", "1,2", "-q")
    assert done.returncode == 0, done.stderr
