"""Graph dumps, the HTML report (opened in a real headless Chromium) and ``hstu-export inspect``."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from hstu_export import PassContext, generate_batch, register_model, run_passes, save_bundle, trace
from hstu_export import passes as pass_registry
from hstu_export.cli import main
from hstu_export.models import HSTUConfig, build_preset
from hstu_export.models.ranking import HstuRankingModel

# Graph pictures: SVG with graphviz, the .dot text without it (the product falls back the same way).
PICTURE = ".svg" if shutil.which("dot") else ".dot"
CHROMIUM = (
    shutil.which("chromium")
    or shutil.which("chromium-browser")
    or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
)


def _tiny_config() -> HSTUConfig:
    return build_preset("tiny").config


class ClippedHeads(nn.Module):
    """Clamps extreme inputs with data-dependent Python control flow (FX cannot trace it)."""

    def __init__(self, heads: nn.Module) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        if x.abs().max() > 1e3:
            x = x.clamp(-1e3, 1e3)
        return self.heads(x)


@register_model("test_untraceable_ranking", HSTUConfig)
class UntraceableRanking(HstuRankingModel):
    def __init__(self, config: HSTUConfig) -> None:
        super().__init__(config)
        self.task_heads = ClippedHeads(self.task_heads)  # type: ignore[assignment]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_preset("tiny")
    batch = generate_batch(model.input_schema(), 3, seed=0)
    out = tmp_path_factory.mktemp("graphs")
    run_passes(trace(model, batch), PassContext(example_inputs=batch, model=model, dump_dir=out))
    return out


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_preset("tiny")
    path = tmp_path_factory.mktemp("bundle") / "tiny.pt"
    return save_bundle(model, path, generate_batch(model.input_schema(), 3, seed=0))


def _ran_passes() -> list[str]:
    return pass_registry.known_pass_names()


def _stem(name: str) -> str:
    """The dump-file stem of a pass of the default pipeline (NN_name)."""
    return f"{pass_registry.known_pass_names().index(name) + 1:02d}_{name}"


def test_dump_files_for_every_pass(dumped: Path) -> None:
    recorded = {entry["name"]: entry for entry in json.loads((dumped / "report.json").read_text())["passes"]}
    html = (dumped / "report.html").read_text()
    unchanged = []
    for index, name in enumerate(pass_registry.known_pass_names(), start=1):
        stem = dumped / f"{index:02d}_{name}"
        suffixes = (".before.py", ".after.py", ".diff", PICTURE)
        if name in _ran_passes() and recorded[name]["files"]:
            for suffix in suffixes:
                assert Path(f"{stem}{suffix}").is_file(), f"{stem}{suffix}"
        else:
            # Not run, or the graph's code did not change: no copy of it, and the report says so.
            assert not any(Path(f"{stem}{s}").exists() for s in suffixes)
            if name in _ran_passes():
                unchanged.append(name)
                section = html.split(f'id="pass-{index:02d}"')[1].split("</section>")[0]
                assert "no change: the graph is the same as before this pass" in section
    assert "eliminate_dead_code" in unchanged and "split_sparse_dense" not in unchanged
    split = dumped / _stem("split_sparse_dense")
    before, after = Path(f"{split}.before.py").read_text(), Path(f"{split}.after.py").read_text()
    # print_readable names nested graph modules by attribute: the halves appear only after the split.
    assert "class sparse(" not in before and "class sparse(" in after and "class dense(" in after
    diff = Path(f"{split}.diff").read_text()
    stem = _stem("split_sparse_dense")
    assert diff.startswith(f"--- {stem}.before.py\n+++ {stem}.after.py\n")
    assert "+    class sparse(torch.nn.Module):" in diff
    picture = Path(f"{split}{PICTURE}").read_text()
    assert ("<svg" in picture if PICTURE == ".svg" else picture.startswith("digraph G {"))
    assert "cluster" in picture and "sparse" in picture and "dense" in picture
    marks_removed = Path(dumped / f"{_stem('remove_boundary_marks')}.diff").read_text()
    assert marks_removed.count("-    ") >= 5  # 5 marks removed
    html = (dumped / "report.html").read_text()
    assert "http://" not in html and "https://" not in html  # nothing fetched from outside


def test_without_graphviz_dot_text_is_written_once_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hstu_export.report.dumps as inspection

    monkeypatch.setattr(inspection.shutil, "which", lambda name: None)
    model = build_preset("tiny")
    batch = generate_batch(model.input_schema(), 2, seed=0)
    with pytest.warns(UserWarning, match="graphviz `dot` was not found") as warned:
        result = run_passes(
            trace(model, batch),
            PassContext(example_inputs=batch, dump_dir=tmp_path),
            passes=["prune_unused", "split_sparse_dense"],
        )
    assert sum("graphviz" in str(w.message) for w in warned) == 1
    assert not list(tmp_path.glob("*.svg"))
    dot = (tmp_path / "02_split_sparse_dense.dot").read_text()
    assert dot.startswith("digraph G {") and "cluster_" in dot
    assert result.report_path is not None and "graphviz was not installed" in result.report_path.read_text()
    groups = json.loads((tmp_path / "report.json").read_text())["passes"][1]["pictures"]["groups"]
    assert groups and all(g["file"].endswith(".dot") and (tmp_path / g["file"]).is_file() for g in groups)


def test_pictures_group_nodes_by_module_within_the_limit() -> None:
    from hstu_export.report import pictures

    model = build_preset("tiny")
    batch = generate_batch(model.input_schema(), 2, seed=0)
    result = run_passes(trace(model, batch), PassContext(example_inputs=batch, model=model))
    gm = result.graph
    everything = [n for _, sub in gm.named_modules() if isinstance(sub, torch.fx.GraphModule) for n in sub.graph.nodes]
    for limit in (60, 20):
        groups = pictures.group_nodes(gm, limit=limit)
        assert max(len(g.nodes) for g in groups) <= limit
        grouped = [n for g in groups for n in g.nodes]
        assert len(grouped) == len(everything) and set(grouped) == set(everything)  # each node once
    groups = pictures.group_nodes(gm, limit=20)
    # A group holds one module's nodes; what a mapped op became is a group below its module, chunked in
    # order when too big for one picture.
    attention = [g for g in groups if g.graph == "dense"
                 and g.module == "transducer.stu.layers.0 ▸ hstu_export::hstu_mha_gated"]
    assert len(attention) >= 2 and [g.part for g in attention] == list(range(1, len(attention) + 1))
    assert all(n.meta["mapped_from"] == "hstu_export::hstu_mha_gated" for g in attention for n in g.nodes)
    assert all("transducer.stu.layers.0" in pictures.module_chain(n) for g in attention for n in g.nodes)
    kinds = pictures.node_kinds(gm)
    counts = collections.Counter(kinds.values())
    # Nodes map_ops put in place keep their module (so they are grouped) and are coloured as mapped.
    mapped = [n for n, kind in kinds.items() if kind == "mapped"]
    assert len(mapped) == counts["mapped"] > 0 and all(pictures.module_chain(n) for n in mapped)
    # The boundary: the sparse graph's output and the dense graph's inputs that come from it.
    boundary = {n.name for n, kind in kinds.items() if kind == "marked"}
    assert {"uih_item_emb", "candidate_item_emb", "user_id_emb"} <= boundary
    overview = pictures.overview_dot(groups, kinds, [f"g{i}.svg" for i in range(len(groups))])
    assert overview.count("subgraph cluster_") == 3  # the top graph, sparse and dense
    assert all(f'URL="g{i}.svg"' in overview for i in range(len(groups)))  # each box opens its group


def _artifacts_dir() -> Path:
    """Where browser tests keep their screenshots: $HSTU_EXPORT_TEST_ARTIFACTS, else out/artifacts/ of the
    repository (ignored by git), where a CI run can collect it."""
    where = os.environ.get("HSTU_EXPORT_TEST_ARTIFACTS")
    path = Path(where) if where else Path(__file__).resolve().parent.parent / "out" / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _chromium(report: Path, profile: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *mode, report.as_uri(),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # type: ignore[arg-type]


def _open(report: Path, tmp_path: Path, screenshot: str | None = None) -> str:
    """The report's DOM after load in headless Chromium, checked to have loaded cleanly; with
    ``screenshot``, a PNG of its first screen is kept under the artifacts directory."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (CI installs it: apt-get install chromium)")
    proc = _chromium(report, tmp_path / "profile", "--dump-dom")
    dom = proc.stdout
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The page's own check ran after load: no script errors, every image and link target loaded.
    assert re.search(r'<html[^>]*data-status="ok"', dom), re.findall(r'<pre id="load-errors"[^<]*', dom)
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "ERR_FILE_NOT_FOUND" in line]
    assert not console, console
    if screenshot is not None:
        png = _artifacts_dir() / screenshot
        shot = _chromium(report, tmp_path / "profile", "--window-size=1300,2600", "--hide-scrollbars",
                         f"--screenshot={png}")
        assert shot.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot.stderr[-2000:]
        assert png.stat().st_size > 20_000  # a page with tables, not an empty screen
    return dom


