"""The C++ runtime's KV cache (``hstu-export-run --kv-cache``, runtimes/cpp/src/kv_cache.cpp) against
Python's (``predictor.kv_cache``): the same sequences of requests give the same answers bit for bit (and
those of the package without cache), and the same counters, through prefills, hits, one-token and
multi-page growth, reordered and new users, the same user twice in a batch, a query time that moves a
time bucket, evictions and users served without being stored; from several threads at once; and bad
input is refused in one line."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from kv_requests import CONFIGS, PAGE, Users, products_rows_independent
from manifests import rewrite_manifest

import hstu_export
from hstu_export.package.tensor_dir import load_tensors, save_tensors
from hstu_export.runtimes.native import LIBRARY_NAME, NativePredictor
from hstu_export.serving.kv_cache import page_bytes

pytestmark = pytest.mark.slow

CLOSE = dict(rtol=1e-5, atol=1e-5)
IDS = {"a": 11, "b": -2, "c": 1 << 40, "d": 7}  # the users' ids as the C++ runtime takes them (int64)
STATS = re.compile(r"kv cache: (\d+) hits, (\d+) misses, (\d+) stale, (\d+) evictions, (\d+) bypassed; (\d+) users in "
                   r"(\d+) of (\d+) pages")


def _sequence(name: str) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
    """(users, request) in serving order: every case the cache distinguishes."""
    users = Users(CONFIGS[name], seed=7)
    users.grow("a", 20)
    users.grow("b", 5)
    users.grow("c", 40)
    out = [(["a", "b"], users.request(["a", "b"], [3, 2]))]  # prefill
    out.append((["b", "a"], users.request(["b", "a"], [1, 4])))  # hits: new candidates only
    users.grow("b", 1)
    users.grow("a", PAGE + 3)
    out.append((["c", "a", "b"], users.request(["c", "a", "b"], [2, 2, 1])))  # a new user; growth by 1 and > a page
    out.append((["a", "a", "b"], users.request(["a", "a", "b"], [1, 2, 3])))  # the same user twice
    # A later query time moves recent tokens to another time bucket: recomputed (stale), not reused.
    out.append((["b", "c"], users.request(["b", "c"], [2, 2], query_time=10_000 + 4000)))
    return out


def _run_cpp(runner, package: Path, steps, work: Path, *extra: object):  # type: ignore[no-untyped-def]
    args: list[object] = [package]
    for k, (_, request) in enumerate(steps):
        args.append(save_tensors(request, work / f"request{k}"))
    for who, _ in steps:
        args += ["--user-ids", ",".join(str(IDS[u]) for u in who)]
    done = runner.run(*args, "--out", work / "out", *extra)
    assert done.returncode == 0, done.stderr
    outputs = [load_tensors(work / "out" / str(k + 1)) for k in range(len(steps))] if len(steps) > 1 else \
        [load_tensors(work / "out")]
    return done, outputs


def _stats(stdout: str) -> dict[str, int]:
    found = STATS.findall(stdout)
    assert found, stdout
    keys = ("hits", "misses", "stale", "evictions", "bypassed", "users", "pages_used", "pages")
    return dict(zip(keys, map(int, found[-1])))


@pytest.mark.parametrize("budget_pages", [None, 5], ids=["roomy", "five-pages"])
def test_cpp_cache_serves_as_python_bit_for_bit(cpp_runtime, kv_package, tmp_path, budget_pages) -> None:  # type: ignore[no-untyped-def]
    """``five-pages``: a budget of 4 users' pages and the scratch page, so a user is evicted and others
    are served without being stored; the two caches must agree on which."""
    name, root, manifest = kv_package
    layout = manifest["kv_cache"]["layout"]
    budget = None if budget_pages is None else budget_pages * page_bytes(
        layout["num_layers"], layout["num_heads"], layout["attention_dim"], layout["linear_dim"], PAGE, torch.float32)
    steps = _sequence(name)
    done, cpp = _run_cpp(cpp_runtime, root, steps, tmp_path, "--kv-cache", budget or "auto")
    predictor = hstu_export.load(root)
    ranker = predictor.kv_cache(budget_bytes=budget)
    # The C++ runtime's cache from Python too (hstu_export.runtimes.native): the CLI's answers and counters.
    native = NativePredictor(root, library=cpp_runtime.path.parent / LIBRARY_NAME).kv_cache(budget)
    for k, ((who, request), got) in enumerate(zip(steps, cpp)):
        python = ranker(request, [IDS[u] for u in who])
        from_python = native(request, [IDS[u] for u in who])
        full = predictor(request)
        assert sorted(got) == sorted(python) and list(from_python) == predictor.output_names
        for key in python:
            assert torch.equal(got[key], python[key]), (k, key, (got[key] - python[key]).abs().max().item())
            assert torch.equal(from_python[key], got[key]), (k, key)
            torch.testing.assert_close(got[key], full[key], **CLOSE)
    stats = _stats(done.stdout)
    assert stats == ranker.cache.stats() == native.stats()
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["bypassed"] > 0
    assert stats["stale"] > 0
    assert (stats["evictions"] > 0) == (budget_pages is not None)
    assert "KV-cached" in done.stdout


def test_cpp_shape_buckets_as_python_bit_for_bit(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--kv-graphs buckets``: requests run in shape buckets (a padding user, the bucket's buffers written
    per request, the padding counts computed by the run), as CUDA graphs run them but without capturing.
    The sequence twice, so that buckets are seen again: the same answers bit for bit as Python's cache in
    the same mode, the same number of bucketed and one-off runs, and the answers of the package without
    cache."""
    from hstu_export.runtimes.kv_graphs import GraphCache

    name, root, _ = kv_package
    steps = _sequence(name) * 2
    done, cpp = _run_cpp(cpp_runtime, root, steps, tmp_path, "--kv-cache", "auto", "--kv-graphs", "buckets")
    predictor = hstu_export.load(root)
    ranker = predictor.kv_cache()
    runner = ranker.runner
    runner.graphs = GraphCache(runner._run, runner._buckets, runner.layout.contextual_seq_len, capture=False)
    for k, ((who, request), got) in enumerate(zip(steps, cpp)):
        python = ranker(request, [IDS[u] for u in who])
        full = predictor(request)
        for key in python:
            assert torch.equal(got[key], python[key]), (k, key, (got[key] - python[key]).abs().max().item())
            torch.testing.assert_close(got[key], full[key], **CLOSE)
    counts = runner.graphs.counts
    assert counts["replays"] > 0 and counts["eager"] > 0
    assert (f"shape buckets: {counts['replays']} replays, 0 graphs captured, {counts['eager']} run as they are"
            in done.stdout), done.stdout
    assert _stats(done.stdout) == ranker.cache.stats()


