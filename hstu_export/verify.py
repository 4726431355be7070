"""Parity between an exported package and the eager model, on batches drawn from the exported ranges.

Every run includes the edge cases (batch size 1 and the maximum; a user with the shortest and one with
the longest sequences; one candidate and the maximum) plus seeded random batches. Each output is
compared by relative L2 error ‖out−ref‖/‖ref‖ and max absolute error against per-dtype tolerances.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.batch import generate_batch
from hstu_export.errors import VerificationError
from hstu_export.schema import FeatureSpec, InputSchema


@dataclass(frozen=True)
class ExportRanges:
    """The dynamic ranges a package accepts: batch size and each lengths feature's maximum."""

    max_batch_size: int
    max_lengths: dict[str, int]
    min_lengths: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def exported_schema(schema: InputSchema, ranges: ExportRanges) -> InputSchema:
    """The model's schema with lengths bounded by the exported ranges."""
    features = tuple(
        dataclasses.replace(f, max_value=ranges.max_lengths[f.name], min_value=ranges.min_lengths[f.name])
        if f.kind == "lengths" else f
        for f in schema.features
    )
    return InputSchema(features, schema.arguments)


def _lengths(spec: FeatureSpec, ranges: ExportRanges, values: list[int]) -> list[int]:
    lo, hi = ranges.min_lengths[spec.name], ranges.max_lengths[spec.name]
    return [min(max(v, lo), hi) for v in values]


def verification_batches(
    schema: InputSchema, ranges: ExportRanges, seed: int, num_random: int
) -> list[tuple[str, dict[str, Tensor]]]:
    """(label, batch) pairs: edge cases first, then ``num_random`` seeded random batches."""
    # Lengths drawn where none are given stay inside the exported ranges, not the model's own (wider) ones.
    schema = exported_schema(schema, ranges)
    lengths = schema.lengths_features()
    b_max = ranges.max_batch_size
    cases: list[tuple[str, dict[str, Tensor]]] = []

    def add(label: str, batch_size: int, chosen: dict[str, list[int]] | None, case_seed: int) -> None:
        cases.append((label, generate_batch(schema, batch_size, seed=case_seed, lengths=chosen)))

    add("batch size 1", 1, None, seed)
    add(f"batch size {b_max} (max), longest sequences", b_max,
        {f.name: [ranges.max_lengths[f.name]] * b_max for f in lengths}, seed + 1)
    if b_max >= 2:
        add("shortest and longest user in one batch", 2,
            {f.name: _lengths(f, ranges, [ranges.min_lengths[f.name], ranges.max_lengths[f.name]]) for f in lengths},
            seed + 2)
    else:
        for i, which in enumerate(("min_lengths", "max_lengths")):
            add(f"one user, {which.split('_')[0]} lengths", 1,
                {f.name: [getattr(ranges, which)[f.name]] for f in lengths}, seed + 2 + i)
    gen = torch.Generator().manual_seed(seed)
    for i in range(num_random):
        b = int(torch.randint(1, b_max + 1, (1,), generator=gen))
        chosen = {
            f.name: torch.randint(ranges.min_lengths[f.name], ranges.max_lengths[f.name] + 1, (b,), generator=gen).tolist()
            for f in lengths
        }
        add(f"random batch {i + 1} (B={b})", b, chosen, seed + 10 + i)
    return cases


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


