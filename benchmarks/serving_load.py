"""A DLRMv3-style Server-scenario load test: Poisson arrivals, one user per query, swept up to the highest
rate whose p99 latency stays within the bound.

    PYTHONPATH=$PWD python benchmarks/serving_load.py --out $OUT [--gpus 1 2] [--cache off on]
    PYTHONPATH=$PWD python benchmarks/serving_load.py --out /tmp/load --small      # CPU, tiny: checks it runs

The package: the zoo's dlrmv3 preset (5 layers, D=512, 4 heads of 128), exported here with --kv-cache on
AOTInductor, bf16, max batch --max-batch (or --package PKG). Served through
``hstu_export.serving.replicas.ReplicaSet``: --serve threads (one replica per GPU in this process) or
processes:N (N replica processes per GPU), each replica with --workers threads that run whatever queries wait
(up to the batch) in one call; with the cache, a user always reaches the replica caching it. --runtime
python serves each call through ``hstu_export.load``, native through the C++ runtime's library (build it first:
``bash runtimes/cpp/build.sh``). --serve triton:N serves it instead through a real Triton Inference Server
(nvidia-pytriton 0.7.0's bundled tritonserver, found as tests/triton_server.py finds it): the repository
``hstu-export serving-repo`` writes, N instances per GPU (KIND_GPU), queries sent over HTTP with binary
tensors by --client-threads threads; with the cache, each query names its user (the correlation id).

Queries: one user each, 2048 candidates, a history drawn as the DLRMv3 reference's synthetic streaming data
builds one (generative-recommenders, dlrm_v3/streaming_synthetic_data.py): the base timestamp's segment plus
one segment per later timestamp the user was sampled at (probability 0.7, inference timestamps 90-99), each
segment Gaussian with a standard deviation of a quarter of its mean, at least a third of it. The segment mean
is scaled so that histories average --mean-history (1024: the dlrmv3 workload of docs/PERF.md), cut to the
package's longest. With the cache, queries come from a pool of returning users: each return adds one new
segment (about mean/67 items) and moves the query time --return-seconds later; a share --new-users of
queries are users seen for the first time (misses by construction). The cache reuses a user's rows while its
time buckets hold for --max-time-drift seconds (CachedRanker's max_time_drift). The cached path runs without
CUDA graphs unless --kv-graphs says otherwise (docs/PERF.md, serving under load, says why).

Per configuration (cache x GPUs x --serve x --workers x --runtime): a closed-loop saturation estimate, then
open-loop windows of --seconds at rising shares of it (or at the --rates given per GPU); reported per rate: achieved
queries/s, p50/p99 latency (from the scheduled arrival to the answer on the host, queueing included), the workers'
busy share and the GPUs' utilisation (NVML, when readable), the cache's hits/misses/stale/evictions in the window,
and what could explain a tail: how late queries were sent, p99 per tenth of the window, the garbage collector's
pauses; with threads and no cache, the predictor called directly on one request of --max-batch users (``call_ms``:
no queue, no batching). Writes serving_load.json after every window. --profile adds a cProfile of the first worker's
calls; --host-threads sets torch's CPU threads (the workers' host tensor work contends for torch's thread pool), and
with --serve triton each instance's. Through Triton, each window also has the server's own split of a request's time
(``server_ms_per_request``: queued, and its execution's input, run and output phases).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import itertools
import json
import math
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hstu_export
from hstu_export.models.config import preset_config
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.serving.batching import combine, to_host
from hstu_export.serving.replicas import ReplicaSet
from hstu_export.serving.triton_repo import ServingRepoSettings, write_serving_repo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # triton_server: the bundled server, HTTP
from triton_server import NO_START, HttpInference, InferenceRefused, TritonServer

P99_BOUND_MS = 80.0
SAMPLED = 0.7  # the reference's user_sampling_ratio
TIMESTAMPS = range(90, 100)  # its inference timestamps (train_ratio 0.9 of 100)
MEAN_SEGMENTS = 1 + SAMPLED * statistics.mean(TIMESTAMPS)
NOW = 1_750_000_000


class Histories:
    """Users' histories in the shape of the reference's synthetic data, scaled to ``mean`` items."""

    def __init__(self, mean: float, longest: int, items: int, actions: int, seed: int) -> None:
        self.segment = mean / MEAN_SEGMENTS
        self.longest, self.items, self.actions = longest, items, actions
        self.rng = np.random.default_rng(seed)

    def segment_length(self) -> int:
        return max(round(float(self.rng.normal(self.segment, self.segment / 4))), math.ceil(self.segment / 3))

    def length(self) -> int:
        segments = 1 + self.rng.binomial(int(self.rng.choice(TIMESTAMPS)), SAMPLED)
        return min(sum(self.segment_length() for _ in range(segments)), self.longest)

    def events(self, count: int, now: int, span: int) -> np.ndarray:
        """``count`` events (item, action, timestamp) in the ``span`` seconds before ``now``, oldest first."""
        times = np.sort(now - self.rng.integers(1, span, count))
        return np.stack([self.rng.integers(0, self.items, count), self.rng.integers(0, self.actions, count), times])


@dataclasses.dataclass
class User:
    uid: int
    events: np.ndarray  # [3, n]: item ids, action ids, timestamps
    now: int


class Workload:
    def __init__(self, args: argparse.Namespace, cfg: Any) -> None:
        self.args, self.cfg = args, cfg
        self.hist = Histories(args.mean_history, cfg.max_history_len, cfg.item_vocab_size, cfg.action_vocab_size,
                              args.seed)
        self.next_uid = 0

    def new_user(self) -> User:
        self.next_uid += 1
        return User(self.next_uid, self.hist.events(self.hist.length(), NOW, 90 * 86400), NOW)

    def returning(self, user: User) -> User:
        """The user a --return-seconds later, with one more segment of history (a fresh user when the
        history would outgrow the package)."""
        now = user.now + self.args.return_seconds
        grown = self.hist.events(self.hist.segment_length(), now, self.args.return_seconds + 1)
        events = np.concatenate([user.events, grown], axis=1)
        if events.shape[1] > self.cfg.max_history_len:
            return self.new_user()
        return User(user.uid, events, now)

    def request(self, user: User) -> dict[str, torch.Tensor]:
        rng = self.hist.rng
        n, c = user.events.shape[1], self.args.candidates
        ev = torch.from_numpy(user.events)
        return {"uih_lengths": torch.tensor([n]), "candidate_lengths": torch.tensor([c]),
                "uih_item_ids": ev[0].clone(), "uih_action_ids": ev[1].clone(), "uih_timestamps": ev[2].clone(),
                "candidate_item_ids": torch.from_numpy(rng.integers(0, self.cfg.item_vocab_size, c)),
                "query_time": torch.tensor([user.now + 1])}

    def queries(self, count: int, pool: list[User] | None) -> list[tuple[dict[str, torch.Tensor], int]]:
        """``count`` queries: fresh users, or (``pool``) returning users of the pool, a --new-users share
        replaced by first-time users. The pool is updated in place."""
        out = []
        for _ in range(count):
            if pool is None:
                user = self.new_user()
            else:
                k = int(self.hist.rng.integers(0, len(pool)))
                fresh = self.hist.rng.random() < self.args.new_users
                pool[k] = user = self.new_user() if fresh else self.returning(pool[k])
            out.append((self.request(user), user.uid))
        return out


class Utilisation:
    """GPU utilisation sampled through NVML (torch.cuda.utilization) while a window runs; None if unreadable."""

    def __init__(self, devices: list[int]) -> None:
        self.devices, self.samples = devices, {d: [] for d in devices}
        self._stop = threading.Event()
        try:
            for d in devices:
                torch.cuda.utilization(d)
            self.readable = True
        except Exception:  # no NVML binding in this environment
            self.readable = False

    def __enter__(self) -> Utilisation:
        if self.readable:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for d in self.devices:
                self.samples[d].append(torch.cuda.utilization(d))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def mean(self) -> list[float] | None:
        if not self.readable:
            return None
        return [round(statistics.mean(s), 1) if s else None for s in self.samples.values()]


class GcPauses:
    """Python's garbage collections while a window runs (each holds the interpreter lock: every thread waits)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict[str, Any]:
        return {"count": len(self.pauses), "total_ms": round(sum(p for _, p in self.pauses), 2),
                "max_ms": round(max((p for _, p in self.pauses), default=0.0), 2),
                "full": sum(g == 2 for g, _ in self.pauses)}


