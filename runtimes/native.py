"""The C++ runtime from Python: a package served by ``libhstu_export_native`` (runtimes/cpp/src/native.cpp, built
by runtimes/cpp/build.sh beside ``hstu-export-run``), with no Python between the request and the answer.

    predictor = NativePredictor("model.aoti")           # Package::open: the C++ runtime's checks and loading
                                                        # (a CUDA package on device=, else the current device;
                                                        # also: hstu_export.load("model.aoti", runtime="native"))
    scores = predictor(request)                         # Package::run: validation, sparse and dense halves
    ranker = predictor.kv_cache()                       # CachedRanker::open (a package exported with --kv-cache)
    followed = NativePredictor("/srv/ranker", follow_seconds=1)   # PublishedPackage: a publish root, followed
    scores = ranker(request, user_ids)

What ``hstu_export.load`` does in Python, the C++ runtime does in C++ (docs/PACKAGE.md "The C++ runtime"): the
same answers, bit for bit, and the same refusals, raised as the same exception types (``RequestError``,
``PackageError``). What it saves is the interpreter's time per call, which at one user is most of a request
(docs/PERF.md). The library is found at ``library``, else ``$HSTU_EXPORT_NATIVE_LIBRARY``, else this checkout's
``build/cpp``; it must be built against the torch this process runs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, HstuExportError, PackageError, RequestError
from hstu_export.package.directory import load_manifest
from hstu_export.runtimes.shape_graphs import copy_limit
from hstu_export.settings import check_time_drift, parse_size

__all__ = ["RUNTIMES", "NativeCachedRanker", "NativePredictor", "check_runtime", "native_library"]

RUNTIMES = ("python", "native")  # what serves a server's calls: hstu_export.load, or the C++ runtime (this module)

LIBRARY_NAME = "libhstu_export_native.so"
_ERRORS: dict[str, type[HstuExportError]] = {"RequestError": RequestError, "PackageError": PackageError,
                                             "Error": HstuExportError}
_STATS = ("hits", "misses", "stale", "evictions", "bypassed", "users", "pages_used", "pages")
_loaded: set[Path] = set()
_lock = threading.Lock()
T = TypeVar("T")


def native_library(library: str | Path | None = None) -> Path:
    """The library's path (see the module's text); ConfigError when it is not there."""
    given = library or os.environ.get("HSTU_EXPORT_NATIVE_LIBRARY")
    checkout = Path(__file__).resolve().parents[1]  # runtimes/ sits in the checkout's root
    path = Path(given) if given else checkout / "build" / "cpp" / LIBRARY_NAME
    if not path.is_file():
        raise ConfigError(f"the C++ runtime's Python library {path} is not there: build it with "
                          "`bash runtimes/cpp/build.sh` (or give its path: library=..., $HSTU_EXPORT_NATIVE_LIBRARY)")
    return path.resolve()


def _load(library: str | Path | None) -> Any:
    path = native_library(library)
    with _lock:
        if path not in _loaded:
            if _loaded:
                raise ConfigError(f"another C++ runtime library is loaded already ({next(iter(_loaded))}); one "
                                  "process serves from one")
            try:
                torch.classes.load_library(str(path))
            except OSError as exc:
                raise ConfigError(f"{path} does not load ({str(exc).splitlines()[0][:300]}): rebuild it against "
                                  f"this process's torch {torch.__version__} with `bash runtimes/cpp/build.sh`") from None
            _loaded.add(path)
    return torch.classes.hstu_export_native


def check_runtime(runtime: str) -> None:
    """ConfigError unless ``runtime`` is one of RUNTIMES (ReplicaSet's and serving-repo's ``runtime``)."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime {str(runtime)[:40]!r}: expected {' or '.join(RUNTIMES)}")


def _device(device: str | torch.device | None) -> torch.device | None:
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {str(device)[:40]!r}: expected cpu, cuda or cuda:N") from None


