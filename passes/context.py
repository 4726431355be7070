"""What a pass is (``GraphPass``) and what it may read and write back (``PassContext``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.fx
from torch import Tensor, nn

from hstu_export.capture import EMBEDDING_MODULES
from hstu_export.package.schema import InputSchema
from hstu_export.passes.boundary import BoundarySchema


@runtime_checkable
class GraphPass(Protocol):
    """What the manager needs of a pass. Optional attribute: ``recursive: bool`` (default True)."""

    name: str

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule: ...


@dataclass
class PassContext:
    """Everything passes may read (settings, example inputs) and the little they write back."""

    example_inputs: dict[str, Tensor]
    model: nn.Module | None = None  # eager reference for check_each_pass (else the graph before any pass)
    schema: InputSchema | None = None  # taken from model.input_schema() when left None
    op_target: str = "aten"  # map_ops: "aten" | "triton" | "fbgemm"
    allow_unmapped: bool = False  # map_ops: keep ops without a mapping instead of failing
    embedding_modules: tuple[str, ...] = EMBEDDING_MODULES  # classes whose outputs must cross a mark
    dump_dir: Path | None = None
    check_each_pass: bool = False
    check_tolerance: float = 1e-5  # max relative error of a checked pass
    # Batches at the export's maxima (graph-input names): observe_values records the largest values of
    # data-dependent ints on them, which bound the padding of mapped foreign attention.
    probe_inputs: list[dict[str, Tensor]] = field(default_factory=list)
    attention_scale: str = "batch"  # "batch" (the model's own, from the batch) or "fixed:N"
    ranges: Any = None  # the export's ExportRanges: guard_ranges makes the artifacts check them
    op_mappings: dict[str, str] = field(default_factory=dict)  # extra foreign-function mappings
    # The user's model on graph inputs -> flat named outputs (check_each_pass's eager reference).
    reference: Any = None
    quantization: Any = None  # quantize_embeddings: an EmbeddingQuantization (None: tables stay as they are)
    export_dtype: str = "float32"  # the dtype the graphs are compiled in (follow_parameter_dtypes)
    export_device: str = "cpu"  # the device type the graphs are compiled for (align_linear_inputs)
    # Written while passes run.
    boundary: BoundarySchema | None = None  # set by split_sparse_dense
    current_graph: str = ""  # submodule path of the graph a pass is running on ("" = top)
    stats: dict[str, Any] = field(default_factory=dict)  # the running pass's statistics
    quantized_tables: list[dict[str, Any]] = field(default_factory=list)  # set by quantize_embeddings
    # Set by lower_embeddings: each embedding collection of the sparse half, lowered or kept with the reason.
    sparse_lowering: list[dict[str, Any]] = field(default_factory=list)
    batch_dependent: str | None = None  # set by map_ops: why a user's answer depends on the batch's other users

    def __post_init__(self) -> None:
        if self.dump_dir is not None:
            self.dump_dir = Path(self.dump_dir)
        if self.schema is None and self.model is not None and callable(getattr(self.model, "input_schema", None)):
            self.schema = self.model.input_schema()  # type: ignore[operator]

    def add_stat(self, key: str, value: Any) -> None:
        """Adds ``value`` to statistic ``key``: over the graphs a pass runs on, numbers sum up, lists
        extend and dicts merge key by key by the same rules; anything else is replaced."""
        _accumulate(self.stats, key, value)


def _accumulate(stats: dict[str, Any], key: str, value: Any) -> None:
    old = stats.get(key)
    if isinstance(old, (int, float)) and not isinstance(old, bool) and isinstance(value, (int, float)):
        stats[key] = old + value
    elif isinstance(old, list) and isinstance(value, list):
        stats[key] = [*old, *value]
    elif isinstance(old, dict) and isinstance(value, dict):
        merged = dict(old)
        for k, v in value.items():
            _accumulate(merged, k, v)
        stats[key] = merged
    else:
        stats[key] = value
