"""The ``hstu-export`` command line. It only parses arguments, builds settings and prints; the work is
done by the Python API. Errors we raise on purpose become one line and an exit code (0 ok, 1 export or
verification failed, 2 bad usage or input); ``-v`` shows the traceback."""

from __future__ import annotations

import sys
import traceback
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hstu_export.errors import HstuExportError
from hstu_export.report.render import human_bytes
from hstu_export.version import __version__

err_console = Console(stderr=True, highlight=False)
console = Console(highlight=False)

EXPORT_COMMAND = "export"


class DefaultToExportGroup(click.Group):
    """``hstu-export MODEL ...`` means ``hstu-export export MODEL ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        first = next((a for a in args if not a.startswith("-")), None)
        wants_help_only = not args or args[0] in ("--help", "-h", "--version")
        if not wants_help_only and first is not None and first not in self.commands and EXPORT_COMMAND in self.commands:
            args = [EXPORT_COMMAND, *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultToExportGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="hstu-export")
def cli() -> None:
    """Export HSTU generative-recommender models to serving packages.

    \b
      hstu-export model.pt --backend aoti        export (AOTInductor; CPU or CUDA)
      hstu-export describe model.pt              what a model bundle holds
      hstu-export inspect model.pt               FX graphs before/after every pass
      hstu-export inspect model.aoti             what a package's export recorded (passes, parity, ...)
      hstu-export verify model.aoti --model model.pt   parity of a package on fresh batches
      hstu-export run model.aoti --batch batch.pt      outputs for one batch
      hstu-export bench model.aoti --model model.pt    latency vs eager, same run
    """


def _verbose_option(f: Any) -> Any:
    return click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and debug output.")(f)


def _import_option(f: Any) -> Any:
    return click.option(
        "--import", "imports", multiple=True, metavar="MODULE",
        help="Import this module first (where your models register themselves or your factory lives). Repeatable.",
    )(f)


def _capture_options(f: Any) -> Any:
    """Options that steer tracing and operator mapping (export and inspect)."""
    options = [
        click.option("--leaf-module", "leaf_module", multiple=True, metavar="NAME",
                     help="Keep this module opaque while tracing: class name (bare or dotted) or submodule path. "
                          "Repeatable."),
        click.option("--opaque-function", "opaque_function", multiple=True, metavar="MODULE.FUNCTION",
                     help="Record this function as one call instead of tracing into it. Repeatable."),
        click.option("--map-function", "map_function", multiple=True, metavar="NAME=RULE",
                     help="Map your function NAME (module.function) like a known one, RULE being its qualified "
                          "name (it takes the same arguments), or fn:module:function (a rewrite of your own); "
                          "NAME=keep traces a function we map through as its library wrote it. Repeatable."),
        click.option("--attention-scale", default="batch", show_default=True, metavar="batch|fixed:N",
                     help="Divisor of mapped foreign HSTU attention: the model's own max length of the batch, "
                          "or a fixed N (the same for every request; verified against the model run with N)."),
        click.option("--max-length", "max_length", multiple=True, metavar="NAME=MAX|NAME=MIN:MAX",
                     help="Range of a lengths feature (or of every key of a KJT argument NAME). Repeatable."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _quantize_options(f: Any) -> Any:
    """How embedding tables are stored (export and describe)."""
    options = [
        click.option("--quantize-embeddings", type=click.Choice(["none", "fp16", "int8", "int4"]), default="none",
                     show_default=True,
                     help="Store the sparse half's torchrec embedding tables quantized (torchrec's quantized "
                          "modules: int8/int4 row-wise with fp16 scale and bias, or fp16). Verification then "
                          "compares with the fp32 model at the mode's tolerances (docs/QUANTIZATION.md)."),
        click.option("--quantize-table", multiple=True, metavar="TABLE=MODE[,TABLE=MODE...]",
                     help="Per-table mode overriding --quantize-embeddings, by table name "
                          "(e.g. item=int4,action=none). Repeatable."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _quantization(mode: str, tables: tuple[str, ...]) -> Any:
    from hstu_export.settings import EmbeddingQuantization, parse_table_modes

    return EmbeddingQuantization(mode, parse_table_modes(tables))


def _parse_mappings(items: tuple[str, ...]) -> dict[str, str]:
    from hstu_export.errors import ConfigError

    out = {}
    for item in items:
        name, sep, rule = item.partition("=")
        if not sep or not name.strip() or not rule.strip():
            raise ConfigError(f"--map-function {item!r}: use NAME=RULE (e.g. my_pkg.ops.attention="
                              "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha)")
        out[name.strip()] = rule.strip()
    return out


def _parse_inductor_options(items: tuple[str, ...]) -> dict[str, bool | int | float | str]:
    from hstu_export.settings import parse_inductor_option

    return dict(parse_inductor_option(item) for item in items)


def _parse_lengths(items: tuple[str, ...]) -> dict[str, tuple[int | None, int | None]]:
    from hstu_export.settings import parse_length_range

    return dict(parse_length_range(item) for item in items)


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--allow-pickle", is_flag=True, help="Accept a pickled nn.Module (runs code from the file).")
@_quantize_options
@_import_option
@_verbose_option
def describe(model: str, allow_pickle: bool, quantize_embeddings: str, quantize_table: tuple[str, ...],
             imports: tuple[str, ...], verbose: bool) -> None:
    """Print a model bundle's name, config, parameters, sparse tables and example batch; with
    --quantize-embeddings, each table's stored size in that mode and the bytes saved."""
    from hstu_export.sources.bundle import load_bundle
    from hstu_export.sources.describe import describe_bundle

    quantization = _quantization(quantize_embeddings, quantize_table)
    bundle = load_bundle(model, allow_pickle=allow_pickle, imports=imports)
    info = describe_bundle(bundle, quantization)
    console.print(f"[bold]{info['model_name']}[/bold]  ({model})")
    console.print(f"parameters: {info['num_parameters']:,}  ({human_bytes(info['parameter_bytes'])})")
    if info["config"]:
        table = Table("config", "value", box=None, pad_edge=False)
        for k, v in info["config"].items():
            table.add_row(k, str(v))
        console.print(table)
    if info["sparse_tables"]:
        quantized = quantization.requested
        rows = [("sparse table", "rows", "dim", "dtype", "bytes", *(("mode", "stored", "saved") if quantized else ()),
                 "features")]
        for t in info["sparse_tables"]:
            plan = t.get("quantization")
            stored = (((plan["mode"], human_bytes(plan["bytes"]), human_bytes(t["bytes"] - plan["bytes"])) if plan
                       else ("kept", human_bytes(t["bytes"]), human_bytes(0))) if quantized else ())
            rows.append((t["name"], f"{t['num_embeddings']:,}", str(t["embedding_dim"]), t["data_type"],
                         human_bytes(t["bytes"]), *stored, ", ".join(t["feature_names"])))
        _print_lines(rows)
    if info["source"]:
        console.print(f"source: {escape(info['source'])}", soft_wrap=True)
    if info["arguments"]:
        console.print(escape(f"forward({', '.join(info['arguments'])})"), soft_wrap=True)
    shapes = info["example_batch"]
    rows = [("request feature", "dtype", "example", "range", "kind")]
    rows += [(f["name"], f["dtype"], str(list(shapes.get(f["name"], ((), ""))[0])), f["range"], f["kind"])
             for f in info["features"]]
    _print_lines(rows)


