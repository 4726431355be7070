"""The serving repository under a real Triton Inference Server (pytriton 0.7.0's bundled tritonserver, CPU,
tests/triton_server.py): answers over HTTP and gRPC are the package's own, bit for bit; the dynamic batcher
groups concurrent requests; a bad request fails alone. One server for the module."""

from __future__ import annotations

import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from torch import Tensor
from triton_server import HttpInference, InferenceRefused, TritonServer, python_library_dir, request_inputs
from tritonclient.utils import InferenceServerException

import hstu_export
from hstu_export import generate_batch
from hstu_export.cli import main as cli_main

pytestmark = pytest.mark.slow

MODEL = "ranker"
OUTPUTS = ("ctr", "cvr")
Answer = dict[str, Tensor] | InferenceServerException


@pytest.fixture(scope="module")
def package(tiny_serving_package: Path) -> Path:
    return tiny_serving_package


@pytest.fixture(scope="module")
def predictor(package: Path):  # type: ignore[no-untyped-def]
    return hstu_export.load(package)


@pytest.fixture(scope="module")
def server(package: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("triton-server")
    # A queue delay of 20 ms (the default is 0.5 ms): on two busy cores the test's concurrent requests
    # reach the server over a few milliseconds, and the batching test must not depend on that.
    assert cli_main(["serving-repo", str(package), "--out", str(root / "repo"), "--max-queue-delay-us", "20000"]) == 0
    with TritonServer(root / "repo", root) as triton:
        yield triton


def _outputs(client: Any) -> list[Any]:
    if client is httpclient:
        return [client.InferRequestedOutput(name, binary_data=True) for name in OUTPUTS]
    return [client.InferRequestedOutput(name) for name in OUTPUTS]


def _answer(result: Any) -> dict[str, Tensor]:
    answer = {}
    for name in OUTPUTS:
        array = result.as_numpy(name)
        assert array.shape[0] == 1, f"{name}: {array.shape}"
        answer[name] = torch.from_numpy(array[0].copy())
    return answer


def _bit_equal(answer: Answer, expected: dict[str, Tensor]) -> bool:
    return isinstance(answer, dict) and sorted(answer) == sorted(expected) and all(
        answer[n].dtype == expected[n].dtype and torch.equal(answer[n], expected[n]) for n in expected)


def _send_concurrently(server: TritonServer, sends: Sequence[Callable[[Any], list[Any]]]) -> list[Answer]:
    """Each ``send(grpcclient)`` builds one request's inputs; all go out at once over gRPC (asynchronous
    calls on one channel), and each gets its answer or its error."""
    answers: list[Answer | None] = [None] * len(sends)
    done = threading.Semaphore(0)

    def finish(index: int, result: Any, error: InferenceServerException | None) -> None:
        answers[index] = error if error is not None else _answer(result)
        done.release()

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        requests = [send(grpcclient) for send in sends]
        for index, inputs in enumerate(requests):
            client.async_infer(MODEL, inputs, callback=lambda result, error, i=index: finish(i, result, error),
                               outputs=_outputs(grpcclient), client_timeout=60)
        for _ in sends:
            assert done.acquire(timeout=120), "an answer did not come back within 120 s"
    return answers  # type: ignore[return-value]


def _calls_that_explain(answers: Sequence[Answer], requests: Sequence[dict[str, Tensor]],
                        predictor: Any) -> list[tuple[int, ...]]:
    """Package calls that give every answer, bit for bit, each request in exactly one call: requests of 2
    users run alone or two to a call (the package takes 4 users), so a call is a request alone, or two
    concatenated in either order whose answers are the call's two halves. A request's half is often the
    same with several partners, so the calls are found as an exact cover (calls of two tried first), not
    greedily. Fails naming the answers no such set of calls gives."""
    assert all(int(r["uih_lengths"].numel()) == 2 for r in requests)
    explains: dict[int, list[tuple[int, ...]]] = {i: [] for i in range(len(requests))}
    for first in range(len(requests)):
        for second in range(len(requests)):
            if first == second:
                continue
            pair = (requests[first], requests[second])
            combined = predictor({name: torch.cat([r[name] for r in pair]) for name in pair[0]})
            counts = [int(r["candidate_lengths"].sum()) for r in pair]
            halves = [dict(zip(OUTPUTS, parts)) for parts in zip(*(torch.split(combined[n], counts) for n in OUTPUTS))]
            if _bit_equal(answers[first], halves[0]) and _bit_equal(answers[second], halves[1]):
                explains[first].append((first, second))
                explains[second].append((first, second))
    for index, request in enumerate(requests):
        if _bit_equal(answers[index], predictor(request)):
            explains[index].append((index,))
    unexplained = [i for i, calls in explains.items() if not calls]
    assert not unexplained, f"answers {unexplained} are bit-equal to no package call holding their request"

    def cover(placed: frozenset[int]) -> list[tuple[int, ...]] | None:
        index = next((i for i in range(len(requests)) if i not in placed), None)
        if index is None:
            return []
        for call in explains[index]:
            if placed.isdisjoint(call):
                rest = cover(placed | set(call))
                if rest is not None:
                    return [call, *rest]
        return None

    calls = cover(frozenset())
    assert calls is not None, f"no set of package calls holds each request once and gives every answer: {explains}"
    return sorted(calls)


def _statistics(server: TritonServer, inferences: int | None = None) -> dict[str, Any]:
    """The model's statistics once they count ``inferences``, or (None) once they stop changing: Triton
    records an execution after its answers have gone out, so a client can hold every answer first."""
    deadline = time.monotonic() + 30
    with httpclient.InferenceServerClient(server.http_url) as client:
        stats = client.get_inference_statistics(MODEL)["model_stats"][0]
        while time.monotonic() < deadline:
            if inferences is not None and int(stats["inference_count"]) >= inferences:
                break
            time.sleep(0.1)
            previous, stats = stats, client.get_inference_statistics(MODEL)["model_stats"][0]
            if inferences is None and stats == previous:
                break
    batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])}
    return {"inference_count": int(stats["inference_count"]), "execution_count": int(stats["execution_count"]),
            "batches": batches}


