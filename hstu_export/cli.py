"""The ``hstu-export`` command line. It only parses arguments, builds settings and prints; the work is
done by the Python API. Errors we raise on purpose become one line and an exit code (0 ok, 1 export or
verification failed, 2 bad usage or input); ``-v`` shows the traceback."""

from __future__ import annotations

import sys
import traceback
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from hstu_export import __version__
from hstu_export.errors import HstuExportError

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
    """


def _verbose_option(f: Any) -> Any:
    return click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and debug output.")(f)


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--allow-pickle", is_flag=True, help="Accept a pickled nn.Module (runs code from the file).")
@_verbose_option
def describe(model: str, allow_pickle: bool, verbose: bool) -> None:
    """Print a model bundle's name, config, parameters, sparse tables and example batch."""
    from hstu_export.bundle import load_bundle
    from hstu_export.describe import describe_bundle

    bundle = load_bundle(model, allow_pickle=allow_pickle)
    info = describe_bundle(bundle)
    console.print(f"[bold]{info['model_name']}[/bold]  ({model})")
    console.print(f"parameters: {info['num_parameters']:,}  ({_human_bytes(info['parameter_bytes'])})")
    if info["config"]:
        table = Table("config", "value", box=None, pad_edge=False)
        for k, v in info["config"].items():
            table.add_row(k, str(v))
        console.print(table)
    if info["sparse_tables"]:
        table = Table("sparse table", "rows", "dim", "bytes", "features", box=None, pad_edge=False)
        for t in info["sparse_tables"]:
            table.add_row(t["name"], f"{t['num_embeddings']:,}", str(t["embedding_dim"]),
                          _human_bytes(t["bytes"]), ", ".join(t["feature_names"]))
        console.print(table)
    table = Table("example batch", "shape", "dtype", box=None, pad_edge=False)
    for name, (shape, dtype) in info["example_batch"].items():
        table.add_row(name, str(list(shape)), dtype)
    console.print(table)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    verbose = "-v" in args or "--verbose" in args
    try:
        cli.main(args=args, prog_name="hstu-export", standalone_mode=False)
    except HstuExportError as exc:
        if verbose:
            traceback.print_exc()
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        return exc.exit_code
    except click.exceptions.Abort:
        err_console.print("aborted")
        return 130
    except click.ClickException as exc:
        exc.show()
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
            f"[red]internal error:[/red] {type(exc).__name__}: {exc} (run with -v for the traceback and report it)",
            soft_wrap=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