def _table(dom: str, table_id: str) -> list[list[str]]:
    """The text of each body row's cells of table ``table_id``."""
    body = re.split(rf'<table[^>]* id="{table_id}"[^>]*>', dom, maxsplit=1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", body.split("<tbody>", 1)[-1], flags=re.S)
    return [[re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)]
            for row in rows]


@pytest.mark.browser
def test_report_opens_in_headless_chromium(dumped: Path, tmp_path: Path) -> None:
    dom = _open(dumped / "report.html", tmp_path)
    rows = re.findall(r'<tr class="pass (\w+)" data-pass="(\w+)">', dom)
    assert [name for _, name in rows] == pass_registry.known_pass_names()
    assert all(status == "ok" for status, name in rows if name in _ran_passes())
    assert '<table id="boundary">' in dom and "uih_lengths.total" in dom
    # Without --check-each-pass the error column is empty, and the page says why.
    assert "only with <code>--check-each-pass</code>" in dom
    # What map_ops did, as a table: our ops onto the reference functions, counted, from our table.
    mapping = {row[0]: row for row in _table(dom, "op-mapping-table")}
    assert mapping["hstu_export::hstu_mha_gated"][2:5] == [
        "hstu_export.ops.reference:hstu_mha_gated_reference", "2", "ours"]  # two STU layers
    record = json.loads((dumped / "report.json").read_text())
    changed = [p for p in record["passes"] if p["files"]]
    if PICTURE == ".svg":  # an overview per pass that changed the graph; the others say "no change"
        assert len(re.findall(r'<img class="graph overview" src="\d\d_\w+\.svg"', dom)) == len(changed) >= 3
        assert dom.count('class="no-change"') == len(_ran_passes()) - len(changed) >= 1
    for entry in changed:  # every node is in one group picture of at most ~60 nodes, each collapsed
        groups = entry["pictures"]["groups"]
        assert groups and max(g["nodes"] for g in groups) <= 60
        assert sum(g["nodes"] for g in groups) == entry["nodes_after"]
        assert dom.count(f'<details class="group" id="pass-{entry["index"]:02d}-group-') == len(groups)
    mapped = next(p for p in changed if p["name"] == "map_ops")["pictures"]["groups"]
    assert sum(g["mapped"] for g in mapped) >= 7  # the nodes the 7 mapped ops became are coloured
    assert 'id="final-sparse"' in dom and 'id="final-dense"' in dom
    assert 'id="legend"' in dom and "map_ops" in "".join(_table(dom, "legend")[0])


