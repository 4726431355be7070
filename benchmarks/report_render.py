"""How fast the inspection report of a preset opens in headless Chromium, and how big its pictures are.

    python benchmarks/report_render.py --preset dlrmv3 --json out.json

Steps: save the preset as a bundle, run ``hstu-export inspect BUNDLE --dump-graphs DIR`` (timed), then
load ``DIR/report.html`` in headless Chromium ``--repeats`` times (wall time of ``--dump-dom``, which
returns after the load event). The baseline, measured in the same run, is the same command on an empty
page (Chromium's own start-up); the report's render time is the difference of the medians. The page is
also timed with every group picture expanded (all ``<details>`` open: the worst a reader can ask for).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hstu_export import generate_batch, save_bundle
from hstu_export.cli import main as cli_main
from hstu_export.models import build_preset


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("chromium is not installed (apt-get install chromium)")


def load_seconds(browser: str, page: Path, profile: Path) -> tuple[float, str]:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
           "--disable-background-networking", "--disable-component-update", f"--user-data-dir={profile}",
           "--dump-dom", page.as_uri()]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"chromium failed on {page}: {proc.stderr[-500:]}")
    return elapsed, proc.stdout


def median_load(browser: str, page: Path, profile: Path, repeats: int) -> tuple[float, list[float], str]:
    runs, dom = [], ""
    for _ in range(repeats):
        seconds, dom = load_seconds(browser, page, profile)
        runs.append(seconds)
    return statistics.median(runs), runs, dom


def run(preset: str, repeats: int, work: Path) -> dict[str, Any]:
    browser = chromium()
    model = build_preset(preset)
    bundle = save_bundle(model, work / f"{preset}.pt", generate_batch(model.input_schema(), 2, seed=0))
    graphs = work / "graphs"
    start = time.perf_counter()
    if cli_main(["inspect", str(bundle), "--dump-graphs", str(graphs)]) != 0:
        raise SystemExit("hstu-export inspect failed")
    inspect_s = time.perf_counter() - start

    blank = work / "blank.html"
    blank.write_text("<!doctype html><html><body></body></html>\n")
    report = graphs / "report.html"
    expanded = graphs / "report_expanded.html"  # beside the pictures, so relative links resolve
    expanded.write_text(report.read_text().replace('<details class="group"', '<details class="group" open')
                        .replace(' loading="lazy"', ''))  # every picture loads at once
    profile = work / "profile"
    load_seconds(browser, blank, profile)  # the first start-up creates the profile: not timed
    baseline, baseline_runs, _ = median_load(browser, blank, profile, repeats)
    collapsed, collapsed_runs, dom = median_load(browser, report, profile, repeats)
    opened, opened_runs, _ = median_load(browser, expanded, profile, repeats)
    record = json.loads((graphs / "report.json").read_text())
    groups = [g for p in record["passes"] if p["pictures"] for g in p["pictures"]["groups"]]
    return {
        "preset": preset,
        "torch": torch.__version__,
        "inspect_s": round(inspect_s, 2),
        "report_html_bytes": report.stat().st_size,
        "files": len(list(graphs.iterdir())),
        "pictures": len(groups) + sum(1 for p in record["passes"] if p["pictures"]),
        "nodes_after_passes": record["passes"][-1]["nodes_after"],
        "largest_group_nodes": max(g["nodes"] for g in groups),
        "groups_over_60": sum(g["nodes"] > 60 for g in groups),
        "status_ok": bool(re.search(r'<html[^>]*data-status="ok"', dom)),
        "chromium_blank_page_s": {"median": round(baseline, 3), "runs": [round(x, 3) for x in baseline_runs]},
        "chromium_report_s": {"median": round(collapsed, 3), "runs": [round(x, 3) for x in collapsed_runs]},
        "chromium_report_all_groups_open_s": {"median": round(opened, 3), "runs": [round(x, 3) for x in opened_runs]},
        "report_render_s": round(collapsed - baseline, 3),
        "report_all_open_render_s": round(opened - baseline, 3),
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="dlrmv3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the bundle and graphs in this directory")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = run(args.preset, args.repeats, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="hstu-report-render-") as tmp:
            result = run(args.preset, args.repeats, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    cli()
