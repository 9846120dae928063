"""What the passes that rewrite a captured graph (not the module tree) share.

Those passes (:mod:`.fuse_add_norm`, :mod:`.fuse_graph_norm`) export the model, edit the exported
program's module and return it: a ``torch.fx.GraphModule`` with the model's parameters under the same
state_dict keys, not the user's class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import fx, nn
from torch.fx.passes.tools_common import legalize_graph

from normswap.graph.capture import export_module
from normswap.graph.ops import op_name, real_users
from normswap.modules.copying import copy_model
from normswap.passes.base import PassReport, RewriteKind, Skip

GRAPH_MODULE = "torch.fx.GraphModule"


class GraphPass(ABC):
    """A pass over the exported graph, with :class:`normswap.passes.base.Pass`'s contract (``name``,
    ``kind``, ``__call__`` returning ``(model, report)``). Subclasses implement :meth:`rewrite_graph`;
    a model with nothing changed is returned as it came."""

    name: ClassVar[str]
    kind: ClassVar[RewriteKind] = RewriteKind.EXACT
    # what the pass does, for "no example inputs: <doing> needs a captured graph"
    doing: ClassVar[str]

    def __call__(
        self,
        model: nn.Module,
        example_args: tuple | None = None,
        example_kwargs: dict[str, Any] | None = None,
        *,
        inplace: bool = False,
    ) -> tuple[nn.Module, PassReport]:
        report = PassReport(self.name, self.kind)
        if example_args is None and not example_kwargs:
            return model, self._unchanged(report, f"no example inputs: {self.doing} needs a captured graph")
        gm = export_module(model if inplace else copy_model(model), example_args, example_kwargs)
        if isinstance(gm, str):
            return model, self._unchanged(report, gm)
        report.graph_method = "export"
        self.rewrite_graph(gm, report, example_args, example_kwargs)
        if not report.changes:
            return model, report
        return finish(gm, model), report

    @abstractmethod
    def rewrite_graph(
        self, gm: fx.GraphModule, report: PassReport, example_args: tuple | None, example_kwargs: dict | None
    ) -> None:
        """Edit ``gm``'s graph in place, recording each change and skip in ``report``."""

    def _unchanged(self, report: PassReport, reason: str) -> PassReport:
        report.graph_error = reason
        report.skips.append(Skip(self.name, "<model>", reason))
        return report


def finish(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """Order, clean, check and recompile an edited graph; take ``model``'s training flags."""
    legalize_graph(gm)  # an inserted node may sit after readers of the value it replaced
    _eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    # The graph was captured in the model's mode and stays in it (an exported module refuses
    # .eval()); the flags say which mode that was, so tools that check them (export, run_model) agree.
    for module in gm.modules():
        module.training = model.training
    return gm


def _eliminate_dead_code(graph: fx.Graph) -> None:
    """Dead code elimination that also drops export's dtype/device assertions on values nothing else
    reads: they have side effects, so plain DCE keeps them, and with them the replaced ops they check."""
    while True:
        graph.eliminate_dead_code()
        orphan_checks = [
            n
            for n in graph.nodes
            if op_name(n) == "_assert_tensor_metadata"
            and isinstance(n.args[0], fx.Node)
            and not real_users(n.args[0])
        ]
        if not orphan_checks:
            return
        for node in orphan_checks:
            graph.erase_node(node)


def op_overload_name(node: fx.Node, namespace: str) -> str | None:
    """``rms_norm_fwd`` for a call of ``torch.ops.normswap.rms_norm_fwd.*`` and ``namespace="normswap"``."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target._opname if target.namespace == namespace else None