@pytest.mark.slow
@pytest.mark.browser
def test_export_report_shows_settings_parity_and_mapping(tiny_bundle: Path, tmp_path: Path) -> None:
    """The report of a tiny export, as it travels in the package: settings, parity per verification
    batch with sizes, timings and package files."""
    package = tmp_path / "pkg"
    assert main(["export", str(tiny_bundle), "--backend", "torchscript", "--out", str(package), "--dump-graphs",
                 str(tmp_path / "graphs"), "--graphs-in-package", "--max-batch-size", "3", "-q"]) == 0
    manifest = json.loads((package / "manifest.json").read_text())
    report = package / "graphs" / "report.html"
    assert manifest["files"]["graphs/report.html"]  # the completed report is the one checksummed
    dom = _open(report, tmp_path, screenshot="export_report_tiny.png")
    assert (tmp_path / "graphs" / "report.html").read_text() == report.read_text()
    settings = {row[0]: row[1] for row in _table(dom, "settings")}
    assert settings["backend"] == "torchscript" and settings["max_batch_size"] == "3"
    model = {row[0]: row[1] for row in _table(dom, "model")}
    assert model["backend"] == "torchscript" and model["model name"] == manifest["model"]["name"]
    batches = _table(dom, "parity-batches")
    recorded = manifest["parity"]["batches"]
    assert [(row[0], int(row[1])) for row in batches] == [(b["batch"], b["batch_size"]) for b in recorded]
    assert {int(row[1]) for row in batches} >= {1, 3} and all(row[5] == "yes" for row in batches)
    worst = max(e["rel_l2"] for b in recorded for e in b["errors"].values())
    assert max(float(row[3]) for row in batches) == pytest.approx(worst, rel=0.05)
    assert "uih_item_ids" in batches[0][2]  # rows per feature
    mapping = {row[0]: row for row in _table(dom, "op-mapping-table")}
    assert mapping["hstu_export::hstu_mha_gated"][3:5] == ["2", "ours"]
    files = {row[0] for row in _table(dom, "package-table")}
    assert "manifest.json" in files and set(manifest["backend"]["files"].values()) <= files
    assert {row[0] for row in _table(dom, "timings-table")} >= {"load", "trace", "passes", "compile", "verify"}