def check_parity(
    run_exported: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    run_eager: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    batches: list[tuple[str, dict[str, Tensor]]],
    tolerances: dict[str, float],
    on_batch: Callable[[str], None] | None = None,
    per_batch: Callable[[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Runs both on every batch; returns a JSON-able report with ``passed``. ``per_batch(batch, exported,
    eager)`` adds its entries to each batch's row (say, rank agreement)."""
    rows = []
    for label, batch in batches:
        if on_batch:
            on_batch(label)
        exported, eager = run_exported(batch), run_eager(batch)
        missing = sorted(set(eager) - set(exported))
        if missing:
            raise VerificationError(
                f"on {label} the package returns {sorted(exported)} but the model returns {sorted(eager)} "
                f"({missing} missing)"
            )
        errors = compare_outputs(exported, eager)
        ok = all(e["rel_l2"] <= tolerances["rel_l2"] and e["max_abs"] <= tolerances["max_abs"] for e in errors.values())
        rows.append({"batch": label, "batch_size": _batch_size(batch), "sizes": _sizes(batch),
                     "errors": errors, "passed": ok, **(per_batch(batch, exported, eager) if per_batch else {})})
    worst = {
        key: max((e[key] for row in rows for e in row["errors"].values()), default=0.0) for key in ("rel_l2", "max_abs")
    }
    return {"passed": all(r["passed"] for r in rows), "tolerances": tolerances, "worst": worst, "batches": rows}


def _batch_size(batch: dict[str, Tensor]) -> int:
    return min(t.size(0) for t in batch.values() if t.dim())


def _sizes(batch: dict[str, Tensor]) -> dict[str, int]:
    """Rows of every feature of a batch (for a mismatch report: which sizes failed)."""
    return {name: int(t.size(0)) for name, t in batch.items() if t.dim()}


def mismatch_summary(parity: dict[str, Any]) -> str:
    """One line naming the first failing batch, its sizes and its worst output."""
    failed = [r for r in parity["batches"] if not r["passed"]]
    if not failed:
        return "no mismatch"
    row = failed[0]
    tol = parity["tolerances"]
    name, err = max(row["errors"].items(), key=lambda kv: kv[1]["rel_l2"] / max(tol["rel_l2"], 1e-30))
    sizes = ", ".join(f"{k}={v}" for k, v in list(row.get("sizes", {}).items())[:6])
    return (f"output {name!r} on {row['batch']} (B={row['batch_size']}; {sizes}): rel. L2 {err['rel_l2']:.3g}, "
            f"max abs {err['max_abs']:.3g} (tolerances rel. L2 {tol['rel_l2']:g}, max abs {tol['max_abs']:g}); "
            f"{len(failed)} of {len(parity['batches'])} batches failed")


# -- checking and timing an existing package (``hstu-export verify`` / ``bench``) ---------------------

def _eager_for_package(predictor: Any, model_path: str | None, allow_pickle: bool) -> tuple[Any, Any]:
    from pathlib import Path

    from hstu_export.bundle import load_bundle
    from hstu_export.errors import ConfigError
    from hstu_export.outputs import call_model
    from hstu_export.settings import TORCH_DTYPES

    if model_path is not None and not Path(model_path).exists():
        raise ConfigError(f"--model {model_path}: no such file")
    path = model_path or predictor.manifest["model"].get("bundle")
    if not path or not Path(path).exists():
        raise ConfigError(
            f"no model bundle to compare with (the manifest records {path!r}, which is not here); "
            "pass --model MODEL.pt"
        )
    bundle = load_bundle(path, allow_pickle=allow_pickle)
    dtype = TORCH_DTYPES[predictor.manifest["dtype"]]
    model = bundle.model.to(device=predictor.device, dtype=dtype).eval()
    return bundle, lambda batch: call_model(model, bundle.input_schema, batch)


def _manifest_ranges(manifest: dict[str, Any]) -> ExportRanges:
    data = manifest["ranges"]["lengths"]
    return ExportRanges(data["max_batch_size"], data["max_lengths"], data["min_lengths"])


def verify_package(package: Any, model_path: str | None, *, num_random: int = 4, seed: int = 7,
                   allow_pickle: bool = False, rtol: float | None = None, atol: float | None = None,
                   imports: tuple[str, ...] = ()) -> dict[str, Any]:
    """Parity of an existing package against its eager model on fresh batches. The tolerances are the
    export's, unless ``rtol`` (relative L2) or ``atol`` (max absolute) are given."""
    from hstu_export.bundle import import_modules
    from hstu_export.runtimes.predictor import load
    from hstu_export.settings import DEFAULT_TOLERANCES

    import_modules(imports)
    predictor = load(package)
    _, eager = _eager_for_package(predictor, model_path, allow_pickle)
    batches = verification_batches(predictor.input_schema, _manifest_ranges(predictor.manifest), seed, num_random)
    tolerances = dict(predictor.manifest.get("parity", {}).get("tolerances")
                      or DEFAULT_TOLERANCES[predictor.manifest["dtype"]])
    if rtol is not None:
        tolerances["rel_l2"] = rtol
    if atol is not None:
        tolerances["max_abs"] = atol
    per_batch = None
    quantized = "embedding_quantization" in predictor.manifest
    if quantized:  # each user's candidate ranking against the fp32 model, as at export
        from hstu_export import rank_agreement

        dims = rank_agreement.output_dims_from_manifest(predictor.manifest)

        def per_batch(batch: dict[str, Tensor], exported: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, Any]:
            return {"rank_agreement": rank_agreement.per_user_tau(exported, ref, batch, dims)}

    with torch.no_grad():
        report = check_parity(predictor, lambda b: eager({k: v.to(predictor.device) for k, v in b.items()}),
                              batches, tolerances, per_batch=per_batch)
    if quantized:
        report["rank_agreement"] = rank_agreement.summarize(report["batches"])
    if "kv_cache" in predictor.manifest:  # its delta program, served through the package's cache as at export
        from hstu_export.kv_export import verify_kv_cache

        with torch.no_grad():
            report["kv_cache"] = verify_kv_cache(
                predictor, lambda b: eager({k: v.to(predictor.device) for k, v in b.items()}), tolerances, seed)
        report["passed"] = report["passed"] and report["kv_cache"]["passed"]
    return report


def bench_package(package: Any, model_path: str | None, *, batch_size: int | None = None, iters: int = 50,
                  warmup: int = 10, seed: int = 11, allow_pickle: bool = False) -> dict[str, Any]:
    """Latency of the package and of eager on one generated batch (sizes drawn from the ranges)."""
    from hstu_export.bench import benchmark
    from hstu_export.runtimes.predictor import load

    predictor = load(package)
    _, eager = _eager_for_package(predictor, model_path, allow_pickle)
    b = min(batch_size or predictor.max_batch_size, predictor.max_batch_size)
    batch = generate_batch(predictor.input_schema, b, seed=seed)
    device_batch = {k: v.to(predictor.device) for k, v in batch.items()}
    cand = next((f.jagged_by for f in predictor.input_schema.features
                 if f.kind == "jagged" and f.jagged_by and "candidate" in f.jagged_by), None)
    num_candidates = int(batch[cand].sum()) if cand else b
    res = benchmark(predictor, eager, device_batch, b, num_candidates, iters, warmup, predictor.device)
    res.update({"package": str(package), "batch_size": b, "num_candidates": num_candidates,
                "device": str(predictor.device), "torch": torch.__version__})
    return res


def load_batch_file(path: str) -> dict[str, Tensor]:
    """A request batch: a directory of tensors (``hstu_export.tensor_dir``), a torch.save'd dict of
    tensors, or a model bundle's example batch."""
    from pathlib import Path

    from hstu_export.bundle import BUNDLE_FORMAT
    from hstu_export.errors import RequestError
    from hstu_export.tensor_dir import load_tensors, load_untrusted

    p = Path(path)
    if p.is_dir():
        return load_tensors(p)
    if not p.is_file():
        raise RequestError(f"{path}: no such batch file")
    data = load_untrusted(p, "dict of tensors")
    if isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT:
        data = data.get("example_batch")
    if not isinstance(data, dict) or not all(isinstance(v, Tensor) for v in data.values()):
        raise RequestError(f"{path} must hold a dict of named tensors")
    return data
