"""Questions answered on a captured graph: which nodes a module call owns, who feeds it, who reads it.

Both export and fx record ``nn_module_stack`` on nodes: an ordered mapping from a per-call key to
``(module path, module class)``. The key differs for each call of the same module (export appends
``@1``, ``@2``...), which is how a module called at more than one site is recognized.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torch import fx

from normswap.graph.capture import CapturedGraph
from normswap.graph.ops import CAST_OPS, CHECK_OPS, op_name, strip_casts


@dataclass
class ModuleCall:
    """One call of one module in the graph."""

    path: str
    key: str
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def node_set(self) -> set[fx.Node]:
        return set(self.nodes)

    def inputs(self, graph_view: GraphView) -> list[fx.Node]:
        """Activation nodes from outside the call that the call reads (parameters excluded)."""
        inside = self.node_set
        found: list[fx.Node] = []
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in found and not graph_view.is_param(a):
                    found.append(a)
        return found

    def outputs(self) -> list[fx.Node]:
        """Nodes of the call whose value is read outside it."""
        inside = self.node_set
        return [
            n
            for n in self.nodes
            if any(u not in inside and op_name(u) not in CHECK_OPS for u in n.users)
            # a cast of the call's own input is the input itself when the dtype already matches, and
            # export then routes other readers of the input through it: not an output of the call
            and not (op_name(n) in CAST_OPS and strip_casts(n) not in inside)
        ]

    def consumers(self) -> list[fx.Node]:
        inside = self.node_set
        found: list[fx.Node] = []
        for n in self.outputs():
            for u in n.users:
                if u not in inside and op_name(u) not in CHECK_OPS and u not in found:
                    found.append(u)
        return found


def normalize_module_path(path: str) -> str:
    """Module path as ``named_modules`` spells it, from an ``nn_module_stack`` entry's path."""
    # export records the root module as "" and children as "L['self'].layer1" in some versions
    for prefix in ("L['self'].", "L__self__."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
    return "" if path in ("L['self']", "L__self__") else path


def module_path(node: fx.Node) -> str:
    """The path of the innermost module whose forward ran ``node`` ("" for the root's own forward)."""
    stack = node.meta.get("nn_module_stack") or {}
    return normalize_module_path(list(stack.values())[-1][0]) if stack else ""


class GraphView:
    """Index of a captured graph by module call, parameter and node."""

    def __init__(self, captured: CapturedGraph) -> None:
        assert captured.graph is not None
        self.captured = captured
        self.graph = captured.graph
        self.nodes = list(self.graph.nodes)
        self.calls: dict[str, list[ModuleCall]] = defaultdict(list)
        by_key: dict[tuple[str, str], ModuleCall] = {}
        for n in self.nodes:
            stack = n.meta.get("nn_module_stack") or {}
            for key, entry in stack.items():
                path = normalize_module_path(entry[0])
                if not path:
                    continue
                call = by_key.get((path, key))
                if call is None:
                    call = by_key[(path, key)] = ModuleCall(path, key)
                    self.calls[path].append(call)
                call.nodes.append(n)

    def is_param(self, node: fx.Node) -> bool:
        return self.param_name(node) is not None

    def param_name(self, node: object) -> str | None:
        """Qualified name of the parameter or buffer a node stands for, if it is one."""
        if not isinstance(node, fx.Node):
            return None
        if node.op == "get_attr":
            return str(node.target)
        if node.op == "placeholder":
            return self.captured.param_names.get(node.name)
        return None

    def innermost_path(self, node: fx.Node) -> str:
        return str(node.target) if node.op == "call_module" else module_path(node)

    def call_count(self, path: str) -> int:
        return len(self.calls.get(path, ()))

    def describe(self, node: fx.Node, modules: dict[str, object] | None = None) -> str:
        """Human name of a value: the leaf module that produced it, an input, or op@module."""
        if node.op == "placeholder":
            return f"input:{node.name}"
        path = self.innermost_path(node)
        op = op_name(node) or str(node.target)
        if modules is not None and path in modules and not list(modules[path].children()):  # type: ignore[attr-defined]
            return path
        return f"{op}@{path}" if path else op


def view_of(captured: CapturedGraph) -> GraphView:
    """The one :class:`GraphView` of ``captured``, built on first use (indexing a large graph costs as
    much as a forward pass; a capture shared by discovery and several passes is indexed once)."""
    if captured.index is None:
        captured.index = GraphView(captured)
    return captured.index