@pytest.mark.slow
@pytest.mark.browser
def test_report_of_a_third_party_style_model(tmp_path: Path) -> None:
    """A user's model with its own attention, declared like generative-recommenders': the op-mapping table
    says whose mapping rewrote it."""
    from user_models import dlrm_hstu

    from hstu_export import ExportSettings, VerifySettings, export

    user_attention = "user_models.dlrm_hstu.jagged_hstu_attention"
    gr_attention = "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha"
    bundle = save_bundle(dlrm_hstu.build_ranker(), tmp_path / "user.pt", example_inputs=dlrm_hstu.example_inputs(3, seed=0),
                         factory="user_models.dlrm_hstu:build_ranker",
                         ranges={"uih_features": (1, 12), "candidates_features": (1, 5)})
    settings = ExportSettings(backend="torchscript", max_batch_size=4, verify=VerifySettings(num_random_batches=2),
                              op_mappings={user_attention: gr_attention}, dump_dir=tmp_path / "graphs")
    result = export(bundle, tmp_path / "pkg", settings)
    dom = _open(tmp_path / "graphs" / "report.html", tmp_path, screenshot="export_report_user_model.png")
    mapping = {row[0]: row for row in _table(dom, "op-mapping-table")}
    attention = mapping[user_attention]
    assert attention[1] == "function" and attention[3] == "2"  # two layers
    assert attention[4] == "generative-recommenders" and attention[5] == f"declared like {gr_attention}"
    # The foreign function and its lowering are one row: source → our op → the target's.
    assert attention[2] == "hstu_export::hstu_mha → hstu_export.ops.reference:hstu_mha_reference (for aten)"
    assert "hstu_export::hstu_mha" not in mapping
    assert mapping["fbgemm::jagged_to_padded_dense"][2:5] == [
        "hstu_export.ops.mappings.fbgemm:fbgemm_jagged_to_padded_dense_as_aten", "2", "fbgemm"]
    batches = _table(dom, "parity-batches")
    assert len(batches) == len(result.parity["batches"]) and all(row[5] == "yes" for row in batches)
    assert {int(row[1]) for row in batches} >= {1, 4}
    settings_shown = {row[0]: row[1] for row in _table(dom, "settings")}
    assert user_attention in settings_shown["op_mappings"]
    model = {row[0]: row[1] for row in _table(dom, "model")}
    assert model["model source"] == "kind: factory, factory: user_models.dlrm_hstu:build_ranker, kwargs: none"
    assert settings_shown["max_batch_size"] == "4" and "{" not in "".join(settings_shown.values())
    record = json.loads((tmp_path / "graphs" / "report.json").read_text())
    mapped = next(p for p in record["passes"] if p["name"] == "map_ops")["pictures"]["groups"]
    assert max(g["nodes"] for g in mapped) <= 60 and sum(g["mapped"] for g in mapped) > 0


