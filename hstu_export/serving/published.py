"""Serving the current version of a directory ``hstu-export publish`` writes, and following it.

    predictor = PublishedPredictor("/srv/ranker")      # loads /srv/ranker/current
    scores = predictor(request)                        # a new version is picked up between calls

A call looks at ``current`` at most every ``check_seconds``. A new version is loaded in a background thread
while the one served goes on answering, then swapped in: every call runs wholly on one version, and none is
refused or held back by the switch. A version is switched to only if it takes the same requests and gives
the same outputs (input schema, maximum batch size, output names, whether requests may share a call:
the manifest's ``batch_dependent``) as the one served, so that batching and
clients built on the first keep working; one that fails to load or differs is not served, ``last_error``
says why, and it is not tried again until ``current`` names another version.

The KV cache does not follow versions: ``kv_cache(...)`` serves the version current when it was made (a new
dense program would invalidate every cached K/V anyway); make a new one after a switch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from hstu_export.errors import ConfigError, HstuExportError, PackageError
from hstu_export.package.publish import current_version, is_published_root

__all__ = ["PublishedPredictor"]


class PublishedPredictor:
    """Callable as a Predictor (its attributes are the served version's). ``check_seconds``: how often a call
    looks at ``current``; ``loader``: how a version directory is loaded (default ``hstu_export.load`` with
    ``tables_device``, where every version keeps its tables: see ``hstu_export.load``)."""

    def __init__(self, root: str | Path, *, check_seconds: float = 1.0,
                 loader: Callable[[Path], Any] | None = None, tables_device: str | None = None) -> None:
        import hstu_export

        self.root = Path(root)
        if not is_published_root(self.root):
            raise PackageError(f"{self.root} holds no published versions (no 'current' link); publish a package "
                               f"with `hstu-export publish PKG --to {self.root}`, or load a package directly")
        self.check_seconds = check_seconds
        if loader is not None and tables_device is not None:
            raise ConfigError("PublishedPredictor takes a loader or a tables device, not both (the loader decides "
                              "where tables live)")
        self._load = loader or (lambda path: hstu_export.load(path, tables_device=tables_device))
        version = current_version(self.root)
        assert version is not None  # is_published_root: the link exists, and current_version checked its target
        self._served: tuple[int, Any] = (version, self._load(self.root / str(version)))
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._loading: threading.Thread | None = None
        self._given_up: int | None = None  # the version not served (last_error), until current changes
        self.last_error: str | None = None
        self.switches = 0

    @property
    def version(self) -> int:
        """The version calls run on now."""
        return self._served[0]

    @property
    def predictor(self) -> Any:
        return self._served[1]

    def __call__(self, request: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if time.monotonic() - self._checked >= self.check_seconds:
            self._check(wait=False)
        return self._served[1](request)

    def refresh(self) -> int:
        """Looks at ``current`` now and, if it names another version, loads it before returning; returns the
        version served."""
        self._check(wait=True)
        return self.version

    def __getattr__(self, name: str) -> Any:  # input_schema, max_batch_size, package_manifest, device, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._served[1], name)

    def _check(self, wait: bool) -> None:
        with self._lock:
            self._checked = time.monotonic()
            loading = self._loading
            if loading is None:
                try:
                    latest = current_version(self.root)
                except PackageError as exc:
                    self.last_error = str(exc)
                    return
                if latest is None or latest in (self._served[0], self._given_up):
                    return
                loading = self._loading = threading.Thread(target=self._switch_to, args=(latest,),
                                                           name=f"load-version-{latest}", daemon=True)
                loading.start()
        if wait:
            loading.join()

    def _switch_to(self, version: int) -> None:
        try:
            try:
                predictor = self._load(self.root / str(version))
            except Exception as exc:  # a damaged or removed version, or one its runtime cannot load
                raise PackageError(f"version {version} of {self.root} is not served: {exc}") from exc
            served = self._served[1]
            differs = [what for what, a, b in (("input schema", predictor.input_schema, served.input_schema),
                                               ("maximum batch size", predictor.max_batch_size, served.max_batch_size),
                                               ("output names", predictor.output_names, served.output_names),
                                               ("batching (batch_dependent)", _batches(predictor), _batches(served)))
                       if a != b]
            if differs:
                verb = "differs" if len(differs) == 1 else "differ"
                raise PackageError(f"version {version} of {self.root} is not served: its {' and '.join(differs)} "
                                   f"{verb} from version {self._served[0]}'s; serve it from a new process")
        except HstuExportError as exc:
            with self._lock:
                self.last_error, self._given_up, self._loading = str(exc), version, None
            return
        with self._lock:
            self._served = (version, predictor)
            self._loading, self._given_up, self.last_error = None, None, None
            self.switches += 1


def _batches(predictor: Any) -> bool:
    """Whether requests may share a call (no ``batch_dependent`` in the manifest)."""
    return not predictor.package_manifest.raw.get("batch_dependent")
