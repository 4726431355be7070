"""The sparse→dense boundary: which tensors the dense graph takes and where they come from.

``split_sparse_dense`` writes one ``BoundarySchema``. Shapes use symbolic names for dynamic dims:
``"batch"`` for the number of users, ``"batch+1"`` for offsets, ``"<lengths feature>.total"`` for a jagged
dim 0 (the sum of that lengths feature), ``"<name>.size0"`` for a size of its own (``max_dim0`` bounds
it), plain ints for static dims. Names are graph-input names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SPARSE = "sparse"  # submodule name of the sparse graph in the split graph module
DENSE = "dense"
BATCH_DIM = "batch"


def jagged_total_dim(jagged_by: str) -> str:
    """Symbolic name of the dim 0 of values partitioned by the lengths feature ``jagged_by``."""
    return f"{jagged_by}.total"


@dataclass(frozen=True)
class BoundaryTensor:
    """One input of the sparse or dense graph.

    ``source`` is ``"sparse"`` for a tensor the sparse graph computes (a ``sparse_boundary`` mark) and
    ``"input"`` for a model input passed straight through. ``jagged_by`` names the lengths feature that
    partitions dim 0 ("" for a per-user ``[B, ...]`` tensor or a lengths feature itself).
    """

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    jagged_by: str
    source: str
    max_dim0: int | None = None  # the range of a dim 0 that is none of batch, batch+1 or a total

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BoundaryTensor:
        return cls(data["name"], data["dtype"], tuple(data["shape"]), data["jagged_by"], data["source"],
                   data.get("max_dim0"))


@dataclass(frozen=True)
class BoundarySchema:
    """Inputs of both graphs: ``sparse(**sparse_inputs) -> {name: tensor}`` for every dense input with
    source ``"sparse"``; ``dense(**dense_inputs) -> outputs``."""

    sparse_inputs: tuple[BoundaryTensor, ...]
    dense_inputs: tuple[BoundaryTensor, ...]
    output_names: tuple[str, ...] = field(default=())

    @property
    def sparse_outputs(self) -> tuple[BoundaryTensor, ...]:
        return tuple(t for t in self.dense_inputs if t.source == "sparse")

    @property
    def passthrough(self) -> tuple[BoundaryTensor, ...]:
        """Model inputs the dense graph takes directly (lengths, timestamps, ...)."""
        return tuple(t for t in self.dense_inputs if t.source == "input")

    def to_json(self) -> dict[str, Any]:
        return {
            "sparse_inputs": [t.to_json() for t in self.sparse_inputs],
            "dense_inputs": [t.to_json() for t in self.dense_inputs],
            "output_names": list(self.output_names),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BoundarySchema:
        return cls(
            tuple(BoundaryTensor.from_json(t) for t in data["sparse_inputs"]),
            tuple(BoundaryTensor.from_json(t) for t in data["dense_inputs"]),
            tuple(data.get("output_names", ())),
        )