def test_export_report_shows_what_was_exported_readably(tmp_path: Path) -> None:
    """The settings an export ran with, with the package's own max batch size where export narrowed it;
    structured values (settings, the model's source, long pass statistics) as readable text, whole."""
    from hstu_export.passes.record import PassRecord, PassReport
    from hstu_export.report import render
    from hstu_export.report.build import add_export_context, pass_record

    lengths = {"max_batch_size": 8, "max_lengths": {"uih": 40}, "min_lengths": {"uih": 1}}
    manifest = {
        "model": {"name": "m", "source": {"kind": "factory", "factory": "pkg.models:build", "kwargs": {}}},
        "settings": {"max_batch_size": 32, "verify": {"enabled": True, "seed": 7, "tolerances": None},
                     "op_mappings": {"pkg.attention": "generative_recommenders.ops.pytorch.x"}, "dump_dir": None},
        "ranges": {"max_batch_size": 8, "lengths": lengths, "narrowed": [{"dim": "batch", "from": 32, "to": 8}]},
        "parity": {"skipped": True},
    }
    ints = {f"int_{i}": i for i in range(80)}  # observe_values' int maxima of a large model
    report = PassReport([PassRecord(index=1, name="observe_values", status="ok", stats={"int_maxima": ints})])
    record = pass_record("m", report, {}, None, [], {}, checked=False)
    add_export_context(record, manifest, tmp_path, tmp_path / "pkg", written=False)
    assert record.settings["max_batch_size"] == "8 (asked 32, narrowed at export)"
    assert record.ranges["max batch size"] == "8"
    assert record.settings["verify"] == "enabled: true, seed: 7, tolerances: none"
    assert record.settings["op_mappings"] == "pkg.attention: generative_recommenders.ops.pytorch.x"
    assert record.model["source"] == "kind: factory, factory: pkg.models:build, kwargs: none"
    whole = ", ".join(f"int_{i}: {i}" for i in range(80))
    assert record.passes[0].stats["int_maxima"] == whole and record.passes[0].stat_entries["int_maxima"] == 80
    page = render.render(record, tmp_path)
    assert f'<details class="stat" data-stat="int_maxima"><summary>int_maxima (80 entries)</summary>{whole}</details>' in page
    assert "…" not in page.split('id="passes"')[1].split("</table>")[0]  # nothing cut
    assert "{&#34;" not in page and '{"' not in page  # no JSON


class _ScaleDenseOutputs:
    """A wrong rewrite of the dense graph: every output times 1.01."""

    name = "scale_dense_outputs"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        if ctx.current_graph == "dense":
            output = next(n for n in gm.graph.nodes if n.op == "output")
            with gm.graph.inserting_before(output):
                output.args = ({k: gm.graph.call_function(torch.mul, (v, 1.01)) for k, v in output.args[0].items()},)
        return gm


def test_failed_verification_is_in_the_report(tiny_bundle: Path, tmp_path: Path) -> None:
    from hstu_export import ExportSettings, VerifySettings, export
    from hstu_export.errors import VerificationError
    from hstu_export.report.record import RunRecord

    settings = ExportSettings(backend="torchscript", max_batch_size=2, dump_dir=tmp_path / "graphs",
                              verify=VerifySettings(num_random_batches=1))
    with pytest.raises(VerificationError, match="the package differs from the model"):
        export(tiny_bundle, tmp_path / "pkg", settings, extra_passes=[_ScaleDenseOutputs()])
    assert not (tmp_path / "pkg").exists()
    record = RunRecord.read(tmp_path / "graphs")
    assert record.kind == "export" and record.parity.verified and record.passes[-1].name == "scale_dense_outputs"
    assert record.parity.batches and not any(b.passed for b in record.parity.batches)
    # rel. L2 of 1.01 r against r is 0.01 on every batch
    assert all(b.worst_rel_l2 == pytest.approx(0.01, rel=1e-3) for b in record.parity.batches)
    assert record.package_files == [] and "not written" in record.target["package"]
    page = (tmp_path / "graphs" / "report.html").read_text()
    assert page.count('<tr class="mismatch">') == len(record.parity.batches)


