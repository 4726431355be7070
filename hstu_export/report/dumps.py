"""Graph dumps of a pipeline run: per pass that changed the graph ``NN_<pass>.before.py``, ``.after.py``,
``.diff``, an overview picture ``NN_<pass>.svg`` (a box per module group) and one picture per group
``NN_<pass>.gKK.svg`` (graphviz ``dot``; without it the ``.dot`` text is written instead and one warning
says so), plus the run's record ``report.json`` and the self-contained ``report.html`` rendered from it
(see ``hstu_export.report``)."""

from __future__ import annotations

import difflib
import logging
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch.fx

from hstu_export.passes.boundary import DENSE, SPARSE, BoundarySchema
from hstu_export.report import pictures, render
from hstu_export.report.build import pass_record
from hstu_export.report.record import GroupPicture, PassPictures

if TYPE_CHECKING:
    from hstu_export.passes.record import PassReport

log = logging.getLogger(__name__)

REPORT_NAME = render.REPORT_NAME
human_bytes = render.human_bytes
DOT_TIMEOUT_S = 120


def graph_code(gm: torch.fx.GraphModule) -> str:
    """Readable Python of ``gm`` including its nested graph modules."""
    return gm.print_readable(print_output=False)


class GraphDumper:
    """Writes the files of one pipeline run into ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dot = shutil.which("dot")
        self._warned_no_dot = False
        self.pictures: dict[int, PassPictures] = {}

    def graph_code(self, gm: torch.fx.GraphModule) -> str:
        return graph_code(gm)

    def write_pass(self, index: int, name: str, before: str, gm: torch.fx.GraphModule) -> list[str]:
        """Writes before/after code, their diff and the after graph's picture; returns the file names. A
        pass that left the graph's code as it was writes nothing (the report says "no change")."""
        stem = f"{index:02d}_{name}"
        after = graph_code(gm)
        if after == before:
            return []
        diff = "".join(
            difflib.unified_diff(
                before.splitlines(keepends=True), after.splitlines(keepends=True),
                f"{stem}.before.py", f"{stem}.after.py",
            )
        )  # fmt: skip
        files = {f"{stem}.before.py": before, f"{stem}.after.py": after, f"{stem}.diff": diff}
        for file_name, text in files.items():
            (self.directory / file_name).write_text(text)
        drawn = self._write_pictures(index, stem, gm)
        return [*files, drawn.overview, *(g.file for g in drawn.groups)]

    def _write_pictures(self, index: int, stem: str, gm: torch.fx.GraphModule) -> PassPictures:
        """The overview (a box per module group) and one picture per group."""
        groups = pictures.group_nodes(gm)
        kinds = pictures.node_kinds(gm)
        groups_of = {n: i for i, g in enumerate(groups) for n in g.nodes}
        suffix = ".svg" if self.dot is not None else ".dot"
        links = [f"{stem}.g{number:02d}{suffix}" for number in range(len(groups))]
        drawn = PassPictures(self._write_picture(stem, pictures.overview_dot(groups, kinds, links)))
        for number, group in enumerate(groups):
            counts = pictures.kind_counts(group, kinds)
            source = pictures.group_dot(group, kinds, groups_of, groups)
            drawn.groups.append(GroupPicture(
                number, group.title, len(group.nodes), counts["mapped"], counts["marked"], counts["opaque"],
                self._write_picture(f"{stem}.g{number:02d}", source),
            ))  # fmt: skip
        self.pictures[index] = drawn
        return drawn

    def _write_picture(self, stem: str, dot_source: str) -> str:
        if self.dot is not None:
            svg = self.directory / f"{stem}.svg"
            try:
                subprocess.run(
                    [self.dot, "-Tsvg", "-o", str(svg)], input=dot_source.encode(), check=True,
                    capture_output=True, timeout=DOT_TIMEOUT_S,
                )  # fmt: skip
                return svg.name
            except (subprocess.SubprocessError, OSError) as exc:
                log.warning("dot failed on %s (%s); writing the .dot text instead", stem, exc)
        elif not self._warned_no_dot:
            self._warned_no_dot = True
            warnings.warn(
                "graphviz `dot` was not found: writing .dot files instead of .svg pictures "
                "(install graphviz to get SVGs)",
                stacklevel=2,
            )
        path = self.directory / f"{stem}.dot"
        path.write_text(dot_source)
        return path.name

    def write_report(self, report: PassReport, gm: torch.fx.GraphModule, boundary: BoundarySchema | None,
                     checked: bool = False) -> Path:
        """``report.json`` (the pass part of the run's record) and ``report.html``; export and inspect add
        their part later (``hstu_export.report.build``)."""
        halves = [(n, getattr(gm, n)) for n in (SPARSE, DENSE) if isinstance(getattr(gm, n, None), torch.fx.GraphModule)]
        final = {name: sub.code for name, sub in halves or [("graph", gm)]}
        record = pass_record(type(gm).__name__, report, self.pictures, boundary, gm.meta.get("opaque_calls", []),
                             final, checked)
        return render.write(record, self.directory)

