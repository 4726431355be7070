"""Building the run record: from a pass run, then from what inspect or export adds to it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hstu_export.report.record import (
    KIND_EXPORT,
    KIND_INSPECT,
    RECORD_NAME,
    BoundaryRow,
    FinalGraph,
    OpaqueCallRow,
    OpMappingRow,
    PackageFile,
    ParityBatchRow,
    ParityRecord,
    PassPictures,
    PassRow,
    RunRecord,
)

if TYPE_CHECKING:
    from hstu_export.passes.boundary import BoundarySchema
    from hstu_export.passes.record import PassReport

NO_TABLE = "none (no table has it)"
# The settings inspect reads (the others — backend, device, verification — only steer an export).
INSPECT_SETTINGS = ("op_target", "leaf_modules", "opaque_functions", "op_mappings", "attention_scale", "lengths",
                    "imports", "passes", "skip_passes", "check_each_pass", "dump_dir")


def pass_record(title: str, report: PassReport, pictures: dict[int, PassPictures], boundary: BoundarySchema | None,
                opaque_calls: list[dict[str, Any]], final_graphs: dict[str, str], checked: bool) -> RunRecord:
    """The pass part of a run's record."""
    record = RunRecord(title=title, created=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    for r in report:
        record.passes.append(PassRow(
            index=r.index, name=r.name, status=r.status, note=r.note, time_ms=r.time_s * 1000,
            nodes_before=r.nodes_before, nodes_after=r.nodes_after, parameters=r.parameters_after,
            parameter_bytes=r.parameter_bytes_after, max_rel_error=r.max_rel_error,
            stats={k: readable(v) for k, v in r.stats.items()},
            stat_entries={k: len(v) for k, v in r.stats.items() if isinstance(v, (dict, list))},
            files=list(r.files), pictures=pictures.get(r.index),
        ))  # fmt: skip
    record.checked_each_pass = checked
    if boundary is not None:
        for side, tensors in (("sparse input", boundary.sparse_inputs), ("dense input", boundary.dense_inputs)):
            record.boundary.extend(
                BoundaryRow(side, t.name, t.dtype, "[" + ", ".join(map(str, t.shape)) + "]", t.jagged_by, t.source)
                for t in tensors
            )
        record.boundary_outputs = list(boundary.output_names)
    map_ops = next((r for r in report if r.name == "map_ops"), None)
    record.op_mappings = op_mapping_rows(map_ops.stats if map_ops is not None else {})
    record.opaque_calls = opaque_rows(opaque_calls)
    record.final_graphs = [FinalGraph(name, code) for name, code in final_graphs.items()]
    return record


def op_mapping_rows(stats: dict[str, Any]) -> list[OpMappingRow]:
    """map_ops's statistics as a table: source → target, count and whose mapping table it came from. A
    foreign function and the lowering of the op it became are one row (source → our op → target); an op
    row stays for the calls of that op that no foreign function made."""
    from hstu_export.ops.mappings import fbgemm, function_mappings, ours

    def origin_of(op: str) -> str:
        return "ours" if op in ours.OPS else "fbgemm" if op in fbgemm.OPS else NO_TABLE

    target = str(stats.get("target", ""))
    try:
        functions = function_mappings()
    except ImportError:  # a table that fails to import must not cost the report
        functions = {}
    # How each op was lowered, and how many of its calls are left to show on their own.
    lowered: dict[str, list[Any]] = {}
    for key, count in _dict(stats.get("mapped")).items():
        source, _, into = str(key).partition(" -> ")
        lowered[source] = [into, _int(count)]
    for key, count in _dict(stats.get("kept")).items():
        lowered.setdefault(str(key), ["kept", _int(count)])
    rows: list[OpMappingRow] = []
    for key, count in _dict(stats.get("foreign")).items():
        name, _, library = str(key).partition(" (")
        origin, _, like = (library.removesuffix(")") or "user").partition(" (declared like ")
        like = like.removesuffix(")")
        mapping = functions.get(name) or functions.get(like)
        # Descriptions read "HSTU attention → hstu_export::hstu_mha": the op after the arrow.
        ours_op = mapping.description.rpartition("→ ")[2] if mapping is not None and mapping.description else ""
        became = ours_op or "our ops (hstu_export::*)"
        if ours_op in lowered:
            into, left = lowered[ours_op]
            became = f"{ours_op} → {into}" + (f" (for {target})" if target and into != "kept" else "")
            lowered[ours_op][1] = max(left - _int(count), 0)
        rows.append(OpMappingRow(name, became, _int(count), origin, "function", f"declared like {like}" if like else ""))
    for name, reason in _dict(stats.get("foreign_kept")).items():
        mapping = functions.get(str(name))
        rows.append(OpMappingRow(str(name), "kept as a call", 0, mapping.library if mapping else "user", "function",
                                 str(reason)))
    for key in _dict(stats.get("mapped")):
        source, _, into = str(key).partition(" -> ")
        if lowered[source][1]:
            rows.append(OpMappingRow(source, into, lowered[source][1], origin_of(source), "op"))
    for key in _dict(stats.get("kept")):
        origin = origin_of(str(key))
        reason = (f"the table keeps it for {target}" if origin != NO_TABLE else
                  f"no mapping for {target}, kept by --allow-unmapped") + ": its library is loaded at serve time"
        if lowered[str(key)][1]:
            rows.append(OpMappingRow(str(key), "kept", lowered[str(key)][1], origin, "op", reason))
    return rows


def opaque_rows(calls: Any) -> list[OpaqueCallRow]:
    return [OpaqueCallRow(str(c.get("kind", "")), str(c.get("name", "")), str(c.get("where", "")),
                          str(c.get("reason", ""))) for c in (calls if isinstance(calls, list) else [])
            if isinstance(c, dict)]


def add_inspect_context(record: RunRecord, model: dict[str, Any], settings: dict[str, Any], op_target: str,
                        ranges: dict[str, Any] | None = None) -> None:
    """What ``hstu-export inspect`` on a bundle knows: the model, the settings and the ranges when the model
    states them (``ExportRanges.to_json()``); nothing is verified."""
    record.kind = KIND_INSPECT
    record.ranges = ranges_text(ranges) if ranges else {}
    if record.ranges:
        record.ranges["max batch size"] += " (the default: inspect compiles nothing; export's --max-batch-size sets it)"
    record.model = {k: readable(v) for k, v in model.items() if v}
    record.target = {"op target": op_target, "backend": "none (inspect compiles nothing)"}
    record.settings = settings_text({k: settings[k] for k in INSPECT_SETTINGS if k in settings})
    record.parity = ParityRecord(note="inspect compiles and verifies nothing: `hstu-export MODEL` verifies the "
                                      "package it writes on every verification batch, and its report shows them")


def add_export_context(record: RunRecord, manifest: dict[str, Any], package_dir: Path, out: Path,
                       written: bool = True) -> None:
    """What an export knows once its package is verified (``written``) or failed verification: from the
    manifest and the package directory."""
    record.kind = KIND_EXPORT
    model = _dict(manifest.get("model"))
    record.title = str(model.get("name") or record.title)
    record.model = {k: readable(v) for k, v in (("name", model.get("name")), ("source", model.get("source")),
                                            ("bundle", model.get("bundle")), ("bundle sha256", model.get("bundle_sha256")))
                    if v}
    backend = _dict(manifest.get("backend"))
    device = manifest.get("device")
    if isinstance(device, dict):
        device = " ".join(str(device[k]) for k in ("type", "name") if device.get(k))
    record.target = {k: str(v) for k, v in (("backend", backend.get("name")), ("device", device),
                                             ("dtype", manifest.get("dtype")), ("op target", manifest.get("op_target")),
                                             ("package", out if written else f"{out}: not written, the "
                                              "package failed verification")) if v}
    ranges = _dict(manifest.get("ranges"))
    record.settings = exported_settings(_dict(manifest.get("settings")), ranges)
    record.ranges = ranges_text(_dict(ranges.get("lengths")), _dict(ranges.get("dims")))
    record.parity = parity_record(_dict(manifest.get("parity")))
    record.timings = {str(k): float(v) for k, v in _dict(manifest.get("timings")).items() if isinstance(v, (int, float))}
    if written:
        record.package_files = [PackageFile(p.relative_to(package_dir).as_posix(), p.stat().st_size)
                                for p in sorted(package_dir.rglob("*"))
                                if p.is_file() and p.relative_to(package_dir).parts[0] != "graphs"]


def ranges_text(lengths: dict[str, Any], dims: dict[str, Any] | None = None) -> dict[str, str]:
    """The accepted ranges: ``lengths`` as ExportRanges.to_json() writes it, ``dims`` {name: [min, max]}."""
    shown = {"max batch size": str(lengths.get("max_batch_size"))}
    for name, high in _dict(lengths.get("max_lengths")).items():
        shown[name] = f"{_dict(lengths.get('min_lengths')).get(name, 0)} … {high}"
    for name, span in (dims or {}).items():
        if isinstance(span, list) and len(span) == 2:
            shown[name] = f"{span[0]} … {span[1]}"
    return shown


def parity_record(parity: dict[str, Any]) -> ParityRecord:
    if parity.get("skipped") or not isinstance(parity.get("batches"), list):
        return ParityRecord(note="not verified: the export ran with --no-verify")
    # The KV-cache check (--kv-cache) serves its requests through the package's cache, in order.
    kv = _dict(parity.get("kv_cache")).get("batches")
    labelled = [("", b) for b in parity["batches"]] + [("KV cache: ", b) for b in (kv if isinstance(kv, list) else [])]
    rows = []
    for prefix, batch in ((p, b) for p, b in labelled if isinstance(b, dict)):
        errors = [e for e in _dict(batch.get("errors")).values() if isinstance(e, dict)]
        rel = [float(e["rel_l2"]) for e in errors if isinstance(e.get("rel_l2"), (int, float))]
        absolute = [float(e["max_abs"]) for e in errors if isinstance(e.get("max_abs"), (int, float))]
        sizes = ", ".join(f"{k} {v}" for k, v in _dict(batch.get("sizes")).items())
        rows.append(ParityBatchRow(prefix + str(batch.get("batch")), _int(batch.get("batch_size")), sizes,
                                   max(rel) if rel else None, max(absolute) if absolute else None,
                                   bool(batch.get("passed"))))
    tolerances = {str(k): float(v) for k, v in _dict(parity.get("tolerances")).items() if isinstance(v, (int, float))}
    return ParityRecord(verified=True, tolerances=tolerances, batches=rows)


def settings_text(settings: dict[str, Any]) -> dict[str, str]:
    """Settings that say something (left-out values dropped), as text."""
    shown = {}
    for key, value in settings.items():
        if value in (None, "", [], {}, ()):
            continue
        shown[str(key)] = readable(value)
    return shown


def exported_settings(settings: dict[str, Any], ranges: dict[str, Any]) -> dict[str, str]:
    """The settings an export ran with, as text, with the package's own ranges where export settled them
    (a bound the compiled program refused is narrowed: ``ranges.narrowed``)."""
    shown = settings_text(settings)
    exported = ranges.get("max_batch_size")
    if isinstance(exported, int) and not isinstance(exported, bool):
        asked = settings.get("max_batch_size")
        shown["max_batch_size"] = str(exported) + (f" (asked {asked}, narrowed at export)"
                                                   if asked not in (None, exported) else "")
    return shown


def readable(value: Any, nested: bool = False) -> str:
    """Plain data as text a person reads, whole: ``a: 1, b: (c: 2)`` for a dict, ``x, y`` for a list (in
    parentheses when nested), ``true``/``false``, ``none`` for nothing, else ``str``."""
    if isinstance(value, (dict, list, tuple)):
        items = [f"{k}: {readable(v, True)}" for k, v in value.items()] if isinstance(value, dict) \
            else [readable(v, True) for v in value]
        text = ", ".join(items) or "none"
        return f"({text})" if nested and items else text
    if isinstance(value, bool):
        return "true" if value else "false"
    return "none" if value is None else str(value)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def complete_report(directory: Path, change: Callable[[RunRecord], None]) -> Path:
    """Reads the run's record from ``directory``, applies ``change`` and renders the page again."""
    from hstu_export.report import render

    record = RunRecord.read(directory)
    change(record)
    return render.write(record, directory)


def complete_export_report(dump_dir: Path, manifest: dict[str, Any], package_dir: Path, out: Path,
                           written: bool = True) -> None:
    """The export's report: in the dump directory and, when the dumps travel in the package, there too."""
    def change(record: RunRecord) -> None:
        add_export_context(record, manifest, package_dir, out, written)

    complete_report(dump_dir, change)
    in_package = package_dir / "graphs"
    if written and (in_package / RECORD_NAME).is_file():
        complete_report(in_package, change)
