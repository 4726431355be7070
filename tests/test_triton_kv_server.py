"""KV-cached serving under a real Triton Inference Server (pytriton 0.7.0's bundled tritonserver, CPU,
tests/triton_server.py): a package exported with --kv-cache (conftest's ``kv_package``, no contextual
features), its repository written with ``--kv-cache`` and two instances. Users send their requests
concurrently, each named by its correlation id; every answer is the package's own (within the KV tests'
tolerance), the metrics endpoint counts one miss per user and a hit for every later request (which
fails if a user's request reached the other instance's cache), and a bad request fails alone. Two more
repositories of the same package: a cache that holds two users evicts the least recently used one, and a
user beyond the sequence slots waits in Triton's backlog until a slot idles out."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from kv_requests import CONFIGS, Users
from triton_server import NO_START, TritonServer, request_inputs
from tritonclient.utils import InferenceServerException

import hstu_export
from hstu_export.cli import main as cli_main

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)]

MODEL = "ranker"
OUTPUTS = ("ctr", "cvr")
CLOSE = dict(rtol=1e-5, atol=1e-5)  # as tests/test_kv_export.py: a delta run sums over fewer rows
Answer = dict[str, torch.Tensor] | InferenceServerException


@pytest.fixture(scope="module")
def package(kv_package) -> Path:  # type: ignore[no-untyped-def]
    return kv_package[1]


@pytest.fixture(scope="module")
def predictor(package: Path):  # type: ignore[no-untyped-def]
    return hstu_export.load(package)


@pytest.fixture(scope="module")
def server(package: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("triton-kv-server")
    # 20 ms queue delay, as tests/test_triton_server.py: concurrent requests reach the server over a few ms.
    # Users idle for 5 s end their sequences (far longer than between a user's requests here): the server
    # waits for open sequences when it stops (up to its exit timeout, 30 s).
    assert cli_main(["serving-repo", str(package), "--out", str(root / "repo"), "--name", MODEL, "--kv-cache", "1MiB",
                     "--instances", "2", "--max-requests-per-batch", "4", "--max-queue-delay-us", "20000",
                     "--sequence-idle-us", "5000000"]) == 0
    with TritonServer(root / "repo", root) as triton:
        yield triton


def infer_user(client: Any, user: int | str, request: dict[str, torch.Tensor]) -> Answer:
    """The client protocol of docs/SERVING.md: the request goes out named by its user (the correlation id)
    without sequence flags; a user Triton holds no sequence for (the first request, or after the idle
    time) is refused before it runs, and the request is sent again with the START flag."""
    outputs = [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]
    for start in (False, True):
        try:
            result = client.infer(MODEL, request_inputs(grpcclient, request), outputs=outputs, sequence_id=user,
                                  sequence_start=start, client_timeout=60)
        except InferenceServerException as exc:
            if not start and NO_START in exc.message():
                continue
            return exc
        return {name: torch.from_numpy(result.as_numpy(name)[0].copy()) for name in OUTPUTS}
    raise AssertionError("unreachable")


def _kv_metrics(server: TritonServer, served: int) -> dict[str, dict[str, float]]:
    """hstu_kv_cache_* per metric, per instance, once hits + misses + stale count ``served`` users."""
    deadline = time.monotonic() + 30
    while True:
        samples = server.metrics()
        found = {name[len("hstu_kv_cache_"):]: {dict(labels)["instance"]: value for labels, value in values.items()
                                                if dict(labels).get("model") == MODEL}
                 for name, values in samples.items() if name.startswith("hstu_kv_cache_")}
        counted = sum(sum(found.get(name, {}).values()) for name in ("hits", "misses", "stale"))
        if counted >= served or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _run_users(server: TritonServer, plans: dict[int | str, list[dict[str, torch.Tensor]]]) -> dict[Any, list[Answer]]:
    """Each user's requests in order, the users at the same time (a thread and a gRPC client each). Each
    request waits a while first, a different while for each user and round, so that the users' requests
    meet in other batches each round: without routing by user, some would reach the other instance."""
    answers: dict[Any, list[Answer]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(plans))

    def user_thread(index: int, user: int | str, requests: list[dict[str, torch.Tensor]]) -> None:
        try:
            with grpcclient.InferenceServerClient(server.grpc_url) as client:
                start.wait(timeout=60)
                answers[user] = []
                for step, request in enumerate(requests):
                    time.sleep((index * 5 + step * 3) % 8 * 0.015)
                    answers[user].append(infer_user(client, user, request))
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=user_thread, args=(i, *item)) for i, item in enumerate(plans.items())]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors
    return answers


def _same(answer: Answer, expected: dict[str, torch.Tensor], what: str) -> None:
    assert not isinstance(answer, InferenceServerException), f"{what}: {answer.message()}"
    assert sorted(answer) == sorted(expected), what
    for name in expected:
        torch.testing.assert_close(answer[name], expected[name], **CLOSE, msg=lambda m, n=name: f"{what}, {n}: {m}")


def test_users_reach_their_instances_cache_and_get_the_packages_answers(server: TritonServer, predictor) -> None:  # type: ignore[no-untyped-def]
    with httpclient.InferenceServerClient(server.http_url) as client:
        config = client.get_model_config(MODEL)
    assert config["sequence_batching"]["oldest"]["max_candidate_sequences"] == 1024
    assert [group["count"] for group in config["instance_group"]] == [2]
    # Users (ints and a string: correlation ids of both kinds), each: a first request (prefill: a miss), the
    # same history with new candidates (a hit), then twice a grown history (hits: only the new tokens run).
    users = Users(CONFIGS["no-context"], seed=11)
    ids: list[int | str] = [*range(1, 8), "user-8"]
    plans: dict[int | str, list[dict[str, torch.Tensor]]] = {}
    for index, user in enumerate(ids):
        key = str(user)
        users.grow(key, 12 + 3 * index)
        plans[user] = [users.request([key], [3]), users.request([key], [2])]
        for grown in (5, 1):
            users.grow(key, grown)
            plans[user].append(users.request([key], [4]))
    answers = _run_users(server, plans)
    for user, requests in plans.items():
        for step, (request, answer) in enumerate(zip(requests, answers[user])):
            _same(answer, predictor(request), f"user {user!r}, request {step}")
    served = sum(len(requests) for requests in plans.values())
    counts = _kv_metrics(server, served)
    total = {name: sum(values.values()) for name, values in counts.items()}
    assert total["misses"] == len(ids), counts  # one prefill per user: no user's request reached the other cache
    assert total["hits"] == served - len(ids), counts
    assert total["stale"] == total["evictions"] == total["bypassed"] == 0, counts
    assert total["users"] == len(ids), counts
    # Both instances served users (so one cache holding everyone would not pass), each its own: an
    # instance's users are the users it missed once.
    assert sorted(counts["misses"]) == [f"{MODEL}_0_0", f"{MODEL}_0_1"], counts
    assert all(counts["misses"][instance] > 0 for instance in counts["misses"]), counts
    assert all(counts["users"][instance] == counts["misses"][instance] for instance in counts["misses"]), counts
    assert all(counts["pages"][instance] == counts["pages"][f"{MODEL}_0_0"] > 0 for instance in counts["pages"])
    with httpclient.InferenceServerClient(server.http_url) as client:
        stats = client.get_inference_statistics(MODEL)["model_stats"][0]
    # The sequence batcher batched requests of different users within an instance.
    assert int(stats["execution_count"]) < int(stats["inference_count"]), stats
    assert any(int(b["batch_size"]) > 1 for b in stats["batch_stats"]), stats["batch_stats"]


def test_a_bad_request_fails_alone(server: TritonServer, predictor) -> None:  # type: ignore[no-untyped-def]
    users = Users(CONFIGS["no-context"], seed=12)
    for key in ("20", "21", "22", "23", "24", "25"):
        users.grow(key, 10)
    limit = next(f.max_value for f in predictor.input_schema.features if f.name == "candidate_item_ids")
    beyond = users.request(["22"], [3])
    beyond["candidate_item_ids"][0] = limit + 1
    plans: dict[int | str, list[dict[str, torch.Tensor]]] = {
        20: [users.request(["20"], [3])], 21: [users.request(["21"], [2])], 22: [beyond],
        23: [users.request(["23", "24"], [1, 2])],  # two users under one correlation id
        25: [users.request(["25"], [2])],
    }
    answers = _run_users(server, plans)
    for user in (20, 21, 25):
        _same(answers[user][0], predictor(plans[user][0]), f"user {user}")
    for user, message in ((22, f"'candidate_item_ids' has value {limit + 1} beyond the exported maximum {limit}"),
                          (23, "a request to a KV-cached model holds one user")):
        answer = answers[user][0]
        assert isinstance(answer, InferenceServerException), f"user {user}: the request succeeded"
        assert message in answer.message(), answer.message()
    # A request without a correlation id is refused by Triton itself.
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException, match="non-zero or non-empty correlation ID"):
            client.infer(MODEL, request_inputs(grpcclient, users.request(["20"], [1])))


@pytest.fixture(scope="module")
def small_server(package: Path, predictor, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One instance whose cache holds 4 pages (with the scratch page, 5 pages of the budget): two users of 20
    history tokens, pages of kv_requests.PAGE (16) tokens."""
    pages = predictor.kv_cache(1 << 20).cache.page_bytes * 5
    root = tmp_path_factory.mktemp("triton-kv-evict")
    assert cli_main(["serving-repo", str(package), "--out", str(root / "repo"), "--name", MODEL, "--kv-cache",
                     str(pages), "--instances", "1", "--sequence-idle-us", "5000000"]) == 0
    with TritonServer(root / "repo", root) as triton:
        yield triton


