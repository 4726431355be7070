"""Graph dumps of a pipeline run: per pass ``NN_<pass>.before.py``, ``.after.py``, ``.diff`` and ``.svg``
(graphviz ``dot``; without it the ``.dot`` text is written instead and one warning says so), plus one
self-contained ``report.html`` (inline CSS, SVGs linked relatively, no network fetches)."""

from __future__ import annotations

import difflib
import html
import json
import logging
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.fx

from hstu_export.boundary import DENSE, SPARSE, BoundarySchema

if TYPE_CHECKING:
    from hstu_export.pipeline import PassReport

log = logging.getLogger(__name__)

REPORT_NAME = "report.html"
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
        return [*files, self._write_picture(stem, gm)]

    def _write_picture(self, stem: str, gm: torch.fx.GraphModule) -> str:
        dot_source = to_dot(gm)
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

    def write_report(
        self, report: PassReport, gm: torch.fx.GraphModule, boundary: BoundarySchema | None
    ) -> Path:
        path = self.directory / REPORT_NAME
        (self.directory / "report.json").write_text(
            json.dumps({"passes": report.to_json(), "boundary": boundary.to_json() if boundary else None},
                       indent=2, default=str)
        )
        path.write_text(render_report(report, gm, boundary, self.directory))
        return path


# ---- graphviz -----------------------------------------------------------------------------------

_COLORS = {
    "placeholder": "#cfe2ff",
    "output": "#e2e3e5",
    "get_attr": "#fff3cd",
    "call_module": "#ffe5d0",
    "call_method": "#f8f9fa",
    "call_function": "#ffffff",
}


