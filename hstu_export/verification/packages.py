"""Checking and timing a package already written: ``hstu-export verify`` and ``hstu-export bench``, and
reading a request batch from disk."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hstu_export.package.ranges import ExportRanges
from hstu_export.verification.batch import generate_batch
from hstu_export.verification.corners import verification_batches
from hstu_export.verification.parity import check_parity


def _eager_for_package(predictor: Any, model_path: str | None, allow_pickle: bool,
                       reference_device: str | None = None) -> tuple[Any, Any]:
    """The package's model as the reference: on ``reference_device`` (default: the export's
    ``--reference-device``) in fp32, else on the package's device in its dtype. It takes a batch on any
    device."""
    from pathlib import Path

    from hstu_export.errors import ConfigError
    from hstu_export.settings import TORCH_DTYPES
    from hstu_export.sources.bundle import load_bundle
    from hstu_export.sources.output_plan import OutputPlan
    from hstu_export.sources.outputs import call_model

    if model_path is not None and not Path(model_path).exists():
        raise ConfigError(f"--model {model_path}: no such file")
    path = model_path or predictor.manifest["model"].get("bundle")
    if not path or not Path(path).exists():
        raise ConfigError(
            f"no model bundle to compare with (the manifest records {path!r}, which is not here); "
            "pass --model MODEL.pt"
        )
    bundle = load_bundle(path, allow_pickle=allow_pickle)
    where = reference_device or (predictor.manifest.get("settings") or {}).get("reference_device")
    device = torch.device(where) if where else predictor.device
    dtype = torch.float32 if where else TORCH_DTYPES[predictor.manifest["dtype"]]
    model = bundle.model.to(device=device, dtype=dtype).eval()
    plan = OutputPlan.from_manifest(predictor.manifest)  # named (renamed, one per task) as the package's
    return bundle, lambda batch: call_model(model, bundle.input_schema, {k: v.to(device) for k, v in batch.items()},
                                            plan)


def _manifest_ranges(manifest: dict[str, Any]) -> ExportRanges:
    data = manifest["ranges"]["lengths"]
    return ExportRanges(data["max_batch_size"], data["max_lengths"], data["min_lengths"])


def verify_package(package: Any, model_path: str | None, *, num_random: int = 4, seed: int = 7,
                   allow_pickle: bool = False, rtol: float | None = None, atol: float | None = None,
                   imports: tuple[str, ...] = (), reference_device: str | None = None) -> dict[str, Any]:
    """Parity of an existing package against its eager model on fresh batches. The tolerances are the
    export's, unless ``rtol`` (relative L2) or ``atol`` (max absolute) are given. The model runs where the
    export ran it (``--reference-device``), unless ``reference_device`` says otherwise."""
    from hstu_export.runtimes.predictor import load
    from hstu_export.settings import DEFAULT_TOLERANCES
    from hstu_export.sources.bundle import import_modules

    import_modules(imports)
    predictor = load(package)
    _, eager = _eager_for_package(predictor, model_path, allow_pickle, reference_device)
    batches = verification_batches(predictor.input_schema, _manifest_ranges(predictor.manifest), seed, num_random)
    tolerances = dict(predictor.manifest.get("parity", {}).get("tolerances")
                      or DEFAULT_TOLERANCES[predictor.manifest["dtype"]])
    # Outputs the export held to tolerances of their own (a quantized package's embeddings), unless told.
    own = {name: dict(tol) for name, tol in (predictor.manifest.get("parity", {}).get("output_tolerances") or {}).items()}
    for tol in (tolerances, *own.values()):
        if rtol is not None:
            tol["rel_l2"] = rtol
        if atol is not None:
            tol["max_abs"] = atol
    per_batch = None
    quantized = "embedding_quantization" in predictor.manifest
    if quantized:  # each user's candidate ranking against the fp32 model, as at export: of its scores
        from hstu_export.package.manifest import SCORE_KINDS
        from hstu_export.verification import rank_agreement

        dims = rank_agreement.output_dims_from_manifest(predictor.manifest)
        kinds = predictor.output_kinds  # empty: an older package, whose kinds are not recorded
        dims = {name: d for name, d in dims.items() if not kinds or kinds.get(name) in SCORE_KINDS}

        def per_batch(batch: dict[str, Tensor], exported: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, Any]:
            return {"rank_agreement": rank_agreement.per_user_tau(exported, ref, batch, dims)}

    with torch.no_grad():
        report = check_parity(predictor, eager, batches, tolerances, per_batch=per_batch, output_tolerances=own)
    if quantized:
        report["rank_agreement"] = rank_agreement.summarize(report["batches"])
    if "kv_cache" in predictor.manifest:  # its delta program, served through the package's cache as at export
        from hstu_export.kv_export import verify_kv_cache

        with torch.no_grad():
            report["kv_cache"] = verify_kv_cache(
                predictor, eager, tolerances, seed)
        report["passed"] = report["passed"] and report["kv_cache"]["passed"]
    return report


def bench_package(package: Any, model_path: str | None, *, batch_size: int | None = None, iters: int = 50,
                  warmup: int = 10, seed: int = 11, allow_pickle: bool = False) -> dict[str, Any]:
    """Latency of the package and of eager on one generated batch (sizes drawn from the ranges). A
    ``batch_size`` beyond the package's maximum is timed at the maximum, and the result's ``note`` says so."""
    from hstu_export.runtimes.predictor import load
    from hstu_export.verification.bench import benchmark, clamp_batch_size

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
    """A request batch: a directory of tensors (``hstu_export.package.tensor_dir``), a torch.save'd dict of
    tensors, or a model bundle's example batch."""
    from pathlib import Path

    from hstu_export.errors import RequestError
    from hstu_export.package.tensor_dir import load_tensors, load_untrusted
    from hstu_export.sources.bundle import BUNDLE_FORMAT

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
