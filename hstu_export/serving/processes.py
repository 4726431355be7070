"""A replica in a process of its own (``ReplicaSet(..., processes=True)``).

Threads of one process share one Python interpreter, and with it one lock: measured on the dlrmv3 workload,
a replica's workers spend most of their time in Python (checking, combining and splitting requests,
launching the compiled program), so a second GPU served from the same process adds far less than a second
GPU's worth (docs/SERVING.md gives the figures). A process per replica gives each its own interpreter.

The process is a fresh interpreter (``sys.executable``, this process's ``sys.path``; not a fork, in which
CUDA cannot be used, and not multiprocessing's spawn, which would run the caller's main module again). It
loads the package itself and serves it with a :class:`~hstu_export.serving.replica.Replica`: its workers, its batching, its KV cache,
with as many torch CPU threads as the process that made it uses (``torch.set_num_threads`` before).
The process that submits only routes: it sends each request's tensors down a pipe as raw bytes and a
thread per replica reads the answers back into the requests' futures. An error raised in the replica
(a refused request, a failed call) reaches the request's future as the same exception type; one that
cannot travel arrives as a ``ServingError`` naming it. If the process ends, every request it holds fails
with a ``ServingError`` that says so, and so does every later request routed to it.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import HstuExportError, RequestError, ServingError
from hstu_export.serving.replica import Item, Replica

__all__ = ["ProcessReplica", "decode_tensors", "encode_tensors"]

_START_SECONDS = 600.0  # a package compiled for the first time on a device can take minutes to load
_STOP_SECONDS = 60.0
# A replica process's feeding thread blocks on the socket, then needs the interpreter lock to take the next
# request in, while a worker holds it preparing a call: at Python's default switch interval (5 ms) it waits
# up to that long for each request, and the workers starve for requests.
_SWITCH_SECONDS = 0.0005

Encoded = list[tuple[str, Any]]


def encode_tensors(tensors: Mapping[str, Any]) -> Encoded:
    """Named tensors as numpy arrays, which pickle as one copy of their bytes (a pickled tensor goes through
    torch.save, several times slower); a dtype numpy lacks (bf16) travels as its raw bytes with its dtype
    and shape."""
    out: Encoded = []
    for name, value in tensors.items():
        if not isinstance(value, Tensor):
            raise RequestError(f"request[{name!r}] is a {type(value).__name__}, not a tensor")
        value = value.detach().cpu()
        try:
            out.append((str(name), value.numpy()))
        except TypeError:  # no numpy twin
            raw = value.reshape(-1).contiguous().view(torch.uint8).numpy()
            out.append((str(name), (str(value.dtype).removeprefix("torch."), tuple(value.shape), raw)))
    return out


def decode_tensors(encoded: Encoded) -> dict[str, Tensor]:
    """The tensors :func:`encode_tensors` encoded, sharing the unpickled arrays' memory (no copy)."""
    out = {}
    for name, value in encoded:
        if isinstance(value, tuple):
            dtype_name, shape, raw = value
            out[name] = torch.from_numpy(raw).view(getattr(torch, dtype_name)).reshape(shape)
        else:
            out[name] = torch.from_numpy(value)
    return out


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (our errors, torch's RuntimeErrors), else a ServingError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return ServingError(f"{type(exc).__name__}: {exc}")


class ProcessReplica:
    """The package at ``path`` served on ``device`` by a Replica in a spawned process; ``options`` are
    Replica's keyword arguments. The constructor starts the process; :meth:`wait_ready` waits until it
    serves (or raises the error that stopped it)."""

    def __init__(self, path: str | Path, device: torch.device, **options: Any) -> None:
        self.device = device
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = f"from hstu_export.serving.processes import serve; serve({theirs.fileno()})"
        self._process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send_bytes(pickle.dumps((str(path), str(device), options, torch.get_num_threads())))
        self._send = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, int]] = {}
        self._ids = itertools.count(1)
        self._ended: str | None = None
        self._reader: threading.Thread | None = None
        self.waiting_users = 0  # users sent and not answered yet, for routing
        self.schema: Any = None
        self.pid = self._process.pid

    @property
    def serving(self) -> bool:
        """False once the process has ended (or was stopped)."""
        return self._ended is None

    def wait_ready(self, timeout: float = _START_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self._process.poll() is not None:
                raise ServingError(f"the replica process for {self.device} ended while starting "
                                   f"(exit code {self._process.returncode}); its output says why")
            if time.monotonic() > deadline:
                raise ServingError(f"the replica process for {self.device} did not start within {timeout:.0f} s")
        try:
            kind, _, body = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise ServingError(f"the replica process for {self.device} ended while starting "
                               f"(exit code {self._process.wait()})") from None
        if kind == "failed":
            raise body
        self.schema = body["schema"]
        self._reader = threading.Thread(target=self._read, name=f"replica-{self.device}-answers", daemon=True)
        self._reader.start()

    def put(self, item: Item) -> None:
        try:
            encoded = encode_tensors(item.request)
        except HstuExportError as exc:
            item.future.set_exception(exc)
            return
        with self._lock:
            if self._ended is not None:
                item.future.set_exception(ServingError(self._ended))
                return
            ident = next(self._ids)
            self._pending[ident] = (item.future, item.users)
            self.waiting_users += item.users
        body = {"request": encoded, "users": item.users, "user_ids": item.user_ids}
        self._post(pickle.dumps(("request", ident, body), protocol=5), ident)

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        future: Future = Future()
        with self._lock:
            if self._ended is not None:
                return {"device": str(self.device), "process": self.pid, "ended": self._ended}
            ident = next(self._ids)
            self._pending[ident] = (future, 0)
        self._post(pickle.dumps(("stats", ident, None)), ident)
        try:
            return {**future.result(timeout=timeout), "process": self.pid}
        except ServingError as exc:
            return {"device": str(self.device), "process": self.pid, "ended": str(exc)}

    def stop(self) -> None:
        """Serves what was sent, then ends the process (killed if it has not ended within a minute)."""
        if self._process.poll() is None:
            try:
                with self._send:
                    self._conn.send_bytes(pickle.dumps(("stop", 0, None)))
            except OSError:
                pass
            try:
                self._process.wait(_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._reader is not None:
            self._reader.join(_STOP_SECONDS)
        self._end(f"the replica process for {self.device} was stopped")
        self._conn.close()

    def _post(self, message: bytes, ident: int) -> None:
        try:
            with self._send:
                self._conn.send_bytes(message)
        except OSError:  # the process ended: the reader fails what it held; this one fails here
            with self._lock:
                entry = self._pending.pop(ident, None)
            if entry is not None:
                entry[0].set_exception(ServingError(self._ended or f"the replica process for {self.device} ended"))

    def _read(self) -> None:
        while True:
            try:
                kind, ident, body = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            with self._lock:
                entry = self._pending.pop(ident, None)
                if entry is None:  # failed already (the replica was being stopped)
                    continue
                future, users = entry
                self.waiting_users -= users
            if kind == "answer":
                future.set_result(decode_tensors(body))
            elif kind == "error":
                future.set_exception(body)
            else:  # stats
                future.set_result(body)
        try:
            code: int | None = self._process.wait(5.0)
        except subprocess.TimeoutExpired:
            code = None
        self._end(f"the replica process for {self.device} ended (exit code {code}); restart the ReplicaSet")

    def _end(self, reason: str) -> None:
        with self._lock:
            if self._ended is None:
                self._ended = reason
            pending, self._pending = self._pending, {}
            self.waiting_users = 0
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(ServingError(reason))


def serve(fd: int) -> None:
    """The replica process: reads the package, device and Replica options from the connection on ``fd``,
    loads the package, then serves requests from it until told to stop or the parent goes away."""
    conn = Connection(fd)
    send = threading.Lock()

    def reply(kind: str, ident: int, body: Any) -> None:
        data = pickle.dumps((kind, ident, body), protocol=5)
        with send:
            try:
                conn.send_bytes(data)
            except OSError:  # the parent is gone; the loop below ends on its side of the pipe
                pass

    try:
        path, device, options, threads = pickle.loads(conn.recv_bytes())
        torch.set_num_threads(threads)
        sys.setswitchinterval(_SWITCH_SECONDS)
        replica = Replica(path, torch.device(device), **options)
    except BaseException as exc:  # any failure to start is reported to the parent
        reply("failed", 0, _portable(exc))
        return
    reply("ready", 0, {"schema": replica.schema, "pid": os.getpid()})

    def answer(ident: int, future: Future) -> None:
        error = future.exception()
        if error is not None:
            reply("error", ident, _portable(error))
            return
        try:
            encoded = encode_tensors(future.result())
        except Exception as exc:  # an output that cannot travel fails its request, not the process
            reply("error", ident, _portable(exc))
            return
        reply("answer", ident, encoded)

    while True:
        try:
            kind, ident, body = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if kind == "stop":
            break
        if kind == "stats":
            reply("stats", ident, replica.stats())
            continue
        item = Item(decode_tensors(body["request"]), body["users"], body["user_ids"])
        item.future.add_done_callback(lambda future, ident=ident: answer(ident, future))
        replica.put(item)
    replica.stop()  # answers what was queued before the stop
    conn.close()