def _print_lines(rows: list[tuple[str, ...]]) -> None:
    """Rows as plain aligned lines, the first one bold: not a table, so long names are never cut (a line
    longer than the terminal wraps)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for i, row in enumerate(rows):
        line = "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]])
        console.print(f"[bold]{escape(line)}[/bold]" if i == 0 else escape(line), soft_wrap=True)


def _stage_progress(quiet: bool) -> Any:
    """A progress callback for ``export``: a spinner while a stage runs, a line when it ends."""
    import contextlib
    import time

    labels = {"load": "load bundle", "prepare": "prepare inputs", "trace": "trace (FX)", "passes": "run passes",
              "compile": "compile backend",
              "verify": "verify against eager", "write": "write package"}

    @contextlib.contextmanager
    def stage(name: str) -> Any:
        start = time.perf_counter()
        if quiet:
            yield
            return
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        # A spinner with the time spent so far (compiling can take minutes), gone when the stage ends.
        columns = (SpinnerColumn(), TextColumn("{task.description}…"), TimeElapsedColumn())
        with Progress(*columns, console=err_console, transient=True) as bar:
            bar.add_task(labels.get(name, name), total=None)
            yield
        err_console.print(f"[green]✓[/green] {labels.get(name, name)} [dim]{time.perf_counter() - start:.1f}s[/dim]")

    return stage


@cli.command(EXPORT_COMMAND)
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--backend", type=click.Choice(["aoti", "torchscript", "onnx", "trt"]), default="aoti",
              show_default=True, help="What compiles the dense graph.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16", "float32", "bfloat16", "float16"]),
              default="fp32", show_default=True)
@click.option("--max-batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Largest batch (users) the package accepts.")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="Longest user history accepted [default: the model's own limit].")
@click.option("--max-candidates", type=click.IntRange(min=1), default=None,
              help="Most candidates per user accepted [default: the model's own limit].")
@click.option("--op-target", type=click.Choice(["triton", "aten", "rtp", "fbgemm"]), default=None,
              help="Operator mapping [default: triton on CUDA, aten on CPU/ONNX/TensorRT].")
@click.option("--allow-unmapped", is_flag=True, help="Keep ops with no mapping for the target (recorded as libraries).")
@click.option("--workspace", default=None, help="TensorRT workspace size, e.g. 4GiB, 512MiB or bytes.")
@click.option("--min-block-size", type=click.IntRange(min=1), default=5, show_default=True,
              help="TensorRT: smallest subgraph worth converting.")
@click.option("--torch-executed-op", multiple=True, help="TensorRT: op kept in PyTorch (repeatable).")
@click.option("--dryrun", is_flag=True, help="TensorRT: report which ops it would take, build nothing.")
@click.option("-o", "--out", type=click.Path(file_okay=False), default=None,
              help="Package directory to write [default: <model>.<backend> beside the model].")
@click.option("--dump-graphs", type=click.Path(file_okay=False), default=None,
              help="Write every pass's graph before/after, diffs, SVGs and report.html here.")
@click.option("--emit-serving-repo", "serving_repo", type=click.Path(file_okay=False), default=None,
              help="Also write a Triton Inference Server model repository for the package here (docs/SERVING.md).")
@click.option("--graphs-in-package", is_flag=True,
              help="With --dump-graphs: also copy the dumps into the package (graphs/), checksummed.")
@click.option("--output-names", multiple=True, metavar="OUTPUT=NAME[,OUTPUT=NAME...]",
              help="Name the model's outputs in the package (e.g. output_0=user_embeddings,output_1=item_embeddings: "
                   "tuple positions, or any name the package would otherwise give). Repeatable.")
@click.option("--score-outputs", multiple=True, metavar="NAME[,NAME...]",
              help="The outputs that are per-candidate scores [default: the model's tasks, else those with one value "
                   "per candidate]: quantized packages hold them to the quantization tolerances and rank them per "
                   "user, the other outputs to a relative error (docs/QUANTIZATION.md). Repeatable.")
@_capture_options
@click.option("--skip-pass", multiple=True, help="Pass to leave out (repeatable).")
@click.option("--passes", default=None, help="Comma-separated pass list to run instead of the default.")
@click.option("--check-each-pass", is_flag=True, help="Compare the graph with eager after every pass.")
@click.option("--force", is_flag=True, help="Replace an existing package directory.")
@click.option("--kv-cache", is_flag=True,
              help="Also export the delta program for KV-cached serving, verified against the model: the zoo's own, "
                   "or one derived from the model's graph (docs/KV_CACHE.md).")
@click.option("--kv-page-size", type=int, default=64, show_default=True,
              help="With --kv-cache: tokens per cache page (a power of two >= 16; larger pages mean fewer page-table "
                   "reads in the attention kernel, smaller ones less unused room per user).")
@click.option("--kv-splits", type=int, default=0, show_default=True,
              help="With --kv-cache on CUDA: key slices of the paged attention kernel; 0 chooses per call from the "
                   "request's size (more slices fill the GPU at small batches).")
@click.option("--kv-program", type=click.Choice(["auto", "written", "derived"]), default="auto", show_default=True,
              help="With --kv-cache: the delta program written for the zoo's HstuRankingModel, or one derived from "
                   "the model's traced graph (any model). auto: written for the zoo, derived for any other model.")
@click.option("--aoti-option", "aoti_option", multiple=True, metavar="KEY=VALUE",
              help="An Inductor config option for the AOTInductor compiles (repeatable), e.g. combo_kernels=true; "
                   "checked against the installed torch. Applies to the dense program and, with --kv-cache, the "
                   "delta program (which uses combo_kernels=true on CUDA unless told otherwise). Compiles start from "
                   "shape_padding=false (the matmul padding pass can hold a dynamic dim to the example's size).")
@click.option("--prechecked-sparse", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="With the aoti backend: also compile the sparse half with its ids clamped to the tables instead of "
                   "checked, which the runtimes run after checking the manifest's ranges on the host, so the host "
                   "does not wait for the GPU before the dense half (stock loaders still get the checked program). "
                   "auto: on for CUDA.")
@click.option("--no-verify", is_flag=True, help="Skip the parity check (the manifest records that).")
@click.option("--reference-device", type=click.Choice(["cpu"]), default=None,
              help="Run your model (the verification reference, and while tracing) on the CPU in fp32, for models "
                   "whose own ops do not run on the export device (fbgemm's jagged ops without its CUDA build); "
                   "the package is compared with the exported dtype's tolerances (an fp32 one with rel. L2 and max abs "
                   "1e-4: the devices sum in their own orders).")
@click.option("--verify-batches", type=click.IntRange(min=0), default=4, show_default=True,
              help="Random batches verified besides the edge cases.")
@click.option("--rtol", type=float, default=None, help="Relative L2 tolerance of verification [default: by dtype].")
@click.option("--atol", type=float, default=None, help="Max absolute tolerance of verification [default: by dtype].")
@click.option("--allow-pickle", is_flag=True, help="Accept a pickled nn.Module bundle (runs code from the file).")
@_quantize_options
@_import_option
@click.option("-q", "--quiet", is_flag=True, help="Print only errors and the package path.")
@_verbose_option
def export_command(model: str, backend: str, device: str, dtype: str, max_batch_size: int,
                   max_seq_len: int | None, max_candidates: int | None, op_target: str | None,
                   allow_unmapped: bool, workspace: str | None, min_block_size: int,
                   torch_executed_op: tuple[str, ...], dryrun: bool, out: str | None, dump_graphs: str | None,
                   serving_repo: str | None, graphs_in_package: bool, output_names: tuple[str, ...],
                   score_outputs: tuple[str, ...], leaf_module: tuple[str, ...], opaque_function: tuple[str, ...], map_function: tuple[str, ...],
                   attention_scale: str, max_length: tuple[str, ...], skip_pass: tuple[str, ...],
                   passes: str | None, check_each_pass: bool, force: bool, kv_cache: bool, kv_page_size: int,
                   kv_splits: int, kv_program: str, aoti_option: tuple[str, ...], prechecked_sparse: str, no_verify: bool, reference_device: str | None,
                   verify_batches: int, rtol: float | None, atol: float | None, allow_pickle: bool, quantize_embeddings: str,
                   quantize_table: tuple[str, ...], imports: tuple[str, ...], quiet: bool, verbose: bool) -> None:
    """Export MODEL (a model bundle) to a verified package.

    \b
      hstu-export model.pt --backend aoti
      hstu-export model.pt --backend onnx --out model.onnx.pkg --force
      hstu-export model.pt --backend trt --device cuda --workspace 4GiB
      hstu-export ranker.pt --import my_pkg.models --max-length uih_features=1:256
      hstu-export model.pt --quantize-embeddings int8 --quantize-table item=int4,action=none
    """
    from pathlib import Path

    from hstu_export.exporter import export
    from hstu_export.settings import (
        ExportSettings,
        VerifySettings,
        parse_output_names,
        parse_score_outputs,
        parse_size,
    )

    settings = ExportSettings(
        backend=backend, device=device, dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
        max_candidates=max_candidates, op_target=op_target, allow_unmapped=allow_unmapped,
        workspace_bytes=parse_size(workspace) if workspace else None, min_block_size=min_block_size,
        torch_executed_ops=tuple(torch_executed_op), dryrun=dryrun,
        passes=tuple(p.strip() for p in passes.split(",") if p.strip()) if passes else None,
        skip_passes=tuple(skip_pass), leaf_modules=tuple(leaf_module), check_each_pass=check_each_pass,
        dump_dir=Path(dump_graphs) if dump_graphs else None, graphs_in_package=graphs_in_package,
        output_names=parse_output_names(output_names), score_outputs=parse_score_outputs(score_outputs),
        opaque_functions=tuple(opaque_function),
        op_mappings=_parse_mappings(map_function), attention_scale=attention_scale,
        lengths=_parse_lengths(max_length), imports=tuple(imports),
        verify=VerifySettings(enabled=not no_verify, num_random_batches=verify_batches, rtol=rtol, atol=atol),
        reference_device=reference_device,
        quantization=_quantization(quantize_embeddings, quantize_table), force=force, kv_cache=kv_cache,
        kv_page_size=kv_page_size, kv_splits=kv_splits, kv_program=kv_program, aoti_options=_parse_inductor_options(aoti_option),
        prechecked_sparse=prechecked_sparse,
    )
    target = Path(out) if out else Path(model).with_suffix(f".{backend}")
    if serving_repo:  # refused before the export, not after it
        from hstu_export.serving.triton_repo import check_out

        check_out(Path(serving_repo), force, package=target)
    result = export(model, target, settings, allow_pickle=allow_pickle, progress=_stage_progress(quiet))
    if result.dryrun_report is not None:
        console.print(result.dryrun_report, markup=False, highlight=False, soft_wrap=True)
        return
    repo = None
    if serving_repo:
        from hstu_export.serving.triton_repo import write_serving_repo

        repo = write_serving_repo(result.path, serving_repo, force=force)
    if quiet:
        console.print(str(result.path))
        return
    _print_summary(result.manifest, result.path)
    if repo is not None:
        console.print(f"Triton model repository: {escape(str(repo.parent))} (model {escape(repo.name)})")


def _print_summary(manifest: dict[str, Any], path: Any) -> None:
    from pathlib import Path

    root = Path(path)
    table = Table(box=None, pad_edge=False, show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # long names wrap, never cut
    table.add_row("package", str(root))
    table.add_row("backend", f"{manifest['backend']['name']} on {manifest['device']['type']} "
                             f"({manifest['device']['name']}), {manifest['dtype']}, ops → {manifest['op_target']}")
    sizes = {name: (root / name).stat().st_size for name in manifest["files"]}
    artifacts = {n: s for n, s in sizes.items() if not n.startswith("graphs/")}
    table.add_row("files", ", ".join(f"{n} {human_bytes(s)}" for n, s in artifacts.items()))
    if len(artifacts) < len(sizes):
        table.add_row("graphs", f"{len(sizes) - len(artifacts)} debug files, report: {root / 'graphs' / 'report.html'}")
    table.add_row("size", human_bytes(sum(sizes.values())))
    ranges = manifest["ranges"]
    shared = {f["name"] for f in _schema_features(manifest) if f.get("same_as")}
    lengths = ", ".join(f"{k} ≤ {v}" for k, v in ranges["lengths"]["max_lengths"].items() if k not in shared)
    table.add_row("accepts", f"batch ≤ {ranges['max_batch_size']}, {lengths}")
    table.add_row("timings", ", ".join(f"{k} {v:.1f}s" for k, v in manifest.get("timings", {}).items()))
    parity = manifest["parity"]
    if parity.get("skipped"):
        table.add_row("parity", "[yellow]not verified (--no-verify)[/yellow]")
    else:
        w, tol = parity["worst"], parity["tolerances"]
        table.add_row("parity", f"[green]passed[/green] on {len(parity['batches'])} batches: worst rel. L2 "
                                f"{w['rel_l2']:.2e} (tol {tol['rel_l2']:.0e}), max abs {w['max_abs']:.2e} "
                                f"(tol {tol['max_abs']:.0e})")
    reads = _device_reads(manifest)
    if reads:
        table.add_row("device reads", reads)
    if "kv_cache" in manifest:
        kv, checked = manifest["kv_cache"], parity.get("kv_cache")
        line = f"delta program {kv['program']}, pages of {kv['page_size']} tokens"
        if kv.get("kind") == "derived" and isinstance(kv.get("layout"), dict):
            layers = kv["layout"].get("num_layers")
            fusions = kv.get("fused") if isinstance(kv.get("fused"), dict) else {}
            fused = fusions.get("gated_attention", 0)
            last = ", the last on the targets' rows past its projection" if fusions.get("last_layer_on_targets") is True else ""
            norms = fusions.get("residual_norms")
            last += f", {norms} residual sums with the next norm" if isinstance(norms, int) and norms else ""
            line += (f"; derived from the graph: {layers} layers ({fused} with the attention and gate as one op{last}), "
                     f"frontier rows of {kv['layout'].get('row_width')} values")
            if kv.get("counts_on_host"):
                line += ", counts added up on the host from the request's lengths"
        if checked:
            w = checked["worst"]
            line += (f"; served {len(checked['batches'])} requests through its cache ({checked['cache']['hits']} hits): "
                     f"worst rel. L2 {w['rel_l2']:.2e}, max abs {w['max_abs']:.2e}")
            for what in checked.get("not_checked", []):
                line += f"; not checked: {escape(what)}"
            padding = checked.get("padding")
            if isinstance(padding, dict):
                line += (f"; shape buckets: {padding.get('padded')} requests served with a padding user"
                         if padding.get("passed") else f"; no shape buckets: {escape(str(padding.get('reason')))}")
        table.add_row("kv cache", line)
    for name, ra in parity.get("rank_agreement", {}).items():
        table.add_row("rank agreement", f"{escape(name)}: {_rank_agreement(ra)}")
    for t in manifest.get("embedding_quantization", {}).get("tables", []):
        table.add_row("embeddings", f"{t['name']} {t['mode']}: {human_bytes(t['fp32_bytes'])} → "
                                    f"{human_bytes(t['bytes'])} (saved {human_bytes(t['fp32_bytes'] - t['bytes'])})")
    if manifest.get("op_libraries"):
        table.add_row("load needs", ", ".join(manifest["op_libraries"]))
    passes = {p["name"]: p for p in manifest.get("passes", [])}
    marks = passes.get("mark_sparse_dense", {}).get("stats", {})
    if marks.get("automatic_marks"):
        table.add_row("boundary", f"found automatically: {len(marks['automatic_marks'])} tensors "
                                  f"({', '.join(marks['automatic_marks'][:4])}{', ...' if len(marks['automatic_marks']) > 4 else ''})")
    elif marks.get("explicit_marks"):
        table.add_row("boundary", f"{marks['explicit_marks']} sparse_boundary marks in the model")
    from hstu_export.report.build import op_mapping_rows

    for row in op_mapping_rows(passes.get("map_ops", {}).get("stats", {})):
        if row.kind == "function":  # source → our op → the target's: what became of the model's own functions
            table.add_row("mapped" if row.count else "not mapped",
                          f"{row.source} → {row.target}, {row.count}× ({row.origin})" if row.count
                          else f"{row.source}: {row.reason}")
    for call in manifest.get("capture", {}).get("opaque_calls", []):
        table.add_row("kept opaque", f"{call['kind']} {call['name']} ({call['reason']})")
    meta = manifest["backend"].get("meta", {})
    if meta.get("method") == "trace":
        script_error = (str(meta.get("script_error", "")).strip().splitlines() or [""])[0]
        table.add_row("torchscript", f"dense half traced (torch.jit.script failed: {script_error})")
    console.print(table)


def _schema_features(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    schema = manifest.get("input_schema", [])
    return schema.get("features", []) if isinstance(schema, dict) else schema


def _device_reads(manifest: dict[str, Any]) -> str:
    """What the export's programs read back from the device a call (each a wait on a GPU), where recorded."""
    meta = manifest.get("backend", {}).get("meta", {})
    kv = manifest.get("kv_cache", {})
    parts = [f"{label} {count}" for label, count in (("dense half", meta.get("dense_device_reads")),
                                                      ("delta program", kv.get("device_reads")))
             if isinstance(count, int)]
    return ", ".join(parts) + " a call" if parts else ""