def test_buckets_stay_within_the_programs_bounds(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A bucket has one user more than its request (the padding user), and beyond the delta program's
    exported bounds the program's answers are not defined: with the package's bounds lowered to 2 users, no
    request of 2 or 3 users runs in a bucket, in C++ as in Python, and the answers stay those of the package
    without cache. A package without recorded bounds (older) gets the ones the export would have given, and one
    that does not say its program fits the counts (older too) has its padding user's counts computed at each
    replay: the same answers."""
    name, root, _ = kv_package
    steps = _sequence(name) * 2
    low = _edit_manifest(root, tmp_path / "low", lambda m: m["kv_cache"]["bounds"].update(batch=2))
    done, cpp = _run_cpp(cpp_runtime, low, steps, tmp_path / "low-run", "--kv-cache", "auto", "--kv-graphs", "buckets")
    assert "shape buckets: 0 replays, 0 graphs captured, 10 run as they are" in done.stdout, done.stdout
    predictor = hstu_export.load(low)
    ranker = predictor.kv_cache()
    assert ranker.runner._buckets.max_batch == 2
    for (_, request), got in zip(steps, cpp):
        full = predictor(request)
        for key in full:
            torch.testing.assert_close(got[key], full[key], **CLOSE)
    old = _edit_manifest(root, tmp_path / "old", lambda m: (m["kv_cache"].pop("bounds"), m["kv_cache"].pop("fits_counts")))
    done, cpp = _run_cpp(cpp_runtime, old, steps, tmp_path / "old-run", "--kv-cache", "auto", "--kv-graphs", "buckets")
    assert re.search(r"shape buckets: [1-9]\d* replays", done.stdout), done.stdout
    buckets = hstu_export.load(old).kv_cache().runner._buckets
    assert buckets.max_batch == 16 and not buckets.fitted_counts
    for (_, request), got in zip(steps, cpp):
        full = predictor(request)
        for key in full:
            torch.testing.assert_close(got[key], full[key], **CLOSE)


def test_a_history_grown_over_many_requests(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A user whose history grows by a token or two at each of 20 requests: every request after the first is a
    hit that adds its new tokens to the entry (the C++ record keeps them as runs, merged after 16), and
    another user's history changes at the 18th, in its middle: stale, not reused. The answers equal Python's
    bit for bit, and so do the counts."""
    name, root, _ = kv_package
    users = Users(CONFIGS[name], seed=11)
    users.grow("a", 10)  # 38 tokens at the end, within the package's 46
    users.grow("d", 12)
    steps = []
    for k in range(20):
        if k:
            users.grow("a", 1 + k % 2)
        if k == 17:
            item, action, stamp = users.history["d"][5]
            users.history["d"][5] = ((item + 1) % CONFIGS[name].item_vocab_size, action, stamp)
        steps.append((["a", "d"], users.request(["a", "d"], [2, 1])))
    done, cpp = _run_cpp(cpp_runtime, root, steps, tmp_path, "--kv-cache", "auto")
    ranker = hstu_export.load(root).kv_cache()
    for k, ((who, request), got) in enumerate(zip(steps, cpp)):
        python = ranker(request, [IDS[u] for u in who])
        for key in python:
            assert torch.equal(got[key], python[key]), (k, key)
    stats = _stats(done.stdout)
    assert stats == ranker.cache.stats()
    # "a" grows at every request: a hit each time without contextual features; with them only an unchanged
    # history is reused, so "a" is recomputed each time (stale) and "d" alone is reused.
    grown = (19, 0) if name == "no-context" else (0, 19)
    assert (stats["misses"], stats["hits"], stats["stale"]) == (2, grown[0] + 18, grown[1] + 1)


@pytest.mark.parametrize("budget_pages", [None, 5], ids=["roomy", "five-pages"])
def test_a_history_changed_in_place(cpp_runtime, kv_package, tmp_path, budget_pages) -> None:  # type: ignore[no-untyped-def]
    """A cached history changed in its middle, as long as before, then changed and grown by a page: the C++
    runtime compares histories while the device runs the request as if they matched, and runs it again with that
    user from nothing; Python compares first. Answers and counters equal bit for bit. ``five-pages``: the changed,
    grown user needs a page nobody can free, so it is served unstored and its stale entry dropped."""
    name, root, manifest = kv_package
    layout = manifest["kv_cache"]["layout"]
    budget = None if budget_pages is None else budget_pages * page_bytes(
        layout["num_layers"], layout["num_heads"], layout["attention_dim"], layout["linear_dim"], PAGE, torch.float32)
    users = Users(CONFIGS[name], seed=13)
    users.grow("a", 2 * PAGE)
    users.grow("b", 2 * PAGE)

    def change(user: str, at: int) -> None:
        item, action, stamp = users.history[user][at]
        users.history[user][at] = ((item + 1) % CONFIGS[name].item_vocab_size, action, stamp)

    steps = [(["a", "b"], users.request(["a", "b"], [2, 1]))]
    change("b", 3)
    steps.append((["a", "b"], users.request(["a", "b"], [1, 2])))
    change("a", 5)
    users.grow("a", PAGE // 2)
    steps.append((["a", "b"], users.request(["a", "b"], [2, 2])))
    done, cpp = _run_cpp(cpp_runtime, root, steps, tmp_path, "--kv-cache", budget or "auto")
    predictor = hstu_export.load(root)
    ranker = predictor.kv_cache(budget_bytes=budget)
    for k, ((who, request), got) in enumerate(zip(steps, cpp)):
        python = ranker(request, [IDS[u] for u in who])
        for key in python:
            assert torch.equal(got[key], python[key]), (k, key)
        torch.testing.assert_close(got, predictor(request), **CLOSE)
    stats = _stats(done.stdout)
    assert stats == ranker.cache.stats()
    if name == "no-context":  # pages of 16: each user's 32 tokens take 2, "a" grown to 40 takes 3
        expected = {"misses": 2, "hits": 2, "stale": 2, "evictions": 0}
        expected.update({"bypassed": 0, "users": 2, "pages_used": 5} if budget_pages is None
                        else {"bypassed": 1, "users": 1, "pages_used": 2})
        assert {key: stats[key] for key in expected} == expected
    else:
        assert stats["stale"] >= 1


def test_cpp_phase_times_of_cached_requests(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--phase-times with --kv-cache: a line per request of the sequence, the dense half (the delta program
    as served) timed apart from the bookkeeping and the sparse half; the answers stay the first pass's."""
    from test_cpp_runtime import PHASES

    name, root, _ = kv_package
    steps = _sequence(name)[:3]
    done, _ = _run_cpp(cpp_runtime, root, steps, tmp_path, "--kv-cache", "auto", "--repeat", 3, "--phase-times")
    found = PHASES.findall(done.stdout)
    assert [int(k) for k, *_ in found] == [1, 2, 3], done.stdout
    assert all(float(dense) > 0 and float(before) > 0 and 0 < float(launch) <= float(dense)
               for _, before, dense, _, launch, _, _ in found), done.stdout
    # The sparse half of the new tokens runs before the dense half, within its time.
    assert all(0 < float(sparse) and float(to_device) + float(sparse) <= 1.5 * float(before) + 0.01
               for _, before, _, _, _, to_device, sparse in found), done.stdout
    assert "outputs equal to the first pass's bit for bit" in done.stdout


def test_cpp_cache_from_several_threads(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Four threads serve the same sequence at once (the same users in every thread: serialised per
    user); on CPU in fp32 every answer equals the first pass's: bit for bit where the matrix products allow
    it (a later pass may serve a request from the cache that the first computed in full), else within
    fp32's last bits."""
    name, root, _ = kv_package
    steps = _sequence(name)[:3]
    done, _ = _run_cpp(cpp_runtime, root, steps, tmp_path, "--kv-cache", "1MiB", "--threads", 4, "--repeat", 3)
    assert "latency over 36 runs on 4 thread(s)" in done.stdout, done.stdout
    if products_rows_independent():
        assert "outputs equal to the first pass's bit for bit" in done.stdout
    else:
        gap = re.search(r"outputs equal to the first pass's bit for bit|largest difference from the first pass: "
                        r"([0-9.e+-]+)", done.stdout)
        assert gap is not None and float(gap[1] or 0) < 1e-6, done.stdout
    stats = _stats(done.stdout)
    # Misses in the first pass only (a repeated pass starts with shorter histories than the cached ones:
    # stale), and nothing evicted from a roomy cache.
    assert stats["misses"] == 3 and stats["hits"] > 12 and stats["evictions"] == 0


def _edit_manifest(root: Path, copy: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(root, copy)
    rewrite_manifest(copy, edit)
    return copy


def _kv_edit(**changes: object):  # type: ignore[no-untyped-def]
    return lambda m: m["kv_cache"].update(changes)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.pop("kv_cache"), "has no KV-cache delta program; export it with --kv-cache"),
    (_kv_edit(page_size=24), "'kv_cache.page_size' is not a power of two of at least 16"),
    (_kv_edit(program="kv/other.pt2"), "'kv_cache.program' names a file that files does not list"),
    (lambda m: m["kv_cache"]["outputs"].append("kv_new_k"), "it returned the new K/V): re-export with --kv-cache"),
    (lambda m: m["kv_cache"]["inputs"].remove("kv_page_table"), "lacks 'kv_page_table'"),
    (_kv_edit(fits_counts="yes"), "'kv_cache.fits_counts' is a string, expected a boolean"),
])
def test_a_package_without_a_usable_cache_section(cpp_runtime, kv_package, tmp_path, edit, message) -> None:  # type: ignore[no-untyped-def]
    """--kv-cache is refused in one line; the package still serves requests without a cache."""
    name, root, _ = kv_package
    package = _edit_manifest(root, tmp_path / "pkg", edit)
    _, request = _sequence(name)[0]
    directory = save_tensors(request, tmp_path / "request")
    done = cpp_runtime.run(package, directory, "--kv-cache", "auto", "--user-ids", "1,2")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("hstu-export-run: error: ") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1
    assert cpp_runtime.run(package, directory, "-q").returncode == 0


def test_bad_kv_arguments_are_refused_in_one_line(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    name, root, _ = kv_package
    _, request = _sequence(name)[0]
    one = save_tensors(request, tmp_path / "one")
    usage = [
        ((one, "--kv-cache", "auto"), "--kv-cache needs one --user-ids per REQUEST_DIR: got 0 for 1"),
        ((one, one, "--user-ids", "1,2"), "several only with --kv-cache"),
        ((one, "--kv-cache", "12XB", "--user-ids", "1,2"), "--kv-cache needs a positive integer, got '12XB'"),
        ((one, "--kv-cache", "auto", "--user-ids", "1,x"), "--user-ids needs integers, got 'x'"),
        ((one, "--user-ids", "1,2"),
         "--user-ids, --max-time-drift, --kv-graphs, --kv-graph-copy-limit, --kv-held-rows and --kv-shape-buckets go "
         "with --kv-cache"),
        ((one, "--kv-cache", "auto", "--user-ids", "1,2", "--kv-held-rows", "always"),
         "--kv-held-rows is on or off, got always"),
        ((one, "--kv-cache", "auto", "--user-ids", "1,2", "--kv-shape-buckets", "always"),
         "--kv-shape-buckets is auto, on or off, got always"),
        ((one, "--kv-cache", "auto", "--user-ids", "1,2", "--kv-graphs", "always"),
         "--kv-graphs is auto, on, off or buckets, got 'always'"),
        ((one, "--kv-cache", "auto", "--user-ids", "1,2", "--kv-graph-copy-limit", "0MiB"),
         "--kv-graph-copy-limit needs a positive integer, got '0'"),
    ]
    for args, message in usage:
        done = cpp_runtime.run(root, *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    served = [
        ((one, "--kv-cache", "auto", "--user-ids", "1,2,3"), "3 user ids for a batch of 2 users"),
        ((one, "--kv-cache", "100", "--user-ids", "1,2"), "holds no page for users"),
        ((one, "--kv-cache", "auto", "--user-ids", "1,2", "--kv-graphs", "on"), "CUDA graphs need a CUDA package"),
        ((one, "--kv-cache", "auto", "--user-ids", "1,2", "--kv-held-rows", "on"),
         "held rows apply to a derived delta program"),
        ((one, "--kv-cache", "auto", "--user-ids", "1,2", "--kv-shape-buckets", "on"),
         "shape buckets on apply to a derived delta program"),
    ]
    for args, message in served:
        done = cpp_runtime.run(root, *args, "--out", tmp_path / "out")
        assert done.returncode == 1 and done.stdout == "", (args, done.stdout)
        assert done.stderr.startswith("hstu-export-run: error: ") and message in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