def _current_cuda_device() -> int:
    """The device a CUDA package opens on when none is named: this thread's current one, as ``hstu_export.load``."""
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _call(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a runtime error raised as hstu-export's own exception (native.cpp puts its class in front)."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        kind, _, message = text.partition(": ")
        if kind in _ERRORS and message:
            raise _ERRORS[kind](message) from None
        raise


def _graphs_mode(cuda_graphs: bool | None) -> str:
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise ConfigError(f"cuda_graphs is True, False or None, got {cuda_graphs!r}")
    return "auto" if cuda_graphs is None else "on" if cuda_graphs else "off"


class NativePredictor:
    """A package served by the C++ runtime; called like ``hstu_export.load``'s predictor, with a request of
    tensors (on the host or the package's device) and answering its outputs in ``output_names`` order.
    ``cuda_graphs`` (default: on where it is safe) replays whole requests of shapes seen before from CUDA graphs
    and ``graph_copy_limit`` bounds the requests it replays (``Options::graphs`` and ``graph_copy_limit``, as
    ``hstu_export.load``'s); ``hstu_export.load(path, runtime="native")`` opens one."""

    def __init__(self, path: str | Path, *, device: str | torch.device | None = None, tables_device: str | None = None,
                 verify_checksums: bool = True, library: str | Path | None = None,
                 follow_seconds: float | None = None, cuda_graphs: bool | None = None,
                 graph_copy_limit: int | str | None = None) -> None:
        if tables_device not in (None, "cpu", "cuda"):
            raise ConfigError(f"tables device {str(tables_device)[:40]!r}: expected cpu or cuda")
        if follow_seconds is not None and not 0 <= follow_seconds <= 86400:
            raise ConfigError(f"follow_seconds must be from 0 to 86400, got {follow_seconds!r}")
        wanted = _device(device)
        classes = _load(library)
        index = wanted.index if wanted is not None and wanted.index is not None else _current_cuda_device()
        self.following = follow_seconds is not None
        graphs = _graphs_mode(cuda_graphs)
        limit = 0 if graph_copy_limit is None else copy_limit(graph_copy_limit)  # 0: the C++ runtime's default
        if self.following:
            self._package = _call(classes.Published, str(path), tables_device or "", verify_checksums, index,
                                  float(follow_seconds), graphs, limit)  # type: ignore[arg-type]
        else:
            self._package = _call(classes.Package, str(path), tables_device or "", verify_checksums, index, graphs,
                                  limit)
        self._classes = classes
        self.output_names: list[str] = list(self._package.output_names())
        self.max_batch_size: int = self._package.max_batch_size()
        self.device = torch.device(self._package.device())
        if wanted is not None and wanted.type != self.device.type:
            raise ConfigError(f"{self.path} is a {self.device.type} package; it cannot be served on {wanted}")
        # What BatchingPredictor and the serving paths read of a predictor; the C++ runtime checked it all already.
        self.package_manifest = load_manifest(self.path, verify_checksums=False)
        self.input_schema = self.package_manifest.input_schema

    @property
    def path(self) -> Path:
        """The package served now (with ``follow_seconds``: the current version's directory)."""
        return Path(self._package.path())

    @property
    def version(self) -> int | None:
        """With ``follow_seconds``: the published version served now."""
        return self._package.version() if self.following else None

    def refresh(self) -> int:
        """With ``follow_seconds``: looks at ``current`` now, opens a newly named version before returning, and
        returns the version served (``PublishedPackage::refresh``)."""
        if not self.following:
            raise ConfigError("refresh() follows a publish root: open it with follow_seconds=")
        return _call(self._package.refresh)

    @property
    def last_error(self) -> str:
        """With ``follow_seconds``: why the version ``current`` names is not served ("" when it is)."""
        return self._package.last_error() if self.following else ""

    def __call__(self, request: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return dict(_call(self._package.run, dict(request)))

    def kv_cache(self, budget_bytes: int | str | None = None, *, max_time_drift: int = 0,
                 cuda_graphs: bool | None = None, graph_copy_limit: int | str | None = None,
                 held_rows: bool = False, shape_buckets: bool | None = None) -> NativeCachedRanker:
        """The C++ runtime's KV cache over this package (as ``Predictor.kv_cache``): ``budget_bytes`` (bytes or a
        size such as ``"2GiB"``; default: room for the maximum batch at the longest sequence); ``graph_copy_limit``
        as ``Predictor.kv_cache``'s. ``held_rows`` (a derived delta program's cache): each cached user's jagged
        request rows kept on the device, so that a request whose rows begin with them sends only the rest
        (``KVCacheOptions::held_rows``; off by default: not yet timed on a GPU). ``shape_buckets`` as
        ``Predictor.kv_cache``'s (``KVCacheOptions::shape_buckets``)."""
        budget = 0  # the C++ runtime's default
        if budget_bytes is not None:
            budget = parse_size(budget_bytes) if isinstance(budget_bytes, str) else budget_bytes
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ConfigError(f"KV cache budget must be a positive number of bytes, got {budget_bytes!r}")
        max_time_drift = check_time_drift(max_time_drift)
        if self.following:
            raise ConfigError("a KV cache serves one version (a new one's weights would not match the cached K/V): "
                              "open one version's directory, without follow_seconds")
        graphs = _graphs_mode(cuda_graphs)
        limit = 0 if graph_copy_limit is None else copy_limit(graph_copy_limit)  # 0: the C++ runtime's default
        if not isinstance(held_rows, bool):
            raise ConfigError(f"held_rows is True or False, got {held_rows!r}")
        if shape_buckets is not None and not isinstance(shape_buckets, bool):
            raise ConfigError(f"shape_buckets is True, False or None, got {shape_buckets!r}")
        buckets = "auto" if shape_buckets is None else "on" if shape_buckets else "off"
        return NativeCachedRanker(_call(self._classes.CachedRanker, self._package, budget, max_time_drift, graphs,
                                        limit, held_rows, buckets))


class NativeCachedRanker:
    """``ranker(request, user_ids)``: the C++ runtime's KV-cached serving (``CachedRanker::run``)."""

    def __init__(self, ranker: Any) -> None:
        self._ranker = ranker

    def __call__(self, request: Mapping[str, Tensor], user_ids: Sequence[Hashable] | Tensor) -> dict[str, Tensor]:
        ids = user_ids.tolist() if isinstance(user_ids, Tensor) else list(user_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestError("the C++ runtime's KV cache takes integer user ids")
        return dict(_call(self._ranker.run, dict(request), ids))

    @property
    def cache(self) -> NativeCachedRanker:
        """Where its counters are read, as ``CachedRanker.cache``: ``ranker.cache.stats()``."""
        return self

    def stats(self) -> dict[str, int]:
        return dict(zip(_STATS, self._ranker.stats(), strict=True))
