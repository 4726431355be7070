"""Input schema: the named tensors a model (and an exported package) takes.

A feature is one of
- ``lengths``: per-user counts ``[B]`` (int64), each in [min_value, max_value];
- ``jagged``: values ``[sum(lengths)]`` partitioned by the ``jagged_by`` lengths feature;
- ``per_user``: one value per user ``[B]``.
The same schema drives the batch generator, the package manifest and request validation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import RequestError

KINDS = ("lengths", "jagged", "per_user")
DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    dtype: str
    kind: str
    jagged_by: str | None = None
    min_value: int | None = None
    max_value: int | None = None
    # "timestamp": jagged values increase within a user; a per-user timestamp comes after them.
    # "history_length" / "candidate_count": lengths bounded by --max-seq-len / --max-candidates.
    semantic: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class InputSchema:
    features: tuple[FeatureSpec, ...]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.features]

    def get(self, name: str) -> FeatureSpec:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(name)

    def lengths_features(self) -> list[FeatureSpec]:
        return [f for f in self.features if f.kind == "lengths"]

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(f) for f in self.features]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]]) -> InputSchema:
        return cls(tuple(FeatureSpec(**d) for d in data))

    def validate(self, batch: dict[str, Tensor], max_batch_size: int | None = None) -> int:
        """Checks a request; returns its batch size. Raises RequestError naming the first problem."""
        if not isinstance(batch, dict):
            raise RequestError(f"a request is a dict of named tensors, got {type(batch).__name__}")
        missing = [n for n in self.names if n not in batch]
        if missing:
            raise RequestError(f"request is missing feature(s) {missing}; the package expects {self.names}")
        extra = sorted(set(batch) - set(self.names))
        if extra:
            raise RequestError(f"request has unknown feature(s) {extra}; the package expects {self.names}")
        batch_size: int | None = None
        for f in self.features:
            t = batch[f.name]
            if not isinstance(t, Tensor):
                raise RequestError(f"feature {f.name!r} must be a tensor, got {type(t).__name__}")
            if t.dtype != f.torch_dtype:
                raise RequestError(f"feature {f.name!r} has dtype {t.dtype}, expected {f.torch_dtype}")
            if t.dim() != 1:
                raise RequestError(f"feature {f.name!r} must be 1-D, got shape {tuple(t.shape)}")
            if f.kind in ("lengths", "per_user"):
                if batch_size is None:
                    batch_size = t.numel()
                elif t.numel() != batch_size:
                    raise RequestError(
                        f"feature {f.name!r} has {t.numel()} entries but the batch has {batch_size} users")
            if t.numel() and f.min_value is not None and int(t.min()) < f.min_value:
                raise RequestError(f"feature {f.name!r} has value {int(t.min())} below the minimum {f.min_value}")
            if t.numel() and f.max_value is not None and int(t.max()) > f.max_value:
                what = "length" if f.kind == "lengths" else "value"
                raise RequestError(
                    f"feature {f.name!r} has {what} {int(t.max())} beyond the exported maximum {f.max_value}")
        if batch_size is None or batch_size < 1:
            raise RequestError("request has no users (batch size 0)")
        if max_batch_size is not None and batch_size > max_batch_size:
            raise RequestError(f"batch size {batch_size} is beyond the exported maximum {max_batch_size}")
        for f in self.features:
            if f.kind == "jagged":
                total = int(batch[f.jagged_by].sum())  # type: ignore[index]
                if batch[f.name].numel() != total:
                    raise RequestError(
                        f"feature {f.name!r} has {batch[f.name].numel()} values but {f.jagged_by!r} sums to {total}")
        return batch_size
