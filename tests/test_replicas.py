"""One package served by several replicas (hstu_export/serving/replicas.py): answers, batching, routing of a
user to the replica holding its KV cache, a bad request failing alone, and clear refusals."""

from __future__ import annotations

import threading

import pytest
import torch
from kv_requests import CONFIGS, Users

import hstu_export
from hstu_export.errors import ConfigError, HstuExportError, RequestError
from hstu_export.serving.replicas import ReplicaSet, replica_of

pytestmark = pytest.mark.slow

CLOSE = dict(rtol=1e-5, atol=1e-5)  # a request batched with others is not bit-equal to it run alone


def _requests(schema, count: int) -> list[dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    return [hstu_export.generate_batch(schema, 1 + i % 2, seed=100 + i) for i in range(count)]


def test_replicas_answer_as_the_package_and_batch(tiny_serving_package) -> None:  # type: ignore[no-untyped-def]
    predictor = hstu_export.load(tiny_serving_package)
    requests = _requests(predictor.input_schema, 12)
    with ReplicaSet(tiny_serving_package, ["cpu", "cpu"], max_queue_delay_ms=300) as replicas:
        futures = [replicas.submit(r) for r in requests]
        answers = [f.result(timeout=60) for f in futures]
        stats = replicas.stats()
    for request, answer in zip(requests, answers):
        expected = predictor(request)
        assert sorted(answer) == sorted(expected)
        for name in expected:
            torch.testing.assert_close(answer[name], expected[name], **CLOSE)
    assert sum(s["requests"] for s in stats) == 12
    assert sum(s["users"] for s in stats) == sum(1 + i % 2 for i in range(12))
    assert all(s["requests"] > 0 for s in stats), stats  # the least loaded replica takes the next request
    assert sum(s["calls"] for s in stats) < 12, stats  # requests waiting together run in one call
    assert all(s["users"] <= s["calls"] * predictor.max_batch_size for s in stats)


def test_a_bad_request_fails_alone(tiny_serving_package) -> None:  # type: ignore[no-untyped-def]
    predictor = hstu_export.load(tiny_serving_package)
    good = _requests(predictor.input_schema, 4)
    beyond = dict(good[0])
    beyond["candidate_item_ids"] = beyond["candidate_item_ids"] + 10**9
    missing = {k: v for k, v in good[1].items() if k != "query_time"}
    with ReplicaSet(tiny_serving_package, ["cpu"], max_queue_delay_ms=300) as replicas:
        futures = [replicas.submit(r) for r in (good[0], beyond, good[1], missing, good[2], good[3])]
        with pytest.raises(RequestError, match="candidate_item_ids"):
            futures[1].result(timeout=60)
        with pytest.raises(RequestError, match="query_time"):
            futures[3].result(timeout=60)
        for future, request in zip([futures[i] for i in (0, 2, 4, 5)], good):
            expected = predictor(request)
            for name, value in future.result(timeout=60).items():
                torch.testing.assert_close(value, expected[name], **CLOSE)
        assert replicas.stats()[0]["errors"] == 2


def test_workers_of_a_replica_run_calls_side_by_side(tiny_serving_package) -> None:  # type: ignore[no-untyped-def]
    """Two calls must be in flight at once to pass the barrier: one worker alone would fail both."""
    predictor = hstu_export.load(tiny_serving_package)
    requests = _requests(predictor.input_schema, 4)
    for workers in (1, 2):
        with ReplicaSet(tiny_serving_package, ["cpu"], max_batch_users=2, workers=workers) as replicas:
            replica = replicas.replicas[0]
            working, together = replica.batcher, threading.Barrier(2, timeout=5)

            def waiting(*args, working=working, together=together, **kwargs):  # type: ignore[no-untyped-def]
                together.wait()
                return working(*args, **kwargs)
            replica.batcher = waiting
            futures = [replicas.submit(r) for r in requests[:2]]
            if workers == 1:
                with pytest.raises(threading.BrokenBarrierError):
                    futures[0].result(timeout=60)
                continue
            for request, future in zip(requests, futures):
                for name, value in future.result(timeout=60).items():
                    torch.testing.assert_close(value, predictor(request)[name], **CLOSE)
            replica.batcher = working
            assert [f.result(timeout=60) is not None for f in map(replicas.submit, requests)] == [True] * 4
            assert replicas.stats()[0]["workers"] == 2
    with pytest.raises(ConfigError, match="workers"):
        ReplicaSet(tiny_serving_package, ["cpu"], workers=0)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_a_user_returns_to_the_replica_that_caches_it(kv_package, workers) -> None:  # type: ignore[no-untyped-def]
    """Six users, three rounds each with a grown history, on two replicas with their own caches: every
    return is a hit, which it could not be on the other replica's cache (with two workers a replica serves
    two calls at once from its one cache)."""
    name, root, _ = kv_package
    predictor = hstu_export.load(root)
    users = Users(CONFIGS[name], seed=3)
    ids = [11, 12, 13, 14, 15, 16]
    for user in ids:
        users.grow(str(user), 5 + user % 4)
    assert {replica_of(u, 2) for u in ids} == {0, 1}
    with ReplicaSet(root, ["cpu", "cpu"], kv_cache_bytes=4 << 20, max_queue_delay_ms=100,
                    max_batch_users=2, workers=workers) as replicas:
        for _ in range(3):
            requests = [users.request([str(u)], [3]) for u in ids]
            futures = [replicas.submit(r, [u]) for r, u in zip(requests, ids)]
            for request, future in zip(requests, futures):
                expected = predictor(request)
                for key, value in future.result(timeout=120).items():
                    torch.testing.assert_close(value, expected[key], **CLOSE)
            for user in ids:
                users.grow(str(user), 2)
        stats = replicas.stats()
    caches = [s["kv_cache"] for s in stats]
    assert sum(c["misses"] for c in caches) == len(ids)
    assert sum(c["hits"] for c in caches) == 2 * len(ids)
    for index, cache in enumerate(caches):
        assert cache["users"] == sum(replica_of(u, 2) == index for u in ids)


def test_a_failed_call_fails_its_requests_and_the_worker_goes_on(tiny_serving_package) -> None:  # type: ignore[no-untyped-def]
    predictor = hstu_export.load(tiny_serving_package)
    request = _requests(predictor.input_schema, 1)[0]
    with ReplicaSet(tiny_serving_package, ["cpu"]) as replicas:
        replica = replicas.replicas[0]
        working = replica.batcher

        def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
            replica.batcher = working
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        replica.batcher = broken
        with pytest.raises(RuntimeError, match="illegal memory access"):
            replicas.submit(request).result(timeout=60)
        answer = replicas.submit(request).result(timeout=60)
        assert replicas.stats()[0]["errors"] == 1
    for name, value in predictor(request).items():
        torch.testing.assert_close(answer[name], value, **CLOSE)
    with pytest.raises(ConfigError, match="closed"):
        replicas.submit(request)


def test_replicas_of_a_publish_root_follow_its_current_version(  # type: ignore[no-untyped-def]
        tiny_serving_package, tiny_serving_package_v2, tmp_path) -> None:
    from hstu_export.package.publish import publish

    root = tmp_path / "ranker"
    publish(tiny_serving_package, root)
    request = _requests(hstu_export.load(root).input_schema, 1)[0]
    old, new = (hstu_export.load(p)(request) for p in (tiny_serving_package, tiny_serving_package_v2))
    with ReplicaSet(root, ["cpu", "cpu"]) as replicas:
        for replica in replicas.replicas:
            replica.predictor.check_seconds = 0.0
        for name, value in replicas(request).items():
            assert torch.equal(value, old[name])
        publish(tiny_serving_package_v2, root)
        for replica in replicas.replicas:
            assert replica.predictor.refresh() == 2
        for _ in range(4):  # both replicas (the least loaded takes each)
            for name, value in replicas(request).items():
                assert torch.equal(value, new[name])


def test_refusals_are_clear(tiny_serving_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="at least one device"):
        ReplicaSet(tiny_serving_package, [])
    with pytest.raises(ConfigError, match="not a device"):
        ReplicaSet(tiny_serving_package, ["gpu7"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no usable CUDA device"):
            ReplicaSet(tiny_serving_package, ["cuda:0"])
    with pytest.raises(HstuExportError, match="export it with --kv-cache"):
        ReplicaSet(tiny_serving_package, ["cpu"], kv_cache_bytes="1MiB")
    with ReplicaSet(tiny_serving_package, ["cpu"]) as replicas:
        with pytest.raises(RequestError, match="dict of named tensors"):
            replicas.submit([1, 2]).result(timeout=10)
