"""Loading a package and serving it: ``hstu_export.load(path)`` returns a thread-safe Predictor.

A package is untrusted input. Load-time checks, in order: the package format; the manifest's own sha256
(manifest.sha256); every manifest field (``hstu_export.package.manifest``: types, values, every path inside the
package and listed with its sha256); every file's sha256; the torch version (compiled artifacts are
tied to it); the device and, for CUDA, the GPU architecture; then the op libraries the graphs call are
imported (only names from a fixed list, each mapped to the module imported for it), and the backend
loads its files. Each request's tensors are made plain (dense, contiguous, detached), validated against
the exported input schema, and moved to the package's device, so compiled code only ever sees tensors
laid out as it was compiled for.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, HstuExportError, PackageError, RequestError
from hstu_export.package.directory import load_manifest, recover_interrupted_replace
from hstu_export.package.manifest import OP_LIBRARIES, Manifest, as_manifest
from hstu_export.package.publish import current_path, is_published_root
from hstu_export.package.schema import InputSchema
from hstu_export.package.tables import check_tables_device
from hstu_export.runtimes import get_backend
from hstu_export.runtimes.base import RANGE_CHECK_MESSAGES, Runner, SplitRunner
from hstu_export.runtimes.native import NativePredictor, check_runtime
from hstu_export.runtimes.shape_graphs import REQUEST_COPY_BYTES, ShapeGraphs, copy_limit


class Predictor:
    """Callable ``predictor(batch) -> {output name: tensor}``. Safe to call from many threads: the loaded
    runners (AOTInductor's model container, TorchScript, onnxruntime) are, and what the predictor keeps between
    calls, its whole-request CUDA graphs (``graphs``), is kept under a lock."""

    def __init__(self, root: Path, manifest: Manifest | dict[str, Any], runner: Runner, device: torch.device, *,
                 cuda_graphs: bool | None = None, graph_copy_limit: int | str | None = None) -> None:
        checked = as_manifest(manifest, root)
        self.root = root
        self.package_manifest = checked  # the validated, typed manifest
        self.manifest = checked.raw  # the decoded manifest.json, as before
        self.device = device
        self.input_schema: InputSchema = checked.input_schema
        self.max_batch_size: int = checked.ranges.max_batch_size
        self.output_names: list[str] = list(checked.output_names)
        # score, probability, embedding or other per output (empty: a package that records no kinds)
        self.output_kinds: dict[str, str] = dict(checked.output_kinds)
        self._feature_names = frozenset(self.input_schema.names)
        self._runner = runner
        self.graphs: ShapeGraphs | None = self._request_graphs(cuda_graphs, graph_copy_limit)

    def graphs_unsafe(self) -> str:
        """Why whole requests of this package cannot be replayed from CUDA graphs ("" when they can): something
        reads the device before the outputs, and the values it reads would be fixed at the capture's (as the C++
        runtime's ``Package::Impl::graphs_unsafe``)."""
        from hstu_export.runtimes.aoti import PRECHECKED_MODEL

        why, fix = f"{self.root} cannot be replayed from CUDA graphs: ", "; serve it without graphs"
        backend = self.manifest["backend"]["name"]
        split = self.split
        if backend != "aoti" or split is None:
            return f"{why}it is a {backend} package (graphs replay AOTInductor programs){fix}"
        if split.sparse_model is None:
            return f"{why}its sparse half is TorchScript, which reads sizes from the device{fix}"
        if split.sparse_model != PRECHECKED_MODEL:
            return (f"{why}its compiled sparse half checks the request's ranges on the device (no prechecked model "
                    f"applies: export with --prechecked-sparse on){fix}")
        reads = (self.manifest["backend"].get("meta") or {}).get("dense_device_reads")
        if reads != 0:
            count = "an unrecorded number of" if reads is None else reads
            return f"{why}its dense program reads {count} value(s) back from the device (backend.meta.dense_device_reads){fix}"
        return ""

    def _request_graphs(self, cuda_graphs: bool | None, graph_copy_limit: int | str | None) -> ShapeGraphs | None:
        """Whole requests from exact-shape CUDA graphs (``cuda_graphs``; None: where the device is CUDA and
        :meth:`graphs_unsafe` finds nothing), or None."""
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs is True, False or None, got {cuda_graphs!r}")
        limit = REQUEST_COPY_BYTES if graph_copy_limit is None else copy_limit(graph_copy_limit)
        if cuda_graphs is False:
            return None
        unsafe = self.graphs_unsafe()
        if cuda_graphs and unsafe:
            raise ConfigError(unsafe)
        if cuda_graphs and self.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA package; {self.root} is for {self.device.type}")
        if self.device.type != "cuda" or unsafe:
            return None
        # Keeping the first graphs: under traffic whose shapes keep changing, at most 16 captures in all.
        return ShapeGraphs(self._whole_request, (), max_bytes=limit, evict=False)

    def _whole_request(self, **inputs: Tensor) -> dict[str, Tensor]:
        """The runner on a request on the device, by graph name: what a whole-request graph holds."""
        return self._runner(inputs)

    def check_request(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` as plain tensors, validated against the exported input schema (RequestError if not)."""
        if not isinstance(batch, Mapping):
            raise RequestError(f"a request is a dict of named tensors, got {type(batch).__name__}")
        # Unknown names are kept as they are, for validate() to name them. Validation reads the plain
        # tensors (the values compiled code will see), before the move to the device: on the host its
        # range checks cost no device synchronisation.
        request = {k: plain_tensor(k, v) if k in self._feature_names else v for k, v in batch.items()}
        self.input_schema.validate(request, self.max_batch_size)
        return request

    def __call__(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        request = self.check_request(batch)
        try:
            inputs = {f.graph_name: to_device(request[f.name], self.device) for f in self.input_schema.features}
            if self.graphs is not None:
                with torch.no_grad():
                    return self.graphs(inputs)
            return self._runner(inputs)
        except HstuExportError:
            raise
        except Exception as exc:  # the artifacts' own checks, compiled guards, the runtime: one line each
            raise self.refusal(exc, request) from exc

    def refusal(self, exc: BaseException, request: Mapping[str, Tensor]) -> HstuExportError:
        """What ``exc``, raised by the package's artifacts on a request that passed ``check_request``, tells
        the caller: a RequestError naming the feature and its limit when a range check inside an artifact
        refused it (the manifest then does not match the programs) or a compiled guard did (named by the
        request's features at their limits), a RequestError for a request too large for memory, else a
        PackageError."""
        text = str(exc)
        raised = _ASSERTION.findall(text)  # the last one: TorchScript's traceback quotes the assert's code first
        if raised:
            message = raised[-1].strip()
            for suffix, bound in RANGE_CHECK_MESSAGES:
                name = message[: -len(suffix)]
                if message.endswith(suffix) and name in self._feature_names:
                    return RequestError(self._range_refusal(name, bound, request[name]))
        first = _first_line(text) or type(exc).__name__
        if isinstance(exc, torch.OutOfMemoryError):
            return RequestError(f"the request does not fit in the memory of {self.device} ({first[:200]}); send fewer "
                                "users or shorter sequences")
        if _COMPILED_GUARD.search(text) or "exported" in first:
            return RequestError(
                f"the package's programs refuse this request although its manifest accepts it ({first[:300]}); at "
                f"their limits: {self._at_limits(request)}. Re-export the package (export verifies every corner of "
                "the ranges and narrows what its programs do not take)")
        return PackageError(f"{self.root}: running the package failed: {first[:500]}")

    def _range_refusal(self, name: str, bound: str, value: Tensor) -> str:
        """Worded as the C++ runtime words it when it cannot read the program's own limit."""
        spec = self.input_schema.get(name)
        files = self.package_manifest.backend.files
        artifact = files.get("model") or files.get("sparse") or "the package's programs"
        if bound == "rows":
            found = f"has {value.size(0)} entries, beyond the exported maximum of users {artifact} was exported for"
            limit = f"the manifest allows {self.max_batch_size}"
        elif bound == "low":
            found = f"has value {value.min().item() if value.numel() else '?'} below the range {artifact} was exported for"
            limit = (f"the manifest's minimum is {spec.min_value}" if spec.min_value is not None
                     else "the manifest states no minimum")
        else:
            what = "length" if spec.kind == "lengths" else "value"
            found = (f"has {what} {value.max().item() if value.numel() else '?'} beyond the range {artifact} was "
                     "exported for")
            limit = (f"the manifest's maximum is {spec.max_value}" if spec.max_value is not None
                     else "the manifest states no maximum")
        return (f"feature {name!r} {found} (refused by {artifact} itself; {limit}, so the manifest does not match "
                "the package's programs: re-export the package)")

    def _at_limits(self, request: Mapping[str, Tensor]) -> str:
        """``B=1 (min), uih_lengths=1..1 (min)``: the batch size and each lengths feature's shortest and
        longest user, with the bounds they reach."""
        users = next((request[f.name].size(0) for f in self.input_schema.features if f.kind == "lengths"), None)
        parts = [f"B={users}" + (" (max)" if users == self.max_batch_size else " (min)" if users == 1 else "")]
        for f in self.input_schema.lengths_features():
            value = request[f.name]
            if f.same_as or not value.numel():
                continue
            low, high = int(value.min()), int(value.max())
            marks = [m for m, hit in (("min", low == f.min_value), ("max", high == f.max_value)) if hit]
            parts.append(f"{f.name}={low}..{high}" + (f" ({', '.join(marks)})" if marks else ""))
        return ", ".join(parts)

    predict = __call__

    def kv_cache(self, budget_bytes: int | None = None, *, max_time_drift: int = 0,
                 cuda_graphs: bool | None = None, graph_copy_limit: int | str | None = None,
                 shape_buckets: bool | None = None) -> Any:
        """A :class:`~hstu_export.serving.kv_cache.CachedRanker` over this package's delta program (a package
        exported with ``--kv-cache``): ``ranker(request, user_ids)`` answers as ``predictor(request)``,
        running only each user's tokens past its cached prefix. ``budget_bytes`` (default: room for
        ``max_batch_size`` users at the longest sequence, and the scratch page) is allocated now, on the package's device.
        ``cuda_graphs`` (default: on for a CUDA package) replays requests from CUDA graphs, one per shape
        bucket (``runtimes/kv_graphs.py``); a derived delta program, one per exact shape seen twice, and only
        when it reads nothing back from the device (``runtimes/shape_graphs.py``): a call whose inputs copied into
        its graph exceed ``graph_copy_limit`` (bytes or a size such as ``"64MiB"``; default 160 MiB) runs as it
        is. ``shape_buckets`` (a derived program; default: with its graphs) appends a padding user that rounds a
        request's shapes to a bucket's, where the export verified one (``kv_cache.padding``:
        ``serving/kv_padding.py``)."""
        from hstu_export.runtimes.kv_delta import PackageDelta
        from hstu_export.serving.kv_cache import CachedRanker, page_bytes

        if shape_buckets is not None and not isinstance(shape_buckets, bool):
            raise ConfigError(f"shape_buckets is True, False or None, got {shape_buckets!r}")
        section = self.manifest.get("kv_cache")
        if section is not None and section.get("kind") == "derived":  # a delta program derived from the graph
            return self._derived_kv_cache(budget_bytes, max_time_drift, cuda_graphs, graph_copy_limit, shape_buckets)
        if shape_buckets is not None:
            raise ConfigError("shape_buckets applies to a derived delta program; the zoo's pads its requests into "
                              "buckets with its CUDA graphs (cuda_graphs)")
        runner = PackageDelta(self, cuda_graphs=cuda_graphs)
        if budget_bytes is None:
            layout = runner.layout
            # plus the scratch page (serving/kv_cache.py)
            pages = self.max_batch_size * -(-self.manifest["kv_cache"]["max_seq_len"] // runner.page_size) + 1
            budget_bytes = pages * page_bytes(layout.num_layers, layout.num_heads, layout.attention_dim,
                                              layout.linear_dim, runner.page_size, layout.dtype)
        return CachedRanker(runner, budget_bytes=budget_bytes, page_size=runner.page_size,
                            max_time_drift=max_time_drift)

    def _derived_kv_cache(self, budget_bytes: int | None, max_time_drift: int, cuda_graphs: bool | None,
                          graph_copy_limit: int | str | None, shape_buckets: bool | None) -> Any:
        from hstu_export.runtimes.kv_derived import PackageDerived
        from hstu_export.serving.kv_cache import page_bytes
        from hstu_export.serving.kv_derived import DerivedCachedRanker

        if max_time_drift:
            raise ConfigError("max_time_drift applies to the zoo model's delta program; a derived one reuses a "
                              "user's tokens only while the rows its layers start from are unchanged")
        runner = PackageDerived(self, cuda_graphs=cuda_graphs, graph_copy_limit=graph_copy_limit,
                                shape_buckets=shape_buckets)
        if budget_bytes is None:
            layout, size = runner.layout, runner.page_size
            pages = self.max_batch_size * -(-layout["max_seq_len"] // size) + 1  # and the scratch page
            row_item = torch.empty(0, dtype=getattr(torch, layout["row_dtype"])).element_size()
            budget_bytes = pages * (page_bytes(layout["num_layers"], layout["num_heads"], layout["attention_dim"],
                                               layout["linear_dim"], size, runner.dtype)
                                    + size * layout["row_width"] * row_item)
        return DerivedCachedRanker(runner, budget_bytes=budget_bytes, page_size=runner.page_size)

    @property
    def split(self) -> SplitRunner | None:
        """The sparse and dense halves, when the backend stores them apart (to time the dense part)."""
        return self._runner if isinstance(self._runner, SplitRunner) else None

    def __repr__(self) -> str:
        b = self.manifest["backend"]["name"]
        return f"Predictor({self.root}, backend={b}, device={self.device}, dtype={self.manifest['dtype']})"


# A range check inside an artifact (check_ranges' TorchScript assert, or a compiled sparse half's refusal worded
# as one): the feature's name, then one of RANGE_CHECK_MESSAGES (runtimes/base.py). The C++ runtime reads the same.
_ASSERTION = re.compile(r"AssertionError: ([^\n]+)")
# A guard AOTInductor compiled into a program ("Expected u14 >= 2 but received 1").
_COMPILED_GUARD = re.compile(r"Expected .+ but received")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def plain_tensor(name: str, value: Any) -> Tensor:
    """``value`` as compiled code may read it: a plain dense tensor with contiguous strides, detached.

    AOTInductor reads inputs as contiguous memory without checking strides, so a strided view (``t[::2]``)
    aborted the process or silently gave wrong scores; such views are copied here. Tensors with no data
    (meta) or another layout (sparse, nested, quantized, tensor subclasses) raise RequestError."""
    if (type(value) is Tensor and not value.is_nested and value.dim() == 1 and value.layout == torch.strided
            and not value.requires_grad and value.stride() == (1,) and not value.is_conj() and not value.is_neg()
            and not value.is_meta and not value.is_quantized):
        return value  # the common case, as a request arrives: a plain, contiguous 1-d tensor
    if not isinstance(value, Tensor):
        raise RequestError(f"feature {name!r} must be a tensor, got {type(value).__name__}")
    if value.is_meta:
        raise RequestError(f"feature {name!r} is a meta tensor (it has a shape but no data); pass real values")
    if value.is_nested:
        raise RequestError(f"feature {name!r} is a nested tensor; pass a dense tensor (jagged values flat, "
                           "with their lengths feature)")
    if value.layout != torch.strided:
        raise RequestError(f"feature {name!r} has layout {value.layout}; pass a dense tensor (.to_dense())")
    if value.is_quantized:
        raise RequestError(f"feature {name!r} is a quantized tensor; pass it with its plain dtype")
    if type(value).__torch_dispatch__ is not Tensor.__torch_dispatch__:
        # FakeTensor, FunctionalTensor, DTensor...: no plain memory for compiled code to read.
        raise RequestError(f"feature {name!r} is a {type(value).__name__}; pass a plain torch.Tensor")
    if value.requires_grad:
        value = value.detach()
    value = value.resolve_conj().resolve_neg()
    if value.stride() != _contiguous_strides(value.shape):
        # is_contiguous() ignores the strides of size-1 dims; compiled code may not.
        value = value.clone(memory_format=torch.contiguous_format)
    return value


def to_device(value: Tensor, device: torch.device) -> Tensor:
    """A host-to-device copy may be asynchronous (it is ordered on the stream before the model's
    kernels); a device-to-host copy may not, or the CPU model would read memory still being written."""
    if value.device == device:
        return value
    return value.to(device, non_blocking=device.type == "cuda")


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_environment(manifest: Manifest | dict[str, Any], root: Path) -> torch.device:
    """The device to load on, after checking versions and hardware against the manifest."""
    manifest = as_manifest(manifest, root)
    built = manifest.torch_version
    if _major_minor(built) != _major_minor(torch.__version__):
        raise PackageError(
            f"{root} was built with torch {built[:40]} but this process has torch {torch.__version__}; "
            "compiled artifacts only load with the same torch major.minor: re-export it here"
        )
    device_meta = manifest.device
    if device_meta.type == "cuda":
        if not torch.cuda.is_available():
            raise PackageError(f"{root} is a CUDA package but this machine has no usable CUDA device")
        major, minor = torch.cuda.get_device_capability()
        here = f"sm_{major}{minor}"
        if here != device_meta.arch:
            raise PackageError(
                f"{root} was compiled for {device_meta.arch[:40]} ({device_meta.name[:80]}) but this GPU is {here} "
                f"({torch.cuda.get_device_name()}); re-export on this GPU"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_op_libraries(names: list[str] | tuple[str, ...], root: Path) -> None:
    """Imports the module OP_LIBRARIES maps each name to; a name not there is refused, never imported."""
    for name in names:
        module = OP_LIBRARIES.get(name) if isinstance(name, str) else None
        if module is None:
            raise PackageError(
                f"{root} names the op library {str(name)[:80]!r}, which is not one hstu-export loads "
                f"({', '.join(OP_LIBRARIES)}); a package cannot make the loader import other modules"
            )
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as exc:
            raise PackageError(
                f"{root} needs the op library {name!r} at load time, and importing it failed ({exc}); "
                "install it in this environment"
            ) from None


def _tables_device(manifest: Manifest, root: Path, device: torch.device, asked: str | None) -> torch.device | None:
    """Where ``load`` puts the package's tables stored outside their program (None: on ``device``)."""
    if asked is None:
        return None
    check_tables_device(manifest.artifacts, root, device.type, asked)
    return torch.device(asked)


def load(path: str | Path, *, verify_checksums: bool = True, require_signature: str | Path | None = None,
         tables_device: str | None = None, cuda_graphs: bool | None = None,
         graph_copy_limit: int | str | None = None, runtime: str = "python") -> Predictor | NativePredictor:
    """Load a package written by ``hstu_export.export`` / ``hstu-export MODEL``, or the current version of a
    directory ``hstu-export publish`` writes. With
    ``require_signature`` (a public key, PEM), the package must carry a signature by its private key over
    exactly its files (``hstu-export sign``), checked before anything of it is read. ``tables_device``
    (``cpu`` or ``cuda``; default: the package's device): where the tables stored beside a compiled sparse program
    live; ``cpu`` serves a CUDA package whose tables exceed the GPU's memory from pinned host memory.
    ``cuda_graphs`` (default: on for a CUDA package whose programs read nothing back from the device) replays
    whole requests from CUDA graphs, one per exact request shapes seen twice, for the first 16 shapes captured
    (:mod:`~hstu_export.runtimes.shape_graphs`); a request whose tensors exceed ``graph_copy_limit`` (bytes or a size such as ``"2MiB"``;
    default 512 KiB: a few users of long histories, past which the GPU's work bounds a request) runs as it is. ``True`` refuses a package that cannot be replayed (``graphs_unsafe``).
    ``runtime="native"`` returns the package served by the C++ runtime instead
    (:class:`~hstu_export.runtimes.native.NativePredictor`, built by ``make cpp-runtime``; its library found as that
    class finds it): the same answers bit for bit and the same refusals, with these options, called and cached
    (``kv_cache``) the same way, without the interpreter's time in each call (docs/PERF.md); a required signature is
    checked here first."""
    check_runtime(runtime)
    root = Path(path)
    if is_published_root(root):  # hstu-export publish's directory: its current version
        root = current_path(root)
    # An export killed midway through replacing this package may have left it moved aside: put it back.
    recover_interrupted_replace(root)
    if require_signature is not None:
        from hstu_export.package.signing import verify_signature

        verify_signature(root, require_signature)
    if runtime == "native":
        return NativePredictor(root, tables_device=tables_device, verify_checksums=verify_checksums,
                               cuda_graphs=cuda_graphs, graph_copy_limit=graph_copy_limit)
    manifest = load_manifest(root, verify_checksums=verify_checksums)
    device = check_environment(manifest, root)
    load_op_libraries(manifest.op_libraries, root)
    backend = get_backend(manifest.backend.name)  # a registered name: parse_manifest checked it
    runner = backend.load(root, manifest, device, _tables_device(manifest, root, device, tables_device))
    return Predictor(root, manifest, runner, device, cuda_graphs=cuda_graphs, graph_copy_limit=graph_copy_limit)
