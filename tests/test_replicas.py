"""One package served by several replicas (hstu_export/serving/replicas.py), in this process or each in its
own (processes.py): answers, batching, routing of a user to the replica holding its KV cache, a bad request
failing alone, a replica process that dies, and clear refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from kv_requests import CONFIGS, Users

import hstu_export
from hstu_export.errors import ConfigError, HstuExportError, PackageError, RequestError, ServingError
from hstu_export.runtimes.native import LIBRARY_NAME
from hstu_export.serving.processes import decode_tensors, encode_tensors
from hstu_export.serving.replicas import ReplicaSet, replica_of

pytestmark = pytest.mark.slow

CLOSE = dict(rtol=1e-5, atol=1e-5)  # a request batched with others is not bit-equal to it run alone


def _requests(schema, count: int) -> list[dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    return [hstu_export.generate_batch(schema, 1 + i % 2, seed=100 + i) for i in range(count)]


@pytest.fixture
def native_library(cpp_runtime, monkeypatch) -> Path:  # type: ignore[no-untyped-def]
    """The C++ runtime's Python library, built, and named to this process and the replica processes it starts."""
    path = cpp_runtime.path.parent / LIBRARY_NAME
    monkeypatch.setenv("HSTU_EXPORT_NATIVE_LIBRARY", str(path))
    return path


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_replicas_answer_as_the_package_and_batch(tiny_serving_package, processes) -> None:  # type: ignore[no-untyped-def]
    predictor = hstu_export.load(tiny_serving_package)
    requests = _requests(predictor.input_schema, 12)
    with ReplicaSet(tiny_serving_package, ["cpu", "cpu"], max_queue_delay_ms=300, processes=processes) as replicas:
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
    if processes:  # each replica ran in a process of its own
        assert len({s["process"] for s in stats} | {os.getpid()}) == 3, stats


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_bad_request_fails_alone(tiny_serving_package, processes) -> None:  # type: ignore[no-untyped-def]
    predictor = hstu_export.load(tiny_serving_package)
    good = _requests(predictor.input_schema, 4)
    beyond = dict(good[0])
    beyond["candidate_item_ids"] = beyond["candidate_item_ids"] + 10**9
    missing = {k: v for k, v in good[1].items() if k != "query_time"}
    with ReplicaSet(tiny_serving_package, ["cpu"], max_queue_delay_ms=300, processes=processes) as replicas:
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


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_native_replicas_answer_as_the_package(tiny_serving_package, native_library, processes) -> None:  # type: ignore[no-untyped-def]
    """runtime="native": each call served by the C++ runtime. A request alone in its call is answered as
    hstu_export.load answers it, bit for bit; requests waiting together share a call; a bad one fails alone."""
    predictor = hstu_export.load(tiny_serving_package)
    requests = _requests(predictor.input_schema, 8)
    beyond = dict(requests[0])
    beyond["candidate_item_ids"] = beyond["candidate_item_ids"] + 10**9
    with ReplicaSet(tiny_serving_package, ["cpu"], max_queue_delay_ms=300, workers=2, processes=processes,
                    runtime="native") as replicas:
        for request in requests[:3]:
            answer, expected = replicas(request), predictor(request)
            assert list(answer) == list(expected)
            assert all(torch.equal(answer[name], value) for name, value in expected.items())
        futures = [replicas.submit(r) for r in [*requests[3:6], beyond, *requests[6:]]]
        with pytest.raises(RequestError, match="candidate_item_ids"):
            futures.pop(3).result(timeout=60)
        for request, future in zip(requests[3:], futures):
            expected = predictor(request)
            for name, value in future.result(timeout=60).items():
                torch.testing.assert_close(value, expected[name], **CLOSE)
        stats = replicas.stats()[0]
    assert stats["requests"] == 9 and stats["errors"] == 1
    assert stats["calls"] < 3 + 6 + 1, stats  # the six waiting together shared calls (the bad one ran again alone)


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


@pytest.mark.parametrize(("workers", "processes", "runtime"),
                         [(1, False, "python"), (2, False, "python"), (1, True, "python"), (2, False, "native")],
                         ids=["1-worker", "2-workers", "processes", "native"])
@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_a_user_returns_to_the_replica_that_caches_it(kv_package, workers, processes, runtime,  # type: ignore[no-untyped-def]
                                                      request) -> None:
    """Six users, three rounds each with a grown history, on two replicas with their own caches: every
    return is a hit, which it could not be on the other replica's cache (with two workers a replica serves
    two calls at once from its one cache; as processes, the caches are in two processes; native: the C++
    runtime's cache)."""
    if runtime == "native":
        request.getfixturevalue("native_library")
    name, root, _ = kv_package
    predictor = hstu_export.load(root)
    users = Users(CONFIGS[name], seed=3)
    ids = [11, 12, 13, 14, 15, 16]
    for user in ids:
        users.grow(str(user), 5 + user % 4)
    assert {replica_of(u, 2) for u in ids} == {0, 1}
    with ReplicaSet(root, ["cpu", "cpu"], kv_cache_bytes=4 << 20, max_queue_delay_ms=100,
                    max_batch_users=2, workers=workers, processes=processes, runtime=runtime) as replicas:
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
    with pytest.raises(ConfigError, match="runtime 'rust': expected python or native"):
        ReplicaSet(tiny_serving_package, ["cpu"], runtime="rust")


