"""What each pass of a pipeline run did: the records the pass manager writes and the report reads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PassRecord:
    """What one pass did. ``status`` is "ok" or "failed"."""

    index: int
    name: str
    status: str = "ok"
    note: str = ""
    graphs: list[str] = field(default_factory=list)
    time_s: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    parameters_before: int = 0  # elements of all parameters and buffers
    parameters_after: int = 0
    parameter_bytes_before: int = 0
    parameter_bytes_after: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    max_rel_error: float | None = None  # set when check_each_pass ran
    files: list[str] = field(default_factory=list)  # dump files, relative to dump_dir

    def to_json(self) -> dict[str, Any]:
        # Passes may report any value; anything JSON cannot hold is written as its str().
        return json.loads(json.dumps(asdict(self), default=str))


@dataclass
class PassReport:
    """The per-pass records of one pipeline run (iterable, indexable by position or pass name)."""

    records: list[PassRecord] = field(default_factory=list)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: int | str) -> PassRecord:
        if isinstance(key, int):
            return self.records[key]
        for record in self.records:
            if record.name == key:
                return record
        raise KeyError(key)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records]
