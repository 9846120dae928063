"""The command line parses options and renders typed results: every import it makes from normswap is
the public API (``normswap.api``, ``normswap.errors`` or the package root ``normswap`` itself), never a
layer's internals (``load``, ``graph``, ``calibrate`` ...). Files are parsed, not imported; imports inside
functions count."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parent.parent / "cli"
# The public surface: the API, the errors, the package root, and the registry of rewrites (torch-free, so
# convert builds its options and help from it at import time without slowing --help).
PUBLIC = {"normswap", "normswap.api", "normswap.errors", "normswap.rewrites"}

# Known exceptions, by file, with the internal modules they may still import (none today; an entry must
# name what it still needs, test_known_exceptions_are_still_needed checks it).
KNOWN: dict[str, set[str]] = {}


def internal_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every normswap import in ``source`` beyond the public API, at any depth.
    ``from normswap import x`` counts as importing the submodule ``normswap.x`` when ``x`` is one, and
    as the root's public name otherwise."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "normswap":
                names = [f"normswap.{a.name}" if _is_submodule(a.name) else "normswap" for a in node.names]
        else:
            continue
        for name in names:
            if (name == "normswap" or name.startswith("normswap.")) and name not in PUBLIC:
                found.append((node.lineno, name))
    return found


def _is_submodule(name: str) -> bool:
    package = CLI.parent / "normswap"
    return (package / name).is_dir() or (package / f"{name}.py").exists()


def test_the_cli_imports_only_the_public_api():
    offenders = []
    for path in sorted(CLI.glob("*.py")):
        allowed = KNOWN.get(path.name, set())
        for line, name in internal_imports(path.read_text()):
            if name not in allowed:
                offenders.append(f"cli/{path.name}:{line} {name}")
    assert not offenders, "cli/ imports normswap internals:\n" + "\n".join(offenders)


def test_the_rule_sees_internal_imports_at_any_depth():
    source = (
        "from normswap.api import convert\n"
        "from normswap.errors import BadInputError\n"
        "def run():\n"
        "    from normswap.load import load_model\n"
        "    import normswap.graph.capture\n"
        "    from normswap import load, convert\n"
    )
    assert internal_imports(source) == [
        (4, "normswap.load"),
        (5, "normswap.graph.capture"),
        (6, "normswap.load"),
    ]


def test_known_exceptions_are_still_needed():
    """An exception that the file no longer needs is removed from KNOWN, so it cannot hide a new one."""
    for file, allowed in KNOWN.items():
        used = {name for _, name in internal_imports((CLI / file).read_text())}
        assert allowed <= used, f"cli/{file} no longer imports {sorted(allowed - used)}: drop it from KNOWN"