def test_server_reports_its_version_and_the_model_ready(server: TritonServer) -> None:
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert client.get_server_metadata()["version"] == "2.51.0"  # Triton release 24.10, in pytriton 0.7.0
        assert client.is_model_ready(MODEL)
        config = client.get_model_config(MODEL)
    assert config["backend"] == "python" and config["max_batch_size"] == 8
    library = python_library_dir()
    if library is not None:  # the stub runs this interpreter's libpython, not another patch release's
        soname = sysconfig.get_config_var("INSTSONAME")
        assert server.stub_libraries() == {str((library / soname).resolve())}, server.stub_libraries()
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 20000


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_answers_are_the_packages_bit_for_bit(server: TritonServer, predictor, protocol: str) -> None:  # type: ignore[no-untyped-def]
    client_module = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    with client_module.InferenceServerClient(url) as client:
        for index, users in enumerate([1, 4, 2, 3, 1, 4]):
            request = generate_batch(predictor.input_schema, users, seed=300 + index)
            result = client.infer(MODEL, request_inputs(client_module, request), outputs=_outputs(client_module))
            answer, expected = _answer(result), predictor(request)
            assert answer["ctr"].shape == (int(request["candidate_lengths"].sum()),)
            assert _bit_equal(answer, expected), f"request {index} ({users} users) over {protocol}"


