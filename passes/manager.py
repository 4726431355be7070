"""The pass manager: runs graph passes in order and records what each one did.

A pass is any object with a ``name`` and ``run(gm, ctx) -> gm``. The manager applies it to every
``GraphModule`` of the hierarchy (nested graph modules first, then the top) unless the pass sets
``recursive = False`` (it then sees only the top graph, like ``split_sparse_dense``). Passes report
statistics with ``ctx.add_stat``. After each pass the manager lints and recompiles every graph, records
time, node counts, op histograms and parameter totals, optionally re-runs the graph on the example batch
against eager (``check_each_pass``) and dumps the graphs (``dump_dir``).

    ctx = PassContext(example_inputs=batch, model=model)
    result = run_passes(trace(model, batch), ctx)
    outputs = result.run(batch)          # dense(**sparse(batch), **passthrough)
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.fx.node import _get_qualified_name

from hstu_export.errors import ConfigError, HstuExportError, PassError
from hstu_export.passes.boundary import DENSE, SPARSE, BoundarySchema
from hstu_export.passes.context import GraphPass, PassContext
from hstu_export.passes.record import PassRecord, PassReport

log = logging.getLogger(__name__)


@dataclass
class PipelineResult:
    """The rewritten graph; after ``split_sparse_dense`` also its two halves and their boundary."""

    graph: torch.fx.GraphModule
    sparse: torch.fx.GraphModule | None
    dense: torch.fx.GraphModule | None
    boundary: BoundarySchema | None
    report: PassReport
    report_path: Path | None = None  # dump_dir/report.html when graphs were dumped

    def run(self, batch: dict[str, Tensor]) -> Any:
        """``dense(**sparse(batch), **passthrough)``: the split model on a feature batch."""
        if self.sparse is None or self.dense is None or self.boundary is None:
            raise ConfigError("this pipeline did not run split_sparse_dense; call result.graph(**batch)")
        missing = [t.name for t in (*self.boundary.sparse_inputs, *self.boundary.passthrough) if t.name not in batch]
        if missing:
            raise ConfigError(f"the batch lacks feature(s) {missing}")
        sparse_out = self.sparse(**{t.name: batch[t.name] for t in self.boundary.sparse_inputs})
        dense_in = {
            t.name: sparse_out[t.name] if t.source == "sparse" else batch[t.name] for t in self.boundary.dense_inputs
        }
        return self.dense(**dense_in)


def run_passes(
    gm: torch.fx.GraphModule,
    ctx: PassContext,
    passes: Sequence[str | GraphPass] | None = None,
    skip: Sequence[str] = (),
) -> PipelineResult:
    """Runs ``passes`` (default: the registry's order) on ``gm``, rewriting it in place.

    ``passes`` mixes registered names and pass objects; ``skip`` drops passes by name. Unknown names
    raise ConfigError; a failing pass raises PassError naming it (after the dumps written so far).
    """
    planned = _resolve(passes, skip)
    dumper = None
    if ctx.dump_dir is not None:
        from hstu_export.report.dumps import GraphDumper

        dumper = GraphDumper(ctx.dump_dir)
    reference = _reference_outputs(gm, ctx) if ctx.check_each_pass else None
    report = PassReport()
    try:
        with torch.no_grad():
            for index, (name, graph_pass) in enumerate(planned, start=1):
                record = PassRecord(index=index, name=name)
                report.records.append(record)
                gm = _run_one(graph_pass, gm, ctx, record, reference, dumper)
                if reference is not None and getattr(graph_pass, "approximate", False):
                    # A pass that changes the numbers on purpose (quantization): later passes are held
                    # to exactness against its result, not against the model.
                    reference = gm(**ctx.example_inputs)
    finally:
        report_path = dumper.write_report(report, gm, ctx.boundary, ctx.check_each_pass) if dumper is not None else None
    has_split = ctx.boundary is not None and isinstance(getattr(gm, SPARSE, None), torch.fx.GraphModule)
    return PipelineResult(
        graph=gm,
        sparse=getattr(gm, SPARSE) if has_split else None,
        dense=getattr(gm, DENSE) if has_split else None,
        boundary=ctx.boundary,
        report=report,
        report_path=report_path,
    )


def _run_one(
    graph_pass: GraphPass,
    gm: torch.fx.GraphModule,
    ctx: PassContext,
    record: PassRecord,
    reference: Any,
    dumper: Any,
) -> torch.fx.GraphModule:
    name = record.name
    before_code = dumper.graph_code(gm) if dumper is not None else ""
    record.nodes_before, record.ops_before = count_nodes(gm), op_histogram(gm)
    record.parameters_before, record.parameter_bytes_before = parameter_totals(gm)
    ctx.stats = {}
    start = time.perf_counter()
    try:
        gm = _apply(graph_pass, gm, ctx, record)
        _lint_and_recompile(gm, name)
    except HstuExportError as exc:
        # Our own errors keep their type (and exit code); the message gains the pass name.
        record.status, record.note = "failed", str(exc)
        if name not in str(exc):
            exc.args = (f"pass {name!r}: {exc}", *exc.args[1:])
        raise
    except Exception as exc:
        record.status, record.note = "failed", f"{type(exc).__name__}: {exc}"
        raise PassError(f"pass {name!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        record.time_s = time.perf_counter() - start
        record.stats = dict(ctx.stats)
        ctx.current_graph = ""
    record.nodes_after, record.ops_after = count_nodes(gm), op_histogram(gm)
    record.parameters_after, record.parameter_bytes_after = parameter_totals(gm)
    log.debug("pass %s: %d -> %d nodes in %.3fs %s", name, record.nodes_before, record.nodes_after,
              record.time_s, record.stats)
    if dumper is not None:
        record.files = dumper.write_pass(record.index, name, before_code, gm)
    if reference is not None:
        try:
            record.max_rel_error = _check(gm, ctx, reference, name, exact=not getattr(graph_pass, "approximate", False))
        except PassError as exc:
            record.status, record.note = "failed", str(exc)
            raise
    return gm


def _apply(graph_pass: GraphPass, gm: torch.fx.GraphModule, ctx: PassContext, record: PassRecord) -> torch.fx.GraphModule:
    if getattr(graph_pass, "recursive", True):
        for path in nested_graph_paths(gm):
            ctx.current_graph = path
            sub = gm.get_submodule(path)
            new = _checked(graph_pass.run(sub, ctx), record.name)  # type: ignore[arg-type]
            if new is not sub:
                parent, _, attr = path.rpartition(".")
                gm.get_submodule(parent).register_module(attr, new)
            record.graphs.append(path)
    ctx.current_graph = ""
    gm = _checked(graph_pass.run(gm, ctx), record.name)
    record.graphs.append("")
    return gm


def _checked(gm: Any, name: str) -> torch.fx.GraphModule:
    if not isinstance(gm, torch.fx.GraphModule):
        raise PassError(f"pass {name!r} returned {type(gm).__name__}, not a torch.fx.GraphModule")
    return gm


def nested_graph_paths(gm: torch.fx.GraphModule) -> list[str]:
    """Submodule paths of the graph modules nested in ``gm``, deepest first (``gm`` itself excluded)."""
    paths = [p for p, m in gm.named_modules() if p and isinstance(m, torch.fx.GraphModule)]
    return sorted(paths, key=lambda p: -p.count("."))


def graph_modules(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """``gm`` ("" path) and every graph module nested in it, top first."""
    return [(p, m) for p, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)]


def _lint_and_recompile(gm: torch.fx.GraphModule, name: str) -> None:
    for path, sub in reversed(graph_modules(gm)):
        try:
            sub.graph.lint()
        except Exception as exc:
            where = f"graph '{path}'" if path else "the top graph"
            raise PassError(f"pass {name!r} left an invalid {where}: {exc}") from exc
        sub.recompile()


def count_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(len(sub.graph.nodes) for _, sub in graph_modules(gm))


def op_name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    """A readable name for what ``node`` computes (histogram key)."""
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return str(node.target)
        return _get_qualified_name(node.target).replace("_operator.", "operator.")  # type: ignore[arg-type]
    if node.op == "call_method":
        return f"method:{node.target}"
    if node.op == "call_module":
        try:
            return f"module:{type(gm.get_submodule(str(node.target))).__name__}"
        except AttributeError:
            return f"module:{node.target}"
    return node.op


def op_histogram(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for _, sub in graph_modules(gm):
        counts.update(op_name(n, sub) for n in sub.graph.nodes)
    return dict(sorted(counts.items()))


def parameter_totals(module: nn.Module) -> tuple[int, int]:
    """(elements, bytes) of the distinct parameters and buffers of ``module``."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return (
        sum(t.numel() for t in tensors.values()),
        sum(t.numel() * t.element_size() for t in tensors.values()),
    )


