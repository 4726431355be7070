"""A replica in a process of its own (``ReplicaSet(..., processes=True)``).

Threads of one process share one Python interpreter, and with it one lock; a process per replica gives each
its own. The process is a fresh interpreter (``sys.executable``, this process's ``sys.path``; not a fork, in
which CUDA cannot be used, and not multiprocessing's spawn, which would run the caller's main module again).
It loads the package itself and serves it with a :class:`~hstu_export.serving.replica.Replica` (its
workers, its batching, its KV cache), with as many torch CPU threads as the process that made it uses.

The process that submits only routes. Requests and answers cross a socket pair as numpy arrays (bf16 as raw
bytes), each way through a sending thread that sends whatever queued as one message, so ``submit`` never
waits for the replica process; a thread per replica reads the answers back into the requests' futures. An
error raised in the replica (a refused request, a failed call) reaches the request's future as the same
exception type; one that cannot travel arrives as a ``ServingError`` naming it. If the process ends, every
request it holds fails with a ``ServingError`` that says so, and so does every later request routed to it.

Measured (docs/SERVING.md): on CPU replicas two processes served twice what two threads did; on GPUs fewer.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
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
# A replica process's reading thread needs the interpreter lock to take requests in while a worker holds it
# preparing a call: at Python's default switch interval (5 ms) it could wait that long each time.
_SWITCH_SECONDS = 0.0005
_CLOSE = object()

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


class _Outbox:
    """Messages to the other process, sent by a thread of their own: whatever was queued while the last
    send ran goes as one list. Fewer sends, and the reading side takes many messages in per turn of its
    interpreter lock, which a worker busy in Python hands over only every switch interval."""

    def __init__(self, conn: Connection, name: str, failed: Callable[[list[Any]], None]) -> None:
        self._conn, self._failed = conn, failed
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: tuple[str, int, Any]) -> None:
        self._queue.put(message)

    def close(self, timeout: float) -> None:
        """Sends what is queued, then ends the sending thread."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            closing = any(message is _CLOSE for message in batch)
            batch = [message for message in batch if message is not _CLOSE]
            if batch:
                try:
                    self._conn.send_bytes(pickle.dumps(batch, protocol=5))
                except OSError:  # the other process is gone
                    self._failed(batch)
            if closing:
                return


class ProcessReplica:
    """The package at ``path`` served on ``device`` by a Replica in a process of its own; ``options`` are
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
        self._outbox: _Outbox | None = None
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
        self._outbox = _Outbox(self._conn, f"replica-{self.device}-requests", self._unsent)
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
        self._outbox.put(("request", ident, {"request": encoded, "users": item.users, "user_ids": item.user_ids}))

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        future: Future = Future()
        with self._lock:
            if self._ended is not None:
                return {"device": str(self.device), "process": self.pid, "ended": self._ended}
            ident = next(self._ids)
            self._pending[ident] = (future, 0)
        self._outbox.put(("stats", ident, None))
        try:
            return {**future.result(timeout=timeout), "process": self.pid}
        except ServingError as exc:
            return {"device": str(self.device), "process": self.pid, "ended": str(exc)}

    def stop(self) -> None:
        """Serves what was sent, then ends the process (killed if it has not ended within a minute, or at once
        if it never became ready: another replica failed to start)."""
        if self._process.poll() is None and self._outbox is None:  # still starting: nothing of it to serve
            self._process.kill()
            self._process.wait()
        if self._process.poll() is None:
            self._outbox.put(("stop", 0, None))
            self._outbox.close(_STOP_SECONDS)
            try:
                self._process.wait(_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._reader is not None:
            self._reader.join(_STOP_SECONDS)
        self._end(f"the replica process for {self.device} was stopped")
        self._conn.close()

    def _unsent(self, messages: list[Any]) -> None:
        """Messages the process was gone for: their requests fail here (the reader fails what it held)."""
        reason = self._ended or f"the replica process for {self.device} ended"
        with self._lock:
            entries = [self._pending.pop(ident, None) for _, ident, _ in messages]
        for entry in entries:
            if entry is not None and not entry[0].done():
                entry[0].set_exception(ServingError(reason))

    def _read(self) -> None:
        while True:
            try:
                messages = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            for kind, ident, body in messages:
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
    try:
        path, device, options, threads = pickle.loads(conn.recv_bytes())
        torch.set_num_threads(threads)
        sys.setswitchinterval(_SWITCH_SECONDS)
        replica = Replica(path, torch.device(device), **options)
    except BaseException as exc:  # any failure to start is reported to the parent
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("failed", 0, _portable(exc))))
        return
    conn.send_bytes(pickle.dumps(("ready", 0, {"schema": replica.schema, "pid": os.getpid()})))
    outbox = _Outbox(conn, "answers", lambda messages: None)  # unsent: the parent is gone

    def answer(ident: int, future: Future) -> None:
        error = future.exception()
        if error is not None:
            outbox.put(("error", ident, _portable(error)))
            return
        try:
            encoded = encode_tensors(future.result())
        except Exception as exc:  # an output that cannot travel fails its request, not the process
            outbox.put(("error", ident, _portable(exc)))
            return
        outbox.put(("answer", ident, encoded))

    running = True
    while running:
        try:
            messages = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        for kind, ident, body in messages:
            if kind == "stop":
                running = False
                break
            if kind == "stats":
                outbox.put(("stats", ident, replica.stats()))
                continue
            item = Item(decode_tensors(body["request"]), body["users"], body["user_ids"])
            item.future.add_done_callback(lambda future, ident=ident: answer(ident, future))
            replica.put(item)
    replica.stop()  # answers what was queued before the stop
    outbox.close(_STOP_SECONDS)
    conn.close()