def test_the_plain_http_client_gets_the_packages_answers(server: TritonServer, predictor) -> None:  # type: ignore[no-untyped-def]
    """tests/triton_server.py's HttpInference (binary tensors over http.client, what the GPU load test sends
    with) against the same server: bit for bit, and a refusal carries model.py's words."""
    client = HttpInference(server.http_url, MODEL)
    try:
        for index, users in enumerate([1, 3]):
            request = generate_batch(predictor.input_schema, users, seed=350 + index)
            assert _bit_equal(client.infer(request), predictor(request)), f"request {index} ({users} users)"
        bad = generate_batch(predictor.input_schema, 1, seed=360)
        bad["candidate_item_ids"][0] = 5000  # the package's item ids end at 999
        with pytest.raises(InferenceRefused, match="candidate_item_ids"):
            client.infer(bad)
        request = generate_batch(predictor.input_schema, 2, seed=361)  # the connection still serves
        assert _bit_equal(client.infer(request), predictor(request))
    finally:
        client.close()


def test_the_dynamic_batcher_groups_concurrent_requests(server: TritonServer, predictor) -> None:  # type: ignore[no-untyped-def]
    requests = [generate_batch(predictor.input_schema, 2, seed=400 + i) for i in range(12)]
    before = _statistics(server)
    answers = _send_concurrently(server, [lambda c, r=r: request_inputs(c, r) for r in requests])
    after = _statistics(server, before["inference_count"] + len(requests))
    served = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert served == len(requests)
    assert executions < served, f"{served} requests took {executions} executions: nothing was batched"
    grouped = {size: count - before["batches"].get(size, 0) for size, count in after["batches"].items()}
    assert any(size > 1 and count > 0 for size, count in grouped.items()), grouped
    # Inside an execution, model.py runs the requests two to a package call (2 + 2 users of at most 4).
    calls = _calls_that_explain(answers, requests, predictor)
    assert any(len(call) == 2 for call in calls), calls


def test_a_bad_request_fails_alone(server: TritonServer, predictor) -> None:  # type: ignore[no-untyped-def]
    good = [generate_batch(predictor.input_schema, 2, seed=500 + i) for i in range(6)]
    out_of_range = generate_batch(predictor.input_schema, 2, seed=510)
    out_of_range["candidate_item_ids"][0] = 5000  # the package's item ids end at 999
    sends: list[Callable[[Any], list[Any]]] = [lambda c, r=r: request_inputs(c, r) for r in good]
    bad = {
        "feature 'candidate_item_ids' has value 5000 beyond the exported maximum 999":
            lambda c: request_inputs(c, out_of_range),
        "send each feature as [1, n, ...]":  # two batch elements in one request
            lambda c: request_inputs(c, generate_batch(predictor.input_schema, 1, seed=511), rows=2),
        "inference input 'user_id' data-type is 'INT32', but model 'ranker' expects 'INT64'":  # Triton's check
            lambda c: request_inputs(c, generate_batch(predictor.input_schema, 1, seed=512), datatypes={"user_id": "INT32"}),
    }
    # Interleaved, all sent at once: the bad ones share the queue (and executions) with the good ones.
    order = [sends[0], sends[1], *bad.values(), *sends[2:]]
    before = _statistics(server)
    answers = _send_concurrently(server, order)
    after = _statistics(server, before["inference_count"] + len(good) + 3)
    good_answers = [answers[0], answers[1], *answers[2 + len(bad):]]
    for message, answer in zip(bad, answers[2:2 + len(bad)]):
        assert isinstance(answer, InferenceServerException), f"{message!r}: the request succeeded"
        assert message in answer.message(), answer.message()
    _calls_that_explain(good_answers, good, predictor)
    # Batch elements that reached model.py: the good requests, the out-of-range one and the two-row one (2);
    # Triton refuses the INT32 one before queueing it. Triton counts the two model.py refused as inferences
    # (the Python backend reports an answer's error in the answer, not in the statistics' failures).
    reached = after["inference_count"] - before["inference_count"]
    assert reached == len(good) + 3
    assert after["execution_count"] - before["execution_count"] < len(good) + 2  # some held several requests


