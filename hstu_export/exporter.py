"""One export: bundle → trace → passes → backend → verify → package (atomic).

``export()`` is the Python API behind ``hstu-export MODEL``. Progress is reported through an optional
callback so the CLI can show stages; nothing here prints.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hstu_export.errors import ConfigError, ExportError, VerificationError
from hstu_export.ops.mappings import (
    fixed_attention_scale,
    function_mappings,
    imported_functions,
    unscalable_attention,
)
from hstu_export.package.artifacts import describe as describe_artifacts
from hstu_export.package.artifacts import name_dims, op_library_files
from hstu_export.package.directory import (
    OP_NAMESPACE,
    check_target,
    commit,
    device_info,
    library_versions,
    sha256_file,
    staging_dir,
    write_manifest,
)
from hstu_export.package.ranges import ExportRanges, exported_schema
from hstu_export.package.schema import InputSchema
from hstu_export.runtimes import get_backend
from hstu_export.runtimes.base import CompileInputs, DimSpec
from hstu_export.settings import ExportSettings
from hstu_export.sources.bundle import ModelBundle, load_bundle
from hstu_export.sources.hints import model_hints
from hstu_export.sources.model_failures import running_model
from hstu_export.sources.model_limits import Limit, lengths_limits, sequence_limits
from hstu_export.verification.batch import generate_batch
from hstu_export.verification.corners import verification_batches
from hstu_export.verification.parity import check_parity, mismatch_summary

BATCH_DIM = "batch"
Progress = Callable[[str], Any]  # called with a stage name; may return a context manager


@dataclass
class ExportResult:
    path: Path
    manifest: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    dryrun_report: str | None = None  # set by --dryrun: the backend's report; nothing was written

    @property
    def parity(self) -> dict[str, Any]:
        return self.manifest["parity"]


def export_ranges(schema: InputSchema, settings: ExportSettings,
                  stated: dict[str, tuple[int | None, int | None]] | None = None,
                  limits: dict[str, Limit] | None = None) -> ExportRanges:
    """Exported ranges from the model's schema, ranges the model states in its hints (``stated``) and the
    settings (``--max-length``, ``--max-seq-len``, ``--max-candidates``), in rising priority. ``limits`` are
    the model's own (``hstu_export.sources.model_limits.lengths_limits``): only those cannot be widened, and a
    schema's maxima are only defaults beside them (a bundle's stored schema holds the ranges stated when it
    was saved). Without ``limits``, the schema's maxima are the model's own."""
    chosen: dict[str, tuple[int | None, int | None]] = {}
    flags: dict[str, str] = {}
    for source, flag in ((stated or {}, "the range stated for {key}"), (settings.lengths, "--max-length {key}")):
        for key, value in source.items():
            for name in schema.resolve_lengths(key):
                chosen[schema.canonical_lengths(name)] = value
                flags[schema.canonical_lengths(name)] = flag.format(key=key)
    max_lengths, min_lengths = {}, {}
    for f in schema.lengths_features():
        if f.same_as:
            continue
        limit = (limits.get(f.name) if limits is not None else
                 Limit(f.max_value, "the model's input schema") if f.max_value is not None else None)
        default = f.max_value if f.max_value is not None else limit.value if limit is not None else None
        lo, hi = chosen.get(f.name, (None, None))
        wanted = hi if hi is not None else {
            "history_length": settings.max_seq_len, "candidate_count": settings.max_candidates
        }.get(f.semantic)
        if default is None and wanted is None:
            raise ConfigError(
                f"no maximum length for {f.name!r}: the model does not bound it; pass --max-length {f.name}=N "
                "(or state ranges in the bundle / the model's export hints)"
            )
        if wanted is not None and limit is not None and wanted > limit.value:
            flag = (f"{flags[f.name]}={wanted}" if hi is not None
                    else "--max-seq-len" if f.semantic == "history_length" else "--max-candidates")
            raise ConfigError(f"{flag} exceeds the model's own limit of {limit.value} for {f.name!r} "
                              f"({limit.source})")
        max_lengths[f.name] = wanted if wanted is not None else default
        floor = lo if lo is not None else (f.min_value if f.min_value is not None else 1)
        min_lengths[f.name] = min(max(floor, 0), max_lengths[f.name])
    for f in schema.lengths_features():
        if f.same_as:
            root = schema.canonical_lengths(f.name)
            max_lengths[f.name], min_lengths[f.name] = max_lengths[root], min_lengths[root]
    return ExportRanges(settings.max_batch_size, max_lengths, min_lengths)


def feature_dims(schema: InputSchema, ranges: ExportRanges) -> dict[str, dict[int, DimSpec]]:
    """Named dynamic dims of every model input, by graph-input name: [B] features share ``batch``;
    jagged values share ``<lengths>.total`` (keys that share lengths share it too). Maxima are at
    least 2 so the example (all dims >= 2) fits."""
    b_max = max(ranges.max_batch_size, 2)
    dims: dict[str, dict[int, DimSpec]] = {}
    for f in schema.features:
        if f.kind == "jagged":
            dims[f.graph_name] = {0: total_dim(schema.canonical_lengths(f.jagged_by or ""), ranges)}
        else:
            dims[f.graph_name] = {0: DimSpec(BATCH_DIM, 1, b_max)}
    return dims


def total_dim(lengths_name: str, ranges: ExportRanges) -> DimSpec:
    """The dim of values partitioned by ``lengths_name``: its own dynamic size, or ``k * batch`` when
    every user has exactly k values (a contextual feature with one id per user)."""
    b_max = max(ranges.max_batch_size, 2)
    fixed = ranges.max_lengths[lengths_name]
    if fixed >= 1 and ranges.min_lengths[lengths_name] == fixed:
        return DimSpec(BATCH_DIM, 1, b_max, scale=fixed)
    return DimSpec(f"{lengths_name}.total", 1, max(b_max * ranges.max_lengths[lengths_name], 4))


def export_example_batch(schema: InputSchema, ranges: ExportRanges, seed: int,
                         unlike: dict[str, int] | None = None) -> dict[str, Tensor]:
    """A batch whose dynamic sizes are all >= 2 and pairwise different, so torch.export neither
    specialises a dim to 0/1 nor unifies two independent dims that happen to be equal. With ``unlike``
    (``dim_values`` of another batch), every dynamic size differs from that batch's too where the ranges
    allow, so that comparing the two tells which output dims follow which input dims."""
    b = 3 if ranges.max_batch_size >= 3 else 2
    if unlike and unlike.get(BATCH_DIM) == b and ranges.max_batch_size >= 4:
        b = 4
    canonical = [f for f in schema.lengths_features() if not f.same_as]
    fixed = {f.name for f in canonical if ranges.min_lengths[f.name] == ranges.max_lengths[f.name]}
    for attempt in range(200):
        gen = torch.Generator().manual_seed(seed + attempt)
        chosen = {}
        for f in canonical:
            lo, hi = max(ranges.min_lengths[f.name], 1), ranges.max_lengths[f.name]
            chosen[f.name] = torch.randint(lo, max(hi, lo) + 1, (b,), generator=gen).tolist()
        # Fixed-length features have k * batch values: a derived dim, not one that must differ.
        totals = {f"{name}.total": sum(v) for name, v in chosen.items() if name not in fixed}
        sizes = [b, *totals.values()]
        if min(sizes) < 2 or len(set(sizes)) != len(sizes):
            continue
        if unlike and attempt < 150 and any(unlike.get(k) == v for k, v in totals.items()):
            continue
        return generate_batch(schema, b, seed=seed, lengths=chosen)
    raise ConfigError("cannot build an export example batch with distinct dynamic sizes; widen the length ranges")


def dim_values(schema: InputSchema, ranges: ExportRanges, batch: dict[str, Tensor]) -> dict[str, int]:
    """The size of every named dynamic dim (``batch``, ``<lengths>.total``) in ``batch`` (keyed by request
    or graph-input names)."""
    def get(f: Any) -> Tensor:
        return batch[f.name] if f.name in batch else batch[f.graph_name]

    canonical = [f for f in schema.lengths_features() if not f.same_as]
    values = {BATCH_DIM: int(get(canonical[0]).size(0))} if canonical else {}
    for f in canonical:
        if ranges.min_lengths[f.name] != ranges.max_lengths[f.name]:
            values[f"{f.name}.total"] = int(get(f).sum())
    return values


def probe_batch(schema: InputSchema, ranges: ExportRanges, seed: int) -> dict[str, Tensor]:
    """The largest batch the package accepts: every user at every maximum length."""
    b = ranges.max_batch_size
    return generate_batch(schema, b, seed=seed, lengths={f.name: [ranges.max_lengths[f.name]] * b
                                                         for f in schema.lengths_features() if not f.same_as})


def _run_stage(progress: Progress | None, name: str) -> contextlib.AbstractContextManager[Any]:
    if progress is None:
        return contextlib.nullcontext()
    result = progress(name)
    return result if isinstance(result, contextlib.AbstractContextManager) else contextlib.nullcontext()


@contextlib.contextmanager
def _timed(timings: dict[str, float], progress: Progress | None, name: str) -> Iterator[None]:
    start = time.perf_counter()
    with _run_stage(progress, name):
        yield
    timings[name] = round(time.perf_counter() - start, 3)


def _to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


@dataclass
class Captured:
    """A model traced and through the passes, with what export and inspect need around it."""

    result: Any  # PipelineResult
    schema: InputSchema
    ranges: ExportRanges | None  # None when inspecting a model whose lengths have no stated range
    example: dict[str, Tensor]  # the flat request the graph was traced and checked on
    reference: Callable[[dict[str, Tensor]], dict[str, Tensor]]  # the user's model on a flat request
    summary: dict[str, Any]  # opaque calls and leaf modules, for the manifest and the report
    quantized_tables: list[dict[str, Any]] = field(default_factory=list)  # quantize_embeddings' records
    output_plan: Any = None  # OutputPlan: the package's outputs, taken from the model's
    batch_dependent: str | None = None  # why a user's answer depends on the other users of a call (map_ops)
    sparse_lowering: list[dict[str, Any]] = field(default_factory=list)  # lower_embeddings' records


def capture(bundle: ModelBundle, settings: ExportSettings, op_target: str, *, timings: dict[str, float] | None = None,
            progress: Progress | None = None, extra_passes: list[Any] | None = None,
            need_ranges: bool = True) -> Captured:
    """Trace the bundle's model (on ``settings.device``/``dtype``, or in fp32 on ``--reference-device``, the
    graphs then moved to the export device and dtype) and run the passes. ``need_ranges`` False (inspect)
    falls back to the bundle's example batch when no lengths ranges are known."""
    from hstu_export.capture import trace
    from hstu_export.passes.context import PassContext
    from hstu_export.passes.manager import run_passes

    timings = {} if timings is None else timings
    # The model's own code runs here: while tracing, while passes observe values, as the reference.
    device = settings.reference_torch_device
    with _timed(timings, progress, "prepare"):
        schema: InputSchema = bundle.input_schema
        hints = model_hints(bundle.model)
        op_mappings = {**hints.mappings, **settings.op_mappings}
        functions = function_mappings(op_mappings)
        try:
            ranges: ExportRanges | None = export_ranges(schema, settings, hints.ranges,
                                                        lengths_limits(bundle.model, bundle.schema))
        except ConfigError:
            if need_ranges:
                raise
            ranges = None
        eager = copy.deepcopy(bundle.model).to(device=device, dtype=settings.reference_torch_dtype).eval()
        if ranges is not None:
            example = export_example_batch(schema, ranges, seed=settings.verify.seed)
            probes = [probe_batch(schema, ranges, seed=settings.verify.seed + 1)]
        else:
            example, probes = dict(bundle.example_batch), []
        example = _to_device(example, device)
        reference = _eager_reference(eager, schema, settings, functions, device)
    with _timed(timings, progress, "trace"), torch.no_grad(), running_model(device, "while it was traced"):
        gm = trace(eager, example, leaf_modules=settings.leaf_modules, schema=schema,
                   opaque_functions=[*settings.opaque_functions, *imported_functions(list(functions))])
        _check_attention_scale(settings, gm, functions)
        # The package's output names (renamed, one per task) from here on, in the graph and the reference.
        plan = _output_plan(eager, reference, example, schema, ranges, settings, hints)
        plan.apply_to_graph(gm)
        reference = plan.wrap(reference)
    with _timed(timings, progress, "passes"), torch.no_grad(), running_model(device, "while the passes ran its graph"):
        ctx = PassContext(
            example_inputs=schema.to_graph_inputs(example), model=eager, schema=schema, op_target=op_target,
            allow_unmapped=settings.allow_unmapped, dump_dir=settings.dump_dir,
            check_each_pass=settings.check_each_pass,
            probe_inputs=[schema.to_graph_inputs(_to_device(p, device)) for p in probes],
            attention_scale=settings.attention_scale, op_mappings=op_mappings, ranges=ranges,
            quantization=settings.quantization, export_dtype=settings.dtype,
            export_device=settings.torch_device.type,
            reference=lambda graph_batch: reference({f.name: graph_batch[f.graph_name] for f in schema.features}),
        )
        names = list(settings.passes) if settings.passes else None
        if extra_passes:
            from hstu_export.passes import default_pass_names

            names = (names or default_pass_names()) + list(extra_passes)
        result = run_passes(gm, ctx, passes=names, skip=settings.skip_passes)
    if (device, settings.reference_torch_dtype) != (settings.torch_device, settings.torch_dtype):
        # Traced where the model runs; compiled for the export device and dtype. A copy: the graphs share
        # their modules with the model, which stays the reference where it is.
        result = _moved(result, settings.torch_device, settings.torch_dtype)
        example = _to_device(example, settings.torch_device)
    summary = {"opaque_calls": gm.meta.get("opaque_calls", []), "leaf_modules": gm.meta.get("leaf_modules", [])}
    return Captured(result, schema, ranges, example, reference, summary, ctx.quantized_tables, plan,
                    ctx.batch_dependent, ctx.sparse_lowering)


