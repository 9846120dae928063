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
    code = _run()
    if code == 0 and _one_of_several_processes():
        # A torchrun worker that finished leaves without the interpreter's finalization: gloo's worker
        # threads outlive destroy_process_group, and one that touches a Python object while the
        # interpreter is torn down is killed inside C++ code that cannot unwind, which aborts the process
        # ("terminate called without an active exception", pytorch/pytorch#190489): a finished run, its
        # files written, would fail under torchrun now and then. Every file is closed by now; only the
        # stdio buffers remain. A failed run exits as usual: leaving at once would let torchrun stop the
        # other processes before they say why they failed too.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _run() -> int:
    """Run the command line; its exit status."""
    try:
        app()  # standalone mode: ends in SystemExit
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        render.err.print(str(exc.code))
        return 1
    except KeyboardInterrupt:
        render.err.print("interrupted")
        return 130
    return 0


def _one_of_several_processes() -> bool:
    """True in a process that torchrun started as one of several (the variable torchrun sets)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


if __name__ == "__main__":
    main()