def test_native_replicas_follow_a_publish_root(tiny_serving_package, tiny_serving_package_v2, native_library,  # type: ignore[no-untyped-def]
                                               tmp_path) -> None:
    """runtime="native" on a publish root: the C++ runtime's PublishedPackage serves its current version and moves to
    a newly published one, each answer bit for bit the version's own; a KV cache is refused on a followed root."""
    from hstu_export.package.publish import publish
    from hstu_export.runtimes.native import NativePredictor

    root = tmp_path / "ranker"
    publish(tiny_serving_package, root)
    request = _requests(hstu_export.load(root).input_schema, 1)[0]
    old, new = (hstu_export.load(p)(request) for p in (tiny_serving_package, tiny_serving_package_v2))
    with ReplicaSet(root, ["cpu", "cpu"], runtime="native") as replicas:
        assert all(r.predictor.version == 1 for r in replicas.replicas)
        for name, value in replicas(request).items():
            assert torch.equal(value, old[name])
        publish(tiny_serving_package_v2, root)
        for replica in replicas.replicas:
            assert replica.predictor.refresh() == 2 and replica.predictor.path.name == "2"
        for _ in range(4):  # both replicas (the least loaded takes each)
            for name, value in replicas(request).items():
                assert torch.equal(value, new[name])
    followed = NativePredictor(root, follow_seconds=0)
    with pytest.raises(ConfigError, match="a KV cache serves one version"):
        followed.kv_cache("1MiB")
    with pytest.raises(ConfigError, match="refresh\\(\\) follows a publish root"):
        NativePredictor(tiny_serving_package).refresh()
    with pytest.raises(PackageError):
        NativePredictor(tiny_serving_package, follow_seconds=1)


def test_tensors_travel_to_a_replica_process_unchanged() -> None:
    """Every dtype a request or an answer can hold (bf16 has no numpy twin), with 0-d, empty and strided
    tensors, arrives bit for bit, in dtype and shape."""
    sent = {"ids": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
            "scores": torch.randn(5, dtype=torch.bfloat16), "half": torch.randn(2, 3, dtype=torch.float16),
            "flags": torch.tensor([True, False]), "count": torch.tensor(7, dtype=torch.int32),
            "none": torch.empty(0, 4), "small": torch.tensor([-3], dtype=torch.int8),
            "one": torch.tensor(2.5, dtype=torch.bfloat16), "no_rows": torch.empty(0, 3, dtype=torch.bfloat16),
            "strided": torch.randn(4, 6, dtype=torch.bfloat16)[:, ::2]}
    import pickle
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on arrays it cannot write to: they must arrive writable
        got = decode_tensors(pickle.loads(pickle.dumps(encode_tensors(sent), protocol=5)))
    assert list(got) == list(sent)
    for name, value in sent.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name
    with pytest.raises(RequestError, match=r"request\['ids'\] is a list, not a tensor"):
        encode_tensors({"ids": [1, 2]})


def test_a_replica_process_that_dies_fails_its_requests_and_the_others_serve(tiny_serving_package) -> None:  # type: ignore[no-untyped-def]
    """A replica process killed while it holds requests: they fail with a ServingError that says so, later
    requests go to the replica that still serves, and stats and close still work."""
    predictor = hstu_export.load(tiny_serving_package)
    requests = _requests(predictor.input_schema, 6)
    with ReplicaSet(tiny_serving_package, ["cpu", "cpu"], processes=True, max_queue_delay_ms=5000,
                    max_batch_users=4) as replicas:
        doomed, other = replicas.replicas
        held = replicas.submit(requests[0])  # a queue delay of 5 s: it waits in the process for more users
        assert held in [f for f, _ in doomed._pending.values()]
        os.kill(doomed.pid, signal.SIGKILL)
        with pytest.raises(ServingError, match="replica process for cpu ended"):
            held.result(timeout=60)
        assert not doomed.serving and other.serving
        for request in requests[1:]:  # each waits out the other replica's queue delay: one at a time is enough
            answer = replicas.submit(request).result(timeout=60)
            for name, value in predictor(request).items():
                torch.testing.assert_close(answer[name], value, **CLOSE)
        stats = replicas.stats()
        assert "ended" in stats[0] and stats[1]["requests"] == 5, stats


def test_a_replica_process_that_cannot_start_raises_the_error_it_met(tiny_serving_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PackageError) as threads:
        ReplicaSet(tmp_path / "missing", ["cpu"])
    with pytest.raises(PackageError) as processes:
        ReplicaSet(tmp_path / "missing", ["cpu"], processes=True)
    assert str(processes.value) == str(threads.value)
    with pytest.raises(HstuExportError, match="export it with --kv-cache"):
        ReplicaSet(tiny_serving_package, ["cpu", "cpu"], kv_cache_bytes="1MiB", processes=True)


def test_a_script_without_a_main_guard_serves_through_processes(tiny_serving_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The replica processes are fresh interpreters: the caller's script, written without
    ``if __name__ == "__main__"``, is not run again in them (as multiprocessing's spawn would)."""
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import hstu_export
        from hstu_export.serving.replicas import ReplicaSet
        print("script ran", flush=True)
        request = hstu_export.generate_batch(hstu_export.load({str(tiny_serving_package)!r}).input_schema, 2, seed=3)
        with ReplicaSet({str(tiny_serving_package)!r}, ["cpu"], processes=True) as replicas:
            print(sorted(replicas(request)), flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(hstu_export.__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines.count("script ran") == 1, done.stdout
    predictor = hstu_export.load(tiny_serving_package)
    assert lines[-1] == str(sorted(predictor(hstu_export.generate_batch(predictor.input_schema, 2, seed=3)))), done.stdout
