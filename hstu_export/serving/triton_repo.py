"""A Triton Inference Server model repository for a package: ``hstu-export serving-repo PKG --out DIR``
(or ``hstu-export MODEL --emit-serving-repo DIR``). docs/SERVING.md says how to run it.

    DIR/
      serving.json            what wrote it, for which package and server (hstu-export's marker)
      README.md               how to start the server and call the model
      NAME/config.pbtxt       Python backend; one input per request feature, one output per package output,
                              ragged dynamic batching (with a KV cache: the sequence batcher, the
                              correlation id naming the user); GPU or CPU instances as the package's device
      NAME/1/model.py         hstu_export/serving/triton_model.py
      NAME/1/package/         the package, unchanged (its checksums still hold)

PKG may instead be a directory ``hstu-export publish`` writes: then nothing is copied, the config names that
directory (absolute) and each instance follows its ``current`` version (``PublishedPredictor``), switching
between requests; the config is written from the current version (later versions must take the same
requests, or they are not served).

Written for Triton Inference Server 2.73.0's model configuration (the release of tritonclient 2.73.0,
whose model_config protobuf the tests parse the config with). CI serves a repository with a real server,
the tritonserver nvidia-pytriton 0.7.0 bundles (Triton 2.51.0, CPU): tests/test_triton_server.py.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hstu_export.errors import ConfigError
from hstu_export.package.directory import (
    SERVING_MARKER,
    check_writable,
    load_manifest,
    parent_dirs,
    rename_into_place,
    staging_dir,
)
from hstu_export.package.manifest import Manifest
from hstu_export.package.publish import current_path, current_version, is_published_root
from hstu_export.package.tables import check_tables_device
from hstu_export.runtimes.native import check_runtime, native_library
from hstu_export.serving.batching import output_rows
from hstu_export.settings import check_time_drift, check_whole_number, parse_size
from hstu_export.version import __version__

TRITON_SERVER_VERSION = "2.73.0"
MARKER = SERVING_MARKER
DATA_TYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "bfloat16": "TYPE_BF16",
              "float16": "TYPE_FP16", "float64": "TYPE_FP64", "bool": "TYPE_BOOL"}
MODEL_FILE = Path(__file__).with_name("triton_model.py")


@dataclass(frozen=True)
class ServingRepoSettings:
    name: str | None = None  # model name [default: the package directory's stem]
    max_requests_per_batch: int = 8  # Triton's max_batch_size: requests the dynamic batcher groups
    max_queue_delay_us: int = 500  # how long a request may wait for others to batch with
    instances: int = 1  # model instances (processes) per device
    # Serve through a KV cache of this many bytes per instance (a size: "512MiB"); None: no cache. Needs a
    # package exported with --kv-cache. Requests are then routed by Triton's sequence batcher, the
    # correlation id naming the request's one user, so that a user's requests reach the instance holding its cache.
    kv_cache_budget: str | None = None
    max_sequences: int = 1024  # users in flight per instance (the sequence batcher's max_candidate_sequences)
    sequence_idle_us: int = 60_000_000  # a user's slot (and its routing to an instance) ends after this idle time
    # With the KV cache: a user's cached rows are reused while its query time moved at most this many seconds
    # (CachedRanker's max_time_drift; 0: only at the same query time), and CUDA graphs of the cached path
    # ("auto": the package's default, on for CUDA; "on"; "off": no capture when a new shape first comes).
    kv_max_time_drift: int = 0
    kv_cuda_graphs: str = "auto"
    follow_seconds: float = 1.0  # PKG a publish root: how often an instance looks at its current version
    # Where each instance keeps the tables stored beside a compiled sparse half (hstu_export.load's tables_device:
    # "cpu" serves a CUDA package's tables from pinned host memory); None: on the instance's device.
    tables_device: str | None = None
    # What serves each instance's calls: "python" (hstu_export.load) or "native" (the C++ runtime's library,
    # hstu_export.runtimes.native, found when the repository is written and named in its config).
    runtime: str = "python"
    # torch's host threads in each instance's process (torch.set_num_threads). None: 1 for a CUDA package's
    # instances, whose host work is small tensors (on an H200, one instance served 971-1,278 queries/s with a thread
    # per core and 1,757 with one: docs/PERF.md, serving under load); torch's default (one per core) for a CPU
    # package's, whose calls run on the host.
    host_threads: int | None = None


KV_PARAMETER = "kv_cache_budget"  # config parameter model.py reads: serve through a KV cache of this budget
DRIFT_PARAMETER = "kv_max_time_drift"  # ... the cache's max_time_drift, in seconds
GRAPHS_PARAMETER = "kv_cuda_graphs"  # ... "on" or "off": CUDA graphs of the cached path (absent: the default)
KV_CUDA_GRAPHS = ("auto", "on", "off")


def model_name(package: Path, settings: ServingRepoSettings) -> str:
    name = settings.name or package.resolve().name.split(".")[0] or "model"
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"model name {name!r}: use letters, digits, '_', '.' and '-' (a directory of the repository)")
    return name


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dims(shape: list[Any]) -> str:
    # Triton adds the leading batch dim (max_batch_size > 0): the tensor is [1, n, *trailing].
    return ", ".join("-1" if isinstance(d, str) else str(d) for d in shape)


FOLLOW_PARAMETER = "follow_seconds"  # config parameter model.py reads: the package is a publish root to follow
TABLES_PARAMETER = "tables_device"  # config parameter model.py reads: where an instance keeps the tables
NATIVE_PARAMETER = "native_library"  # config parameter model.py reads: serve with the C++ runtime of this library
THREADS_PARAMETER = "host_threads"  # config parameter model.py reads: torch's host threads in the instance


def config_text(manifest: Manifest, name: str, settings: ServingRepoSettings, package: str = "package",
                follow_seconds: float | None = None, native_library: str | None = None) -> str:
    """config.pbtxt for the package: inputs from the request schema, outputs from the final artifact.
    ``package``: where the instances load it (relative to the version directory, or absolute);
    ``follow_seconds``: it is a publish root, whose ``current`` they look at that often; ``native_library``:
    the instances serve it with the C++ runtime of that library."""
    final = manifest.artifacts.get("dense") or manifest.artifacts.get("model") or {}
    lines = [
        f"# Written by hstu-export {__version__} for Triton Inference Server {TRITON_SERVER_VERSION} (Python backend).",
        "# Each feature is sent as [1, n, ...]: one package request per Triton batch element (docs/SERVING.md).",
        f"name: {_quoted(name)}",
        'backend: "python"',
        f"max_batch_size: {settings.max_requests_per_batch}",
        *_batcher(settings),
        "input [",
    ]
    features = manifest.input_schema.features
    for i, f in enumerate(features):
        dims = _dims(["n", *f.trailing])
        comma = "," if i < len(features) - 1 else ""
        lines.append(f"  {{ name: {_quoted(f.name)} data_type: {DATA_TYPES[f.dtype]} dims: [ {dims} ] "
                     f"allow_ragged_batch: true }}{comma}")
    lines.append("]")
    lines.append("output [")
    outputs = final.get("outputs", [])
    for i, tensor in enumerate(outputs):
        comma = "," if i < len(outputs) - 1 else ""
        lines.append(f"  {{ name: {_quoted(tensor['name'])} data_type: {DATA_TYPES[tensor['dtype']]} "
                     f"dims: [ {_dims(tensor['shape'])} ] }}{comma}")
    lines.append("]")
    kind = "KIND_GPU" if manifest.device.type == "cuda" else "KIND_CPU"
    lines.append(f"instance_group [ {{ kind: {kind} count: {settings.instances} }} ]")
    lines.append(f'parameters {{ key: "package" value: {{ string_value: {_quoted(package)} }} }}')
    if follow_seconds is not None:
        lines.append(f'parameters {{ key: "{FOLLOW_PARAMETER}" value: {{ string_value: "{follow_seconds:g}" }} }}')
    if settings.kv_cache_budget is not None:
        lines.append(f'parameters {{ key: "{KV_PARAMETER}" value: {{ string_value: {_quoted(settings.kv_cache_budget)} }} }}')
        if settings.kv_max_time_drift:
            lines.append(f'parameters {{ key: "{DRIFT_PARAMETER}" value: {{ string_value: "{settings.kv_max_time_drift}" }} }}')
        if settings.kv_cuda_graphs != "auto":
            lines.append(f'parameters {{ key: "{GRAPHS_PARAMETER}" value: {{ string_value: "{settings.kv_cuda_graphs}" }} }}')
    if settings.tables_device is not None:
        lines.append(f'parameters {{ key: "{TABLES_PARAMETER}" value: {{ string_value: {_quoted(settings.tables_device)} }} }}')
    threads = settings.host_threads if settings.host_threads is not None else 1 if kind == "KIND_GPU" else None
    if threads is not None:
        lines.append(f'parameters {{ key: "{THREADS_PARAMETER}" value: {{ string_value: "{threads}" }} }}')
    if native_library is not None:
        lines.append(f'parameters {{ key: "{NATIVE_PARAMETER}" value: {{ string_value: {_quoted(native_library)} }} }}')
    return "\n".join(lines) + "\n"


def _batcher(settings: ServingRepoSettings) -> list[str]:
    if settings.kv_cache_budget is None:
        return [f"dynamic_batching {{ max_queue_delay_microseconds: {settings.max_queue_delay_us} }}"]
    # The sequence batcher sends all requests of one correlation id (one user) to the same instance, whose
    # KV cache holds that user; "oldest" still batches requests of different users within an instance.
    return [
        "# One user per request, named by its correlation id; a user's requests all reach one instance.",
        "sequence_batching {",
        f"  max_sequence_idle_microseconds: {settings.sequence_idle_us}",
        f"  oldest {{ max_candidate_sequences: {settings.max_sequences} "
        f"preferred_batch_size: [ {settings.max_requests_per_batch} ] "
        f"max_queue_delay_microseconds: {settings.max_queue_delay_us} }}",
        "}",
    ]


def _readme(name: str, manifest: Manifest, batching: bool, kv_cache: str | None) -> str:
    features = "\n".join(f"- `{f.name}`: {f.dtype}, [1, n{''.join(f', {d}' for d in f.trailing)}] ({f.kind})"
                         for f in manifest.input_schema.features)
    how = ("Requests Triton's batcher groups run in as few package calls as its maximum batch size "
           f"({manifest.ranges.max_batch_size} users) allows." if batching else
           f"Each request runs alone: {manifest.raw['batch_dependent']}." if manifest.raw.get("batch_dependent") else
           "This package's outputs cannot be split per request, so each request runs alone.")
    if kv_cache is not None:
        how += (f" Served through a KV cache of {kv_cache} per instance: each request holds one user, named by "
                "its correlation id (sequence id); send it without sequence flags, and if the server answers that "
                "the START flag is missing, send it again with sequence_start=true (docs/SERVING.md).")
    return f"""# Triton model repository for `{name}` (hstu-export {__version__})

