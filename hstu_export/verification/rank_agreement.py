"""Rank agreement of candidates per user between two sets of outputs (a quantized package and the fp32
model): Kendall's tau-b over each user's candidate scores. Ranking is what a recommender serves, so a
quantized package is judged by the order it gives each user's candidates as well as by its max error.

Which rows belong to one user is read from the output's named dims (``hstu_export.package.artifacts.name_dims``):
dim 0 named ``<lengths>.total`` is jagged by that lengths feature (one segment per user); dim 0 named
``batch`` with a second dim of two or more is one row per user. Other outputs have no per-user ranking.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

BATCH_DIM = "batch"
_PAIR_BLOCK = 512  # rows of the pairwise comparison held at once


def kendall_tau(x: Tensor, y: Tensor) -> float | None:
    """Kendall's tau-b of two score vectors (ties counted as neither concordant nor discordant); None for
    fewer than two items or when either vector is constant."""
    x, y = x.detach().double().flatten().cpu(), y.detach().double().flatten().cpu()
    n = x.numel()
    if n < 2:
        return None
    concordance = untied_x = untied_y = 0.0
    # Pairs (i, j > i), a block of rows at a time: memory stays O(block * n) for users with many candidates.
    for start in range(0, n - 1, _PAIR_BLOCK):
        rows = torch.arange(start, min(start + _PAIR_BLOCK, n - 1))
        later = torch.arange(n)[None, :] > rows[:, None]
        dx = torch.sign(x[rows, None] - x[None, :]) * later
        dy = torch.sign(y[rows, None] - y[None, :]) * later
        concordance += float((dx * dy).sum())
        untied_x += float((dx != 0).sum())
        untied_y += float((dy != 0).sum())
    if untied_x == 0 or untied_y == 0:
        return None
    return concordance / (untied_x * untied_y) ** 0.5


def user_rows(value: Tensor, dims: list[int | str] | None, batch: dict[str, Tensor]) -> list[Tensor] | None:
    """``value`` cut into one score vector per user, or None when its dims say no such cut exists."""
    if not dims or value.dim() == 0:
        return None
    dim0 = dims[0]
    if isinstance(dim0, str) and dim0.endswith(".total") and dim0[: -len(".total")] in batch:
        lengths = batch[dim0[: -len(".total")]].flatten().tolist()
        if sum(lengths) != value.size(0):
            return None
        return [segment.flatten() for segment in torch.split(value, lengths)]
    if dim0 == BATCH_DIM and value.dim() >= 2 and value[0].numel() >= 2:
        return [row.flatten() for row in value]
    return None


def per_user_tau(exported: dict[str, Tensor], reference: dict[str, Tensor], batch: dict[str, Tensor],
                 output_dims: dict[str, list[int | str]]) -> dict[str, dict[str, Any]]:
    """Output name -> {users, mean, min} of the per-user Kendall tau on one batch (outputs with a per-user
    ranking only; users with fewer than two candidates or constant scores are not counted)."""
    report = {}
    for name, ref in reference.items():
        if name not in exported or exported[name].shape != ref.shape:
            continue
        ref_rows = user_rows(ref, output_dims.get(name), batch)
        out_rows = user_rows(exported[name], output_dims.get(name), batch)
        if ref_rows is None or out_rows is None:
            continue
        taus = [t for a, b in zip(out_rows, ref_rows) if (t := kendall_tau(a, b)) is not None]
        report[name] = {"users": len(taus), "mean": sum(taus) / len(taus) if taus else None,
                        "min": min(taus) if taus else None}
    return report


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per output over the verification batches (each row's ``rank_agreement``): users counted, the mean
    of the per-user taus and the smallest one."""
    summary: dict[str, dict[str, Any]] = {}
    for row in rows:
        for name, stats in row.get("rank_agreement", {}).items():
            if not stats["users"]:
                continue
            total = summary.setdefault(name, {"users": 0, "sum": 0.0, "min": 1.0})
            total["users"] += stats["users"]
            total["sum"] += stats["mean"] * stats["users"]
            total["min"] = min(total["min"], stats["min"])
    return {name: {"users": t["users"], "mean_tau": t["sum"] / t["users"], "min_tau": t["min"]}
            for name, t in summary.items()}


def output_dims_from_manifest(manifest: dict[str, Any]) -> dict[str, list[int | str]]:
    """Each model output's named dims, as a package's manifest describes them (``artifacts``)."""
    wanted = set(manifest.get("output_names", []))
    dims: dict[str, list[int | str]] = {}
    for artifact in manifest.get("artifacts", {}).values():
        for output in artifact.get("outputs", []):
            if output.get("name") in wanted:
                dims[output["name"]] = list(output.get("shape", []))
    return dims
