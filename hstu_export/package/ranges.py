"""The dynamic ranges a package accepts (the manifest's ``ranges``), and the input schema bounded by them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hstu_export.package.schema import InputSchema


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
