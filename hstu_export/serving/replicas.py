"""One package served from several devices: a replica per device, each with its own request queue, a
worker thread that batches what is queued into as few package calls as the exported maximum batch size
allows, and, when asked, its own KV cache.

    with ReplicaSet("model.aoti", ["cuda:0", "cuda:1"], kv_cache_bytes="40GiB") as replicas:
        answer = replicas.submit(request, user_ids=[17]).result()

Each replica runs ``workers`` threads over its queue, sharing its loaded package (and cache): while one
waits for its call's answers to come back from the device, another checks, combines and launches the next
call. Their calls go to the device's current stream, in the order they were launched: a compiled program
reuses its buffers from one call to the next, so its calls must not run side by side on two streams.

Routing: with a KV cache a request goes to the replica its first user belongs to (a stable function of
the id), so a returning user reaches the cache that holds its rows; a request of several users is cached
whole on that replica. Without a cache it goes to the replica with the fewest users waiting. Every
replica loads the package's tables onto its own device (they are part of the package's sparse artifact).

``path`` may be a directory ``hstu-export publish`` writes: each replica then serves its current version and
follows it between calls (``PublishedPredictor``), except with a KV cache, which serves the version current
when it was made.

A bad request fails alone (``BatchingPredictor``: a batched call that fails runs its requests again one by
one).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import zlib
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, HstuExportError, RequestError
from hstu_export.package.publish import is_published_root
from hstu_export.serving.batching import BatchingPredictor, batch_size
from hstu_export.serving.kv_cache import user_keys
from hstu_export.serving.published import PublishedPredictor

__all__ = ["Replica", "ReplicaSet", "replica_of"]

_STOP = object()


def replica_of(user: Hashable, count: int) -> int:
    """The replica that serves ``user`` among ``count``: the same in every process (no salted hash)."""
    if isinstance(user, int):
        return user % count
    return zlib.crc32(repr(user).encode()) % count


@dataclass
class _Item:
    request: Mapping[str, Tensor]
    users: int
    user_ids: list[Hashable] | None
    future: Future = field(default_factory=Future)


class Replica:
    """The package loaded on one device, served by one worker thread."""

    def __init__(self, path: str | Path, device: torch.device, *, kv_cache_bytes: int | str | None,
                 max_time_drift: int, kv_cuda_graphs: bool | None, max_batch_users: int | None,
                 max_queue_delay_ms: float, host_outputs: bool, workers: int) -> None:
        import hstu_export

        self.device = device
        guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with guard:
            # A publish root is followed (switching between calls) unless a KV cache holds the version's K/V.
            follow = kv_cache_bytes is None and is_published_root(Path(path))
            predictor = PublishedPredictor(path) if follow else hstu_export.load(path)
            if predictor.device.type != device.type:
                raise ConfigError(f"{path} is a {predictor.device.type} package; it cannot be served on {device}")
            self.ranker = (predictor.kv_cache(kv_cache_bytes, max_time_drift=max_time_drift,
                                              cuda_graphs=kv_cuda_graphs)
                           if kv_cache_bytes is not None else None)
        self.predictor = predictor
        self.batcher = BatchingPredictor(predictor, self.ranker, host_outputs=host_outputs)
        self.max_users = min(max_batch_users or predictor.max_batch_size, predictor.max_batch_size)
        self.delay = max_queue_delay_ms / 1e3
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.waiting_users = 0  # users queued, for routing (read without the lock: a hint)
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "users": 0, "calls": 0, "errors": 0}
        self.busy_seconds = 0.0  # summed over the workers
        self._held: _Item | None = None
        self._take = threading.Lock()  # one worker at a time takes a batch off the queue
        self._threads = [threading.Thread(target=self._serve, name=f"replica-{device}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def put(self, item: _Item) -> None:
        with self._lock:
            self.waiting_users += item.users
        self.queue.put(item)

    def stop(self) -> None:
        for _ in self._threads:  # each worker ends on the first stop it takes
            self.queue.put(_STOP)
        for thread in self._threads:
            thread.join()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"device": str(self.device), "workers": len(self._threads), **self._counts,
                                   "busy_seconds": round(self.busy_seconds, 6)}
        if self.ranker is not None:
            out["kv_cache"] = self.ranker.cache.stats()
        return out

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._take:
                batch = self._next_batch()
            if batch is None:
                return
            start = time.perf_counter()
            self._run(batch)
            with self._lock:
                self.busy_seconds += time.perf_counter() - start
                self.waiting_users -= sum(item.users for item in batch)

    def _next_batch(self) -> list[_Item] | None:
        """The oldest waiting requests whose users fit one call; waits up to the queue delay for more."""
        first = self._held if self._held is not None else self.queue.get()
        self._held = None
        if first is _STOP:
            return None
        batch, users = [first], first.users
        deadline = time.perf_counter() + self.delay
        while users < self.max_users:
            try:
                left = deadline - time.perf_counter()
                item = self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP or users + item.users > self.max_users:
                self._held = item  # starts the next batch (or stops the worker after this one)
                break
            batch.append(item)
            users += item.users
        return batch

    def _run(self, batch: list[_Item]) -> None:
        requests = [item.request for item in batch]
        try:
            if self.ranker is None:
                results = self.batcher(requests)
            else:
                results = self.batcher(requests, [item.user_ids or [] for item in batch])
        except Exception as exc:  # the call itself failed (a device error): its requests get it, the worker goes on
            results = [exc] * len(batch)  # type: ignore[list-item]
        with self._lock:
            self._counts["calls"] += 1
            self._counts["requests"] += len(batch)
            self._counts["users"] += sum(item.users for item in batch)
            self._counts["errors"] += sum(isinstance(r, Exception) for r in results)
        for item, result in zip(batch, results):
            if isinstance(result, Exception):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)


class ReplicaSet:
    """The package at ``path`` served on each of ``devices`` (``"cuda:0"``, ``"cpu"``, ...; a device named
    twice gets two replicas). ``kv_cache_bytes``: a KV cache of that size per replica (the package must be
    exported with ``--kv-cache``), and requests then name their users; ``max_time_drift`` and
    ``kv_cuda_graphs`` (its ``cuda_graphs``) as :meth:`Predictor.kv_cache` takes them. ``max_batch_users``: most users per
    call (default and ceiling: the package's maximum batch size). ``max_queue_delay_ms``: how long a worker
    holding fewer users than that waits for more before it calls. ``host_outputs``: answers are moved to the
    host (as a server sends them), else left on the replica's device. ``workers``: threads per replica (see
    the module's text); more than one can help while the interpreter has time to spare (docs/SERVING.md
    gives the measurements)."""

    def __init__(self, path: str | Path, devices: Sequence[str | torch.device], *,
                 kv_cache_bytes: int | str | None = None, max_time_drift: int = 0,
                 kv_cuda_graphs: bool | None = None, max_batch_users: int | None = None, max_queue_delay_ms: float = 0.0,
                 host_outputs: bool = True, workers: int = 1) -> None:
        if not devices:
            raise ConfigError("ReplicaSet needs at least one device")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers must be a whole number, 1 or more, got {workers!r}")
        if max_queue_delay_ms < 0:
            raise ConfigError(f"max_queue_delay_ms must be 0 or more, got {max_queue_delay_ms}")
        parsed = [_device(d) for d in devices]
        self.replicas: list[Replica] = []
        try:
            for device in parsed:
                self.replicas.append(Replica(path, device, kv_cache_bytes=kv_cache_bytes,
                                             max_time_drift=max_time_drift, kv_cuda_graphs=kv_cuda_graphs,
                                             max_batch_users=max_batch_users,
                                             max_queue_delay_ms=max_queue_delay_ms, host_outputs=host_outputs,
                                             workers=workers))
        except BaseException:
            self.close()
            raise
        self.cached = kv_cache_bytes is not None
        self.schema = self.replicas[0].predictor.input_schema

    def submit(self, request: Mapping[str, Tensor], user_ids: Sequence[Hashable] | Tensor | None = None) -> Future:
        """Queues ``request``; the future holds its outputs, or the HstuExportError that refused it (or the
        error of a call that failed on the device)."""
        if not self.replicas:
            raise ConfigError("this ReplicaSet is closed")
        try:
            users = self._users(request)
            ids = None
            if self.cached:
                if user_ids is None:
                    raise RequestError("this ReplicaSet serves through a KV cache: pass user_ids, one per user")
                ids = user_keys(user_ids)
                if len(ids) != users:
                    raise RequestError(f"{len(ids)} user ids for a request of {users} users")
        except HstuExportError as exc:
            refused: Future = Future()
            refused.set_exception(exc)
            return refused
        item = _Item(request, users, ids)
        if ids is not None:
            target = self.replicas[replica_of(ids[0], len(self.replicas))]
        else:
            target = min(self.replicas, key=lambda r: r.waiting_users)
        target.put(item)
        return item.future

    def __call__(self, request: Mapping[str, Tensor],
                 user_ids: Sequence[Hashable] | Tensor | None = None) -> dict[str, Tensor]:
        return self.submit(request, user_ids).result()

    def stats(self) -> list[dict[str, Any]]:
        return [replica.stats() for replica in self.replicas]

    def close(self) -> None:
        for replica in self.replicas:
            replica.stop()
        self.replicas = []

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _users(self, request: Mapping[str, Tensor]) -> int:
        if not isinstance(request, Mapping):
            raise RequestError(f"a request is a dict of named tensors, got {type(request).__name__}")
        try:
            return batch_size(self.schema.features, request)
        except (KeyError, StopIteration, AttributeError, IndexError):
            return 1  # validation on the replica names what is wrong


def _device(value: str | torch.device) -> torch.device:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"not a device: {value!r} ({exc})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{device} asked for, but this machine has no usable CUDA device")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{device} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise ConfigError(f"replicas run on cpu or cuda devices, got {device}")
    return device
