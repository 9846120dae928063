"""Every Python call the documentation shows exists: ``normswap.X(...)`` in README.md, docs/ and the
``normswap.json`` a converted model directory carries (which tells its reader how to load it)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CALL = re.compile(r"\bnormswap(?:\.[A-Za-z_]\w*)+(?=\()")


def _documents() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "normswap/load/checkpoint_write.py",
    ]


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


def _documented_calls() -> list[tuple[str, str]]:
    calls = set()
    for path in _documents():
        if path.exists():
            calls |= {(path.relative_to(ROOT).as_posix(), name) for name in CALL.findall(path.read_text())}
    return sorted(calls)


def test_the_docs_show_calls_at_all():
    # the scan must see the calls the front page is built on, or the test below compares nothing
    names = {name for _, name in _documented_calls()}
    assert {"normswap.convert", "normswap.save", "normswap.load_model"} <= names


@pytest.mark.parametrize(("document", "name"), _documented_calls())
def test_documented_call_exists(document: str, name: str):
    assert callable(_resolve(name)), f"{document} shows {name}(...), which is not callable"
