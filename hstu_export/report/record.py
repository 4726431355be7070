"""The typed record of one export or inspect run that ``report.html`` is rendered from.

``run_passes`` with a dump directory writes the pass part (passes, pictures, boundary, op mapping,
opaque calls, per-pass checks, final graphs) as ``report.json``; ``inspect`` and ``export`` then add
what they know (settings, model source, ranges, parity per verification batch, timings, package
files) and render the page again. The record is read back from JSON, so every part is plain data.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD_NAME = "report.json"

KIND_PASSES = "passes"  # run_passes alone (the Python API)
KIND_INSPECT = "inspect"
KIND_EXPORT = "export"


@dataclass
class GroupPicture:
    """One group's picture: nodes of one module (or a chunk of them) in one graph module."""

    index: int
    title: str
    nodes: int
    mapped: int
    marked: int
    opaque: int
    file: str  # .svg, or .dot without graphviz


@dataclass
class PassPictures:
    overview: str  # .svg or .dot: a box per group
    groups: list[GroupPicture] = field(default_factory=list)

    @property
    def largest_group(self) -> int:
        return max((g.nodes for g in self.groups), default=0)


@dataclass
class PassRow:
    index: int
    name: str
    status: str
    note: str
    time_ms: float
    nodes_before: int
    nodes_after: int
    parameters: int
    parameter_bytes: int
    max_rel_error: float | None
    stats: dict[str, str] = field(default_factory=dict)  # readable values, whole
    stat_entries: dict[str, int] = field(default_factory=dict)  # how many entries a dict or list statistic has
    files: list[str] = field(default_factory=list)
    pictures: PassPictures | None = None

    @property
    def changed(self) -> bool:
        return bool(self.files)

    @property
    def diff_file(self) -> str:
        return next((f for f in self.files if f.endswith(".diff")), "")


@dataclass
class BoundaryRow:
    graph: str  # "sparse input" / "dense input"
    name: str
    dtype: str
    shape: str
    jagged_by: str
    source: str


@dataclass
class OpMappingRow:
    """What map_ops did with one source op or foreign function."""

    source: str
    target: str  # what replaced it, or "kept" (with the reason)
    count: int
    origin: str  # whose table: ours, fbgemm, generative-recommenders, TorchEasyRec, user
    kind: str  # "op" or "function"
    reason: str = ""  # why a call was kept as it is


@dataclass
class OpaqueCallRow:
    kind: str
    name: str
    where: str
    reason: str


@dataclass
class ParityBatchRow:
    batch: str
    batch_size: int
    sizes: str  # rows per feature
    worst_rel_l2: float | None
    worst_max_abs: float | None
    passed: bool


@dataclass
class ParityRecord:
    """Package against model, per verification batch (export only)."""

    verified: bool = False
    note: str = ""  # why there is nothing to show
    tolerances: dict[str, float] = field(default_factory=dict)
    batches: list[ParityBatchRow] = field(default_factory=list)


@dataclass
class PackageFile:
    name: str
    size: int


@dataclass
class FinalGraph:
    name: str
    code: str


@dataclass
class RunRecord:
    kind: str = KIND_PASSES
    title: str = ""  # the model's (or graph module's) name
    created: str = ""
    model: dict[str, str] = field(default_factory=dict)  # name, source, bundle, checksum
    target: dict[str, str] = field(default_factory=dict)  # backend, device, dtype, op target, package
    settings: dict[str, str] = field(default_factory=dict)
    ranges: dict[str, str] = field(default_factory=dict)
    passes: list[PassRow] = field(default_factory=list)
    checked_each_pass: bool = False
    boundary: list[BoundaryRow] = field(default_factory=list)
    boundary_outputs: list[str] = field(default_factory=list)
    op_mappings: list[OpMappingRow] = field(default_factory=list)
    opaque_calls: list[OpaqueCallRow] = field(default_factory=list)
    parity: ParityRecord = field(default_factory=ParityRecord)
    timings: dict[str, float] = field(default_factory=dict)
    package_files: list[PackageFile] = field(default_factory=list)
    final_graphs: list[FinalGraph] = field(default_factory=list)

    @property
    def largest_group(self) -> int:
        return max((p.pictures.largest_group for p in self.passes if p.pictures), default=0)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        return _load(cls, data)

    def write(self, directory: Path) -> Path:
        path = Path(directory) / RECORD_NAME
        path.write_text(json.dumps(self.to_json(), indent=1, default=str))
        return path

    @classmethod
    def read(cls, directory: Path) -> RunRecord:
        return cls.from_json(json.loads((Path(directory) / RECORD_NAME).read_text()))


def _load(tp: Any, data: Any) -> Any:
    """``data`` (JSON) as type ``tp``: nested dataclasses, lists, optionals; anything else as it is."""
    if data is None:
        return None
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        known = {f.name for f in dataclasses.fields(tp)}
        return tp(**{k: _load(hints[k], v) for k, v in data.items() if k in known})
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_load(item, x) for x in data]
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _load(inner[0], data) if len(inner) == 1 else data
    return data