def _with_start(encoded: tuple[bytes, int]) -> tuple[bytes, int]:
    """An encoded request of one user again, with the START flag."""
    body, head = encoded
    header = json.loads(body[:head])
    header["parameters"]["sequence_start"] = True
    text = json.dumps(header).encode()
    return text + body[head:], len(text)


def _post_as_user(client: HttpInference, encoded: tuple[bytes, int], user: int | None) -> tuple[Any, bool]:
    """The answer to an encoded query, and whether it needed START: a query of a user the server holds no
    sequence for is refused and sent again with the flag (docs/SERVING.md's client protocol)."""
    try:
        return client.post(encoded), False
    except InferenceRefused as exc:
        if user is None or NO_START not in str(exc):
            raise
        return client.post(_with_start(encoded)), True


def _client_process(url: str, model: str, threads: int, inbox: Any, outbox: Any) -> None:
    """A process of --client-processes: ``threads`` senders post the bodies the main process handed over
    (("bodies", {key: encoded}), then ("send", (key, user)) per query) and answer (key, time.perf_counter() when
    the answer came, the error's words or None, whether START was needed); perf_counter is CLOCK_MONOTONIC,
    the same clock in every process."""
    bodies: dict[int, tuple[bytes, int]] = {}
    work: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def send() -> None:
        client = HttpInference(url, model)
        while (item := work.get()) is not None:
            key, user = item
            error, started = None, False
            try:
                _, started = _post_as_user(client, bodies.pop(key), user)
            except Exception as exc:  # the query's failure, counted by the window
                error = f"{type(exc).__name__}: {exc}"
            outbox.put((key, time.perf_counter(), error, started))
        client.close()

    senders = [threading.Thread(target=send, daemon=True) for _ in range(threads)]
    for sender in senders:
        sender.start()
    while (message := inbox.get()) is not None:
        kind, payload = message
        if kind == "bodies":
            bodies.update(payload)
        else:
            work.put(payload)
    for _ in senders:
        work.put(None)
    for sender in senders:
        sender.join()