def _resolve(
    passes: Sequence[str | GraphPass] | None, skip: Sequence[str]
) -> list[tuple[str, GraphPass]]:
    """(name, pass) in run order."""
    from hstu_export.passes import create_pass, known_pass_names

    known = known_pass_names()
    unknown_skip = [s for s in skip if s not in known]
    if unknown_skip:
        raise ConfigError(f"unknown pass(es) to skip {unknown_skip}; known passes: {', '.join(known)}")
    chosen: list[str | GraphPass] = list(known if passes is None else passes)
    out: list[tuple[str, GraphPass]] = []
    for item in chosen:
        if isinstance(item, str):
            if item not in known:
                raise ConfigError(f"unknown pass {item!r}; known passes: {', '.join(known)}")
            if item in skip:
                continue
            out.append((item, create_pass(item)))
        elif isinstance(getattr(item, "name", None), str) and callable(getattr(item, "run", None)):
            if item.name not in skip:
                out.append((item.name, item))
        else:
            raise ConfigError(f"{item!r} is neither a pass name nor a pass object (with .name and .run(gm, ctx))")
    return out


def _reference_outputs(gm: torch.fx.GraphModule, ctx: PassContext) -> Any:
    with torch.no_grad():
        if ctx.reference is not None:
            return ctx.reference(ctx.example_inputs)
        if ctx.model is not None and ctx.schema is not None:
            from hstu_export.sources.outputs import call_model

            by_graph_name = {f.graph_name: f.name for f in ctx.schema.features}
            return call_model(ctx.model, ctx.schema, {by_graph_name.get(k, k): v for k, v in ctx.example_inputs.items()})
        if ctx.model is not None:
            return ctx.model(ctx.example_inputs)
        return gm(**ctx.example_inputs)


