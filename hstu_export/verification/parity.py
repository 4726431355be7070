"""Parity between a package and the eager model: each output compared by relative L2 error
‖out−ref‖/‖ref‖ and max absolute error against per-dtype tolerances, batch by batch. An output may be
held to tolerances of its own (a quantized package's embeddings: relative L2 only, no ``max_abs``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import VerificationError


def compare_outputs(out: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    result = {}
    for name, r in ref.items():
        o = out[name].detach().to("cpu", torch.float64)
        r64 = r.detach().to("cpu", torch.float64)
        if o.shape != r64.shape:
            result[name] = {"rel_l2": float("inf"), "max_abs": float("inf")}
            continue
        denom = torch.linalg.vector_norm(r64).clamp_min(1e-30)
        result[name] = {
            "rel_l2": float(torch.linalg.vector_norm(o - r64) / denom),
            "max_abs": float((o - r64).abs().max()) if o.numel() else 0.0,
        }
    return result


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def check_parity(
    run_exported: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    run_eager: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    batches: list[tuple[str, dict[str, Tensor]]],
    tolerances: dict[str, float],
    on_batch: Callable[[str], None] | None = None,
    per_batch: Callable[[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]], dict[str, Any]] | None = None,
    output_tolerances: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Runs both on every batch; returns a JSON-able report with ``passed``. ``per_batch(batch, exported,
    eager)`` adds its entries to each batch's row (say, rank agreement). ``output_tolerances`` holds the
    outputs it names to their own tolerances (a key left out is not checked), the others to ``tolerances``. A batch the package refuses (it
    raises) is a failed row with ``refused`` set to the package's message; a batch the model itself cannot
    run raises VerificationError: the ranges ask for requests the model does not take."""
    own = output_tolerances or {}
    rows = []
    for label, batch in batches:
        if on_batch:
            on_batch(label)
        row: dict[str, Any] = {"batch": label, "batch_size": _batch_size(batch), "sizes": _sizes(batch)}
        try:
            eager = run_eager(batch)
        except Exception as exc:
            raise VerificationError(
                f"the model itself fails on {label} ({_sizes_text(row)}): {first_line(exc)}; export only ranges "
                "the model takes (--max-length FEATURE=MIN:MAX, --max-batch-size)") from exc
        try:
            exported = run_exported(batch)
        except Exception as exc:  # a compiled guard, an in-artifact check, a runtime failure: all refusals
            rows.append({**row, "errors": {}, "passed": False, "refused": first_line(exc)[:500]})
            continue
        missing = sorted(set(eager) - set(exported))
        if missing:
            raise VerificationError(
                f"on {label} the package returns {sorted(exported)} but the model returns {sorted(eager)} "
                f"({missing} missing)"
            )
        errors = compare_outputs(exported, eager)
        ok = all(within(e, own.get(name, tolerances)) for name, e in errors.items())
        rows.append({**row, "errors": errors, "passed": ok, **(per_batch(batch, exported, eager) if per_batch else {})})
    worst = {
        key: max((e[key] for row in rows for e in row["errors"].values()), default=0.0) for key in ("rel_l2", "max_abs")
    }
    report = {"passed": all(r["passed"] for r in rows), "tolerances": tolerances, "worst": worst, "batches": rows}
    if own:
        report["output_tolerances"] = own
    return report


def within(errors: dict[str, float], tolerances: dict[str, float]) -> bool:
    """Whether one output's errors are inside ``tolerances`` (a measure it does not name is not checked)."""
    return all(errors[key] <= limit for key, limit in tolerances.items())


def _batch_size(batch: dict[str, Tensor]) -> int:
    return min(t.size(0) for t in batch.values() if t.dim())


def _sizes(batch: dict[str, Tensor]) -> dict[str, int]:
    """Rows of every feature of a batch (for a mismatch report: which sizes failed)."""
    return {name: int(t.size(0)) for name, t in batch.items() if t.dim()}


def _sizes_text(row: dict[str, Any]) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in list(row.get("sizes", {}).items())[:6])
    return f"B={row['batch_size']}; {sizes}"


def mismatch_summary(parity: dict[str, Any]) -> str:
    """One line naming the first failing batch, its sizes and its worst output (or the package's refusal)."""
    failed = [r for r in parity["batches"] if not r["passed"]]
    if not failed:
        return "no mismatch"
    refused = [r for r in failed if r.get("refused")]
    if refused:
        row = refused[0]
        return (f"the package refuses {row['batch']} ({_sizes_text(row)}), a request inside its ranges: "
                f"{row['refused']}; {len(refused)} of {len(parity['batches'])} batches refused")
    row = failed[0]
    own = parity.get("output_tolerances", {})

    def excess(item: tuple[str, dict[str, float]]) -> float:
        tol = own.get(item[0], parity["tolerances"])
        return max(item[1][key] / max(limit, 1e-30) for key, limit in tol.items())

    name, err = max(row["errors"].items(), key=excess)
    tol = own.get(name, parity["tolerances"])
    limits = ", ".join(f"{_MEASURES[key]} {limit:g}" for key, limit in tol.items())
    return (f"output {name!r} on {row['batch']} ({_sizes_text(row)}): rel. L2 {err['rel_l2']:.3g}, "
            f"max abs {err['max_abs']:.3g} (tolerances {limits}); "
            f"{len(failed)} of {len(parity['batches'])} batches failed")


_MEASURES = {"rel_l2": "rel. L2", "max_abs": "max abs"}