def _output_plan(model: nn.Module, reference: Callable[[dict[str, Tensor]], dict[str, Tensor]],
                 example: dict[str, Tensor], schema: InputSchema, ranges: ExportRanges | None,
                 settings: ExportSettings, hints: Any) -> Any:
    """The package's outputs (``hstu_export.sources.output_plan``), from the model's on the example and,
    when it lists tasks, on a batch of other sizes (which tells the tasks' axis from the candidates')."""
    from hstu_export.sources.output_plan import model_tasks, plan_outputs

    other = None
    if ranges is not None and model_tasks(model) is not None:
        device = next(iter(example.values())).device
        other = reference(_to_device(export_example_batch(schema, ranges, seed=settings.verify.seed + 7919,
                                                          unlike=dim_values(schema, ranges, example)), device))
    return plan_outputs(model, reference(example), other, renames={**hints.output_names, **settings.output_names},
                        score_outputs=settings.score_outputs, declared_kinds=hints.output_kinds,
                        reserved=tuple(dict.fromkeys([*(f.name for f in schema.features), *schema.graph_names])))


def _moved(result: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A PipelineResult whose graphs are copies on ``device`` in ``dtype`` (floating tensors only)."""
    import dataclasses

    from hstu_export.passes.boundary import DENSE, SPARSE

    graph = copy.deepcopy(result.graph).to(device=device, dtype=dtype)
    return dataclasses.replace(result, graph=graph,
                               sparse=getattr(graph, SPARSE) if result.sparse is not None else None,
                               dense=getattr(graph, DENSE) if result.dense is not None else None)


def export(
    model: str | Path | ModelBundle,
    out: str | Path,
    settings: ExportSettings | None = None,
    *,
    allow_pickle: bool = False,
    extra_passes: list[Any] | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Export ``model`` (a bundle path or a loaded ModelBundle) to the package directory ``out``.

    ``extra_passes`` are pass objects (``name``, ``run(gm, ctx)``) appended after the default passes.
    With ``settings.dryrun`` the backend's ``dryrun(inputs)`` report is returned in ``dryrun_report`` and
    nothing is compiled or written.
    Raises our error types: ConfigError/BundleError (bad input, nothing done), PackageError (the package
    cannot be written there: read-only, no permission, not enough disk space; nothing done), ExportError
    (also a full disk or a read-only file system met while writing; nothing written), VerificationError
    (nothing written)."""
    from hstu_export.package.directory import check_free_space, check_writable, file_system_errors

    settings = settings or ExportSettings()
    out = Path(out)
    timings: dict[str, float] = {}
    backend = get_backend(settings.backend)
    device = settings.torch_device
    # Missing libraries first: that message says what to install, whatever --device was given.
    backend.check_available(settings)
    if device.type not in backend.devices:
        raise ConfigError(f"the {backend.name} backend supports --device {' / '.join(backend.devices)}, not {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but this machine has no usable CUDA device")
    if settings.dryrun and not backend.supports_dryrun:
        raise ConfigError(f"--dryrun reports how a backend partitions the graph; the {backend.name} backend has no "
                          "dry run (use --backend trt)")
    if not settings.dryrun:
        check_target(out, settings.force, protect=[model.path if isinstance(model, ModelBundle) else Path(model)])
    if settings.dump_dir is not None:
        check_writable(settings.dump_dir, "--dump-graphs")
    _check_pass_names(settings)
    if settings.kv_cache:
        from hstu_export.kv_export import check_kv_cache

        check_kv_cache(backend.name)

    with _timed(timings, progress, "load"):
        bundle = (model if isinstance(model, ModelBundle)
                  else load_bundle(model, allow_pickle=allow_pickle, imports=settings.imports))

    weight_bytes = _refuse_what_the_machine_cannot_hold(bundle, settings, out)
    _check_quantization(bundle, settings)
    if settings.kv_cache:
        _written_delta(bundle.model, settings)  # --kv-program written on another model: refused before tracing
    op_target = settings.op_target or backend.default_op_target(device)
    doing = f"writing the graph dumps to {settings.dump_dir}" if settings.dump_dir is not None else "the export"
    with file_system_errors(settings.dump_dir, doing):
        captured = capture(bundle, settings, op_target, timings=timings, progress=progress, extra_passes=extra_passes)
    result, schema, ranges, example = captured.result, captured.schema, captured.ranges, captured.example
    _check_sequence_length(result, schema, ranges, settings, bundle.model)
    if settings.kv_cache and _written_delta(bundle.model, settings) and not captured.output_plan.keeps_model_names:
        raise ConfigError("--kv-cache serves the zoo model's outputs under the model's own names: export without "
                          "--output-names (or the model's output_names hints)")
    assert ranges is not None  # capture() raises without ranges when need_ranges
    if result.sparse is None or result.dense is None or result.boundary is None:
        raise ConfigError("exporting needs the split_sparse_dense pass; do not skip it")

    with running_model(device, "while its split graphs ran"):
        inputs = _compile_inputs(result, schema.to_graph_inputs(example), schema, ranges, settings)
    derived = None
    if settings.kv_cache and not _written_delta(bundle.model, settings):
        from hstu_export.kv_derived_export import derive_for_export

        with _timed(timings, progress, "kv-cache derivation"), torch.no_grad():
            # The pipeline again at the triton target, so that each attention is one node (our Triton op, read
            # back as the generic op; a gated one as the attention and its gate, whichever model wrote it): the
            # derivation reads the layers around it, then lowers the program to op_target.
            again = capture(bundle, _replace(settings, dump_dir=None), "triton")
            with running_model(device, "while its delta program was derived"):
                derived = derive_for_export(again.result, inputs, op_target)
    if settings.dryrun:
        with _timed(timings, progress, "compile"), torch.no_grad():
            report = backend.dryrun(inputs)
        return ExportResult(out, {}, timings, dryrun_report=report)
    with running_model(device, "while its split graphs ran"):
        output_shapes = _output_shapes(result, schema, ranges, inputs, settings)
    outputs = captured.output_plan.describe(output_shapes, inputs.example_outputs)
    with staging_dir(out) as staged:
        # Again, after the long capture: something else may have filled the disk meanwhile.
        check_free_space(out, weight_bytes)
        with _timed(timings, progress, "compile"), torch.no_grad(), _collecting_triton_configs() as configs:
            artifacts = backend.compile(inputs, staged)
        _check_op_libraries(artifacts.op_libraries)
        ranges, compiled_narrowing = _narrow_to_compiled(artifacts.meta.get("narrowed_dims", []), ranges)
        kv_section = None
        if settings.kv_cache and _written_delta(bundle.model, settings):
            from hstu_export.kv_export import compile_kv_delta

            with _timed(timings, progress, "kv-cache program"), torch.no_grad():
                kv_model = copy.deepcopy(bundle.model).to(device=device, dtype=settings.torch_dtype).eval()
                kv_section = compile_kv_delta(kv_model, ranges, settings, op_target, staged, inputs.output_names)
        elif derived is not None:
            from hstu_export.kv_derived_export import compile_derived_delta

            with _timed(timings, progress, "kv-cache program"), torch.no_grad(), \
                    running_model(device, "while its delta program was compiled"):
                kv_section = compile_derived_delta(derived, inputs, settings, staged, artifacts,
                                                   {f.graph_name: f.name for f in schema.features})
            ranges, kv_narrowing = _narrow_to_compiled(kv_section.get("narrowed_dims", []), ranges)
            compiled_narrowing += kv_narrowing
        if result.report_path is not None and settings.graphs_in_package:
            # Asked for: the graph dumps travel inside the package (graphs/report.html).
            shutil.copytree(result.report_path.parent, staged / "graphs")
        graph_names = set(schema.graph_names)
        manifest: dict[str, Any] = {
            "model": {
                "name": bundle.model_name,
                "source": bundle.source,
                "config": bundle.config_dict,
                "bundle": str(bundle.path) if bundle.path else None,
                "bundle_sha256": sha256_file(bundle.path) if bundle.path else None,
            },
            "op_namespace": OP_NAMESPACE,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": library_versions(),
            "backend": {"name": backend.name, "files": artifacts.files, "meta": artifacts.meta},
            "device": device_info(device),
            "dtype": settings.dtype,
            "op_target": op_target,
            "op_libraries": artifacts.op_libraries,
            "triton_configs": dict(sorted(configs.items())) if op_target == "triton" else {},
            "input_schema": exported_schema(schema, ranges).to_json(),
            "ranges": {"max_batch_size": ranges.max_batch_size, "lengths": ranges.to_json(),
                       "dims": {d.name: [d.min, ranges.max_batch_size if d.name == BATCH_DIM and compiled_narrowing
                                          else d.max]
                                for dims in inputs.dense_dynamic_dims.values() for d in dims.values()},
                       **({"narrowed": compiled_narrowing} if compiled_narrowing else {})},
            "sparse_input_names": inputs.sparse_input_names,
            "sparse_output_names": [n for n in inputs.dense_input_names if n not in graph_names],
            "dense_input_names": inputs.dense_input_names,
            "dense_passthrough_inputs": [n for n in inputs.dense_input_names if n in graph_names],
            "output_names": inputs.output_names,
            "outputs": outputs,
            "artifacts": describe_artifacts(backend.name, artifacts.files, inputs, feature_dims(schema, ranges),
                                            {f.graph_name: f.name for f in schema.features}, output_shapes,
                                            artifacts.formats, artifacts.constants),
            "op_library_files": op_library_files(artifacts.op_libraries),
            "boundary": result.boundary.to_json(),
            "passes": result.report.to_json(),
            "capture": captured.summary,
            "settings": settings.to_json(),
            "parity": {"skipped": True},
        }
        if kv_section is not None:
            manifest["kv_cache"] = kv_section
        if captured.sparse_lowering:
            manifest["sparse_lowering"] = captured.sparse_lowering
        dependent = captured.batch_dependent
        if dependent is not None:
            manifest["batch_dependent"] = dependent
            warnings.warn(f"{dependent}: it is served one request per call (exported with --attention-scale fixed:N, "
                          f"requests could share calls)", BatchDependentWarning, stacklevel=2)
        if settings.quantization.requested:
            manifest["embedding_quantization"] = {"mode": settings.quantization.mode,
                                                  "tables": captured.quantized_tables}
        write_manifest(staged, manifest)

        if settings.verify.enabled:
            with _timed(timings, progress, "verify"), torch.no_grad(), \
                    running_model(settings.reference_torch_device, "as verification's reference"):
                ranges = _settle_ranges(staged, manifest, schema, ranges, settings)
                parity = _verify(staged, captured.reference, schema, ranges, settings,
                                 captured.quantized_tables, output_shapes, {o["name"]: o["kind"] for o in outputs})
            manifest["parity"] = parity
            if not parity["passed"]:
                if result.report_path is not None:  # the report shows where it failed
                    from hstu_export.report.build import complete_export_report

                    complete_export_report(result.report_path.parent, manifest, staged, out, written=False)
                raise VerificationError(
                    f"the package differs from the model: {mismatch_summary(parity)}; nothing was written "
                    "(--rtol/--atol set the tolerances)"
                )
            padding = parity.get("kv_cache", {}).get("padding")
            if padding is not None and not padding["passed"]:  # each shape then runs as it is
                manifest["kv_cache"].pop("padding", None)
            if "kv_cache" in parity and not parity["kv_cache"]["passed"]:
                from hstu_export.kv_export import kv_failure

                raise VerificationError(f"KV-cached serving of the package differs from the model: "
                                        f"{kv_failure(parity['kv_cache'])}; nothing was written "
                                        "(--rtol/--atol set the tolerances)")
        manifest["timings"] = timings
        if result.report_path is not None:  # the report gains the export's settings, parity, timings, files
            from hstu_export.report.build import complete_export_report

            complete_export_report(result.report_path.parent, manifest, staged, out)
        manifest = write_manifest(staged, manifest)
        with _timed(timings, progress, "write"):
            commit(staged, out, settings.force, protect=[bundle.path])
    return ExportResult(out, manifest, timings)


def _refuse_what_the_machine_cannot_hold(bundle: ModelBundle, settings: ExportSettings, out: Path) -> int:
    """Before the long work: the largest request the package would accept must fit in memory (its inputs
    alone are a lower bound of what verification needs), and the package on disk. Returns the bytes of
    the weights in the export dtype."""
    import math

    from hstu_export.package.directory import check_free_space
    from hstu_export.settings import format_bytes, machine_memory

    schema = bundle.input_schema
    planned = export_ranges(schema, settings, model_hints(bundle.model).ranges,
                            lengths_limits(bundle.model, bundle.schema))
    request_bytes = 0
    for f in schema.features:
        rows = planned.max_batch_size
        if f.kind == "jagged":
            rows *= planned.max_lengths[schema.canonical_lengths(f.jagged_by or "")]
        request_bytes += rows * math.prod(f.trailing) * torch.empty((), dtype=f.torch_dtype).element_size()
    total_memory, available_memory = machine_memory()
    if request_bytes > available_memory:
        lengths = ", ".join(f"{name} <= {n:,}" for name, n in planned.max_lengths.items())
        raise ConfigError(
            f"the largest request the package would accept (batch {planned.max_batch_size:,}{', ' if lengths else ''}"
            f"{lengths}) needs about {format_bytes(request_bytes)} for its inputs alone; this machine has "
            f"{format_bytes(available_memory)} of memory available ({format_bytes(total_memory)} in all): lower "
            "--max-batch-size or the length limits (--max-length, --max-seq-len, --max-candidates)"
        )
    # The compiled package holds the weights in the export dtype (integer tensors keep their own).
    itemsize = torch.empty((), dtype=settings.torch_dtype).element_size()
    weight_bytes = sum(t.numel() * (itemsize if t.is_floating_point() else t.element_size())
                       for t in (*bundle.model.parameters(), *bundle.model.buffers()))
    if not settings.dryrun:
        check_free_space(out, weight_bytes)
    return weight_bytes


def _check_op_libraries(libraries: list[str]) -> None:
    """Packages load only op libraries hstu-export knows (no arbitrary import at load time): an op
    namespace without one cannot be shipped, so say so now rather than at the first load."""
    from hstu_export.package.manifest import OP_LIBRARIES

    unknown = sorted(set(libraries) - set(OP_LIBRARIES))
    if unknown:
        raise ExportError(
            f"the exported graphs call ops of {', '.join(unknown)}, a library packages do not load (they load only "
            f"{', '.join(sorted(OP_LIBRARIES))}, never a module named by the package); map those ops instead of "
            "keeping them (--op-target, --map-function, hstu_export/ops/mappings)"
        )


def _check_pass_names(settings: ExportSettings) -> None:
    """Unknown pass names fail before any work (the pipeline would only notice after tracing)."""
    from hstu_export.passes import known_pass_names

    known = known_pass_names()
    unknown = [n for n in (*(settings.passes or ()), *settings.skip_passes) if isinstance(n, str) and n not in known]
    if unknown:
        raise ConfigError(f"unknown pass(es) {unknown}; known passes: {', '.join(known)}")


def _collecting_triton_configs() -> contextlib.AbstractContextManager[dict[str, Any]]:
    """Collects the block configs our Triton kernels choose while this package's graph is compiled
    (fixed per GPU arch), and only those: not the configs of other exports in the same process."""
    try:
        from hstu_export.ops._triton.configs import collecting_configs
    except ImportError:  # no triton installed: nothing can be chosen
        return contextlib.nullcontext({})
    return collecting_configs()


def _settle_ranges(root: Path, manifest: dict[str, Any], schema: InputSchema, ranges: ExportRanges,
                   settings: ExportSettings) -> ExportRanges:
    """The package's program on every corner of its ranges (``hstu_export.verification.corners.settle_ranges``). A bound it
    refuses is narrowed: written into the staged manifest (input schema, ranges, ``ranges.narrowed``) and
    said in one warning line each. Returns the ranges the package serves."""
    from hstu_export.runtimes.predictor import load
    from hstu_export.verification.corners import narrowing_note, settle_ranges

    predictor = load(root, verify_checksums=False)
    settled, narrowed = settle_ranges(predictor, schema, ranges, settings.verify.seed)
    if narrowed:
        manifest["input_schema"] = exported_schema(schema, settled).to_json()
        manifest["ranges"].update(max_batch_size=settled.max_batch_size, lengths=settled.to_json(),
                                  narrowed=[*manifest["ranges"].get("narrowed", []), *narrowed])
        write_manifest(root, manifest)
        for record in narrowed:
            warnings.warn(narrowing_note(record), NarrowedRangeWarning, stacklevel=2)
    return settled


def _narrow_to_compiled(narrowed_dims: list[dict[str, Any]], ranges: ExportRanges
                        ) -> tuple[ExportRanges, list[dict[str, Any]]]:
    """The ranges within the dims the backend's programs were compiled for (``narrowed_dims``: where Inductor held a
    declared dim to less, runtimes/compiled_bounds.py), each narrowing said in one warning line. A largest number
    of users is narrowed; a smallest one, or a total of rows (which the ranges cannot state), refuses the export."""
    from hstu_export.verification.corners import narrowing_note

    records = []
    for dim in narrowed_dims:
        at_most = dim["bound"] == "max"
        reason = (f"AOTInductor compiled the {dim['program']} program for {dim['input']} dim {dim['axis']} "
                  f"{'at most' if at_most else 'at least'} {dim['compiled']}")
        what = "users" if dim["dim"] == BATCH_DIM else dim["dim"]
        if not at_most:
            raise ExportError(f"{reason}, while a request may hold {dim['declared']} {what}: the package would not "
                              "serve the smallest requests; nothing was written")
        if dim["dim"] != BATCH_DIM:
            raise ExportError(f"{reason}, while {what} may reach {dim['declared']} and the package's ranges cannot "
                              "hold it to less; nothing was written (a smaller --max-batch-size or shorter maximum "
                              "lengths may avoid it)")
        if dim["compiled"] < 1:
            raise ExportError(f"{reason} users; the package could serve no request")
        if dim["compiled"] >= ranges.max_batch_size:
            continue
        record = {"feature": "batch size", "bound": "max", "declared": ranges.max_batch_size,
                  "exported": dim["compiled"], "reason": reason}
        ranges = dataclasses.replace(ranges, max_batch_size=dim["compiled"])
        records.append(record)
        warnings.warn(narrowing_note(record), NarrowedRangeWarning, stacklevel=3)
    return ranges, records


class NarrowedRangeWarning(UserWarning):
    """Export narrowed a declared range the compiled program does not serve (the manifest records it)."""


class BatchDependentWarning(UserWarning):
    """The package's answers depend on the other users of a call (the manifest's ``batch_dependent`` says
    why), so a server runs it one request per call."""


def _verify(root: Path, reference: Any, schema: InputSchema, ranges: ExportRanges, settings: ExportSettings,
            quantized_tables: list[dict[str, Any]], output_shapes: dict[str, list[int | str]],
            kinds: dict[str, str]) -> dict[str, Any]:
    """Parity against the user's fp32 model; with quantized tables, the scores (``kinds``) at the coarsest
    mode's tolerances with each user's candidate ranking compared (Kendall tau,
    ``hstu_export.verification.rank_agreement``), the other outputs at a relative L2 error only."""
    from hstu_export.package.manifest import SCORE_KINDS
    from hstu_export.runtimes.predictor import load
    from hstu_export.verification import rank_agreement

    predictor = load(root, verify_checksums=False)
    batches = verification_batches(schema, ranges, settings.verify.seed, settings.verify.num_random_batches)
    modes = [t["mode"] for t in quantized_tables]
    tolerances = settings.tolerances(modes)
    if not any(m != "none" for m in modes):
        parity = check_parity(predictor, reference, batches, tolerances)
    else:
        scores = {name: dims for name, dims in output_shapes.items() if kinds.get(name) in SCORE_KINDS}
        held = settings.relative_tolerances(modes)

        def taus(batch: dict[str, Tensor], exported: dict[str, Tensor], eager: dict[str, Tensor]) -> dict[str, Any]:
            return {"rank_agreement": rank_agreement.per_user_tau(exported, eager, batch, scores)}

        parity = check_parity(predictor, reference, batches, tolerances, per_batch=taus,
                              output_tolerances={name: held for name in kinds if name not in scores})
        parity["rank_agreement"] = rank_agreement.summarize(parity["batches"])
    if predictor.manifest.get("kv_cache", {}).get("kind") == "derived":
        from hstu_export.kv_derived_export import verify_derived_kv_cache

        parity["kv_cache"] = verify_derived_kv_cache(predictor, reference, tolerances, settings.verify.seed)
    elif "kv_cache" in predictor.manifest:
        from hstu_export.kv_export import verify_kv_cache

        parity["kv_cache"] = verify_kv_cache(predictor, reference, tolerances, settings.verify.seed)
    parity["reference"] = {"device": str(settings.reference_torch_device),
                           "dtype": str(settings.reference_torch_dtype).removeprefix("torch.")}
    return parity


def _check_quantization(bundle: ModelBundle, settings: ExportSettings) -> None:
    """Before any tracing: the tables to quantize exist, and the pass that does it will run."""
    from hstu_export.embedding_quantization import check_model
    from hstu_export.passes import default_pass_names

    if not settings.quantization.requested:
        return
    check_model(bundle.model, settings.quantization)
    planned = [n for n in (settings.passes or default_pass_names()) if n not in settings.skip_passes]
    if "quantize_embeddings" not in planned:
        raise ConfigError("--quantize-embeddings needs the quantize_embeddings pass; do not skip it "
                          "(--skip-pass, --passes)")


def _eager_reference(eager: nn.Module, schema: InputSchema, settings: ExportSettings,
                     functions: dict[str, Any], device: torch.device) -> Any:
    """The user's own model on a flat request (its arguments assembled by the schema), outputs flattened
    by name; with ``--attention-scale fixed:N``, its foreign attention run with that divisor."""
    from hstu_export.sources.outputs import call_model

    def run(batch: dict[str, Tensor]) -> dict[str, Tensor]:
        with fixed_attention_scale(settings.attention_scale, functions, eager), torch.no_grad():
            return call_model(eager, schema, _to_device(batch, device))

    return run


def _check_sequence_length(result: Any, schema: InputSchema, ranges: ExportRanges | None, settings: ExportSettings,
                           model: nn.Module) -> None:
    """The longest sequence the exported ranges allow, as the model's foreign attention sees it (contextual
    tokens + history + candidates, observed with every length at its maximum: ``observe_values``), against
    what the model itself allows (``hstu_export.sources.model_limits.sequence_limits``) and against
    ``--attention-scale fixed:N``."""
    observed = next((r for r in result.report if r.name == "observe_values"), None)
    longest = observed.stats.get("longest_sequence") if observed is not None else None
    if not isinstance(longest, int) or ranges is None:
        return
    lengths = ", ".join(f"{f.name} <= {ranges.max_lengths[f.name]:,}" for f in schema.lengths_features()
                        if not f.same_as)
    seen = ("contextual tokens + history + candidates, as the model's attention sees them with every length at its "
            f"maximum; the ranges now: {lengths}")
    for limit in sequence_limits(model):
        if longest > limit.value:
            raise ConfigError(f"the exported ranges allow sequences of {longest:,} tokens, beyond the model's own limit "
                              f"of {limit}: lower the ranges (--max-length, --max-seq-len, --max-candidates) ({seen})")
    if settings.attention_scale.startswith("fixed:"):
        n = int(settings.attention_scale.partition(":")[2])
        if n < longest:
            raise ConfigError(
                f"--attention-scale fixed:{n} is below the longest sequence the exported ranges allow, {longest:,} "
                "tokens: a longer sequence would be divided by less than its own length, which the model never does "
                f"(given max_seq_len {n}, generative-recommenders' attention truncates it); use fixed:N with N >= "
                f"{longest}, or lower the ranges ({seen})"
            )


def _check_attention_scale(settings: ExportSettings, gm: torch.fx.GraphModule, functions: dict[str, Any]) -> None:
    if settings.attention_scale == "batch":
        return
    missing = unscalable_attention(gm, functions)
    if missing:
        raise ConfigError(
            f"--attention-scale {settings.attention_scale}: verification runs the model's own attention with that "
            f"scale, and {', '.join(missing)} cannot be run so; use --attention-scale batch"
        )


# -- adapting the pipeline's result to the backend interface ---------------------------------------

def _placeholders(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]


def _output_shapes(result: Any, schema: InputSchema, ranges: ExportRanges, inputs: CompileInputs,
                   settings: ExportSettings) -> dict[str, list[int | str]]:
    """Each output's shape with its dynamic dims named: the graph is run on a second example whose dynamic
    sizes all differ from the export example's, and an axis whose size changed is matched to the input
    dim that changed alike (``hstu_export.package.artifacts.name_dims``)."""
    from hstu_export.runtimes.graph_io import as_output_dict

    first = dim_values(schema, ranges, inputs.example_features)
    device = next(iter(inputs.example_features.values())).device
    second_batch = _to_device(export_example_batch(schema, ranges, seed=settings.verify.seed + 7919, unlike=first),
                              device)
    second_inputs = schema.to_graph_inputs(second_batch)
    second = dim_values(schema, ranges, second_batch)
    try:
        with torch.no_grad():
            sparse = as_output_dict(result.sparse(**{n: second_inputs[n] for n in inputs.sparse_input_names}),
                                    list(inputs.example_sparse_outputs))
            dense = {n: sparse[n] if n in sparse else second_inputs[n] for n in inputs.dense_input_names}
            second_outputs = result.dense(**dense)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        raise ExportError(f"the split graphs failed on a second example batch ({second}): "
                          f"{lines[0] if lines else type(exc).__name__}") from exc
    return name_dims(inputs.example_outputs, first, second_outputs, second)


def _written_delta(model: nn.Module, settings: ExportSettings) -> bool:
    """Whether the delta program is the one models/cached.py writes by hand for the zoo's ranking model
    (``kv_program``: written, or auto for the zoo's model), rather than one derived from the traced graph."""
    from hstu_export.models.ranking import HstuRankingModel

    zoo = isinstance(model, HstuRankingModel)
    if settings.kv_program == "written" and not zoo:
        raise ConfigError(f"--kv-program written: the hand-written delta program is hstu-export's HstuRankingModel's; "
                          f"this model is a {type(model).__name__[:60]}: use --kv-program auto or derived")
    return zoo and settings.kv_program != "derived"


def _replace(settings: ExportSettings, **changes: Any) -> ExportSettings:
    import dataclasses

    return dataclasses.replace(settings, **changes)


def _compile_inputs(result: Any, example: dict[str, Tensor], schema: InputSchema, ranges: ExportRanges,
                    settings: ExportSettings) -> CompileInputs:
    """``example`` is keyed by graph-input names."""
    from hstu_export.runtimes.graph_io import as_output_dict

    sparse_names, dense_names = _placeholders(result.sparse), _placeholders(result.dense)
    graph_names = set(schema.graph_names)
    boundary_names = [n for n in dense_names if n not in graph_names]
    with torch.no_grad():
        # In the manifest's order of sparse_output_names: a compiled sparse half returns them in this order.
        returned = as_output_dict(result.sparse(**{n: example[n] for n in sparse_names}), boundary_names)
        sparse_out = {n: returned[n] for n in boundary_names}
        # Standalone contiguous copies: a view (a KeyedTensor's slice) would make torch.export guard on
        # its base tensor, which the program never gets.
        dense_example = {n: (sparse_out[n] if n in sparse_out else example[n]).clone(memory_format=torch.contiguous_format)
                         for n in dense_names}
        outputs = result.dense(**dense_example)
    if not isinstance(outputs, dict):
        raise ExportError("the model must return a dict of named tensors")
    fdims = feature_dims(schema, ranges)
    boundary = {t.name: t for t in result.boundary.dense_inputs}
    dense_dims: dict[str, dict[int, DimSpec]] = {}
    for name in dense_names:
        if name in fdims:
            dense_dims[name] = fdims[name]
        else:
            dim0 = boundary_dim(boundary[name], schema, ranges)
            dense_dims[name] = {0: dim0} if dim0 is not None else {}
    return CompileInputs(
        sparse=result.sparse, dense=result.dense,
        sparse_input_names=sparse_names, dense_input_names=dense_names, output_names=list(outputs),
        example_features=example, example_dense_inputs=dense_example,
        sparse_dynamic_dims={n: fdims[n] for n in sparse_names}, dense_dynamic_dims=dense_dims,
        settings=settings, combined=result.graph,
        user_packages=frozenset(result.graph.meta.get("user_packages", ())),
        example_sparse_outputs=sparse_out, example_outputs=dict(outputs),
    )


def boundary_dim(tensor: Any, schema: InputSchema, ranges: ExportRanges) -> DimSpec | None:
    """The dynamic dim 0 of a tensor crossing from the sparse to the dense graph (None: 0-d)."""
    b_max = max(ranges.max_batch_size, 2)
    if not tensor.shape:
        return None
    dim0 = tensor.shape[0]
    if tensor.jagged_by:
        return total_dim(schema.canonical_lengths(schema.get(tensor.jagged_by).name), ranges)
    if dim0 == BATCH_DIM:
        return DimSpec(BATCH_DIM, 1, b_max)
    if dim0 == f"{BATCH_DIM}+1":
        return DimSpec(BATCH_DIM, 1, b_max, offset=1)
    if isinstance(dim0, int):
        return None
    top = max(int(tensor.max_dim0 or 2), 2)
    return DimSpec(str(dim0), 1, top)