def _rank_agreement(stats: dict[str, Any]) -> str:
    """One rank-agreement record (``parity.rank_agreement``) in words; the user count when it is known."""
    users = f" ({stats['users']} users)" if isinstance(stats.get("users"), int) else ""
    return f"Kendall tau per user mean {stats['mean_tau']:.4f}, min {stats['min_tau']:.4f}{users}"


def _parity_table(parity: dict[str, Any]) -> Table:
    table = Table("batch", "B", "worst rel. L2", "worst max abs", "ok", box=None, pad_edge=False)
    for row in parity["batches"]:
        rel = max(e["rel_l2"] for e in row["errors"].values())
        mab = max(e["max_abs"] for e in row["errors"].values())
        table.add_row(row["batch"], str(row["batch_size"]), f"{rel:.2e}", f"{mab:.2e}",
                      "[green]yes[/green]" if row["passed"] else "[red]NO[/red]")
    return table


@cli.command()
@click.argument("package", type=click.Path(file_okay=False))
@click.option("--model", "model_path", type=click.Path(dir_okay=False), default=None,
              help="The model bundle to compare with [default: the bundle recorded in the manifest].")
@click.option("--batches", type=click.IntRange(min=0), default=4, show_default=True, help="Random batches besides edge cases.")
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--rtol", type=float, default=None, help="Relative L2 tolerance [default: the export's].")
@click.option("--atol", type=float, default=None, help="Max absolute tolerance [default: the export's].")
@click.option("--key", "public_key", type=click.Path(dir_okay=False), default=None,
              help="Public key (PEM): the package must be signed by its private key (hstu-export sign).")
@click.option("--signature-only", is_flag=True, help="With --key: check the signature only, not the parity.")
@click.option("--reference-device", type=click.Choice(["cpu"]), default=None,
              help="Run the model on the CPU in fp32 [default: where the export ran it].")
@click.option("--allow-pickle", is_flag=True)
@_import_option
@_verbose_option
def verify(package: str, model_path: str | None, batches: int, seed: int, rtol: float | None, atol: float | None,
           public_key: str | None, signature_only: bool, reference_device: str | None, allow_pickle: bool,
           imports: tuple[str, ...], verbose: bool) -> None:
    """Check a package against the model it came from on fresh batches (exit 1 on mismatch), and with
    --key its signature first."""
    from hstu_export.errors import ConfigError, VerificationError
    from hstu_export.settings import VerifySettings
    from hstu_export.verification.packages import verify_package
    from hstu_export.verification.parity import mismatch_summary

    if signature_only and public_key is None:
        raise ConfigError("--signature-only needs --key PUBLIC_KEY")
    if public_key is not None:
        from hstu_export.package.signing import verify_signature

        verify_signature(package, public_key)
        console.print(f"[green]signature ok[/green] ({escape(public_key)})")
        if signature_only:
            return
    VerifySettings(rtol=rtol, atol=atol)  # checks the values
    report = verify_package(package, model_path, num_random=batches, seed=seed, allow_pickle=allow_pickle,
                            rtol=rtol, atol=atol, imports=imports, reference_device=reference_device)
    console.print(_parity_table(report))
    for name, ra in report.get("rank_agreement", {}).items():
        console.print(f"rank agreement {escape(name)}: {_rank_agreement(ra)}")
    kv = report.get("kv_cache")
    if kv is not None:
        console.print("KV cache: the delta program, serving these requests in order through the package's cache "
                      f"({kv['cache']['hits']} hits)")
        console.print(_parity_table(kv))
    if not report["passed"]:
        from hstu_export.kv_export import kv_failure

        why = kv_failure(kv) if kv is not None and not kv["passed"] else mismatch_summary(report)
        raise VerificationError(f"{package} does not match the model: {why}")
    extra = f", and {len(kv['batches'])} requests through its KV cache" if kv is not None else ""
    console.print(f"[green]parity ok[/green] on {len(report['batches'])} batches{extra}")


@cli.command()
@click.argument("package", type=click.Path(file_okay=False))
@click.option("--key", "private_key", type=click.Path(dir_okay=False), required=True,
              help="Private key to sign with (PEM, elliptic curve P-256, P-384 or P-521).")
@_verbose_option
def sign(package: str, private_key: str, verbose: bool) -> None:
    """Sign a package (OpenSSF model-signing, offline): writes PACKAGE/package.sig over all its files.

    \b
      openssl ecparam -name prime256v1 -genkey -noout -out key.pem
      openssl ec -in key.pem -pubout -out pub.pem
      hstu-export sign model.aoti --key key.pem
      hstu-export verify model.aoti --key pub.pem --signature-only
    """
    from hstu_export.package.signing import sign_package

    path = sign_package(package, private_key)
    console.print(f"signed: {escape(str(path))}")


@cli.command()
@click.argument("package", type=click.Path(file_okay=False))
@click.option("--batch", "batch_path", type=click.Path(), required=True,
              help="A request directory (hstu-export request), a torch.save'd dict of named tensors, "
                   "or a model bundle (its example batch is used).")
@click.option("--output", type=click.Path(dir_okay=False), default=None,
              help="torch.save the outputs here, as one dict.")
@click.option("--output-dir", type=click.Path(file_okay=False), default=None,
              help="Write the outputs here, one <name>.pt per output (what hstu-export-run --out writes).")
@click.option("--tables-device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where the tables stored beside a compiled sparse half live (default: the package's device). "
                   "cpu: pinned host memory the GPU reads, for tables larger than the GPU's memory.")
@_verbose_option
def run(package: str, batch_path: str, output: str | None, output_dir: str | None, tables_device: str | None,
        verbose: bool) -> None:
    """Run a package on one batch and print its outputs."""
    from pathlib import Path

    from hstu_export.package.directory import check_new_output_dir, check_output_file, write_file_atomically
    from hstu_export.package.tensor_dir import saved_bytes, write_tensors
    from hstu_export.runtimes.predictor import load
    from hstu_export.verification.packages import load_batch_file

    # Where the outputs go is checked before the package runs (write_tensors checks the rest again).
    if output:
        check_output_file(Path(output), "--output")
    if output_dir:
        check_new_output_dir(Path(output_dir), "--output-dir")
    predictor = load(package, tables_device=tables_device)
    batch = load_batch_file(batch_path)
    outputs = predictor(batch)
    table = Table("output", "shape", "dtype", "first values", box=None, pad_edge=False)
    for name, value in outputs.items():
        head = ", ".join(f"{x:.4f}" for x in value.detach().float().cpu().flatten()[:4].tolist())
        table.add_row(name, str(list(value.shape)), str(value.dtype).removeprefix("torch."), head)
    console.print(table)
    if output:
        write_file_atomically(Path(output), saved_bytes({k: v.detach().cpu() for k, v in outputs.items()}),
                              "the outputs")
        console.print(f"wrote {escape(output)}")
    if output_dir:
        write_tensors(outputs, output_dir, "the outputs", "--output-dir")
        console.print(f"wrote {len(outputs)} outputs to {escape(output_dir)}")


@cli.command()
@click.argument("package", type=click.Path(file_okay=False), required=False)
@click.option("--to", "root", type=click.Path(file_okay=False), required=True, metavar="ROOT",
              help="The directory of published versions: ROOT/1, ROOT/2, ... and ROOT/current (created if missing).")
@click.option("--keep", type=click.IntRange(min=1), default=3, show_default=True,
              help="Versions kept; older ones are removed (never the current one).")
@click.option("--switch", "switch_to", type=click.IntRange(min=1), default=None, metavar="N",
              help="Make the already published version N current (a rollback), instead of publishing PACKAGE.")
@_verbose_option
def publish(package: str | None, root: str, keep: int, switch_to: int | None, verbose: bool) -> None:
    """Publish PACKAGE as the next version under ROOT and make it current, atomically: a server following
    ROOT/current (hstu_export.load(ROOT), PublishedPredictor) switches between requests. Files unchanged
    since the version before (same path and checksum) are hard-linked, not copied.

    \b
      hstu-export publish model.aoti --to /srv/ranker
      hstu-export publish --to /srv/ranker --switch 3      # back to version 3
    """
    from hstu_export.errors import ConfigError
    from hstu_export.package.publish import publish as publish_package
    from hstu_export.package.publish import switch
    from hstu_export.settings import format_bytes

    if switch_to is not None:
        if package is not None:
            raise ConfigError("give PACKAGE to publish it, or --switch N to make a published version current, not both")
        path = switch(root, switch_to)
        console.print(f"current: {escape(str(path))}", soft_wrap=True)
        return
    if package is None:
        raise ConfigError("name the PACKAGE to publish (or --switch N to make a published version current)")
    done = publish_package(package, root, keep=keep)
    line = f"published {escape(package)} as {escape(str(done.path))} (current)"
    if done.linked:
        line += f"; {len(done.linked)} file(s) unchanged since the version before, linked ({format_bytes(done.linked_bytes)})"
    line += f"; {len(done.copied)} copied ({format_bytes(done.copied_bytes)})"
    if done.removed:
        line += f"; removed version(s) {', '.join(map(str, done.removed))}"
    console.print(line, soft_wrap=True)


@cli.command("serving-repo")
@click.argument("package", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="The model repository directory to write.")
@click.option("--name", default=None, help="Model name in the repository [default: the package's name].")
@click.option("--max-requests-per-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests Triton's dynamic batcher may group (its max_batch_size).")
@click.option("--max-queue-delay-us", type=click.IntRange(min=0), default=500, show_default=True,
              help="How long a request may wait for others to batch with, in microseconds.")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="Model instances per device.")