def test_op_mapping_rows_say_what_became_of_each_source_and_whose_table_it_was() -> None:
    from hstu_export.ops.mappings import fbgemm, ours
    from hstu_export.report.build import op_mapping_rows

    gr = "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha"
    ours_op, fbgemm_op = next(iter(ours.OPS)), next(iter(fbgemm.OPS))
    stats = {
        "target": "aten",
        "foreign": {f"{gr} (generative-recommenders)": 3, "my.attention (generative-recommenders (declared like "
                    f"{gr}))": 1},
        "foreign_kept": {gr: "attn_scale (a per-position scale) has no equivalent"},
        "mapped": {f"{ours_op} -> hstu_export.ops.reference:x": 2, f"{fbgemm_op} -> y": 5},
        "kept": {"custom::op": 4},
    }
    rows = [(r.source, r.target, r.count, r.origin, r.kind, r.reason) for r in op_mapping_rows(stats)]
    # A foreign function and the lowering of the op it became are one row: source → ours → target.
    lowered = f"{ours_op} → hstu_export.ops.reference:x (for aten)"
    assert rows == [
        (gr, lowered, 3, "generative-recommenders", "function", ""),
        ("my.attention", lowered, 1, "generative-recommenders", "function", f"declared like {gr}"),
        (gr, "kept as a call", 0, "generative-recommenders", "function",
         "attn_scale (a per-position scale) has no equivalent"),
        (fbgemm_op, "y", 5, "fbgemm", "op", ""),
        ("custom::op", "kept", 4, "none (no table has it)", "op",
         "no mapping for aten, kept by --allow-unmapped: its library is loaded at serve time"),
    ]
    # Calls of our op that no foreign function made keep a row of their own, with their count.
    more = op_mapping_rows({**stats, "mapped": {f"{ours_op} -> hstu_export.ops.reference:x": 6}})
    assert [(r.source, r.target, r.count) for r in more if r.kind == "op"][:1] == [
        (ours_op, "hstu_export.ops.reference:x", 2)]
    # A package's statistics are untrusted: anything malformed is left out, not an error.
    assert op_mapping_rows({"mapped": ["not", "a dict"], "foreign": {"f (lib)": "three"}}) == [
        op_mapping_rows({"foreign": {"f (lib)": 0}})[0]]


# ---- the CLI ------------------------------------------------------------------------------------


