"""Parity between an exported package and the eager model, on batches drawn from the exported ranges.

Every run includes the corners of the ranges, derived from the schema (every dynamic dim, the number of
users and each lengths feature, at its minimum and its maximum, alone and combined: 1 user with 1 history
item and 1 candidate, the maximum batch with every user at the minimum, ...), batches mixing the
shortest and the longest users, then seeded random batches. Each output is compared by relative L2 error
‖out−ref‖/‖ref‖ and max absolute error against per-dtype tolerances. ``settle_ranges`` finds the ranges a
compiled program really takes (docs/PACKAGE.md, "Every request inside the ranges").
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.batch import generate_batch
from hstu_export.errors import VerificationError
from hstu_export.schema import InputSchema


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


# Every dynamic dim at its minimum and maximum, all combinations up to this many dims; beyond, each dim at
# one extreme with the others at the other (2 * dims + 2 corners).
ALL_COMBINATIONS_UP_TO = 4


def dynamic_dims(schema: InputSchema, ranges: ExportRanges) -> list[tuple[str, int, int]]:
    """(name, min, max) of every dim a request can vary: ``batch`` (users), and each lengths feature whose
    keys do not share another's lengths and whose range is not one fixed value (every user's length)."""
    dims = [("batch", 1, ranges.max_batch_size)] if ranges.max_batch_size > 1 else []
    for f in schema.lengths_features():
        lo, hi = ranges.min_lengths[f.name], ranges.max_lengths[f.name]
        if not f.same_as and lo != hi:
            dims.append((f.name, lo, hi))
    return dims


def corner_sizes(schema: InputSchema, ranges: ExportRanges) -> list[dict[str, int]]:
    """The corners of the exported ranges, each ``{dim: value}`` over :func:`dynamic_dims` (a lengths
    feature's value is every user's length): every dim at its minimum and at its maximum, alone and
    combined; with more than ``ALL_COMBINATIONS_UP_TO`` dims, all at one extreme, and each dim at one extreme
    with the rest at the other."""
    dims = dynamic_dims(schema, ranges)
    if len(dims) <= ALL_COMBINATIONS_UP_TO:
        picks = list(itertools.product((0, 1), repeat=len(dims)))
    else:
        n = len(dims)
        picks = [(0,) * n, (1,) * n]
        for i in range(n):
            picks += [tuple(int(j == i) for j in range(n)), tuple(int(j != i) for j in range(n))]
    return [{name: (hi if pick else lo) for (name, lo, hi), pick in zip(dims, chosen)} for chosen in picks]


def corner_batch(schema: InputSchema, ranges: ExportRanges, sizes: dict[str, int], seed: int) -> dict[str, Tensor]:
    """A batch at the given dims (:func:`corner_sizes`); dims not given are at their maximum (the batch) or
    their only value."""
    users = sizes.get("batch", 1 if ranges.max_batch_size == 1 else ranges.max_batch_size)
    lengths = {f.name: [sizes.get(f.name, ranges.max_lengths[f.name])] * users
               for f in schema.lengths_features() if not f.same_as}
    return generate_batch(exported_schema(schema, ranges), users, seed=seed, lengths=lengths)


def describe_sizes(sizes: dict[str, int], dims: list[tuple[str, int, int]]) -> str:
    """``B=1, uih_lengths=1 (min), candidate_lengths=20 (max)``."""
    parts = []
    for name, lo, hi in dims:
        value = sizes[name]
        where = " (min)" if value == lo else " (max)" if value == hi else ""
        parts.append(f"B={value}" if name == "batch" else f"{name}={value}{where}")
    return ", ".join(parts) or "the only size"


def verification_batches(
    schema: InputSchema, ranges: ExportRanges, seed: int, num_random: int
) -> list[tuple[str, dict[str, Tensor]]]:
    """(label, batch) pairs: the corners of the ranges (:func:`corner_sizes`), batches mixing the shortest
    and the longest users, then ``num_random`` seeded random batches."""
    # Lengths drawn where none are given stay inside the exported ranges, not the model's own (wider) ones.
    bounded = exported_schema(schema, ranges)
    lengths = [f for f in bounded.lengths_features() if not f.same_as]
    dims = dynamic_dims(schema, ranges)
    b_max = ranges.max_batch_size
    cases: list[tuple[str, dict[str, Tensor]]] = []
    for i, sizes in enumerate(corner_sizes(schema, ranges)):
        cases.append((f"corner: {describe_sizes(sizes, dims)}", corner_batch(schema, ranges, sizes, seed + i)))

    def mixed(users: int) -> dict[str, list[int]]:
        return {f.name: [ranges.min_lengths[f.name] if u % 2 == 0 else ranges.max_lengths[f.name]
                         for u in range(users)] for f in lengths}

    base = seed + len(cases)
    if b_max >= 2:
        cases.append(("mixed: the shortest and the longest user in one batch",
                      generate_batch(bounded, 2, seed=base, lengths=mixed(2))))
    if b_max >= 3:
        cases.append((f"mixed: {b_max} users alternating shortest and longest",
                      generate_batch(bounded, b_max, seed=base + 1, lengths=mixed(b_max))))
    gen = torch.Generator().manual_seed(seed)
    for i in range(num_random):
        b = int(torch.randint(1, b_max + 1, (1,), generator=gen))
        chosen = {
            f.name: torch.randint(ranges.min_lengths[f.name], ranges.max_lengths[f.name] + 1, (b,), generator=gen).tolist()
            for f in lengths
        }
        cases.append((f"random batch {i + 1} (B={b})", generate_batch(bounded, b, seed=seed + 10 + i, lengths=chosen)))
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
) -> dict[str, Any]:
    """Runs both on every batch; returns a JSON-able report with ``passed``. ``per_batch(batch, exported,
    eager)`` adds its entries to each batch's row (say, rank agreement). A batch the package refuses (it
    raises) is a failed row with ``refused`` set to the package's message; a batch the model itself cannot
    run raises VerificationError: the ranges ask for requests the model does not take."""
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
        ok = all(e["rel_l2"] <= tolerances["rel_l2"] and e["max_abs"] <= tolerances["max_abs"] for e in errors.values())
        rows.append({**row, "errors": errors, "passed": ok, **(per_batch(batch, exported, eager) if per_batch else {})})
    worst = {
        key: max((e[key] for row in rows for e in row["errors"].values()), default=0.0) for key in ("rel_l2", "max_abs")
    }
    return {"passed": all(r["passed"] for r in rows), "tolerances": tolerances, "worst": worst, "batches": rows}


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
    tol = parity["tolerances"]
    name, err = max(row["errors"].items(), key=lambda kv: kv[1]["rel_l2"] / max(tol["rel_l2"], 1e-30))
    return (f"output {name!r} on {row['batch']} ({_sizes_text(row)}): rel. L2 {err['rel_l2']:.3g}, "
            f"max abs {err['max_abs']:.3g} (tolerances rel. L2 {tol['rel_l2']:g}, max abs {tol['max_abs']:g}); "
            f"{len(failed)} of {len(parity['batches'])} batches failed")


# -- ranges the compiled program really takes ---------------------------------------------------------

NARROWING_ROUNDS = 8


def _refusal(run: Callable[[dict[str, Tensor]], Any], batch: dict[str, Tensor]) -> str | None:
    try:
        run(batch)
    except Exception as exc:
        # The program's own words: a predictor names the refusal for its callers, raised from them.
        return first_line(exc.__cause__ if exc.__cause__ is not None else exc)
    return None


def _narrowed(schema: InputSchema, ranges: ExportRanges, name: str, at_min: bool, value: int) -> ExportRanges:
    if name == "batch":
        return dataclasses.replace(ranges, max_batch_size=value)
    lows, highs = dict(ranges.min_lengths), dict(ranges.max_lengths)
    for f in schema.lengths_features():
        if schema.canonical_lengths(f.name) == name:
            (lows if at_min else highs)[f.name] = value
    return ExportRanges(ranges.max_batch_size, highs, lows)


def _nearest_taken(run: Callable[[dict[str, Tensor]], Any], schema: InputSchema, ranges: ExportRanges,
                   sizes: dict[str, int], name: str, inward: list[int], seed: int) -> int | None:
    """The first of ``inward`` (values of dim ``name``, from the refused extreme inwards) at which the
    package takes the corner ``sizes``; a binary search that assumes a refusal at a value means one at
    every value before it."""
    def takes(value: int) -> bool:
        return _refusal(run, corner_batch(schema, ranges, {**sizes, name: value}, seed)) is None

    if not inward or not takes(inward[-1]):
        return None
    first, last = 0, len(inward) - 1  # inward[last] is taken
    while first < last:
        middle = (first + last) // 2
        if takes(inward[middle]):
            last = middle
        else:
            first = middle + 1
    return inward[first]


def settle_ranges(run: Callable[[dict[str, Tensor]], Any], schema: InputSchema, ranges: ExportRanges,
                  seed: int) -> tuple[ExportRanges, list[dict[str, Any]]]:
    """The ranges the package serves at every corner, and what had to be narrowed to get there.

    Runs the package (``run``) alone on every corner of ``ranges``. Where it refuses one, each dim at an
    extreme of that corner is moved inward to the nearest value the package takes, and the dim needing the
    smallest move is narrowed; then the corners of the narrower ranges run again. The number of users is
    never narrowed below 1. Returns the final ranges and one record per narrowed bound (``feature``,
    ``bound``, ``declared``, ``exported``, ``reason``). Raises VerificationError when no narrowing makes a
    refused corner pass."""
    declared = {("batch", False): ranges.max_batch_size,
                **{(name, True): ranges.min_lengths[name] for name in ranges.min_lengths},
                **{(name, False): ranges.max_lengths[name] for name in ranges.max_lengths}}
    narrowed: dict[tuple[str, bool], dict[str, Any]] = {}
    for _ in range(NARROWING_ROUNDS):
        dims = dynamic_dims(schema, ranges)
        refusal = None
        for sizes in corner_sizes(schema, ranges):
            message = _refusal(run, corner_batch(schema, ranges, sizes, seed))
            if message is not None:
                refusal = (sizes, message)
                break
        if refusal is None:
            return ranges, list(narrowed.values())
        sizes, message = refusal
        best: tuple[float, str, bool, int] | None = None
        for name, lo, hi in dims:
            value = sizes[name]
            if name == "batch" and value == lo:
                continue  # a package always takes one user
            inward = list(range(value + 1, hi + 1)) if value == lo else list(range(value - 1, lo - 1, -1))
            taken = _nearest_taken(run, schema, ranges, sizes, name, inward, seed)
            if taken is not None:
                move = abs(taken - value) / max(hi - lo, 1)
                if best is None or move < best[0]:
                    best = (move, name, value == lo, taken)
        if best is None:
            raise VerificationError(
                f"the package refuses a request inside its ranges ({describe_sizes(sizes, dims)}: {message}) and no "
                "narrower range avoids it; nothing was written")
        _, name, at_min, value = best
        narrowed[(name, at_min)] = {"feature": "batch size" if name == "batch" else name,
                                    "bound": "min" if at_min else "max", "declared": declared[(name, at_min)],
                                    "exported": value, "reason": message[:300]}
        ranges = _narrowed(schema, ranges, name, at_min, value)
    raise VerificationError(f"the package still refuses requests inside its ranges after {NARROWING_ROUNDS} "
                            "narrowings; nothing was written")


def narrowing_note(record: dict[str, Any]) -> str:
    """One line: which range was narrowed, to what, and why."""
    relation = ">=" if record["bound"] == "min" else "<="
    return (f"{record['feature']} narrowed to {relation} {record['exported']} (declared {record['declared']}): the "
            f"compiled program refuses requests beyond it ({record['reason']})")


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
    """Latency of the package and of eager on one generated batch (sizes drawn from the ranges). A
    ``batch_size`` beyond the package's maximum is timed at the maximum, and the result's ``note`` says so."""
    from hstu_export.bench import benchmark, clamp_batch_size
    from hstu_export.runtimes.predictor import load

    predictor = load(package)
    _, eager = _eager_for_package(predictor, model_path, allow_pickle)
    b, note = clamp_batch_size(batch_size, predictor.max_batch_size)
    batch = generate_batch(predictor.input_schema, b, seed=seed)
    device_batch = {k: v.to(predictor.device) for k, v in batch.items()}
    cand = next((f.jagged_by for f in predictor.input_schema.features
                 if f.kind == "jagged" and f.jagged_by and "candidate" in f.jagged_by), None)
    num_candidates = int(batch[cand].sum()) if cand else b
    res = benchmark(predictor, eager, device_batch, b, num_candidates, iters, warmup, predictor.device)
    res.update({"package": str(package), "batch_size": b, "num_candidates": num_candidates,
                "device": str(predictor.device), "torch": torch.__version__})
    if note:
        res.update(requested_batch_size=batch_size, note=note)
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