@click.option("--kv-cache", "kv_cache", metavar="BUDGET", default=None,
              help="Serve through a KV cache of BUDGET per instance (bytes, or a size such as 512MiB; a package "
                   "exported with --kv-cache). Each request is one user, named by its correlation id; Triton's "
                   "sequence batcher sends a user's requests to the instance holding its cache.")
@click.option("--max-sequences", type=click.IntRange(min=1), default=1024, show_default=True,
              help="With --kv-cache: users in flight per instance (the sequence batcher's max_candidate_sequences).")
@click.option("--sequence-idle-us", type=click.IntRange(min=1), default=60_000_000, show_default=True,
              help="With --kv-cache: a user idle this long (microseconds) gives up its slot and its instance.")
@click.option("--kv-max-time-drift", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --kv-cache: reuse a user's cached rows while its query time moved at most this many "
                   "seconds (0: only at the same query time; docs/KV_CACHE.md says when that is exact).")
@click.option("--kv-cuda-graphs", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="With --kv-cache: CUDA graphs of the cached path (auto: on for a CUDA package). A graph is "
                   "captured the first time each shape bucket comes; off avoids those slow first calls.")
@click.option("--follow-seconds", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="PACKAGE a directory hstu-export publish writes: how often an instance looks for a new current "
                   "version (it switches between requests).")