def test_a_published_version_is_picked_up_without_a_dropped_request(  # type: ignore[no-untyped-def]
        tiny_serving_package, tiny_serving_package_v2, tmp_path) -> None:
    """A repository of a publish root: three clients ask without pause while a version with other weights is
    published; every request is answered, each answer is one version's (they differ by far more than
    batching's rounding), and each client gets the old version and then only the new one."""
    from hstu_export.package.publish import publish

    root = tmp_path / "ranker"
    publish(tiny_serving_package, root)
    assert cli_main(["serving-repo", str(root), "--out", str(tmp_path / "repo"), "--follow-seconds", "0.2"]) == 0
    request = generate_batch(hstu_export.load(tiny_serving_package).input_schema, 2, seed=21)
    versions = [hstu_export.load(p)(request) for p in (tiny_serving_package, tiny_serving_package_v2)]
    assert not torch.allclose(versions[0]["ctr"], versions[1]["ctr"], rtol=1e-3, atol=1e-4)
    seen: list[list[int]] = []
    failures: list[object] = []
    stop = threading.Event()

    def client(url: str) -> None:
        mine: list[int] = []
        seen.append(mine)
        with httpclient.InferenceServerClient(url) as triton:
            while not stop.is_set():
                try:
                    answer = _answer(triton.infer(MODEL, request_inputs(httpclient, request),
                                                  outputs=_outputs(httpclient)))
                except InferenceServerException as exc:
                    failures.append(exc)
                    continue
                close = [all(torch.allclose(answer[n], v[n], rtol=1e-5, atol=1e-6) for n in OUTPUTS) for v in versions]
                if close.count(True) != 1:
                    failures.append(f"an answer of neither version: {answer}")
                    continue
                mine.append(close.index(True) + 1)

    with TritonServer(tmp_path / "repo", tmp_path) as triton:
        clients = [threading.Thread(target=client, args=(triton.http_url,)) for _ in range(3)]
        for thread in clients:
            thread.start()
        time.sleep(1.0)
        publish(tiny_serving_package_v2, root)
        deadline = time.monotonic() + 120
        while not (len(seen) == 3 and all(mine and mine[-1] == 2 for mine in seen)) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        stop.set()
        for thread in clients:
            thread.join(timeout=60)
        log = triton.log()
    assert not failures, (failures[:3], log)
    for mine in seen:
        assert mine and mine[0] == 1 and mine[-1] == 2 and mine == sorted(mine), (mine[:5], mine[-5:])


def test_a_native_repository_answers_bit_for_bit(package, predictor, cpp_runtime, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``serving-repo --runtime native``: the server's Python backend serves the package through the C++ runtime's
    library the config names; a request alone in its execution is answered as the package answers it, bit for
    bit, and a bad request gets its own error while the one beside it is answered."""
    from hstu_export.runtimes.native import LIBRARY_NAME

    monkeypatch.setenv("HSTU_EXPORT_NATIVE_LIBRARY", str(cpp_runtime.path.parent / LIBRARY_NAME))
    assert cli_main(["serving-repo", str(package), "--out", str(tmp_path / "repo"), "--runtime", "native"]) == 0
    requests = [generate_batch(predictor.input_schema, users, seed=500 + users) for users in (1, 4, 2)]
    bad = dict(requests[0], candidate_item_ids=requests[0]["candidate_item_ids"] + 10**9)
    with TritonServer(tmp_path / "repo", tmp_path) as triton, httpclient.InferenceServerClient(triton.http_url) as client:
        for request in requests:
            answer = _answer(client.infer(MODEL, request_inputs(httpclient, request), outputs=_outputs(httpclient)))
            assert _bit_equal(answer, predictor(request)), triton.log()
        answers = _send_concurrently(triton, [lambda c, r=r: request_inputs(c, r) for r in (bad, requests[1])])
    assert isinstance(answers[0], InferenceServerException) and "candidate_item_ids" in str(answers[0])
    assert not isinstance(answers[1], InferenceServerException)
    torch.testing.assert_close(answers[1]["ctr"], predictor(requests[1])["ctr"], rtol=1e-5, atol=1e-6)
