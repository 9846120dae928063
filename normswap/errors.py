"""Errors that carry their own exit code, so the CLI can map them without tracebacks.

`BadInputError` means the user gave something we cannot use (exit 2; `BrokenModelError`: a model that
holds or computes NaN/Inf; `OutputExistsError`: an output path that exists); `CheckFailedError` means a
rewrite or an export did not pass its numerical check and nothing was written (exit 1). :func:`describe`
and :func:`first_line` put an exception into a one-line message; :func:`write_error` and
:func:`failed_write` say a write that failed in the user's environment (a full disk) the one way every
output says it.
"""

from __future__ import annotations

import errno
import functools
import os
import re
from typing import Any


class NormswapError(Exception):
    """Base of every error normswap raises on purpose."""

    exit_code = 2


class BadInputError(NormswapError):
    """A model file, factory, input file or option that cannot be used as given."""

    exit_code = 2


class BrokenModelError(BadInputError):
    """The model given holds or computes NaN/Inf where a check reads it: nothing can be compared there,
    so every command refuses it the same way (exit 2), before writing anything
    (:mod:`normswap.verify.finite`)."""


class OutputExistsError(BadInputError):
    """The output rule's refusal of a path that exists (or appeared while the output was written) when
    replacing it was not asked for. It carries its cause (``label``, ``path``, ``appeared``) so that each
    caller says it in its own terms: its text names the path and the Python parameter
    (``overwrite=True``); the command line names its option for the path (``label``, e.g. ``-o``) and
    ``--overwrite`` (:meth:`sentence`)."""

    def __init__(self, label: str, path: os.PathLike[str] | str, *, appeared: bool = False) -> None:
        self.label = label
        self.path = path
        self.appeared = appeared
        super().__init__(self._refusal(str(path), "overwrite=True"))

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt from its cause (pickle, copy), not from the sentence its args hold
        return (functools.partial(type(self), appeared=self.appeared), (self.label, self.path))

    def _refusal(self, subject: str, option: str) -> str:
        what = "appeared while it was written" if self.appeared else "exists"
        return f"{subject} {what}: pass {option} to replace it"

    def sentence(self, option: str) -> str:
        """The refusal as a command line says it: the path after its option's name, and ``option`` as
        the way to replace it."""
        return self._refusal(f"{self.label} {self.path}", option)


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


# safetensors (Rust) reports a failed read or write as its own error, the OS's code in its text: "I/O
# error: File too large (os error 27)", or "Os { code: 28, kind: StorageFull, ... }"
_OS_ERROR_CODE = re.compile(r"(?:code: |os error )(\d+)")


def os_error_in(exc: BaseException) -> OSError | None:
    """The failure of the user's environment that ``exc`` is, if any: an OSError, or a library writer's
    own error around one (safetensors')."""
    if isinstance(exc, OSError):
        return exc
    found = _OS_ERROR_CODE.search(str(exc)) if type(exc).__name__ == "SafetensorError" else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def failed_write(path: os.PathLike[str] | str, exc: BaseException) -> BadInputError | None:
    """:func:`write_error` for ``exc`` if it is a write that failed in the user's environment
    (:func:`os_error_in`)."""
    failed = os_error_in(exc)
    return None if failed is None else write_error(path, failed)


def write_error(path: os.PathLike[str] | str, exc: OSError) -> BadInputError:
    """One line for a write that failed in the user's environment: a full disk, a quota, permissions."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return BadInputError(
            f"no space left on device writing {path}: free some space or choose another folder"
        )
    return BadInputError(f"cannot write {path}: {exc.strerror or describe(exc)}")
