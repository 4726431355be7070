"""Triton Inference Server Python-backend model for an hstu-export package (copied as ``model.py`` into the
model repository that ``hstu-export serving-repo`` writes; docs/SERVING.md).

Each Triton request carries one request of the package: every feature as a tensor of shape
``[1, n, *trailing]`` (Triton's leading batch dim of 1; ``n`` users, or values for a jagged feature).
The dynamic batcher hands ``execute`` several requests at once; they run in as few package calls as the
package's maximum batch size allows (``hstu_export.serving.batching``), and each gets its own outputs,
``[1, m, *trailing]``, or its own error. Tensors cross by DLPack, so GPU tensors are not copied.

With the config parameter ``kv_cache_budget`` (``triton_repo.KV_PARAMETER``; ``serving-repo --kv-cache``),
each instance serves through its own KV cache (``predictor.kv_cache(budget)``): Triton's sequence batcher
routes requests by their correlation id, which names the request's one user, so a user's requests reach the
instance that holds its cache. The cache's counters are Triton metrics (``hstu_kv_cache_*``, labelled by
model and instance).

With the config parameter ``follow_seconds`` (``serving-repo`` of a directory ``hstu-export publish`` writes),
the package parameter names that directory and each instance serves its current version, switching to a new
one between requests (``hstu_export.serving.published.PublishedPredictor``). With ``tables_device``
(``serving-repo --tables-device``), each instance keeps the tables stored beside a compiled sparse half there
(``hstu_export.load``'s argument). With ``native_library`` (``serving-repo --runtime native``), the C++ runtime
of that library serves each instance's calls (``hstu_export.runtimes.native``), on the instance's device. With
``host_threads`` (``serving-repo --host-threads``), the instance's torch uses that many host threads.

Needs, in the Python environment Triton runs this file with: hstu-export and the torch the package was
exported with (and fbgemm-gpu / torchrec when the package names them). CI runs it in a real server on CPU
(tests/test_triton_server.py; docs/SERVING.md says how the backend's Python finds that environment).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend
from torch.utils import dlpack

import hstu_export
from hstu_export.errors import HstuExportError, RequestError
from hstu_export.runtimes.native import NativePredictor
from hstu_export.serving.batching import BatchingPredictor
from hstu_export.serving.published import PublishedPredictor
from hstu_export.serving.triton_repo import (
    DRIFT_PARAMETER,
    FOLLOW_PARAMETER,
    GRAPHS_PARAMETER,
    KV_PARAMETER,
    NATIVE_PARAMETER,
    TABLES_PARAMETER,
    THREADS_PARAMETER,
)

# The KV cache's counters (CachedRanker.cache.stats()) as Triton metrics: counters, then gauges.
KV_COUNTERS = {"hits": "requests' users served from the cache", "misses": "users with nothing cached (prefill)",
               "stale": "cached users recomputed (the cached entry did not match)", "evictions": "users evicted",
               "bypassed": "users served without storing (no room, or twice in one batch)"}
KV_GAUGES = {"users": "users held in the cache", "pages_used": "cache pages in use", "pages": "cache pages"}


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        package = Path(args["model_repository"]) / args["model_version"] / parameters.get("package", "package")
        if parameters.get(THREADS_PARAMETER):
            torch.set_num_threads(int(parameters[THREADS_PARAMETER]))
        if args.get("model_instance_kind") == "GPU":
            torch.cuda.set_device(int(args["model_instance_device_id"]))
        follow = parameters.get(FOLLOW_PARAMETER)
        # A publish root (serving-repo of one): the current version, followed between requests.
        tables = parameters.get(TABLES_PARAMETER) or None
        library = parameters.get(NATIVE_PARAMETER)
        predictor: Any
        if library:  # the C++ runtime serves the calls, on this instance's device
            device = f"cuda:{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else None
            predictor = NativePredictor(package, device=device, tables_device=tables, library=library,
                                        follow_seconds=float(follow) if follow else None)
        elif follow:
            predictor = PublishedPredictor(package, check_seconds=float(follow), tables_device=tables)
        else:
            predictor = hstu_export.load(package, tables_device=tables)
        self.ranker = None
        budget = parameters.get(KV_PARAMETER)
        if budget:
            graphs = {"on": True, "off": False}.get(parameters.get(GRAPHS_PARAMETER, ""))
            self.ranker = predictor.kv_cache(budget, max_time_drift=int(parameters.get(DRIFT_PARAMETER) or 0),
                                             cuda_graphs=graphs)
            self.metrics = _KVMetrics(args["model_name"], args["model_instance_name"])
        # Outputs go to the host once per package call, then split per request: the answers leave by the host
        # anyway, and a GPU tensor handed to Triton costs a CUDA IPC handle per request and output.
        self.batcher = BatchingPredictor(predictor, self.ranker, host_outputs=True)
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        # The feature whose rows count a request's users (its first lengths or per-user feature).
        self.users_feature = next(f.name for f in predictor.input_schema.features if f.kind in ("lengths", "per_user"))

    def _user(self, request: Any, features: dict[str, torch.Tensor]) -> int | str:
        """A KV-cached request's one user: its correlation id (the sequence batcher's; never 0 or empty)."""
        users = features[self.users_feature].size(0)
        if users != 1:
            raise RequestError(f"a request to a KV-cached model holds one user, named by its correlation id; this one "
                               f"holds {users}: send each user as its own request")
        return request.correlation_id()

    def execute(self, requests: list[Any]) -> list[Any]:
        batch: list[dict[str, torch.Tensor] | HstuExportError] = []
        users: list[list[int | str]] = []
        responses: list[Any] = []
        for request in requests:
            try:
                features = {name: _request_tensor(request, name) for name in self.inputs}
                users.append([self._user(request, features)] if self.ranker is not None else [])
                batch.append(features)
            except HstuExportError as exc:
                batch.append(exc)
                users.append([])
        ready = [i for i, item in enumerate(batch) if not isinstance(item, HstuExportError)]
        if self.ranker is None:
            results = dict(zip(ready, self.batcher([batch[i] for i in ready])))
        else:
            results = dict(zip(ready, self.batcher([batch[i] for i in ready], [users[i] for i in ready])))
            self.metrics.update(self.ranker.cache.stats())
        for index, item in enumerate(batch):
            result = results.get(index, item)
            if isinstance(result, HstuExportError):
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(result))))
                continue
            tensors = [pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(result[name].unsqueeze(0).contiguous()))
                       for name in self.outputs]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses


def _request_tensor(request: Any, name: str) -> torch.Tensor:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise RequestError(f"request is missing input {name!r}")
    value = dlpack.from_dlpack(tensor.to_dlpack())
    if value.dim() < 1 or value.size(0) != 1:
        raise RequestError(
            f"input {name!r} has shape {list(value.shape)}: send each feature as [1, n, ...] (one request per "
            "Triton batch element)")
    return value[0]


class _KVMetrics:
    """The instance's KV-cache counters and gauges in Triton's metrics (its /metrics endpoint)."""

    def __init__(self, model: str, instance: str) -> None:
        labels = {"model": model, "instance": instance}
        self.counted = dict.fromkeys(KV_COUNTERS, 0)
        # The families are kept: Triton refuses a metric whose family has been deleted.
        self.families = {name: pb_utils.MetricFamily(name=f"hstu_kv_cache_{name}", description=text, kind=kind)
                         for kinds, kind in ((KV_COUNTERS, pb_utils.MetricFamily.COUNTER),
                                             (KV_GAUGES, pb_utils.MetricFamily.GAUGE))
                         for name, text in kinds.items()}  # fmt: skip
        self.counters = {name: self.families[name].Metric(labels=labels) for name in KV_COUNTERS}
        self.gauges = {name: self.families[name].Metric(labels=labels) for name in KV_GAUGES}

    def update(self, stats: dict[str, int]) -> None:
        for name, metric in self.counters.items():
            if stats[name] > self.counted[name]:
                metric.increment(stats[name] - self.counted[name])
                self.counted[name] = stats[name]
        for name, metric in self.gauges.items():
            metric.set(stats[name])