@click.option("--tables-device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where each instance keeps the tables stored beside a compiled sparse half [default: its "
                   "device]; cpu: pinned host memory the GPU reads, for tables larger than the GPU's memory.")
@click.option("--runtime", type=click.Choice(["python", "native"]), default="python", show_default=True,
              help="What serves each instance's calls: python (hstu_export.load) or native (the C++ runtime's "
                   "library, built by runtimes/cpp/build.sh; its path is written into the config).")
@click.option("--host-threads", type=click.IntRange(min=1), default=None,
              help="torch's host threads in each instance's process [default: 1 for a CUDA package (its host "
                   "work is small tensors), torch's own (one per core) for a CPU package].")
@click.option("--force", is_flag=True, help="Replace a repository this tool wrote before.")
@_verbose_option
def serving_repo(package: str, out_dir: str, name: str | None, max_requests_per_batch: int, max_queue_delay_us: int,
                 instances: int, kv_cache: str | None, max_sequences: int, sequence_idle_us: int,
                 kv_max_time_drift: int, kv_cuda_graphs: str, follow_seconds: float, tables_device: str | None,
                 runtime: str, host_threads: int | None, force: bool, verbose: bool) -> None:
    """Write a Triton Inference Server model repository for PACKAGE (Python backend, dynamic batching of
    ragged requests; with --kv-cache, the sequence batcher routing each user to its instance's KV cache).
    PACKAGE may be a directory hstu-export publish writes: the instances then serve its current version and
    follow it, and no package is copied. docs/SERVING.md says how to run it."""
    from pathlib import Path

    from hstu_export.errors import ConfigError
    from hstu_export.package.publish import is_published_root
    from hstu_export.serving.triton_repo import TRITON_SERVER_VERSION, ServingRepoSettings, write_serving_repo

    given = click.get_current_context().get_parameter_source
    unused = [f"--{n.replace('_', '-')}" for n in ("max_sequences", "sequence_idle_us", "kv_max_time_drift",
                                                   "kv_cuda_graphs")
              if given(n) is not click.core.ParameterSource.DEFAULT]
    if kv_cache is None and unused:
        verb = "applies" if len(unused) == 1 else "apply"
        raise ConfigError(f"{' and '.join(unused)} {verb} to a KV-cached repository only: add --kv-cache BUDGET")
    if given("follow_seconds") is not click.core.ParameterSource.DEFAULT and not is_published_root(Path(package)):
        raise ConfigError(f"--follow-seconds applies when PACKAGE is a directory hstu-export publish writes; "
                          f"{package} is not one")
    settings = ServingRepoSettings(name=name, max_requests_per_batch=max_requests_per_batch,
                                   max_queue_delay_us=max_queue_delay_us, instances=instances,
                                   kv_cache_budget=kv_cache, max_sequences=max_sequences,
                                   sequence_idle_us=sequence_idle_us, kv_max_time_drift=kv_max_time_drift,
                                   kv_cuda_graphs=kv_cuda_graphs, follow_seconds=follow_seconds,
                                   tables_device=tables_device, runtime=runtime, host_threads=host_threads)
    model_dir = write_serving_repo(package, out_dir, settings, force=force)
    console.print(f"wrote {escape(str(model_dir.parent))}: model {escape(model_dir.name)} for Triton Inference "
                  f"Server {TRITON_SERVER_VERSION}\n  tritonserver --model-repository {escape(str(model_dir.parent))}")


