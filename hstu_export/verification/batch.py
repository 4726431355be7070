"""Deterministic synthetic batches drawn from an input schema.

Lengths features are drawn per user over [min, max] (or given explicitly, for edge cases); ids are
uniform over their vocabulary; timestamps increase within a user and the per-user query time comes
after the user's last event. The same seed gives the same batch on every machine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hstu_export.errors import ConfigError
from hstu_export.package.schema import InputSchema

_START_TIME = 1_700_000_000  # seconds; any fixed epoch works
_MEAN_GAP = 3_600


def generate_batch(
    schema: InputSchema,
    batch_size: int,
    seed: int = 0,
    lengths: dict[str, Tensor | list[int]] | None = None,
) -> dict[str, Tensor]:
    """A batch of ``batch_size`` users. ``lengths`` overrides chosen lengths features."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    given = {k: torch.as_tensor(v, dtype=torch.int64) for k, v in (lengths or {}).items()}
    batch: dict[str, Tensor] = {}
    for f in schema.lengths_features():
        if f.same_as:
            continue
        if f.name in given:
            value = given[f.name]
            if value.shape != (batch_size,):
                raise ConfigError(f"lengths for {f.name!r} must have {batch_size} entries, got {tuple(value.shape)}")
        else:
            lo, hi = f.min_value or 1, f.max_value if f.max_value is not None else 16
            value = torch.randint(lo, hi + 1, (batch_size,), generator=gen)
        batch[f.name] = value.to(f.torch_dtype)
    for f in schema.lengths_features():
        if f.same_as:  # keys that share their lengths get the same draw
            batch[f.name] = batch[schema.canonical_lengths(f.name)].to(f.torch_dtype)
    unknown = sorted(set(given) - set(batch))
    if unknown:
        raise ConfigError(f"{unknown} are not lengths features of this model's schema")

    jagged_times: dict[str, Tensor] = {}
    for f in schema.features:
        if f.kind == "lengths":
            continue
        count = int(batch[f.jagged_by].sum()) if f.kind == "jagged" else batch_size  # type: ignore[index]
        if f.semantic == "timestamp" and f.kind == "jagged":
            lens = batch[f.jagged_by]  # type: ignore[index]
            gaps = torch.randint(1, 2 * _MEAN_GAP, (count,), generator=gen)
            starts = torch.randint(0, 30 * 86_400, (batch_size,), generator=gen) + _START_TIME
            seq = torch.repeat_interleave(torch.arange(batch_size), lens)
            csum = torch.cumsum(gaps, 0)
            offsets = torch.cumsum(lens, 0) - lens
            before = torch.cat([torch.zeros(1, dtype=csum.dtype), csum])[offsets][seq]
            value = starts[seq] + csum - before
            jagged_times[f.name] = (value, seq)
        elif f.semantic == "timestamp":
            last = torch.full((batch_size,), _START_TIME + 30 * 86_400, dtype=torch.int64)
            for value_t, seq in jagged_times.values():
                last = torch.maximum(last, torch.zeros_like(last).scatter_reduce(0, seq, value_t, "amax"))
            value = last + torch.randint(1, _MEAN_GAP, (batch_size,), generator=gen)
        elif f.torch_dtype.is_floating_point:
            value = torch.randn((count, *f.trailing), generator=gen)
            if f.min_value is not None or f.max_value is not None:
                lo = f.min_value if f.min_value is not None else -1e9
                hi = f.max_value if f.max_value is not None else 1e9
                value = value.clamp(lo, hi)
        elif f.torch_dtype == torch.bool:
            value = torch.randint(0, 2, (count, *f.trailing), generator=gen)
        else:
            sample_lo, sample_hi = f.sample_range or (0, 1_000_000)
            lo = f.min_value if f.min_value is not None else sample_lo
            hi = f.max_value if f.max_value is not None else max(sample_hi, lo)
            value = torch.randint(lo, hi + 1, (count, *f.trailing), generator=gen)
        batch[f.name] = value.to(f.torch_dtype)
    return {f.name: batch[f.name] for f in schema.features}
