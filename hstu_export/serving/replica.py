"""One package served on one device: a request queue and ``workers`` threads that batch what is queued into
as few package calls as the exported maximum batch size allows (``BatchingPredictor``), with its own KV cache
when asked. ``ReplicaSet`` (replicas.py) runs one per device, in this process or each in its own
(processes.py).

The workers share the loaded package (and cache): while one waits for its call's answers to come back from
the device, another checks, combines and launches the next call. Their calls go to the device's current
stream, in the order they were launched: a compiled program reuses its buffers from one call to the next,
so its calls must not run side by side on two streams.

``path`` may be a directory ``hstu-export publish`` writes: the replica then serves its current version and
follows it between calls (``PublishedPredictor``), except with a KV cache, which serves the version current
when it was made.

``runtime="native"``: the package is served by the C++ runtime (``NativePredictor``, native.py) instead of
``hstu_export.load``: the same answers, bit for bit, and the interpreter's lock is not held while a call runs,
so the workers' calls overlap on the host. Batching, routing and the futures stay in Python.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError
from hstu_export.package.publish import is_published_root
from hstu_export.runtimes.native import NativePredictor, check_runtime
from hstu_export.serving.batching import BatchingPredictor
from hstu_export.serving.published import PublishedPredictor

__all__ = ["Item", "Replica"]

_STOP = object()


@dataclass
class Item:
    """A queued request: its tensors, its users (and their ids, with a KV cache), and the future it is answered in."""

    request: Mapping[str, Tensor]
    users: int
    user_ids: list[Hashable] | None
    future: Future = field(default_factory=Future)


class Replica:
    """The package loaded on one device, served by ``workers`` threads over one queue (the module's text)."""

    def __init__(self, path: str | Path, device: torch.device, *, kv_cache_bytes: int | str | None,
                 max_time_drift: int, kv_cuda_graphs: bool | None, max_batch_users: int | None,
                 max_queue_delay_ms: float, host_outputs: bool, workers: int,
                 tables_device: str | None = None, runtime: str = "python") -> None:
        import hstu_export

        check_runtime(runtime)
        self.device = device
        guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with guard:
            # A publish root is followed (switching between calls) unless a KV cache holds the version's K/V.
            follow = kv_cache_bytes is None and is_published_root(Path(path))
            predictor: Any
            if runtime == "native":
                predictor = NativePredictor(path, device=device, tables_device=tables_device,
                                            follow_seconds=1.0 if follow else None)
            elif follow:
                predictor = PublishedPredictor(path, tables_device=tables_device)
            else:
                predictor = hstu_export.load(path, tables_device=tables_device)
            if predictor.device.type != device.type:
                raise ConfigError(f"{path} is a {predictor.device.type} package; it cannot be served on {device}")
            self.ranker = (predictor.kv_cache(kv_cache_bytes, max_time_drift=max_time_drift,
                                              cuda_graphs=kv_cuda_graphs)
                           if kv_cache_bytes is not None else None)
        self.predictor = predictor
        self.schema = predictor.input_schema
        self.serving = True  # as ProcessReplica's (a replica in this process ends only with it)
        self.batcher = BatchingPredictor(predictor, self.ranker, host_outputs=host_outputs)
        self.max_users = min(max_batch_users or predictor.max_batch_size, predictor.max_batch_size)
        self.delay = max_queue_delay_ms / 1e3
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.waiting_users = 0  # users queued, for routing (read without the lock: a hint)
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "users": 0, "calls": 0, "errors": 0}
        self.busy_seconds = 0.0  # summed over the workers
        self._held: Item | None = None
        self._take = threading.Lock()  # one worker at a time takes a batch off the queue
        self._threads = [threading.Thread(target=self._serve, name=f"replica-{device}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def put(self, item: Item) -> None:
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

    def _next_batch(self) -> list[Item] | None:
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

    def _run(self, batch: list[Item]) -> None:
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
