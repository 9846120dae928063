"""What every command does the same way on the command line: turn errors into exit codes. Checking a
run's paths before any work and writing a JSON report are the library's, which every command calls
(:func:`normswap.api.check_run_paths`, :func:`normswap.api.write_report`), as is the work itself
(:mod:`normswap.api`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from normswap_cli import render

F = TypeVar("F", bound=Callable[..., Any])


# A crash is a bug, not a refusal: its own exit code, apart from 1 (a check failed) and 2 (bad input).
INTERNAL_ERROR_EXIT = 3


def handles_errors(fn: F) -> F:
    """Turn normswap's own errors into one line on stderr and their exit code (2 bad input, 1 check), and
    any other exception, a bug, into one line pointing to ``--debug`` and exit code 3 (with ``--debug``
    or ``NORMSWAP_DEBUG=1`` the traceback itself)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from normswap.errors import NormswapError, describe

        try:
            return fn(*args, **kwargs)
        except NormswapError as exc:
            render.error(worded(exc))
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            if render.debugging():
                raise
            render.error(
                f"internal error ({describe(exc)}): this is a bug in normswap, not in your model or options; "
                "run the command again with --debug (normswap --debug convert ...) for the traceback, and "
                "report it"
            )
            raise typer.Exit(INTERNAL_ERROR_EXIT) from None

    return wrapper  # type: ignore[return-value]


def worded(exc: Exception) -> str:
    """A library error as the command line says it: the library's sentence names its Python parameters
    where a refusal tells how to go on (an existing output: ``overwrite=True``); here the option."""
    from normswap.errors import OutputExistsError

    if isinstance(exc, OutputExistsError):
        return exc.sentence("--overwrite")
    return str(exc)
