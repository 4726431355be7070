"""One package served from several devices: a replica per device, each with its own request queue, worker
threads that batch what is queued into as few package calls as the exported maximum batch size allows, and,
when asked, its own KV cache (replica.py says how a replica works).

    with ReplicaSet("model.aoti", ["cuda:0", "cuda:1"], kv_cache_bytes="40GiB") as replicas:
        answer = replicas.submit(request, user_ids=[17]).result()

Where the replicas run: in this process (threads), or with ``processes=True`` each in a process of its own
(processes.py), so that no two replicas share one Python interpreter and its lock (docs/SERVING.md says what
each measured). A device named twice gets two replicas: as processes, two processes sharing that device.

Routing: with a KV cache a request goes to the replica its first user belongs to (a stable function of
the id), so a returning user reaches the cache that holds its rows; a request of several users is cached
whole on that replica. Without a cache it goes to the replica with the fewest users waiting. Every
replica loads the package's tables onto its own device (they are part of the package's sparse artifact).

A bad request fails alone (``BatchingPredictor``: a batched call that fails runs its requests again one by
one).
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, HstuExportError, RequestError
from hstu_export.runtimes.native import check_runtime
from hstu_export.serving.batching import batch_size
from hstu_export.serving.kv_cache import user_keys
from hstu_export.serving.processes import ProcessReplica
from hstu_export.serving.replica import Item, Replica
from hstu_export.settings import check_whole_number

__all__ = ["ReplicaSet", "replica_of"]


def replica_of(user: Hashable, count: int) -> int:
    """The replica that serves ``user`` among ``count``: the same in every process (no salted hash)."""
    if isinstance(user, int):
        return user % count
    return zlib.crc32(repr(user).encode()) % count


class ReplicaSet:
    """The package at ``path`` served on each of ``devices`` (``"cuda:0"``, ``"cpu"``, ...; a device named
    twice gets two replicas). ``kv_cache_bytes``: a KV cache of that size per replica (the package must be
    exported with ``--kv-cache``), and requests then name their users; ``max_time_drift`` and
    ``kv_cuda_graphs`` (its ``cuda_graphs``) as :meth:`Predictor.kv_cache` takes them. ``max_batch_users``: most users per
    call (default and ceiling: the package's maximum batch size). ``max_queue_delay_ms``: how long a worker
    holding fewer users than that waits for more before it calls. ``host_outputs``: answers are moved to the
    host (as a server sends them), else left on the replica's device. ``tables_device``: where each replica keeps
    the tables stored beside a compiled sparse half (``hstu_export.load``'s; ``"cpu"``: pinned host memory, one
    copy per replica). ``workers``: threads per replica
    (replica.py); more than one can help while the interpreter has time to spare. ``processes``: each replica
    in a process of its own (processes.py; docs/SERVING.md gives the measurements of both). ``runtime``:
    ``"python"`` (``hstu_export.load``) or ``"native"``: each replica's calls run in the C++ runtime
    (replica.py)."""

    def __init__(self, path: str | Path, devices: Sequence[str | torch.device], *,
                 kv_cache_bytes: int | str | None = None, max_time_drift: int = 0,
                 kv_cuda_graphs: bool | None = None, max_batch_users: int | None = None, max_queue_delay_ms: float = 0.0,
                 host_outputs: bool = True, workers: int = 1, processes: bool = False,
                 tables_device: str | None = None, runtime: str = "python") -> None:
        if not devices:
            raise ConfigError("ReplicaSet needs at least one device")
        workers = check_whole_number(workers, "workers", 1)
        if max_queue_delay_ms < 0:
            raise ConfigError(f"max_queue_delay_ms must be 0 or more, got {max_queue_delay_ms}")
        check_runtime(runtime)
        parsed = [_device(d) for d in devices]
        options: dict[str, Any] = dict(kv_cache_bytes=kv_cache_bytes, max_time_drift=max_time_drift,
                                       kv_cuda_graphs=kv_cuda_graphs, max_batch_users=max_batch_users,
                                       max_queue_delay_ms=max_queue_delay_ms, host_outputs=host_outputs,
                                       workers=workers, tables_device=tables_device, runtime=runtime)
        self.replicas: list[Replica | ProcessReplica] = []
        try:
            if processes:  # all start at once (each imports torch and loads the package), then are waited for
                started = [ProcessReplica(path, device, **options) for device in parsed]
                self.replicas.extend(started)
                for replica in started:
                    replica.wait_ready()
            else:
                for device in parsed:
                    self.replicas.append(Replica(path, device, **options))
        except BaseException:
            self.close()
            raise
        self.cached = kv_cache_bytes is not None
        self.schema = self.replicas[0].schema

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
        item = Item(request, users, ids)
        if ids is not None:  # the user's replica even if it has ended: its cache is nowhere else
            target = self.replicas[replica_of(ids[0], len(self.replicas))]
        else:  # a replica whose process ended is passed over while another serves
            serving = [r for r in self.replicas if r.serving] or self.replicas
            target = min(serving, key=lambda r: r.waiting_users)
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