def test_a_full_cache_evicts_the_least_recently_used_user_and_its_return_is_a_miss(small_server: TritonServer,
                                                                                   predictor) -> None:  # type: ignore[no-untyped-def]
    """A, B, C in turn (C finds the cache full: A, the least recently used, is evicted), A again (a miss: B is
    evicted), C with new candidates (a hit: still held), B again (a miss: A is evicted). Every answer is the
    package's, and the server's metrics count exactly that."""
    users = Users(CONFIGS["no-context"], seed=14)
    for key in ("31", "32", "33"):
        users.grow(key, 20)
    order = [(31, 3), (32, 2), (33, 4), (31, 2), (33, 5), (32, 3)]
    with grpcclient.InferenceServerClient(small_server.grpc_url) as client:
        for step, (user, candidates) in enumerate(order):
            request = users.request([str(user)], [candidates])
            _same(infer_user(client, user, request), predictor(request), f"request {step} (user {user})")
    counts = _kv_metrics(small_server, len(order))
    total = {name: sum(values.values()) for name, values in counts.items()}
    assert (total["misses"], total["hits"], total["evictions"], total["stale"]) == (5, 1, 3, 0), counts
    assert (total["users"], total["pages_used"], total["pages"]) == (2, 4, 4), counts


@pytest.fixture(scope="module")
def one_slot_server(package: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One instance holding one user's sequence at a time (--max-sequences 1), idle after 2 s."""
    root = tmp_path_factory.mktemp("triton-kv-backlog")
    assert cli_main(["serving-repo", str(package), "--out", str(root / "repo"), "--name", MODEL, "--kv-cache", "1MiB",
                     "--instances", "1", "--max-sequences", "1", "--sequence-idle-us", "2000000"]) == 0
    with TritonServer(root / "repo", root) as triton:
        yield triton


def test_a_user_beyond_the_sequence_slots_waits_for_one_to_idle_out(one_slot_server: TritonServer,
                                                                    predictor) -> None:  # type: ignore[no-untyped-def]
    """With every slot held (one instance, one sequence), a second user's request waits in Triton's backlog
    until the first user's sequence is idle for max_sequence_idle_microseconds (2 s), then gets the package's
    answer; the first user's next request, within its sequence, is answered at once."""
    users = Users(CONFIGS["no-context"], seed=15)
    for key in ("41", "42"):
        users.grow(key, 10)
    first, second = users.request(["41"], [2]), users.request(["42"], [3])
    with grpcclient.InferenceServerClient(one_slot_server.grpc_url) as client:
        _same(infer_user(client, 41, first), predictor(first), "user 41")
        start = time.monotonic()
        _same(infer_user(client, 41, first), predictor(first), "user 41 again")
        within = time.monotonic() - start
        start = time.monotonic()
        _same(infer_user(client, 42, second), predictor(second), "user 42")
        waited = time.monotonic() - start
    assert within < 1.0 and waited > 1.4, (within, waited)
    counts = _kv_metrics(one_slot_server, 3)
    total = {name: sum(values.values()) for name, values in counts.items()}
    assert (total["misses"], total["hits"]) == (2, 1), counts
