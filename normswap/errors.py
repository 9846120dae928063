"""Errors that carry their own exit code, so the CLI can map them without tracebacks.

`BadInputError` means the user gave something we cannot use (exit 2); `CheckFailedError` means a
rewrite or an export did not pass its numerical check and nothing was written (exit 1). :func:`describe`
and :func:`first_line` put an exception into a one-line message.
"""

from __future__ import annotations


class NormswapError(Exception):
    """Base of every error normswap raises on purpose."""

    exit_code = 2


class BadInputError(NormswapError):
    """A model file, factory, input file or option that cannot be used as given."""

    exit_code = 2


class CheckFailedError(NormswapError):
    """A numerical check failed; the command wrote nothing."""

    exit_code = 1


def shorten(line: str, limit: int) -> str:
    """``line`` when it fits in ``limit`` characters; else cut after its last whole word that fits
    (never inside a word) and marked with "...", so a message never ends mid-word."""
    if len(line) <= limit:
        return line
    head = line[: limit - 3]
    if line[limit - 3] != " " and " " in head:  # the head ends inside a word: drop that word
        head = head.rsplit(" ", 1)[0]
    return head.rstrip(" ,;:") + "..."


def first_line(text: object, limit: int = 200) -> str:
    """The first non-empty line of an error text, so user-facing messages stay on one line; a longer
    one is cut after its last whole word that fits (never inside a word) and marked with "..."."""
    for line in str(text).splitlines():
        line = line.strip()
        if line:
            return shorten(line, limit)
    return ""


def describe(exc: BaseException) -> str:
    """``exc`` in one line for a message: its type and the first line of its text."""
    detail = first_line(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