def test_inspect_prints_the_pass_table(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "graphs"
    code = main(
        [
            "inspect",
            str(tiny_bundle),
            "--dump-graphs",
            str(out),
            "--check-each-pass",
            "--skip-pass",
            "eliminate_dead_code",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for name in _ran_passes():
        if name != "eliminate_dead_code":
            assert name in captured.out
    assert "eliminate_dead_code" not in captured.out
    assert "uih_item_emb" in captured.out  # the boundary table
    assert (out / "report.html").is_file() and (out / f"{_stem('split_sparse_dense')}{PICTURE}").is_file()
    # The report of the run: the model, the settings inspect read, the ranges, per-pass errors, no parity.
    from hstu_export.report.record import RunRecord

    record = RunRecord.read(out)
    assert record.kind == "inspect" and record.model["bundle"] == str(tiny_bundle)
    assert record.settings["skip_passes"] == "eliminate_dead_code" and "backend" not in record.settings
    # Inspect compiles nothing: the batch size its probes used is the default, and says so.
    assert record.ranges["max batch size"].startswith("32 (the default")
    assert any("…" in v for v in record.ranges.values())
    assert record.checked_each_pass and all(p.max_rel_error is not None and p.max_rel_error <= 1e-5
                                            for p in record.passes)
    assert not record.parity.verified and "verifies nothing" in record.parity.note


def test_inspect_with_explicit_passes(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tiny_bundle), "--passes", "prune_unused,split_sparse_dense"]) == 0
    table = capsys.readouterr().out
    assert "split_sparse_dense" in table and "remove_boundary_marks" not in table
    assert main(["inspect", str(tiny_bundle), "--passes", "prune_unused,fold"]) == 2
    assert "unknown pass 'fold'; known passes: prune_unused" in capsys.readouterr().err


def test_cli_without_graphviz_says_so_in_one_line(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    import hstu_export.report.dumps as inspection

    monkeypatch.setattr(inspection.shutil, "which", lambda name: None)
    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # pytest records warnings; let this one reach the CLI's display
        assert main(["inspect", str(tiny_bundle), "--passes", "prune_unused,split_sparse_dense", "--dump-graphs",
                     str(tmp_path / "graphs")]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "graphviz" in line]
    assert lines == ["warning: graphviz `dot` was not found: writing .dot files instead of .svg pictures (install "
                     "graphviz to get SVGs)"], err
    assert "warnings.warn" not in err and "UserWarning" not in err and ".py:" not in err
    assert warnings.showwarning is shown  # the CLI puts Python's display back


def test_inspect_a_package_shows_what_its_export_recorded(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = tmp_path / "pkg"
    assert main(["export", str(tiny_bundle), "--backend", "torchscript", "--out", str(package), "--dump-graphs",
                 str(tmp_path / "graphs"), "--graphs-in-package", "-q"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(package)]) == 0
    out = capsys.readouterr().out
    for name in ("prune_unused", "split_sparse_dense", "map_ops", "eliminate_dead_code"):
        assert name in out
    assert "package, backend torchscript, cpu" in out and "verification batch" in out
    assert "corner: B=1, uih_lengths=1 (min)" in out and "parity tolerances:" in out and "timings: load" in out
    assert f"graphs and report: {package / 'graphs' / 'report.html'}" in out
    # What map_ops did, as in the report's op-mapping table: source → target, count, whose table.
    assert "mapped: hstu_export::hstu_mha_gated → hstu_export.ops.reference:hstu_mha_gated_reference x2 (ours)" in out
    # Trace options do not apply to a package; a damaged package is refused in one line.
    assert main(["inspect", str(package), "--passes", "prune_unused"]) == 2
    assert "apply to a model bundle" in capsys.readouterr().err
    manifest = package / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"torchscript"', '"aoti"', 1))
    assert main(["inspect", str(package)]) == 2  # bad input, as for every damaged package
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "manifest" in err and len(err.splitlines()) == 1


def test_inspect_untraceable_module_is_kept_opaque_and_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = UntraceableRanking(_tiny_config()).eval()
    batch = generate_batch(model.input_schema(), 3, seed=0)
    path = save_bundle(model, tmp_path / "untraceable.pt", batch)

    assert main(["inspect", str(path), "--check-each-pass"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "kept opaque: module task_heads" in out and "test_inspect.py:" in out
    with torch.no_grad():
        gm = trace(model, batch)
        assert [c["name"] for c in gm.meta["opaque_calls"]] == ["task_heads"]
        result = run_passes(gm, PassContext(example_inputs=batch, model=model))
        assert result.dense is not None and isinstance(result.dense.get_submodule("task_heads"), ClippedHeads)
        # The pictures colour it as kept whole; torch.nn layers (leaves of every FX trace) are plain ops.
        from hstu_export.report import pictures

        kinds = {(n.op, str(n.target)): kind for n, kind in pictures.node_kinds(result.graph).items()}
        assert kinds[("call_module", "task_heads")] == "opaque"
        assert kinds[("call_module", "transducer.preprocessor.history_proj")] == "op"  # an nn.Linear
        for key, value in model(batch).items():
            torch.testing.assert_close(result.run(batch)[key], value, rtol=1e-6, atol=0)
