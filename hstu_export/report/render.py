"""``report.html`` from a run record, through the jinja2 template shipped with the package."""

from __future__ import annotations

import html
from pathlib import Path

import jinja2

from hstu_export.report.pictures import LEGEND
from hstu_export.report.record import RunRecord

REPORT_NAME = "report.html"
TEMPLATE = "report.html.j2"
INLINE_DIFF_LIMIT = 64 * 1024  # larger diffs are linked, not inlined (a page must open fast)
LONG_STAT = 200  # characters: a longer pass statistic is shown whole, folded under its name


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _number(value: float | None, spec: str = ".2g") -> str:
    return "" if value is None else format(value, spec)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("hstu_export.report", "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
    )  # fmt: skip
    env.filters["bytes"] = human_bytes
    env.filters["number"] = _number
    return env


def diff_markup(diff: str) -> str:
    """A unified diff as HTML lines coloured by kind (escaped here; the template marks it safe)."""
    out = []
    for line in diff.splitlines():
        cls = ("hunk" if line.startswith("@@") else "add" if line.startswith("+") and not line.startswith("+++")
               else "del" if line.startswith("-") and not line.startswith("---") else "")
        text = html.escape(line)
        out.append(f'<span class="{cls}">{text}</span>' if cls else text)
    return "\n".join(out)


def render(record: RunRecord, directory: Path) -> str:
    """The page for ``record``; files it names are read from (and linked relative to) ``directory``."""
    diffs: dict[int, str] = {}
    for row in record.passes:
        path = Path(directory) / row.diff_file if row.diff_file else None
        if path is not None and path.is_file() and path.stat().st_size <= INLINE_DIFF_LIMIT:
            diffs[row.index] = diff_markup(path.read_text())
    template = _environment().get_template(TEMPLATE)
    return template.render(record=record, diffs=diffs, legend=LEGEND, long_stat=LONG_STAT)


def write(record: RunRecord, directory: Path) -> Path:
    """Writes ``report.json`` and ``report.html`` into ``directory``; returns the page's path."""
    record.write(directory)
    path = Path(directory) / REPORT_NAME
    path.write_text(render(record, directory))
    return path