def _check(gm: torch.fx.GraphModule, ctx: PassContext, reference: Any, name: str, exact: bool = True) -> float:
    """The pass's max relative error against ``reference``; PassError beyond ``ctx.check_tolerance``
    (only recorded for a pass that is not ``exact``)."""
    try:
        out = gm(**ctx.example_inputs)
    except Exception as exc:
        raise PassError(f"pass {name!r}: the rewritten graph fails on the example batch: {type(exc).__name__}: {exc}") from exc
    error = max_rel_error(out, reference)
    if error is None:
        raise PassError(f"pass {name!r}: the graph's outputs no longer have the structure of the model's outputs")
    if exact and error > ctx.check_tolerance:
        raise PassError(
            f"pass {name!r} changed the results: max relative error {error:.3g} > tolerance {ctx.check_tolerance:g}"
        )
    return error


def max_rel_error(actual: Any, expected: Any) -> float | None:
    """Largest ``max|a - e| / max|e|`` over matching tensors; None when the structures differ."""
    flat_a, spec_a = pytree.tree_flatten(actual)
    flat_e, spec_e = pytree.tree_flatten(expected)
    if spec_a != spec_e:
        return None
    worst = 0.0
    for a, e in zip(flat_a, flat_e):
        if not isinstance(e, Tensor):
            continue
        if not isinstance(a, Tensor) or a.shape != e.shape:
            return None
        if e.numel() == 0:
            continue
        a64, e64 = a.detach().double(), e.detach().double()
        scale = max(float(e64.abs().max()), 1e-12)
        worst = max(worst, float((a64 - e64).abs().max()) / scale)
    return worst
