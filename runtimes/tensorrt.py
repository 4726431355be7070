"""TensorRT backend: the dense graph through Torch-TensorRT's dynamo path (``torch.export`` with the shared
named dynamic dims, then ``torch_tensorrt.dynamo.compile`` with one min/opt/max profile per input), saved
as an ExportedProgram whose TensorRT engines run through the ``tensorrt::execute_engine`` op. The sparse
graph is TorchScript, as for the other backends.

TensorRT has no HSTU or fbgemm ops, so the dense graph must use the ``aten`` op target; anything else is
an error before any compilation. Ops TensorRT cannot convert stay in PyTorch (``--dryrun`` says which).
Written against torch-tensorrt 2.13 / TensorRT 11.0; not exercised in this repository's CI (see
docs/TENSORRT.md for how to verify it on a GPU machine).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import (
    BackendUnavailableError,
    ConfigError,
    ExportError,
    PackageError,
    UnmappedOpsError,
)
from hstu_export.package.manifest import BackendFields, backend_fields
from hstu_export.runtimes.aoti import export_dense
from hstu_export.runtimes.base import (
    Backend,
    BackendArtifacts,
    CompileInputs,
    DimSpec,
    Runner,
    SplitRunner,
    torch_dynamic_shapes,
)
from hstu_export.runtimes.graph_io import op_calls
from hstu_export.runtimes.sparse_torchscript import compile_sparse, load_sparse
from hstu_export.settings import ExportSettings

DENSE_FILE = "dense/dense_trt.ep"
INSTALL_HINT = "pip install 'hstu-export[trt]'"
# Namespaces TensorRT's converters (or its PyTorch fallback) handle without a library of ours.
TENSORRT_NAMESPACES = frozenset({"aten", "prims", "_assert", "higher_order", "_operator", "profiler"})
# Loading the package imports this so ``tensorrt::execute_engine`` resolves.
RUNTIME_LIBRARY = "torch_tensorrt"


# -- input profiles (pure; no TensorRT needed) ------------------------------------------------------

@dataclass(frozen=True)
class InputProfile:
    """One TensorRT optimization-profile entry: min/opt/max shape of one named input."""

    name: str
    min_shape: tuple[int, ...]
    opt_shape: tuple[int, ...]
    max_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def dynamic(self) -> bool:
        return self.min_shape != self.max_shape


def dim_ranges(
    names: list[str], examples: dict[str, Tensor], dims: dict[str, dict[int, DimSpec]]
) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) per dim name. Every axis with one DimSpec name gets the same triple: TensorRT needs
    consistent profiles for dims the exported graph asserts equal. opt is the example's size (the export
    example has every dynamic dim >= 2); min is at least 1."""
    found: dict[str, tuple[int, int, int]] = {}
    for input_name in names:
        for axis, spec in dims.get(input_name, {}).items():
            size = int(examples[input_name].shape[axis])
            triple = (max(spec.min, 1), size, spec.max)
            lo, opt, hi = triple
            if opt < 2:
                raise ExportError(f"the example size of {input_name!r} axis {axis} (dim {spec.name!r}) is {opt}; "
                                  "TensorRT profiles need an example size >= 2 for every dynamic dim")
            if not lo <= opt <= hi:
                raise ExportError(f"the example size {opt} of {input_name!r} axis {axis} is outside dim "
                                  f"{spec.name!r}'s range [{lo}, {hi}]")
            if found.setdefault(spec.name, triple) != triple:
                raise ExportError(f"dim {spec.name!r} has two ranges, {found[spec.name]} and {triple} (at "
                                  f"{input_name!r} axis {axis}); dims that share a name must agree")
    return found


def input_profiles(
    names: list[str], examples: dict[str, Tensor], dims: dict[str, dict[int, DimSpec]]
) -> list[InputProfile]:
    """Profiles for the inputs ``names`` in order; axes without a DimSpec are static (the example's size)."""
    ranges = dim_ranges(names, examples, dims)
    profiles = []
    for input_name in names:
        example = examples[input_name]
        shapes: list[list[int]] = [list(example.shape) for _ in range(3)]
        for axis, spec in dims.get(input_name, {}).items():
            for i, size in enumerate(ranges[spec.name]):
                shapes[i][axis] = size
        profiles.append(InputProfile(input_name, tuple(shapes[0]), tuple(shapes[1]), tuple(shapes[2]), example.dtype))
    return profiles


