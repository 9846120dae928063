"""The ``normswap`` command: one verb per job, each in its own file (``cmd_*.py``), with the options they
share (:mod:`normswap_cli.options`) and the printing (:mod:`normswap_cli.render`) apart. Commands parse
options, call the library and render what it returns; the decisions are the library's.

Start-up stays light: torch and normswap are imported inside the commands, so ``normswap --help``
imports neither triton nor onnx (nor torch).
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from normswap_cli import render
from normswap_cli.cmd_convert import convert
from normswap_cli.cmd_distill import distill
from normswap_cli.cmd_export import export
from normswap_cli.cmd_inspect import inspect
from normswap_cli.cmd_recalibrate import recalibrate
from normswap_cli.cmd_validate import validate

app = typer.Typer(
    name="normswap",
    help="Find, rewrite and verify the normalization layers of a trained PyTorch model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if not value:
        return
    # the installed distribution's metadata: no import of normswap (nor torch) to read a version
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("normswap")
    except PackageNotFoundError:  # run from a source tree that was never installed
        number = "unknown (not installed)"
    render.out.print(f"normswap {number}")
    raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print normswap's version and exit.",
            callback=_print_version,
            is_eager=True,
            metavar="",
        ),
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="Print only what was written (and errors on stderr): no tables, no notes."
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option("--debug", help="Show the traceback of an internal error (a bug) instead of one line."),
    ] = False,
) -> None:
    """Find, rewrite and verify the normalization layers of a trained PyTorch model."""
    render.out.quiet = quiet
    if debug:
        os.environ["NORMSWAP_DEBUG"] = "1"


for _command in (inspect, convert, export, validate, recalibrate, distill):
    app.command()(_command)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        render.err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
