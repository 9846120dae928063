"""What a command reads and what it writes must never be the same file.

Every command names its inputs (model files, a factory's source file, weights, example inputs, data) and its
outputs (``-o``, ``--report``, ``--json``, ``--plot``); :func:`check_paths` refuses the run before any work
starts when an output would land on an input or on another output, whatever the spelling: relative or
absolute, through a symlinked file or directory, or a hard link to the same inode.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping
from pathlib import Path

from normswap.errors import BadInputError, OutputExistsError

PathLike = str | os.PathLike[str]


def same_path(a: PathLike, b: PathLike) -> bool:
    """Whether ``a`` and ``b`` name the same file, existing or not (symlinks and hard links followed)."""
    a, b = Path(a), Path(b)
    try:
        # resolve() follows every symlink it can, so a file not written yet but reached through a
        # symlinked directory resolves to where it would land.
        if a.resolve() == b.resolve():
            return True
    except (OSError, RuntimeError):  # a symlink loop: compare what exists below
        pass
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _working_directory() -> Path:
    try:
        return Path.cwd()
    except OSError:  # deleted under the process: nothing an output could replace
        return Path("/nonexistent-working-directory")


def _inside(path: PathLike, directory: PathLike) -> bool:
    try:
        Path(path).resolve().relative_to(Path(directory).resolve())
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def _module_file(module_name: str) -> Path | None:
    # Found without importing anything: the factory is imported after the paths are checked. The
    # working directory comes last, as when normswap imports the factory.
    relative = Path(*module_name.split("."))
    for base in [*sys.path, ""]:  # "": the working directory, named relative to it in messages
        for candidate in (Path(base) / f"{relative}.py", Path(base) / relative / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def source_paths(label: str, spec: PathLike | None) -> dict[str, Path]:
    """The files a MODEL or DATA argument reads: the file or folder itself, or a factory's source file.

    ``label`` names the argument in messages (``MODEL``, ``--data``). A spec that is neither an existing
    path nor a factory reads nothing here; loading it reports what is wrong.
    """
    if spec is None:
        return {}
    text = os.fspath(spec)
    path = Path(text)
    if path.exists():
        return {label: path}
    target, sep, _ = text.rpartition(":")
    if not sep or not target:
        return {}
    if target.endswith(".py") or "/" in target or os.sep in target or Path(target).is_file():
        return {f"the factory file of {label}": Path(target)}
    found = _module_file(target) if all(part.isidentifier() for part in target.split(".")) else None
    return {f"the factory file of {label}": found} if found is not None else {}


def _show(label: str, given: Path, other_label: str, other: Path) -> str:
    if os.fspath(given) == os.fspath(other):
        return f"{label} {given} is also {other_label}: choose another path"
    return f"{label} {given} is the same file as {other_label} {other}: choose another path"


def check_paths(
    reads: Mapping[str, PathLike | None],
    writes: Mapping[str, PathLike | None],
    working: Collection[str] = (),
) -> None:
    """Refuse (``BadInputError``) a write path that is a read path or another write path.

    ``reads`` and ``writes`` map an option's name (``MODEL``, ``--inputs``, ``-o``, ``--report``) to the
    path it was given, or None when it was not. A write may not be inside a folder that is read either,
    existing or not (an image of a ``--data`` folder, a new file the folder would then hold), nor a folder
    that holds a read path or the working directory (an output folder replaces what was there; ``working`` names the labels of
    folders a command writes into across runs, which it never replaces). Call it before loading
    anything.
    """
    given_reads = [(label, Path(p)) for label, p in reads.items() if p is not None]
    seen: list[tuple[str, Path]] = []
    for label, value in writes.items():
        if value is None:
            continue
        path = Path(value)
        for read_label, read in given_reads:
            if same_path(path, read):
                raise BadInputError(_show(label, path, read_label, read))
            if read.is_dir() and _inside(path, read):
                # existing or not: once written, the folder holds it (a data folder then holds a model
                # file, which the next run on that data refuses; a model directory holds another model)
                raise BadInputError(
                    f"{label} {path} is inside {read_label} {read}, which this command reads: choose a "
                    "path outside it"
                )
            if label not in working and _inside(read, path):  # replacing it would delete what it holds
                raise BadInputError(
                    f"{label} {path} holds {read_label} {read}: writing it would replace the input; "
                    "choose another path"
                )
        if label not in working and _inside(_working_directory(), path):
            raise BadInputError(
                f"{label} {path} is the working directory or holds it: writing it would replace the "
                "folder the command runs in; choose another path"
            )
        for other_label, other in seen:
            if same_path(path, other):
                raise BadInputError(_show(label, path, other_label, other))
            for outer, outer_label, inner, inner_label in ((path, label, other, other_label),
                                                           (other, other_label, path, label)):  # fmt: skip
                # a folder a command writes into across runs, inside an output folder: replacing the
                # output would delete it (the checkpoints a resume needs)
                if inner_label in working and outer_label not in working and _inside(inner, outer):
                    raise BadInputError(
                        f"{inner_label} {inner} is inside {outer_label} {outer}: writing {outer_label} "
                        "would replace it; choose another path"
                    )
        seen.append((label, path))


# An ONNX output with external data is two files: ``OUT.onnx`` and this beside it.
ONNX_DATA_SUFFIX = ".data"


def output_files(path: PathLike) -> list[Path]:
    """The paths an output occupies: itself, and for a .onnx its external data file ``OUT.onnx.data``
    (written for a large model, and replaced or removed with the .onnx)."""
    path = Path(path)
    if path.suffix.lower() == ".onnx":
        return [path, path.with_name(path.name + ONNX_DATA_SUFFIX)]
    return [path]


def check_output(label: str, path: PathLike, *, overwrite: bool = False, directory: bool = False) -> None:
    """The output rule, for one path a command writes (``label`` names its option in the refusal).

    Refused (``BadInputError``), before any work: a symlink, even with ``overwrite`` (normswap never
    writes through one); an existing path unless ``overwrite`` (an
    :class:`~normswap.errors.OutputExistsError`, which the command line words with ``--overwrite``); a
    file output where a folder is (even with ``overwrite``: a .pt never replaces a folder of the user's;
    ``directory`` says the output is a folder); a parent that is missing, not a folder, or not writable. The writers then write atomically
    (a temp beside the path, renamed over it) and, without ``overwrite``, never replace a path that
    appeared meanwhile. Which paths are inputs is :func:`check_paths`'s part.
    """
    path = Path(path)
    for occupied in output_files(path):
        if occupied.is_symlink():
            raise BadInputError(
                f"{label} {occupied} is a symlink: normswap never writes through one; choose another path"
            )
        if not occupied.exists():
            continue
        # a folder where a file goes first: overwrite would not help, so the refusal must not offer it
        if occupied.is_dir() and not directory:
            raise BadInputError(f"{label} {occupied} is a folder: choose a file path")
        if not overwrite:
            raise OutputExistsError(label, occupied)
    parent = path.parent
    if not parent.exists():
        raise BadInputError(f"{label} {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise BadInputError(f"{label} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInputError(f"{label} {path}: folder {parent} is not writable")


def check_outputs(
    reads: Mapping[str, PathLike | None],
    writes: Mapping[str, PathLike | None],
    *,
    overwrite: bool = False,
    directories: Collection[str] = (),
    working: Mapping[str, PathLike | None] | None = None,
) -> None:
    """Every path a command writes, checked before any model is loaded: none is an input or another
    output (:func:`check_paths`), and each keeps the output rule (:func:`check_output`). ``directories``
    names the labels in ``writes`` whose output is a folder; ``working`` holds folders a command reads
    and writes across runs (``--checkpoint-dir``), which must not meet an input or an output but are
    no output themselves."""
    check_paths(reads, {**writes, **(working or {})}, working=tuple(working or {}))
    for label, value in writes.items():
        if value is not None:
            check_output(label, value, overwrite=overwrite, directory=label in directories)