def torch_executed_op_names(ops: tuple[str, ...] | list[str]) -> list[str]:
    """``aten.sub.Tensor``, ``torch.ops.aten.sub.Tensor`` or a packet ``aten.sub`` (all its overloads) ->
    the qualified names Torch-TensorRT matches (``torch.ops.aten.sub.Tensor``)."""
    names: list[str] = []
    for text in ops:
        parts = text.strip().removeprefix("torch.ops.").split(".")
        if len(parts) not in (2, 3) or not all(parts):
            raise ConfigError(f"--torch-executed-op {text!r}: use namespace.op[.overload], e.g. aten.mm.default")
        try:
            packet = getattr(getattr(torch.ops, parts[0]), parts[1])
            overloads = [parts[2]] if len(parts) == 3 else list(packet.overloads())
            for overload in overloads:
                getattr(packet, overload)
        except (AttributeError, RuntimeError):
            raise ConfigError(f"--torch-executed-op {text!r}: no such op in torch.ops") from None
        names += [f"torch.ops.{parts[0]}.{parts[1]}.{o}" for o in overloads]
    return sorted(set(names))


def foreign_ops(module: torch.nn.Module) -> Counter[str]:
    """``ns::op`` -> count, for every op call outside the namespaces TensorRT handles (all nested graphs)."""
    return Counter({key: n for key, n in op_calls(module).items()
                    if key.partition("::")[0] not in TENSORRT_NAMESPACES})


def check_only_aten(module: torch.nn.Module, what: str) -> None:
    ops = foreign_ops(module)
    if ops:
        listing = ", ".join(f"{k} (x{n})" for k, n in sorted(ops.items()))
        raise UnmappedOpsError(f"the {what} still calls {listing}, which TensorRT cannot convert; "
                               "export with --op-target aten (the trt backend's default)")


# -- availability -----------------------------------------------------------------------------------