class TritonReplicas:
    """What the load test calls of a ReplicaSet (``submit``, ``stats``, a context), served by a real Triton
    Inference Server: the repository ``hstu-export serving-repo`` writes for the package (per device
    --serve's N instances, each through --runtime; with the cache, routed by user and cached per instance), run
    by nvidia-pytriton's bundled ``tritonserver`` (tests/triton_server.py) limited to ``devices`` by
    CUDA_VISIBLE_DEVICES. Queries go over HTTP with binary tensors, one user each, from --client-threads
    threads, each with its own keep-alive connection (a window's bodies are encoded before it is timed); a user
    the server holds no sequence for is sent again with the START flag (docs/SERVING.md's client protocol)."""

    MODEL = "ranker"

    def __init__(self, package: Path, devices: list[str], per_device: int, cached: bool, runtime: str,
                 args: argparse.Namespace, workdir: Path) -> None:
        self.package, self.devices, self.cached, self.args = package, devices, cached, args
        self.workdir = workdir
        gpus = sorted({torch.device(d).index or 0 for d in devices}) if devices[0].startswith("cuda") else []
        self.settings = ServingRepoSettings(
            name=self.MODEL, max_requests_per_batch=args.max_batch,
            max_queue_delay_us=int(args.queue_delay_ms * 1000),
            instances=per_device if gpus else per_device * len(devices),
            kv_cache_budget=args.kv_budget if cached else None, max_sequences=args.max_sequences or max(1024, 2 * args.users),
            kv_max_time_drift=args.max_time_drift if cached else 0,
            kv_cuda_graphs=args.kv_graphs if cached else "auto", runtime=runtime, host_threads=args.host_threads)
        self.env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {}
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.server: TritonServer | None = None
        self.monitor: HttpInference | None = None
        self.refused_starts, self.counting = 0, threading.Lock()
        self.bodies: dict[int, tuple[bytes, int]] = {}
        # --client-processes: the senders in processes of their own, each query's body handed over before
        # its window (``prepare``), so that this process only schedules.
        self.processes: list[Any] = []
        self.inboxes: list[Any] = []
        self.outbox: Any = None
        self.keys: dict[int, tuple[int, int]] = {}  # id(request) -> (process, key)
        self.futures: dict[int, concurrent.futures.Future] = {}
        self.next_key = itertools.count()

    def __enter__(self) -> TritonReplicas:
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        write_serving_repo(self.package, self.workdir / "repo", self.settings)
        self.server = TritonServer(self.workdir / "repo", self.workdir, env=self.env)
        self.server.start()
        self.monitor = HttpInference(self.server.http_url, self.MODEL)
        count = self.args.client_processes
        if not count:
            for _ in range(self.args.client_threads):
                thread = threading.Thread(target=self._send, daemon=True)
                thread.start()
                self.threads.append(thread)
            return self
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.outbox = context.Queue()
        for _ in range(count):
            inbox = context.Queue()
            process = context.Process(target=_client_process, daemon=True,
                                      args=(self.server.http_url, self.MODEL,
                                            max(1, self.args.client_threads // count), inbox, self.outbox))
            process.start()
            self.inboxes.append(inbox)
            self.processes.append(process)
        reader = threading.Thread(target=self._read_answers, daemon=True)
        reader.start()
        self.threads.append(reader)
        return self

    def _read_answers(self) -> None:
        while (message := self.outbox.get()) is not None:
            key, stamp, error, started = message
            future = self.futures.pop(key)
            future.done_at = stamp  # type: ignore[attr-defined]
            if started:
                with self.counting:
                    self.refused_starts += 1
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(InferenceRefused(error))

    def __exit__(self, *exc: object) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for process in self.processes:
            process.join(timeout=60)
        if self.outbox is not None:
            self.outbox.put(None)
        else:
            for _ in self.threads:
                self.queue.put(None)
        for thread in self.threads:
            thread.join(timeout=60)
        if self.monitor is not None:
            self.monitor.close()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)  # the repository holds a copy of the package

    def prepare(self, queries: list) -> None:
        """Encodes the queries' bodies now, before they are timed: the senders then only post them."""
        assert self.monitor is not None
        encoded = {id(request): self.monitor.encode(request, uid if self.cached else None) for request, uid in queries}
        if not self.processes:
            self.bodies = encoded
            return
        self.keys = {}
        handed: list[dict[int, tuple[bytes, int]]] = [{} for _ in self.processes]
        for index, (request, _) in enumerate(queries):
            where = (index % len(self.processes), next(self.next_key))
            self.keys[id(request)] = where
            handed[where[0]][where[1]] = encoded[id(request)]
        for inbox, bodies in zip(self.inboxes, handed):
            inbox.put(("bodies", bodies))

    def submit(self, request: dict[str, torch.Tensor], users: list[int] | None = None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        user = users[0] if users else None
        if not self.processes:
            self.queue.put((request, user, future))
            return future
        where = self.keys.pop(id(request), None)
        if where is None:  # not prepared (the warm-up): its body goes with it
            assert self.monitor is not None
            where = (next(self.next_key) % len(self.processes), next(self.next_key))
            self.inboxes[where[0]].put(("bodies", {where[1]: self.monitor.encode(request, user)}))
        self.futures[where[1]] = future
        self.inboxes[where[0]].put(("send", (where[1], user)))
        return future

    def _send(self) -> None:
        assert self.server is not None
        client = HttpInference(self.server.http_url, self.MODEL)
        try:
            while (item := self.queue.get()) is not None:
                request, user, future = item
                try:
                    future.set_result(self._infer(client, request, user))
                except Exception as exc:  # the query's failure, counted by the window
                    future.set_exception(exc)
        finally:
            client.close()

    def _infer(self, client: HttpInference, request: dict[str, torch.Tensor], user: int | None) -> Any:
        answer, started = _post_as_user(client, self.bodies.get(id(request)) or client.encode(request, user), user)
        if started:
            with self.counting:
                self.refused_starts += 1
        return answer

    def stats(self) -> list[dict[str, Any]]:
        """One entry for the server, in ReplicaSet.stats()'s terms: its requests (one user each) as users, its
        executions as calls, the instances' compute time summed as busy seconds; with the cache, the
        instances' counters (Triton's metrics) summed."""
        assert self.monitor is not None and self.server is not None
        model = self.monitor._get(f"/v2/models/{self.MODEL}/stats")["model_stats"][0]
        busy = sum(int(b["compute_infer"]["ns"]) for b in model.get("batch_stats", []))  # per execution
        entry: dict[str, Any] = {"users": int(model["inference_count"]), "calls": int(model["execution_count"]),
                                 "busy_seconds": busy / 1e9, "refused_starts": self.refused_starts}
        # Per request, summed: waiting in the scheduler's queue, and the phases of the execution it was in.
        phases = model.get("inference_stats", {})
        entry["request_seconds"] = {key: int(phases.get(key, {}).get("ns", 0)) / 1e9
                                    for key in ("queue", "compute_input", "compute_infer", "compute_output")}
        if self.cached:
            samples = self.server.metrics()
            entry["kv_cache"] = {key: sum(samples.get(f"hstu_kv_cache_{key}", {}).values())
                                 for key in ("hits", "misses", "stale", "evictions", "bypassed")}
        return [entry]

    def check_answers(self, queries: list) -> dict[str, Any]:
        """Each query sent alone (nothing to batch it with), its answer compared with ``hstu_export.load`` of
        the package on the first device: how many were equal bit for bit, and the largest difference."""
        assert self.server is not None
        local = hstu_export.load(self.package)  # on the current device: the first one
        client = HttpInference(self.server.http_url, self.MODEL)
        equal, worst = 0, 0.0
        try:
            for request, _ in queries:
                answer = client.infer(request)
                expected = to_host(local(request))
                equal += all(torch.equal(answer[n], expected[n]) for n in expected)
                worst = max(worst, *(float((answer[n].float() - expected[n].float()).abs().max()) for n in expected))
        finally:
            client.close()
        return {"queries": len(queries), "bit_equal": equal, "max_abs_difference": worst}


def run_window(replicas: ReplicaSet, queries: list, rate: float, cached: bool, gpus: list[int]) -> dict[str, Any]:
    """Sends ``queries`` at Poisson arrivals of ``rate`` per second; latency from each scheduled arrival.
    The queries were made before: objects that live until the window ends are frozen out of the garbage
    collector's scans (as a server does after start-up), and the collections that still run are recorded."""
    rng = np.random.default_rng(len(queries))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(queries)))
    done = [math.nan] * len(queries)
    sent = np.zeros(len(queries))
    failed = [0]
    before = replicas.stats()
    gc.collect()
    gc.freeze()

    left = [len(queries)]
    count = threading.Lock()
    finished = threading.Event()

    def finisher(i: int):  # type: ignore[no-untyped-def]
        def finish(future) -> None:  # type: ignore[no-untyped-def]
            done[i] = getattr(future, "done_at", None) or time.perf_counter()  # a client process's own stamp
            with count:
                failed[0] += future.exception() is not None
                left[0] -= 1
                if left[0] == 0:
                    finished.set()
        return finish

    # The futures are not kept: answered queries' objects die at once, as in a server, instead of piling up
    # for the garbage collector's full collections to scan (pauses of 40-80 ms at 7,000 queries/s).
    with Utilisation(gpus) as util, GcPauses() as pauses:
        start = time.perf_counter()
        i = 0
        while i < len(queries):
            now = time.perf_counter() - start
            while i < len(queries) and arrivals[i] <= now:
                request, uid = queries[i]
                sent[i] = time.perf_counter() - start
                replicas.submit(request, [uid] if cached else None).add_done_callback(finisher(i))
                i += 1
            if i < len(queries):
                time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        finished.wait()
        elapsed = max(done) - start
    gc.unfreeze()
    unsorted = (np.array(done) - start - arrivals) * 1e3
    latency = np.sort(unsorted)
    lag = (sent - arrivals) * 1e3
    after = replicas.stats()
    row: dict[str, Any] = {
        "offered_qps": round(rate, 1), "queries": len(queries), "achieved_qps": round(len(queries) / elapsed, 1),
        "p50_ms": round(float(np.percentile(latency, 50)), 2), "p99_ms": round(float(np.percentile(latency, 99)), 2),
        "failed": failed[0], "gpu_utilisation_pct": util.mean(),
        "p99_ms_by_tenth": [round(float(np.percentile(part, 99)), 1) for part in np.array_split(unsorted, 10)],
        "send_lag_ms": {"p99": round(float(np.percentile(lag, 99)), 2), "max": round(float(lag.max()), 2)},
        "gc": pauses.summary(),
        "worker_busy": [round((a["busy_seconds"] - b["busy_seconds"]) / elapsed, 3) for a, b in zip(after, before)],
        "users_per_call": [round((a["users"] - b["users"]) / max(1, a["calls"] - b["calls"]), 1)
                           for a, b in zip(after, before)],
    }
    if all("request_seconds" in a for a in after):  # the server's own split of a request's time
        requests = max(1, sum(a["users"] - b["users"] for a, b in zip(after, before)))
        row["server_ms_per_request"] = {
            key: round(sum(a["request_seconds"][key] - b["request_seconds"][key] for a, b in zip(after, before))
                       * 1e3 / requests, 3) for key in after[0]["request_seconds"]}
    if cached:
        keys = ("hits", "misses", "stale", "evictions", "bypassed")
        row["kv"] = {k: sum(a["kv_cache"][k] - b["kv_cache"][k] for a, b in zip(after, before)) for k in keys}
        served = sum(row["kv"][k] for k in ("hits", "misses", "stale", "bypassed"))
        row["kv"]["hit_share"] = round(row["kv"]["hits"] / max(1, served), 3)
    return row


def saturation(replicas: ReplicaSet, queries: list, cached: bool) -> float:
    """Queries/s with every query queued at once (closed loop, the batches full)."""
    start = time.perf_counter()
    futures = [replicas.submit(r, [u] if cached else None) for r, u in queries]
    for future in futures:
        future.result()
    return len(queries) / (time.perf_counter() - start)


def direct_calls(replicas: ReplicaSet, queries: list, repeat: int = 20) -> dict[str, float]:
    """The first replica's predictor called directly with ``queries`` combined into one request (no queue, no
    batching, no worker): p50 and p90 of ``repeat`` calls in ms, the answers on the host."""
    replica = replicas.replicas[0]
    request = combine([r for r, _ in queries], replica.schema.names)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        to_host(replica.predictor(request))
        times.append((time.perf_counter() - start) * 1e3)
    return {"users": len(queries), "p50": round(float(np.percentile(times, 50)), 3),
            "p90": round(float(np.percentile(times, 90)), 3)}


def profile_workers(replicas: ReplicaSet, out: Path) -> Any:
    """A cProfile of the first replica's worker calls, one call at a time (enabled around each; from Python
    3.12 a profile sees every thread while it is on, and only one can be on: a call that starts while another
    is profiled runs unprofiled); returns a function that writes its statistics, top 40 by cumulative time,
    under ``out``."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    replica = replicas.replicas[0]
    inner = replica._run
    one = threading.Lock()

    def run(batch):  # type: ignore[no-untyped-def]
        if not one.acquire(blocking=False):
            return inner(batch)
        profile.enable()
        try:
            return inner(batch)
        finally:
            profile.disable()
            one.release()
    replica._run = run  # type: ignore[method-assign]

    def write(tag: str) -> None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
        (out / f"profile_{tag}.txt").write_text(text.getvalue())
    return write


def serve_mode(text: str) -> tuple[str, int]:
    """``threads``, ``processes`` or ``triton``, with ``:N`` replicas (Triton instances) per GPU."""
    mode, _, count = text.partition(":")
    if mode not in ("threads", "processes", "triton") or not (count or "1").isdigit() or int(count or 1) < 1:
        raise argparse.ArgumentTypeError(f"--serve takes threads[:N], processes[:N] or triton[:N], got {text!r}")
    return mode, int(count or 1)


def sweep(args: argparse.Namespace, package: Path, cfg: Any, devices: list[str], cached: bool,
          serve: tuple[str, int], workers: int, runtime: str, out: dict[str, Any], save: Any) -> None:
    """Fills ``out`` with the configuration's results, calling ``save`` after each window."""
    work = Workload(args, cfg)
    gpus = [torch.device(d).index or 0 for d in devices] if devices[0].startswith("cuda") else []
    mode, per_device = serve
    out.update({"devices": devices, "cache": cached, "serve": f"{mode}:{per_device}", "workers": workers,
                "runtime": runtime,
                "kv_graphs": args.kv_graphs if cached else None, "rates": []})
    kv_bytes = args.kv_budget if cached else None
    graphs = {"auto": None, "on": True, "off": False}[args.kv_graphs]
    t = time.perf_counter()
    served: Any
    if mode == "triton":
        out["instance_host_threads"] = args.host_threads or "serving-repo's default"
        served = TritonReplicas(package, devices, per_device, cached, runtime, args,
                                Path(tempfile.mkdtemp(prefix="triton-load-")))
    else:
        served = ReplicaSet(package, [d for d in devices for _ in range(per_device)], kv_cache_bytes=kv_bytes,
                            max_batch_users=args.max_batch, max_queue_delay_ms=args.queue_delay_ms,
                            max_time_drift=args.max_time_drift, kv_cuda_graphs=graphs, workers=workers,
                            processes=mode == "processes", runtime=runtime)
    with served as replicas:
        out["start_seconds"] = round(time.perf_counter() - t, 2)

        def closed_loop(queries: list) -> float:
            if mode == "triton":  # bodies encoded before the clock starts, as for a window
                replicas.prepare(queries)
            return saturation(replicas, queries, cached)

        pool: list | None = None
        if cached:  # every pool user seen once: the cache filled before anything is timed
            pool = [work.new_user() for _ in range(args.users)]
            t = time.perf_counter()
            closed_loop([(work.request(u), u.uid) for u in pool])
            out["prefill_seconds"] = round(time.perf_counter() - t, 2)
        warm = work.queries(args.saturation_queries * len(devices), pool)
        closed_loop(warm)  # warm-up: every worker's first calls, the allocator's growth
        if mode == "threads" and not cached:
            out["call_ms"] = direct_calls(replicas, warm[: args.max_batch])
        if mode == "triton" and not cached:
            out["answers"] = replicas.check_answers(warm[: 4 * len(devices)])
        write_profiles = profile_workers(replicas, args.out) if args.profile and mode == "threads" else None
        out["saturation_qps"] = sat = round(closed_loop(work.queries(args.saturation_queries * len(devices), pool)), 1)
        passed = None
        # --rates: offered rates per device as given; otherwise shares of the closed-loop estimate.
        offered = [(None, r * len(devices)) for r in args.rates] if args.rates else [(x, x * sat) for x in args.shares]
        for share, rate in offered:
            queries = work.queries(max(50, int(rate * args.seconds)), pool)
            if mode == "triton":
                replicas.prepare(queries)
            row = run_window(replicas, queries, rate, cached, gpus)
            row["share_of_saturation"] = share
            out["rates"].append(row)
            save()
            print(json.dumps({"devices": len(devices), "cache": cached, "serve": out["serve"], "workers": workers,
                              "runtime": runtime, **row}), flush=True)
            if row["p99_ms"] <= P99_BOUND_MS and not row["failed"]:
                passed = row
            elif passed is not None:
                break
        if write_profiles is not None:
            write_profiles(f"{len(devices)}gpu_cache_{'on' if cached else 'off'}_{mode}{per_device}_{workers}workers_"
                           f"{runtime}")
        out["best"] = passed
        out["best_qps_per_device"] = round(passed["achieved_qps"] / len(devices), 1) if passed else None
        out["replicas"] = replicas.stats()
        if mode == "triton":  # the server's log (its end), beside the results
            log = replicas.server.log_path.read_text(errors="replace")[-200_000:]
            (args.out / f"tritonserver_{len(devices)}gpu_cache_{'on' if cached else 'off'}_{runtime}.log").write_text(log)


def export_package(args: argparse.Namespace, cfg: Any, device: str) -> tuple[Path, float]:
    torch.manual_seed(0)
    model = HstuRankingModel(cfg).eval()
    root = args.keep or Path(tempfile.mkdtemp(prefix="load-"))
    root.mkdir(parents=True, exist_ok=True)
    example = hstu_export.generate_batch(model.input_schema(), 2, seed=1)
    bundle = hstu_export.save_bundle(model, root / "m.pt", example)
    settings = hstu_export.ExportSettings(
        backend="aoti", device=device, dtype="bf16" if device == "cuda" else "fp32",
        op_target="triton" if device == "cuda" else "aten", max_batch_size=args.max_batch, kv_cache=True,
        kv_page_size=64, verify=hstu_export.VerifySettings(num_random_batches=1))
    t = time.perf_counter()
    result = hstu_export.export(bundle, root / "m.aoti", settings)
    return Path(result.path), time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--package", type=Path, help="serve this dlrmv3 package instead of exporting one")
    parser.add_argument("--keep", type=Path, help="export into this folder (its m.aoti: --package of later runs)")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="GPU counts to serve on")
    parser.add_argument("--cache", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--serve", type=serve_mode, nargs="+", default=[("threads", 1)],
                        help="where the replicas run, each tried: threads[:N] (N replicas a GPU in this process), "
                             "processes[:N] (N replica processes a GPU) or triton[:N] (a real Triton server, N "
                             "instances a GPU, queries over HTTP; needs nvidia-pytriton's bundled tritonserver)")
    parser.add_argument("--client-threads", type=int, default=64,
                        help="with --serve triton: threads sending queries, each with its own connection")
    parser.add_argument("--client-processes", type=int, default=0,
                        help="with --serve triton: send from this many processes (--client-threads shared among "
                             "them), each window's bodies handed to them before it starts; 0: threads of this process")
    parser.add_argument("--max-sequences", type=int,
                        help="with --serve triton and the cache: users an instance holds a sequence slot for "
                             "[default: twice --users, at least 1024: room for the first-time users too]; users beyond "
                             "the slots wait in Triton's backlog until a user idles out (60 s)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1],
                        help="worker threads per replica to try (ReplicaSet's workers)")
    parser.add_argument("--runtime", nargs="+", choices=["python", "native"], default=["python"],
                        help="what serves each replica's calls, each tried: python (hstu_export.load) or native "
                             "(the C++ runtime's library, built by runtimes/cpp/build.sh)")
    parser.add_argument("--max-batch", type=int, default=32, help="users per call (the export's max batch)")
    parser.add_argument("--queue-delay-ms", type=float, default=2.0, help="a worker's wait for a fuller batch")
    parser.add_argument("--mean-history", type=float, default=1024)
    parser.add_argument("--candidates", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each open-loop window")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9, 0.95, 1.0],
                        help="offered rates, as shares of the closed-loop saturation rate")
    parser.add_argument("--rates", type=float, nargs="+",
                        help="offered rates in queries/s per device (GPU), instead of --shares")
    parser.add_argument("--saturation-queries", type=int, default=512)
    parser.add_argument("--users", type=int, default=2048, help="returning users' pool (cache on)")
    parser.add_argument("--new-users", type=float, default=0.05, help="share of first-time users (cache on)")
    parser.add_argument("--return-seconds", type=int, default=30)
    parser.add_argument("--max-time-drift", type=int, default=600)
    parser.add_argument("--kv-budget", default="40GiB", help="KV cache per GPU")
    parser.add_argument("--kv-graphs", choices=["auto", "on", "off"], default="off",
                        help="CUDA graphs of the cached path (auto: the package's default, on for CUDA)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--host-threads", type=int, help="torch.set_num_threads for the host's tensor work (with --serve triton, "
                        "each instance's too: serving-repo --host-threads)")
    parser.add_argument("--profile", action="store_true", help="cProfile the first replica's workers (threads only)")
    parser.add_argument("--export-only", action="store_true", help="export (into --keep) and stop")
    parser.add_argument("--small", action="store_true", help="tiny model and workload on CPU: checks the script")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.host_threads:
        torch.set_num_threads(args.host_threads)
    cfg = preset_config("dlrmv3")
    device = "cuda"
    if args.small:
        device = "cpu"
        cfg = dataclasses.replace(cfg, embedding_dim=32, attention_dim=16, linear_dim=16, num_layers=2,
                                  max_history_len=256, max_num_candidates=16, item_vocab_size=1000,
                                  task_hidden_dims=(16,))
        args.mean_history, args.candidates, args.max_batch = 100, 16, 4
        args.seconds, args.saturation_queries, args.users, args.kv_budget = 0.5, 16, 16, "64MiB"
        args.shares, args.gpus = [0.5, 0.9], [1, 2]
    else:
        cfg = dataclasses.replace(cfg, max_num_candidates=args.candidates)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                              "gpu_count": torch.cuda.device_count() if device == "cuda" else 0,
                              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                              "host_threads": torch.get_num_threads(),
                              "args": {k: str(v) for k, v in vars(args).items()}, "p99_bound_ms": P99_BOUND_MS,
                              "runs": []}

    def save() -> None:
        (args.out / "serving_load.json").write_text(json.dumps(report, indent=2))

    package = args.package
    if package is None:
        package, seconds = export_package(args, cfg, device)
        report["export_seconds"] = round(seconds, 1)
        save()
        if args.export_only:
            return
    for cache, count, serve, workers, runtime in itertools.product(args.cache, args.gpus, args.serve, args.workers,
                                                                   args.runtime):
        devices = [f"cuda:{i}" for i in range(count)] if device == "cuda" else ["cpu"] * count
        if device == "cuda" and count > torch.cuda.device_count():
            report["runs"].append({"devices": devices, "skipped": "not that many GPUs here"})
            continue
        run: dict[str, Any] = {}
        report["runs"].append(run)
        try:
            sweep(args, package, cfg, devices, cache == "on", serve, workers, runtime, run, save)
        except Exception as exc:  # recorded; the other configurations still run
            run.update({"devices": devices, "cache": cache, "serve": ":".join(map(str, serve)), "workers": workers,
                        "runtime": runtime,
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-3000:]})
        save()
        torch.cuda.empty_cache() if device == "cuda" else None
    print(json.dumps([{k: r.get(k) for k in ("devices", "cache", "serve", "workers", "runtime", "saturation_qps",
                                             "best_qps_per_device")}
                      for r in report["runs"]]), file=sys.stderr)


if __name__ == "__main__":
    main()