Start the server (Triton Inference Server {TRITON_SERVER_VERSION}, whose Python environment has hstu-export
and torch {manifest.torch_version} installed):

    tritonserver --model-repository $PWD

Each request is one request of the package: every feature as a tensor of shape [1, n, ...] (Triton's
leading batch dim is 1; n users, or for a jagged feature all its values):

{features}

Outputs come back as [1, m, ...]. {how} A request that does not fit the exported schema or ranges gets
an error naming the feature; the others in its batch are unaffected.
"""


def check_out(out: Path, force: bool, package: Path | None = None) -> None:
    """ConfigError unless ``out`` is new, empty, or (with ``force``) a repository this tool wrote, and lies
    apart from ``package`` (a repository inside its package would copy the package into itself, and
    replacing a repository that holds the package would delete it); PackageError unless the directory it
    goes in is writable."""
    out = Path(out)
    if package is not None:
        inside, holder = Path(out).resolve(), Path(package).resolve()
        if inside.is_relative_to(holder):
            raise ConfigError(f"--out {out} is inside the package {package}; the repository holds a copy of the "
                              "package, so write it outside: choose another --out")
        if out.exists() and holder.is_relative_to(inside):
            raise ConfigError(f"--out {out} contains the package {package}; it will not be replaced: choose "
                              "another --out")
    if out.is_symlink():
        raise ConfigError(f"{out} is a symbolic link; choose a new directory")
    if out.exists():
        if not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file()):
            raise ConfigError(f"{out} exists and is not a serving repository hstu-export wrote; choose a new "
                              "directory")
        if any(out.iterdir()) and not force:
            raise ConfigError(f"{out} exists; pass --force to replace it")
    check_writable(out.parent, f"--out {out}: its parent directory")


def write_serving_repo(package: str | Path, out: str | Path, settings: ServingRepoSettings | None = None,
                       *, force: bool = False) -> Path:
    """Writes the repository (atomically: built beside ``out`` and renamed in); returns the model's directory."""
    settings = settings or ServingRepoSettings()
    if settings.max_requests_per_batch < 1 or settings.instances < 1 or settings.max_queue_delay_us < 0:
        raise ConfigError("max requests per batch and instances must be >= 1, the queue delay >= 0")
    if settings.max_sequences < 1 or settings.sequence_idle_us < 1:
        raise ConfigError("max sequences and the sequence idle time must be >= 1")
    check_time_drift(settings.kv_max_time_drift, "the KV cache's max time drift")
    if settings.host_threads is not None:
        check_whole_number(settings.host_threads, "host_threads", 1)
    if settings.kv_cuda_graphs not in KV_CUDA_GRAPHS:
        raise ConfigError(f"kv_cuda_graphs must be one of {', '.join(KV_CUDA_GRAPHS)}, got {settings.kv_cuda_graphs!r}")
    if settings.kv_cache_budget is not None:
        try:
            parse_size(settings.kv_cache_budget)
        except ConfigError as exc:
            raise ConfigError(f"KV cache budget (--kv-cache): {exc}") from None
    package, out = Path(package), Path(out)
    follow = is_published_root(package)
    if follow and settings.kv_cache_budget is not None:
        raise ConfigError(f"{package} holds published versions: a KV-cached repository serves one version (a new "
                          "version invalidates every cached K/V); give it one package, e.g. "
                          f"{package}/{current_version(package)}")
    # The package is checked before it is copied; a publish root's current version gives the config.
    manifest = load_manifest(current_path(package) if follow else package)
    name = model_name(package, settings)
    if manifest.backend.name not in ("aoti", "torchscript", "onnx", "trt"):
        raise ConfigError(f"backend {manifest.backend.name!r} has no serving repository")
    if settings.kv_cache_budget is not None and "kv_cache" not in manifest.raw:
        raise ConfigError(f"{package} was exported without --kv-cache, so it has no delta program to serve through a "
                          "KV cache: export it with --kv-cache, or write the repository without --kv-cache")
    if settings.tables_device is not None:
        check_tables_device(manifest.artifacts, package, manifest.device.type, settings.tables_device)
    check_runtime(settings.runtime)
    library = str(native_library()) if settings.runtime == "native" else None
    check_out(out, force, package)
    # Built beside ``out`` and renamed in; a full or read-only disk is one line and leaves nothing behind.
    with parent_dirs(out, "the serving repository"), staging_dir(out, "the serving repository") as staged:
        model_dir = staged / name
        (model_dir / "1").mkdir(parents=True)
        if not follow:
            shutil.copytree(package, model_dir / "1" / "package", symlinks=False)
        shutil.copyfile(MODEL_FILE, model_dir / "1" / "model.py")
        where = str(package.resolve()) if follow else "package"
        (model_dir / "config.pbtxt").write_text(config_text(manifest, name, settings, where,
                                                           settings.follow_seconds if follow else None, library))
        batching = output_rows(manifest) is not None
        (staged / "README.md").write_text(_readme(name, manifest, batching, settings.kv_cache_budget))
        (staged / MARKER).write_text(json.dumps({
            "written_by": f"hstu-export {__version__}", "triton_server": TRITON_SERVER_VERSION, "model": name,
            "package": str(package.resolve()), "backend": "python", "batches_requests": batching,
            "kv_cache_budget": settings.kv_cache_budget, "follows_published_versions": follow,
            "tables_device": settings.tables_device, "runtime": settings.runtime, "native_library": library,
        }, indent=2) + "\n")
        check_out(out, force, package)  # again: something may have appeared meanwhile
        rename_into_place(staged, out)  # an old repository is moved aside first and removed after
    return out / name
