"""Graph bookkeeping shared by the passes that rewrite an exported graph rather than the module tree.

Those passes (:mod:`normswap.passes.fuse.add_norm`, :mod:`normswap.passes.fuse.graph`) are ordinary passes of the one protocol
(:mod:`normswap.passes.core.base`) with ``needs = Needs.EXPORTED_GRAPH``: the driver exports the model, hands
them the exported GraphModule as ``ctx.model``, and after their plans are applied calls
:func:`finish_graph` here. Their result is that GraphModule, with the model's parameters under the same
state_dict keys, not the user's class; this file holds only what edits of such a graph need, so that
no second driver loop can grow here again.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.fx.passes.tools_common import legalize_graph

from normswap.graph.ops import op_name, real_users

GRAPH_MODULE = "torch.fx.GraphModule"


def finish_graph(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
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