def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def missing_requirements() -> list[str]:
    """What this environment lacks for the trt backend, each as a short phrase (empty when all is there)."""
    problems: list[str] = []
    missing_libs: list[str] = []
    for name in ("torch_tensorrt", "tensorrt"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            missing_libs.append(name)
            continue
        except Exception as exc:  # a broken install (missing CUDA libraries) raises OSError and the like
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            problems.append(f"{name} fails to import ({first})")
            continue
        if name == "torch_tensorrt":
            version = str(getattr(module, "__version__", ""))
            if version and _major_minor(version) != _major_minor(torch.__version__):
                problems.append(f"torch_tensorrt {version} does not match torch {torch.__version__} (their "
                                f"major.minor must be equal: {INSTALL_HINT})")
    if missing_libs:
        verb = "is" if len(missing_libs) == 1 else "are"
        problems.insert(0, f"{' and '.join(missing_libs)} {verb} not installed ({INSTALL_HINT})")
    if not torch.cuda.is_available():
        why = "this torch build is CPU-only" if torch.version.cuda is None else "torch sees no GPU"
        problems.append(f"no CUDA device ({why}; TensorRT needs an NVIDIA GPU and a CUDA build of torch)")
    return problems


# -- the backend ------------------------------------------------------------------------------------

class TensorRTBackend(Backend):
    name = "trt"
    supports_dryrun = True
    description = "Torch-TensorRT engines in an ExportedProgram (CUDA)"
    devices = ("cuda",)

    def default_op_target(self, device: torch.device) -> str:
        return "aten"

    def check_available(self, settings: ExportSettings) -> None:
        problems = missing_requirements()
        if problems:
            raise BackendUnavailableError(f"the trt backend cannot run here: {'; '.join(problems)}")
        torch_executed_op_names(settings.torch_executed_ops)  # a typo fails now, not after tracing

    # The steps below are shared by compile() and dryrun().

    def dense_program(self, inputs: CompileInputs) -> torch.export.ExportedProgram:
        """The ExportedProgram TensorRT receives: the dense graph, checked for ops TensorRT cannot take."""
        check_only_aten(inputs.dense, "dense graph")
        program = export_dense(inputs)
        check_only_aten(program.graph_module, "exported dense graph")
        return program

    def compile_options(self, inputs: CompileInputs) -> dict[str, Any]:
        """Keyword arguments of ``torch_tensorrt.dynamo.compile`` (besides the program)."""
        import torch_tensorrt

        settings = inputs.settings
        device = settings.torch_device
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        kwarg_inputs = {}
        for p in input_profiles(inputs.dense_input_names, inputs.example_dense_inputs, inputs.dense_dynamic_dims):
            example = inputs.example_dense_inputs[p.name]
            if p.dynamic:
                kwarg_inputs[p.name] = torch_tensorrt.Input(
                    min_shape=p.min_shape, opt_shape=p.opt_shape, max_shape=p.max_shape, dtype=p.dtype,
                    name=p.name, torch_tensor=example,
                )
            else:
                kwarg_inputs[p.name] = torch_tensorrt.Input(shape=p.opt_shape, dtype=p.dtype, name=p.name,
                                                            torch_tensor=example)
        options: dict[str, Any] = {
            "arg_inputs": (),
            "kwarg_inputs": kwarg_inputs,
            "device": device,
            # TensorRT 11 networks are strongly typed: precision comes from the graph (the exporter has cast
            # the model to --dtype), so enabled_precisions is not passed (torch-tensorrt rejects it).
            # Eager PyTorch runs fp32 matmuls without TF32 and accumulates fp16 in fp32; match both.
            "disable_tf32": settings.dtype == "float32",
            "use_fp32_acc": settings.dtype == "float16",
            "workspace_size": settings.workspace_bytes or 0,  # 0: TensorRT's default (the device's memory)
            "min_block_size": settings.min_block_size,
            "torch_executed_ops": set(torch_executed_op_names(settings.torch_executed_ops)),
            "truncate_double": True,
            "use_python_runtime": False,  # the C++ runtime: needed to serialize as an ExportedProgram
            "require_full_compilation": False,
        }
        return options

    def dryrun(self, inputs: CompileInputs) -> str:
        """Torch-TensorRT's partitioning report (which ops TensorRT takes, which stay in PyTorch); builds no
        engine and writes nothing."""
        import torch_tensorrt

        program = self.dense_program(inputs)
        options = self.compile_options(inputs)
        printed = io.StringIO()
        with tempfile.TemporaryDirectory(prefix="hstu-trt-dryrun-") as tmp:
            report_path = Path(tmp) / "report.txt"
            try:
                with contextlib.redirect_stdout(printed):
                    torch_tensorrt.dynamo.compile(program, **options, dryrun=str(report_path))
            except Exception as exc:
                raise ExportError(f"Torch-TensorRT partitioning failed: {_first_line(exc)}") from exc
            report = report_path.read_text() if report_path.exists() else printed.getvalue()
        return _settings_header(inputs) + report.strip() + "\n"

    def compile(self, inputs: CompileInputs, out_dir: Path) -> BackendArtifacts:
        import tensorrt
        import torch_tensorrt

        program = self.dense_program(inputs)
        sparse, sparse_libraries = compile_sparse(inputs, out_dir)
        options = self.compile_options(inputs)
        try:
            trt_module = torch_tensorrt.dynamo.compile(program, **options)
        except Exception as exc:
            raise ExportError(f"TensorRT compilation failed: {_first_line(exc)}") from exc
        path = out_dir / DENSE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        # Shared torch.export Dims keep equal dims equal in the saved program (Input objects alone would
        # give every input its own dims).
        dynamic = torch_dynamic_shapes(inputs.dense_input_names, inputs.dense_dynamic_dims)
        try:
            torch_tensorrt.save(
                trt_module, str(path), output_format="exported_program", arg_inputs=(),
                kwarg_inputs=dict(inputs.example_dense_inputs), dynamic_shapes=dynamic, retrace=True,
            )
        except Exception as exc:
            raise ExportError(f"saving the TensorRT program failed: {_first_line(exc)}") from exc
        major, minor = torch.cuda.get_device_capability(options["device"])
        meta = {
            "tensorrt": str(tensorrt.__version__),
            "torch_tensorrt": str(torch_tensorrt.__version__),
            "gpu": torch.cuda.get_device_name(options["device"]),
            "gpu_arch": f"sm_{major}{minor}",
            "workspace_bytes": inputs.settings.workspace_bytes,
            "min_block_size": inputs.settings.min_block_size,
            "torch_executed_ops": sorted(options["torch_executed_ops"]),
            "engines": _count_engines(trt_module),
            "profiles": [
                {"name": p.name, "min": list(p.min_shape), "opt": list(p.opt_shape), "max": list(p.max_shape)}
                for p in input_profiles(inputs.dense_input_names, inputs.example_dense_inputs,
                                        inputs.dense_dynamic_dims)
            ],
        }
        return BackendArtifacts(
            files={"sparse": sparse, "dense": DENSE_FILE},
            meta=meta,
            op_libraries=sorted(set(sparse_libraries) | {RUNTIME_LIBRARY}),
        )

    def load(self, root: Path, manifest: BackendFields | dict[str, Any], device: torch.device,
             tables_device: torch.device | None = None) -> Runner:
        fields = backend_fields(manifest, root)
        try:
            import tensorrt
            import torch_tensorrt
        except ImportError as exc:
            raise PackageError(f"{root} is a TensorRT package and loading it needs {exc.name}: {INSTALL_HINT}") from None
        built = fields.backend.meta.get("tensorrt", "")
        if not isinstance(built, str):
            raise PackageError(f"{root}: manifest field backend.meta.tensorrt: expected a string, got "
                               f"{type(built).__name__}")
        if built and _major_minor(built) != _major_minor(str(tensorrt.__version__)):
            raise PackageError(f"{root} holds TensorRT {built[:40]} engines but this process has TensorRT "
                               f"{tensorrt.__version__}; engines only load with the same TensorRT: re-export it here")
        path = fields.artifact(root, "dense")
        sparse = load_sparse(root, fields, device)
        try:
            # torch_tensorrt.load is torch.export.load plus the engine op registrations it needs.
            loaded = torch_tensorrt.load(str(path))
            dense = loaded.module() if isinstance(loaded, torch.export.ExportedProgram) else loaded
        except Exception as exc:
            raise PackageError(f"{root}: could not load the TensorRT program {fields.backend.files['dense']}: "
                               f"{_first_line(exc)}") from exc
        # Calls into one engine's execution context are serialized, so the Predictor stays thread-safe.
        lock = threading.Lock()

        def run_dense(**dense_inputs: Tensor) -> Any:
            with lock:
                return dense(**dense_inputs)

        return SplitRunner(sparse, run_dense, list(fields.dense_passthrough_inputs), list(fields.output_names))


def _count_engines(module: torch.nn.Module) -> int:
    """TensorRT subgraphs in a compiled module (Torch-TensorRT names them ``_run_on_acc_<n>``)."""
    return sum(1 for name, _ in module.named_children() if name.startswith("_run_on_acc"))


def _settings_header(inputs: CompileInputs) -> str:
    s = inputs.settings
    lines = [
        f"TensorRT dry run (nothing built or written): min_block_size={s.min_block_size}, "
        f"torch_executed_ops={torch_executed_op_names(s.torch_executed_ops) or 'none'}, dtype={s.dtype}",
        "input profiles (min / opt / max):",
    ]
    for p in input_profiles(inputs.dense_input_names, inputs.example_dense_inputs, inputs.dense_dynamic_dims):
        lines.append(f"  {p.name}: {list(p.min_shape)} / {list(p.opt_shape)} / {list(p.max_shape)} {p.dtype}")
    return "\n".join(lines) + "\n"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