@cli.command()
@click.argument("package", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Directory to write the request to (one <feature>.pt per feature).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="[default: the package's max]")
@click.option("--seed", type=int, default=0, show_default=True)
@_verbose_option
def request(package: str, out_dir: str, batch_size: int | None, seed: int, verbose: bool) -> None:
    """Write a random request that fits the package's input schema, as a directory of tensors (what
    hstu-export-run, the C++ runtime's CLI, and `hstu-export run --batch DIR` read)."""
    from pathlib import Path

    from hstu_export.errors import ConfigError
    from hstu_export.package.directory import load_manifest
    from hstu_export.package.tensor_dir import write_tensors
    from hstu_export.verification.batch import generate_batch

    manifest = load_manifest(Path(package))
    size = batch_size or manifest.ranges.max_batch_size
    if size > manifest.ranges.max_batch_size:
        raise ConfigError(f"--batch-size {size} is beyond the package's maximum {manifest.ranges.max_batch_size}")
    batch = generate_batch(manifest.input_schema, size, seed=seed)
    write_tensors(batch, out_dir, "the request", "--out")
    console.print(f"wrote a request of {size} users ({len(batch)} features) to {escape(out_dir)}")


@cli.command()
@click.argument("package", type=click.Path(file_okay=False))
@click.option("--model", "model_path", type=click.Path(dir_okay=False), default=None,
              help="The model bundle for the eager baseline [default: the bundle recorded in the manifest].")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="[default: the package's max]")
@click.option("--iters", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True)
@click.option("--seed", type=int, default=11, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write results as JSON.")
@click.option("--allow-pickle", is_flag=True)
@_import_option
@_verbose_option
def bench(package: str, model_path: str | None, batch_size: int | None, iters: int, warmup: int, seed: int,
          json_path: str | None, allow_pickle: bool, imports: tuple[str, ...], verbose: bool) -> None:
    """Latency p50/p99 and throughput of a package against eager, measured in the same run. A
    --batch-size beyond the package's maximum is benchmarked at the maximum, with a note saying so."""
    import json
    from pathlib import Path

    from hstu_export.package.directory import check_output_file, load_manifest, write_file_atomically
    from hstu_export.sources.bundle import import_modules
    from hstu_export.verification.bench import clamp_batch_size
    from hstu_export.verification.packages import bench_package

    if json_path:  # before minutes of timing, not after
        check_output_file(Path(json_path), "--json")
    import_modules(imports)
    # Checksums are left to bench_package's load(); only the maximum batch size is read here.
    maximum = load_manifest(Path(package), verify_checksums=False).ranges.max_batch_size
    size, note = clamp_batch_size(batch_size, maximum)
    if note:
        err_console.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True)
    res = bench_package(package, model_path, batch_size=size, iters=iters, warmup=warmup, seed=seed,
                        allow_pickle=allow_pickle)
    if note:
        res.update(requested_batch_size=batch_size, note=note)
    table = Table("", "p50 ms", "p99 ms", "users/s", "candidates/s", box=None, pad_edge=False)
    for name in ("eager", "exported"):
        r = res[name]
        table.add_row(name, f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['users_per_s']:,.0f}",
                      f"{r['candidates_per_s']:,.0f}")
    console.print(f"{res['package']}: batch of {res['batch_size']} users, {res['num_candidates']} candidates, "
                  f"{iters} iterations on {res['device']}")
    console.print(table)
    console.print(f"speed-up (p50): {res['speedup_p50']:.2f}×")
    if json_path:
        write_file_atomically(Path(json_path), (json.dumps(res, indent=2) + "\n").encode(), "the benchmark results")


