"""The layering of normswap's subpackages: dependencies run one way, and no source file grows past 500 lines.

Every module under ``normswap/`` and ``cli/`` is parsed (never imported). A dependency is any import,
at module level or inside a function, and any string constant that names a normswap module
(``importlib.import_module("normswap.graph.lift")``, a module name returned for a later import). The
unit is the subpackage (``normswap/graph/...`` is ``graph``), a top-level module (``normswap/errors.py``
is ``errors``), the package's own ``__init__`` (``normswap``) and the CLI (``cli``).

:data:`LAYERS` lists the layers, lowest first; a unit may import only units of lower layers.
docs/layout.md draws the same table.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500

LAYERS: list[tuple[str, ...]] = [
    ("errors", "rewrites"),  # exceptions with exit codes; the registry of rewrites (imports nothing)
    ("util",),  # training-mode bookkeeping, the tolerance table
    ("kernels",),  # reference math, torch.library ops, Triton kernels, ONNX translations of the ops
    ("modules",),  # reference and fused nn.Modules
    ("graph",),  # capture, graph analysis, hand-written norm patterns, residual streams, lifting
    ("discover", "load"),  # finding norms; reading models and inputs, writing files
    ("verify",),  # comparing models: metrics, layerwise divergence, input variants
    ("passes",),  # the rewrites and the pipeline that validates them
    ("calibrate", "export"),  # data-driven rewrites; ONNX export checked in onnxruntime
    ("api",),  # normswap.convert: the conversion engine as one call
    ("normswap",),  # the package's public names (normswap/__init__.py)
    ("cli",),  # the command line
]
TIER = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _source_files() -> list[Path]:
    return sorted([*(ROOT / "normswap").rglob("*.py"), *(ROOT / "cli").rglob("*.py")])


def _module_of(path: Path) -> tuple[str, bool]:
    """(dotted module name, whether it is a package ``__init__``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "cli":
        parts[0] = "normswap_cli"
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _unit(module: str) -> str | None:
    """The layering unit of a dotted module name; None outside normswap."""
    parts = module.split(".")
    if parts[0] == "normswap_cli":
        return "cli"
    if parts[0] != "normswap":
        return None
    return parts[1] if len(parts) > 1 else "normswap"


def _known_modules() -> set[str]:
    return {_module_of(path)[0] for path in _source_files()}


def _imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, dotted name) of everything ``module`` imports or names as a module, at any depth."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from normswap import errors`` imports the module normswap.errors, not the package
                candidate = f"{source}.{alias.name}"
                found.append((node.lineno, candidate if candidate in known else source))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "." in node.value
            and node.value in known
        ):
            found.append((node.lineno, node.value))
    return found


def _dependencies() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> where, as "path:line name"."""
    known = _known_modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in _source_files():
        module, is_package = _module_of(path)
        unit = _unit(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module, is_package, known):
            target = _unit(name)
            if target is not None and target != unit:
                edges[(unit, target)].append(f"{path.relative_to(ROOT)}:{line} {name}")
    return edges


def _find_cycle(edges: dict[tuple[str, str], list[str]]) -> list[str] | None:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = 1
        path.append(unit)
        for nxt in sorted(graph[unit]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (cycle := visit(unit)) is not None:
            return cycle
    return None


def test_no_import_cycle_between_subpackages() -> None:
    edges = _dependencies()
    cycle = _find_cycle(edges)
    if cycle is not None:
        where = "\n".join(
            f"  {a} -> {b}: " + "; ".join(edges[(a, b)][:3]) for a, b in itertools.pairwise(cycle)
        )
        raise AssertionError(f"import cycle {' -> '.join(cycle)}:\n{where}")


def test_every_unit_has_a_layer() -> None:
    units = {_unit(_module_of(path)[0]) for path in _source_files()}
    missing = sorted(u for u in units if u not in TIER)
    assert not missing, f"add these to LAYERS in tests/test_layering.py (and docs/layout.md): {missing}"


def test_dependencies_run_down_the_layers() -> None:
    upward = [
        f"  {a} (layer {TIER[a]}) -> {b} (layer {TIER[b]}): " + "; ".join(where[:3])
        for (a, b), where in sorted(_dependencies().items())
        if a in TIER and b in TIER and TIER[a] <= TIER[b]
    ]
    assert not upward, "imports against the layering (a unit may import only lower layers):\n" + "\n".join(
        upward
    )


def test_no_source_file_over_500_lines() -> None:
    long = [
        f"  {path.relative_to(ROOT)}: {n} lines"
        for path in _source_files()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"split these into modules of at most {MAX_LINES} lines:\n" + "\n".join(long)


def test_the_checker_sees_lazy_and_string_imports() -> None:
    """The parser finds imports inside functions and module names in strings, resolving relative ones."""
    code = (
        "import importlib\n"
        "def f():\n"
        "    from normswap.graph import capture\n"
        "    return importlib.import_module('normswap.graph.lift')\n"
        "from . import paths\n"
    )
    known = {"normswap.graph.capture", "normswap.graph.lift", "normswap.load.paths"}
    found = {name for _, name in _imported(ast.parse(code), "normswap.load.x", False, known)}
    assert {"normswap.graph.capture", "normswap.graph.lift", "normswap.load.paths"} <= found


def test_no_private_name_is_imported_from_another_file() -> None:
    """A name with a leading underscore is its file's own: another file that needs it gets a public name
    (issue 25). A package's private modules (``normswap.kernels._tiling``) may be imported by their
    package, as modules."""
    known = _known_modules()
    crossing = []
    for path in _source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("normswap"):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{node.module}.{alias.name}" not in known:
                    crossing.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    assert not crossing, "make these public or keep them in their file:\n" + "\n".join(crossing)
