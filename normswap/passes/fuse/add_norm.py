"""Fuse a residual add into the fused norm that reads it. A graph rewrite: the result is a GraphModule.

In a pre-norm transformer block the residual stream is added and normalized, and the sum is carried on
as the next residual::

    h = x + r            (aten.add.Tensor)
    y = norm(h)          (normswap::{rms,layer}_norm_fwd, put in by :mod:`normswap.passes.fuse.modules`)
    ... h + f(y) ...     (the next residual reads h)

``normswap::add_{rms,layer}_norm_fwd(x, r, ...)`` returns ``(y, h, stats)``: the sum and its norm in one
pass over memory. Every reader of the add's output (the next residual included) reads the fused op's
``h`` instead, every reader of the norm's outputs the fused op's ``y`` and statistics. The function is
unchanged: the kernels round ``h`` to x's dtype, as the add does, and normalize that rounded ``h``.

No module edit can express this (the add is not a module), so the pass asks the pass driver for an
exported graph (``Needs.EXPORTED_GRAPH``: ``torch.export.export(model, ..., strict=False)``) and its
result is that program's module: a ``torch.fx.GraphModule`` with the model's parameters under the same
state_dict keys, not the user's class. Every change says so. A model with nothing to fuse is returned as
it came. The site is the norm node; the plan carries the add it absorbs, so applying it looks nothing up
again.

Legal when the norm op's input is an ``aten.add.Tensor`` of two tensors with the add's own shape and
dtype (no broadcasting, no type promotion) and ``alpha`` 1. Needs example inputs to capture the graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx

from normswap.graph.analysis import module_path
from normswap.passes.core.base import Change, Needs, Pass, PassContext, RewriteKind
from normswap.passes.core.graph_rewrite import GRAPH_MODULE, op_overload_name

_NORM_TO_ADD_NORM = {
    "rms_norm_fwd": "add_rms_norm_fwd",
    "layer_norm_fwd": "add_layer_norm_fwd",
}


@dataclass(frozen=True)
class AddNormSite:
    """A fused norm op of the exported graph; ``path`` is its module path (the node's name if none)."""

    path: str
    norm: fx.Node


@dataclass(frozen=True)
class AddNormPlan:
    """A norm op whose input is an add that can move into the fused op."""

    site: AddNormSite
    add: fx.Node


class FuseAddNorm(Pass[AddNormSite, AddNormPlan, None]):
    """``add -> fused norm`` into one ``normswap::add_*_norm_fwd`` op, on the exported graph."""

    name: ClassVar[str] = "fuse_add_norm"
    kind: ClassVar[RewriteKind] = RewriteKind.EXACT
    needs: ClassVar[Needs] = Needs.EXPORTED_GRAPH
    doing: ClassVar[str] = "fusing adds into norms"

    def candidates(self, ctx: PassContext, state: None) -> list[AddNormSite]:
        """The fused norm ops of the graph (each one fuses with the add before it, or is skipped)."""
        assert ctx.captured.graph is not None
        norms = [n for n in ctx.captured.graph.nodes if _norm_op_name(n) in _NORM_TO_ADD_NORM]
        return [AddNormSite(_site_name(n), n) for n in norms]

    def check(self, site: AddNormSite, ctx: PassContext, state: None) -> AddNormPlan | str:
        reason = _why_not(site.norm)
        if reason is not None:
            return reason
        assert isinstance(site.norm.args[0], fx.Node)
        return AddNormPlan(site, site.norm.args[0])

    def apply(self, plan: AddNormPlan, ctx: PassContext, state: None) -> Change:
        return _fuse(plan.site.norm, plan.add, plan.site.path)


def _why_not(norm: fx.Node) -> str | None:
    """None when the norm's input is an add that can move into the fused op, else why not."""
    add = norm.args[0]
    if not isinstance(add, fx.Node) or add.target is not torch.ops.aten.add.Tensor:
        return f"its input comes from {_describe(add)}, not a residual add"
    if add.kwargs.get("alpha", 1) != 1:
        return f"the add scales its second operand (alpha={add.kwargs['alpha']})"
    if len(add.args) != 2 or not all(isinstance(a, fx.Node) for a in add.args):
        return "the add has a constant operand, not a residual stream"
    values = [a.meta.get("val") for a in (*add.args, add)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return "the add's operands have no recorded shape"
    # sizes as text: a dynamic dim is a symbol (s0), unhashable as a SymInt and equal only to itself
    shapes = [tuple(str(d) for d in v.shape) for v in values]
    dtypes = [v.dtype for v in values]
    if len(set(shapes)) != 1:
        a, b = (f"({', '.join(shape)}{',' if len(shape) == 1 else ''})" for shape in shapes[:2])
        return f"the add broadcasts {a} + {b}: the fused op adds two tensors of one shape"
    if len(set(dtypes)) != 1:
        return f"the add promotes {dtypes[0]} + {dtypes[1]}: the fused op adds two tensors of one dtype"
    return None


def _fuse(norm: fx.Node, add: fx.Node, site: str) -> Change:
    """Replace ``add`` and ``norm`` by one fused op; readers of either read the fused op's outputs."""
    graph = norm.graph
    norm_name = _norm_op_name(norm)
    fused_name = _NORM_TO_ADD_NORM[norm_name]
    target = getattr(torch.ops.normswap, fused_name).default
    with graph.inserting_before(norm):
        fused = graph.call_function(target, (*add.args, *norm.args[1:]), dict(norm.kwargs))
        h = graph.call_function(operator.getitem, (fused, 1))
    fused.meta.update({k: v for k, v in norm.meta.items() if k in ("nn_module_stack", "stack_trace")})
    # Shapes for the next check: the next add may read h.
    h.meta["val"] = add.meta.get("val")
    norm_val = norm.meta.get("val")
    if isinstance(norm_val, tuple | list):
        fused.meta["val"] = (norm_val[0], add.meta.get("val"), *norm_val[1:])
    add.replace_all_uses_with(h, delete_user_cb=lambda user: user is not norm)
    # The fused outputs are (y, h, stats...): the norm's stats move one place along.
    for user in list(norm.users):
        assert user.target is operator.getitem, user
        index = user.args[1]
        user.args = (fused, index if index == 0 else index + 1)
    graph.erase_node(norm)
    if not add.users:
        graph.erase_node(add)
    return Change(
        FuseAddNorm.name,
        site,
        FuseAddNorm.kind,
        f"{add.name} + normswap::{norm_name} -> normswap::{fused_name} (the model is now a {GRAPH_MODULE})",
        {"add": add.name, "norm_op": norm_name, "fused_op": fused_name, "output": GRAPH_MODULE},
    )


def _norm_op_name(node: fx.Node) -> str | None:
    return op_overload_name(node, "normswap")


def _site_name(norm: fx.Node) -> str:
    """The module path of the norm (its innermost ``nn_module_stack`` entry), else the node's name."""
    return module_path(norm) or norm.name


def _describe(value: object) -> str:
    if not isinstance(value, fx.Node):
        return repr(value)
    if value.op == "placeholder":
        return "a model input"
    target = value.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname  # "embedding", "dropout"
    return getattr(target, "__name__", str(target))
