"""The package list in pyproject.toml must name every subpackage, or a regular install loses it."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "normswap").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found <= listed, sorted(found - listed)
    assert config["package-dir"]["normswap_cli"] == "cli" and "normswap_cli" in listed