@cli.command()
@click.argument("model", type=click.Path(exists=True))
@click.option("--dump-graphs", "dump_dir", type=click.Path(file_okay=False),
              help="Write every pass's graph before/after, diff, SVG and report.html here.")
@click.option("--open", "open_report", is_flag=True, help="Open report.html in a browser (a temp dir without --dump-graphs).")
@_capture_options
@click.option("--op-target", type=click.Choice(["triton", "aten", "rtp", "fbgemm"]), default="aten", show_default=True,
              help="Operator mapping to show.")
@click.option("--skip-pass", "skip", multiple=True, metavar="NAME", help="Leave out this pass. Repeatable.")
@click.option("--passes", "passes", metavar="A,B,C", help="Run exactly these passes, in this order.")
@click.option("--check-each-pass", is_flag=True, help="Re-run the graph after each pass and compare with eager.")
@click.option("--allow-pickle", is_flag=True, help="Accept a pickled nn.Module (runs code from the file).")
@_quantize_options
@_import_option
@_verbose_option
def inspect(
    model: str,
    dump_dir: str | None,
    open_report: bool,
    leaf_module: tuple[str, ...],
    opaque_function: tuple[str, ...],
    map_function: tuple[str, ...],
    attention_scale: str,
    max_length: tuple[str, ...],
    op_target: str,
    skip: tuple[str, ...],
    passes: str | None,
    check_each_pass: bool,
    allow_pickle: bool,
    quantize_embeddings: str,
    quantize_table: tuple[str, ...],
    imports: tuple[str, ...],
    verbose: bool,
) -> None:
    """Trace a model bundle and run the graph passes (no compilation); print what each pass did.

    Given a package directory instead, print what its export recorded: the passes, operator mapping,
    opaque calls, parity per verification batch, settings and timings (nothing is traced again)."""
    import logging
    import tempfile
    from pathlib import Path

    if Path(model).is_dir():
        given = [flag for flag, value in (("--dump-graphs", dump_dir), ("--passes", passes), ("--skip-pass", skip),
                                          ("--check-each-pass", check_each_pass),
                                          ("--quantize-embeddings", quantize_embeddings != "none"),
                                          ("--quantize-table", quantize_table)) if value]
        if given:
            raise click.UsageError(f"{', '.join(given)} apply to a model bundle; {model} is a package, whose "
                                   "inspection shows what its export recorded")
        _inspect_package(Path(model), open_report)
        return

    from hstu_export.exporter import capture
    from hstu_export.settings import ExportSettings
    from hstu_export.sources.bundle import load_bundle

    if verbose:
        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
    if open_report and dump_dir is None:
        dump_dir = tempfile.mkdtemp(prefix="hstu-inspect-")
    pass_list = tuple(p.strip() for p in passes.split(",") if p.strip()) if passes is not None else None
    settings = ExportSettings(
        op_target=op_target, leaf_modules=tuple(leaf_module), opaque_functions=tuple(opaque_function),
        op_mappings=_parse_mappings(map_function), attention_scale=attention_scale,
        lengths=_parse_lengths(max_length), imports=tuple(imports), passes=pass_list, skip_passes=tuple(skip),
        check_each_pass=check_each_pass, dump_dir=Path(dump_dir) if dump_dir else None,
        quantization=_quantization(quantize_embeddings, quantize_table),
    )
    bundle = load_bundle(model, allow_pickle=allow_pickle, imports=imports)
    if settings.quantization.requested:
        from hstu_export.embedding_quantization import check_model

        check_model(bundle.model, settings.quantization)
    captured = capture(bundle, settings, settings.op_target or "aten", need_ranges=False)
    result = captured.result

    console.print(f"[bold]{escape(bundle.model_name)}[/bold]  ({escape(model)})")
    _print_passes(result.report.to_json(), captured.summary["opaque_calls"])
    if result.boundary is not None:
        table = Table("dense input", "dtype", "shape", "from", box=None, pad_edge=False)
        for t in result.boundary.dense_inputs:
            table.add_row(t.name, t.dtype, escape("[" + ", ".join(map(str, t.shape)) + "]"), t.source)
        console.print(table)
    if result.report_path is not None:
        from hstu_export.report.build import add_inspect_context, complete_report

        model_source = {"name": bundle.model_name, "source": bundle.source, "bundle": model}
        ranges = captured.ranges.to_json() if captured.ranges is not None else None
        complete_report(result.report_path.parent, lambda record: add_inspect_context(
            record, model_source, settings.to_json(), settings.op_target or "aten", ranges))
        console.print(f"graphs and report: {result.report_path}")
        if open_report:
            click.launch(str(result.report_path))


def _print_passes(entries: Any, opaque_calls: Any) -> None:
    """The pass table, each pass's statistics, the opaque calls and what map_ops mapped, from the pass
    report's JSON form (a fresh trace's, or the one a package recorded: untrusted, so read defensively)."""
    entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []

    def num(value: Any) -> float | None:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    table = Table("#", "pass", "status", "ms", "nodes", "parameters", "max rel err", box=None, pad_edge=False)
    for e in entries:
        done = e.get("status") == "ok"
        index, ms, error = num(e.get("index")), num(e.get("time_s")), num(e.get("max_rel_error"))
        size = num(e.get("parameter_bytes_after"))
        table.add_row(
            f"{int(index):02d}" if index is not None else "", escape(str(e.get("name", ""))[:80]),
            escape(str(e.get("status", ""))[:40]), f"{ms * 1000:.1f}" if done and ms is not None else "",
            f"{e.get('nodes_before')} → {e.get('nodes_after')}" if done else "",
            human_bytes(size) if done and size is not None else "", "" if error is None else f"{error:.2g}",
        )
    for column in table.columns:
        column.no_wrap = True
    console.print(table)
    for e in entries:
        stats = e.get("stats") if isinstance(e.get("stats"), dict) else {}
        if stats or e.get("note"):
            text = " ".join(f"{k}={len(v) if isinstance(v, (list, dict)) else v}" for k, v in stats.items())
            index = num(e.get("index"))
            console.print(f"  [dim]{int(index or 0):02d} {escape(str(e.get('name', '')))}:[/dim] "
                          f"{escape(text or str(e.get('note')))}", soft_wrap=True)
    for call in opaque_calls if isinstance(opaque_calls, list) else []:
        if isinstance(call, dict):
            console.print(f"kept opaque: {escape(str(call.get('kind')))} {escape(str(call.get('name')))} at "
                          f"{escape(str(call.get('where')))} ({escape(str(call.get('reason')))})", soft_wrap=True)
    for line in _mapping_lines(entries):
        console.print(f"mapped: {escape(line)}", soft_wrap=True)


