"""How a file of a model folder is reached: inside the folder, through symlinks too (a snapshot of the
Hugging Face cache may link into its own repository's blobs), and JSON read by the one reader, bounded in
size. Every read of a model folder's files goes through here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from normswap.errors import BadInputError
from normswap.load.json_io import parse_json

# A config or an index this large is not one: refuse it before parsing it.
_MAX_JSON_BYTES = 64 * 1024 * 1024


def folder_root(directory: Path) -> Path:
    """The folder a model directory's files must resolve into: the directory itself (symlinks followed),
    or, for a snapshot of the Hugging Face hub cache (``<repo>/snapshots/<revision>/``, whose files are
    symlinks to ``../../blobs/<sha>``), the repository's cache folder ``<repo>``, which holds the blobs
    of that repository alone."""
    real = directory.resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def folder_file(directory: Path, name: str) -> Path:
    """``directory / name``, the one way a file of a model folder is reached: BadInputError when the file,
    through symlinks, lies outside the folder (:func:`folder_root`). A link inside the folder is fine."""
    path = directory / name
    real, root = path.resolve(), folder_root(directory)
    if not real.is_relative_to(root):
        raise BadInputError(
            f"{path} is a symlink to {real}, outside the model folder {root}: normswap reads nothing from "
            "outside a model folder; copy the file into it"
        )
    return path


def check_links(directory: Path) -> None:
    """Every file at the folder's top (what normswap reads or copies into an output) inside it."""
    for entry in directory.iterdir():
        if entry.is_symlink() and entry.is_file():
            folder_file(directory, entry.name)


def read_json(path: Path, what: str) -> Any:
    if path.stat().st_size > _MAX_JSON_BYTES:
        raise BadInputError(f"{path} is too large for a {what} ({path.stat().st_size} bytes)")
    return parse_json(path.read_bytes(), str(path), what)
