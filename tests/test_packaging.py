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


def test_every_data_file_of_the_package_is_installed():
    """A file normswap reads at run time (the kernels' route rules, py.typed) must be package data, or an
    install from a wheel lacks it."""
    from fnmatch import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [
        path.relative_to(ROOT / "normswap").as_posix()
        for path in (ROOT / "normswap").rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc")
    ]
    assert "kernels/route_rules.json" in data
    assert [f for f in data if not any(fnmatch(f, p) for p in patterns["normswap"])] == []