def _mapping_lines(entries: list[dict[str, Any]]) -> list[str]:
    """What map_ops did, one line per source op or foreign function (the report's op-mapping table)."""
    from hstu_export.report.build import op_mapping_rows

    stats = next((e.get("stats") for e in entries if e.get("name") == "map_ops"), None)
    if not isinstance(stats, dict):
        return []
    return [f"{row.source} → {row.target}{f' x{row.count}' if row.count else ''} ({row.origin}"
            f"{f'; {row.reason}' if row.reason else ''})" for row in op_mapping_rows(stats)]


def _inspect_package(root: Any, open_report: bool) -> None:
    """``hstu-export inspect PKG``: what the package's export recorded (the manifest is checked first)."""
    from pathlib import Path

    from hstu_export.package.directory import load_manifest

    raw = load_manifest(root).raw
    model = raw["model"] if isinstance(raw.get("model"), dict) else {}
    backend = raw["backend"].get("name") if isinstance(raw.get("backend"), dict) else raw.get("backend")
    device = raw.get("device")
    if isinstance(device, dict):
        device = f"{device.get('type')} ({device.get('name')})"
    console.print(f"[bold]{escape(str(model.get('name', '?')))}[/bold]  ({escape(str(root))}): package, "
                  f"backend {escape(str(backend))}, {escape(str(device))}, "
                  f"{escape(str(raw.get('dtype')))}, op target {escape(str(raw.get('op_target')))}", soft_wrap=True)
    capture = raw.get("capture") if isinstance(raw.get("capture"), dict) else {}
    _print_passes(raw.get("passes"), capture.get("opaque_calls"))
    parity = raw.get("parity") if isinstance(raw.get("parity"), dict) else {}
    from hstu_export.report.build import parity_record, readable, settings_text

    rows = parity_record(parity).batches  # with the KV-cache check's requests (--kv-cache), as the report shows
    if rows:
        # Plain lines, the batch's description last and whole (the numbers first, aligned).
        _print_lines([("users", "worst rel. L2", "worst max abs", "passed", "verification batch")] + [
            (str(row.batch_size), f"{row.worst_rel_l2:.2g}" if row.worst_rel_l2 is not None else "",
             f"{row.worst_max_abs:.2g}" if row.worst_max_abs is not None else "", "yes" if row.passed else "NO",
             row.batch) for row in rows])
        console.print(f"parity tolerances: {escape(readable(parity.get('tolerances')))}", soft_wrap=True)
    else:
        console.print("parity: not verified at export", soft_wrap=True)
    ranking = parity.get("rank_agreement") if isinstance(parity.get("rank_agreement"), dict) else {}
    for name, stats in ranking.items():
        if isinstance(stats, dict) and all(isinstance(stats.get(k), (int, float)) for k in ("mean_tau", "min_tau")):
            console.print(f"rank agreement {escape(str(name))}: {_rank_agreement(stats)}", soft_wrap=True)
    quantized = raw.get("embedding_quantization") if isinstance(raw.get("embedding_quantization"), dict) else {}
    tables = [t for t in quantized.get("tables", []) if isinstance(t, dict)
              and all(isinstance(t.get(k), int) for k in ("fp32_bytes", "bytes"))] if isinstance(
        quantized.get("tables"), list) else []
    if tables:
        table = Table("embedding table", "mode", "fp32", "stored", "saved", box=None, pad_edge=False)
        for t in tables:
            table.add_row(escape(str(t.get("name"))), escape(str(t.get("mode"))), human_bytes(t["fp32_bytes"]),
                          human_bytes(t["bytes"]), human_bytes(t["fp32_bytes"] - t["bytes"]))
        console.print(table)
    timings = raw.get("timings") if isinstance(raw.get("timings"), dict) else {}
    if timings:
        console.print("timings: " + ", ".join(f"{escape(str(k))} {v:.1f}s" for k, v in timings.items()
                                              if isinstance(v, (int, float))), soft_wrap=True)
    settings = raw.get("settings") if isinstance(raw.get("settings"), dict) else {}
    if settings:
        shown = "; ".join(f"{k}={v}" for k, v in settings_text(settings).items())
        console.print(f"settings: {escape(shown)}", soft_wrap=True)
    report = Path(root) / "graphs" / "report.html"
    if report.is_file():
        console.print(f"graphs and report: {report}", soft_wrap=True)
        if open_report:
            click.launch(str(report))
    else:
        console.print("graph dumps: not in this package (export with --dump-graphs DIR, and --graphs-in-package to "
                      "keep them inside)", soft_wrap=True)


def _one_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors can span pages)."""
    from rich.markup import escape

    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return escape(text if len(text) <= 500 else text[:497] + "...")


def _quiet_library_noise() -> None:
    """Without -v, hide the libraries' deprecation notices and log lines (torch.jit, torchrec calling
    is_fx_tracing, onnx exporter renames): they are not about the user's model. Our own warnings
    (for example the one before unpickling a file) stay visible."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"(torch|torchrec|fbgemm_gpu|onnxscript|onnx_ir|onnx|copyreg)(\.|$)")
    warnings.filterwarnings("ignore", message=r".*TorchScript")  # raised through ast while scripting torchrec
    for name in ("torch.fx._symbolic_trace", "torch._inductor", "torch._dynamo", "torch.export", "torch.onnx"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """Warnings the CLI lets through, as one line each (Python's default adds the file, line and source)."""
    err_console.print(f"[yellow]warning:[/yellow] {_one_line(Warning(str(message)))}", soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    import warnings

    args = sys.argv[1:] if argv is None else argv
    verbose = "-v" in args or "--verbose" in args
    previous = warnings.showwarning
    if not verbose:
        _quiet_library_noise()
        warnings.showwarning = _show_warning
    try:
        return _run(args, verbose)
    finally:
        warnings.showwarning = previous


def _run(args: list[str], verbose: bool) -> int:
    try:
        cli.main(args=args, prog_name="hstu-export", standalone_mode=False)
    except HstuExportError as exc:
        if verbose:
            traceback.print_exc()
        err_console.print(f"[red]error:[/red] {_one_line(exc)}", soft_wrap=True, markup=True)
        return exc.exit_code
    except click.exceptions.Abort:
        err_console.print("aborted")
        return 130
    except click.ClickException as exc:
        # One line, as for our own errors (click's usage block would be three and a blank).
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see {exc.ctx.command_path} --help)"
        err_console.print(f"[red]error:[/red] {escape(exc.format_message())}{escape(hint)}", soft_wrap=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except Exception as exc:  # a bug of ours: still one line unless -v
        if verbose:
            traceback.print_exc()
        err_console.print(
            f"[red]internal error:[/red] {type(exc).__name__}: {_one_line(exc)} (run with -v for the traceback and report it)",
            soft_wrap=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