def to_dot(gm: torch.fx.GraphModule) -> str:
    """Graphviz source of ``gm``: one cluster per graph module (the top graph and its halves)."""
    lines = ["digraph G {", '  rankdir=TB; node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    modules = [(p, m) for p, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)]
    for index, (path, sub) in enumerate(modules):
        prefix = f"g{index}_"
        lines.append(f"  subgraph cluster_{index} {{")
        lines.append(f'    label="{_dot_escape(path or type(gm).__name__)}"; style=dashed;')
        for node in sub.graph.nodes:
            lines.append(f'    "{prefix}{node.name}" [label="{_dot_escape(_node_label(node))}", fillcolor="{_color(node)}"];')
        for node in sub.graph.nodes:
            for src in node.all_input_nodes:
                lines.append(f'    "{prefix}{src.name}" -> "{prefix}{node.name}";')
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _color(node: torch.fx.Node) -> str:
    target = str(node.target)
    if "sparse_boundary" in target:
        return "#f8d7da"
    if node.op == "call_function" and target.startswith("hstu_export."):
        return "#d1e7dd"
    return _COLORS.get(node.op, "#ffffff")


def _node_label(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        what = node.op
    elif node.op == "call_function":
        what = getattr(node.target, "__name__", str(node.target))
        what = str(node.target) if "OpOverload" in type(node.target).__name__ else what
    else:
        what = f"{node.op} {node.target}"
    label = f"{node.name}\n{what}"
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        label += f"\n{list(meta.shape)} {str(meta.dtype).removeprefix('torch.')}"
    return label


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# ---- HTML ---------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #212529; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #dee2e6; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f1f3f5; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.failed td { background: #f8d7da; }
pre { background: #f8f9fa; padding: 0.8em; overflow: auto; max-height: 40em; font-size: 12px; }
.add { color: #146c43; } .del { color: #b02a37; } .hunk { color: #6f42c1; }
img.graph { max-width: 100%; border: 1px solid #dee2e6; }
code { font-size: 12px; }
"""

# Errors (script errors, resources that fail to load) are collected into the page so a headless
# browser run can check them: <html data-status="ok"> once the page has loaded cleanly.
_ERROR_HOOK = """
window.reportErrors = [];
window.addEventListener("error", function (e) {
  var what = e.message || ((e.target && (e.target.src || e.target.href)) || "error");
  window.reportErrors.push(String(what));
}, true);
window.addEventListener("load", function () {
  document.documentElement.setAttribute("data-status", window.reportErrors.length ? "errors" : "ok");
  document.getElementById("load-errors").textContent = window.reportErrors.join("\\n");
});
"""


def render_report(
    report: PassReport, gm: torch.fx.GraphModule, boundary: BoundarySchema | None, directory: Path
) -> str:
    e = html.escape
    parts = [
        "<!doctype html>",
        '<html lang="en" data-status="loading"><head><meta charset="utf-8">',
        f"<title>hstu-export passes: {e(type(gm).__name__)}</title>",
        f"<style>{_CSS}</style>",
        f"<script>{_ERROR_HOOK}</script>",
        "</head><body>",
        f"<h1>Passes over {e(type(gm).__name__)}</h1>",
        '<pre id="load-errors" hidden></pre>',
        _pass_table(report),
    ]
    if boundary is not None:
        parts.append(_boundary_section(boundary))
    for record in report:
        parts.append(f'<section id="pass-{record.index:02d}"><h2>{record.index:02d} {e(record.name)}</h2>')
        if record.note:
            parts.append(f"<p>{e(record.note)}</p>")
        if record.stats:
            parts.append(f"<p>stats: <code>{e(json.dumps(record.stats, default=str))}</code></p>")
        if record.status == "ok" and not record.files:
            parts.append('<p class="no-change">no change: the graph is the same as before this pass</p>')
        for file_name in record.files:
            if file_name.endswith(".diff"):
                diff = (directory / file_name).read_text()
                parts.append(f'<details open><summary>diff (<a href="{e(file_name)}">{e(file_name)}</a>)</summary>'
                             f"{_diff_html(diff)}</details>")
            elif file_name.endswith(".svg"):
                parts.append(f'<details><summary>graph after the pass</summary><a href="{e(file_name)}">'
                             f'<img class="graph" src="{e(file_name)}" alt="{e(record.name)} graph"></a></details>')
            elif file_name.endswith(".dot"):
                parts.append(f'<p>graph after the pass: <a href="{e(file_name)}">{e(file_name)}</a> '
                             "(graphviz was not installed, so no SVG)</p>")
        parts.append("</section>")
    parts.append("<h2>Final graphs</h2>")
    halves = [(n, getattr(gm, n)) for n in (SPARSE, DENSE) if isinstance(getattr(gm, n, None), torch.fx.GraphModule)]
    for name, sub in halves or [("graph", gm)]:
        parts.append(f'<h3>{e(name)}</h3><pre class="code" id="final-{e(name)}">{e(sub.code)}</pre>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _pass_table(report: PassReport) -> str:
    e = html.escape
    rows = []
    for r in report:
        check = "" if r.max_rel_error is None else f"{r.max_rel_error:.2g}"
        stats = ", ".join(f"{k}={_short(v)}" for k, v in r.stats.items())
        rows.append(
            f'<tr class="pass {e(r.status)}" data-pass="{e(r.name)}"><td class="num">{r.index:02d}</td>'
            f'<td><a href="#pass-{r.index:02d}">{e(r.name)}</a></td><td>{e(r.status)}</td>'
            f'<td class="num">{r.time_s * 1000:.1f}</td><td class="num">{r.nodes_before}</td>'
            f'<td class="num">{r.nodes_after}</td><td class="num">{r.parameters_after:,}</td>'
            f'<td class="num">{human_bytes(r.parameter_bytes_after)}</td><td class="num">{e(check)}</td>'
            f"<td>{e(stats)}</td></tr>"
        )
    head = ("<tr><th>#</th><th>pass</th><th>status</th><th>ms</th><th>nodes before</th><th>nodes after</th>"
            "<th>parameters</th><th>bytes</th><th>max rel. error</th><th>stats</th></tr>")
    return f'<table id="passes"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _boundary_section(boundary: BoundarySchema) -> str:
    e = html.escape
    rows = []
    for side, tensors in (("sparse input", boundary.sparse_inputs), ("dense input", boundary.dense_inputs)):
        for t in tensors:
            shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
            rows.append(f"<tr><td>{side}</td><td>{e(t.name)}</td><td>{e(t.dtype)}</td><td>{e(shape)}</td>"
                        f"<td>{e(t.jagged_by)}</td><td>{e(t.source)}</td></tr>")
    head = "<tr><th>graph</th><th>name</th><th>dtype</th><th>shape</th><th>jagged by</th><th>source</th></tr>"
    outputs = ", ".join(boundary.output_names)
    return (f'<h2>Sparse/dense boundary</h2><table id="boundary"><thead>{head}</thead><tbody>{"".join(rows)}'
            f"</tbody></table><p>dense outputs: {e(outputs)}</p>")


def _diff_html(diff: str) -> str:
    if not diff:
        return "<p>(no change)</p>"
    out = []
    for line in diff.splitlines():
        cls = ("hunk" if line.startswith("@@") else "add" if line.startswith("+") and not line.startswith("+++")
               else "del" if line.startswith("-") and not line.startswith("---") else "")
        text = html.escape(line)
        out.append(f'<span class="{cls}">{text}</span>' if cls else text)
    return '<pre class="diff">' + "\n".join(out) + "</pre>"


def _short(value: Any) -> str:
    if isinstance(value, list):
        return f"[{len(value)}]" if len(value) > 3 else ",".join(map(str, value))
    return str(value)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
