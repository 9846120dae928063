"""Defer an RMSNorm's scaling past the linear layers that read it (FlashNorm). A graph rewrite (exact).

A weightless RMSNorm (``--fold-norm-affine`` moves the weight into the readers first) computes
``n = x * r`` with ``r = rsqrt(mean(x^2) + eps)``, one value per row, and every reader is a linear map
over the normalized dim: ``z = n W^T + c``. Since ``r`` scales a whole row,

    z = (x * r) W^T + c = (x W^T) * r + c

so the matmuls can read ``x`` itself and the scale is applied to their (usually fewer or equal)
outputs: the reduction no longer stands between ``x`` and the matmuls, which can start at once, and
the normalized copy of ``x`` is never written. The statistic is computed once and shared by every
reader (q, k and v; gate and up).

On the exported graph (``Needs.EXPORTED_GRAPH``): a site is an ``aten.rsqrt`` of ``mean(x^2, -1,
keepdim) + eps`` whose only reader is ``x * rsqrt``. Legal when every value derived from that product,
through identity casts and aliases, is the input of an ``aten.linear``; refused, with the reason,
otherwise (a residual add, a model output, attention reading the norm directly, a slice) and when the
statistics are computed in another dtype than x's (a cast around them rounds the normalized value
before the matmul, which deferring would skip: not exact). The result is a ``torch.fx.GraphModule``
with the model's parameters under the same state_dict keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx

from normswap.graph.analysis import module_path
from normswap.graph.ops import PASS_THROUGH_OPS, op_name, real_users
from normswap.passes.core.base import Change, Needs, Pass, PassContext, RewriteKind
from normswap.passes.core.graph_rewrite import GRAPH_MODULE


@dataclass(frozen=True)
class DeferSite:
    path: str
    statistic: fx.Node  # the aten.rsqrt of a written-out norm, or an aten.rms_norm call


@dataclass(frozen=True)
class DeferPlan:
    site: DeferSite
    x: fx.Node
    scaled: fx.Node  # x * rsqrt, or the aten.rms_norm node
    linears: tuple[fx.Node, ...]
    eps: float  # for an aten.rms_norm site, whose statistic the rewrite writes out


def _val(node: object) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _identity(node: fx.Node) -> bool:
    """Whether ``node`` hands its input on unchanged: an alias, or a cast to the dtype it already has."""
    name = op_name(node)
    if name in PASS_THROUGH_OPS:
        return True
    if name in ("to", "_to_copy") and isinstance(node.args[0], fx.Node):
        before, after = _val(node.args[0]), _val(node)
        return before is not None and after is not None and before.dtype == after.dtype
    return False


def _statistic_input(rsqrt: fx.Node) -> tuple[fx.Node, float] | str:
    """(x, eps) when ``rsqrt`` reads ``mean(x^2, -1, keepdim) + eps``, else why not."""
    add = rsqrt.args[0]
    if not isinstance(add, fx.Node) or op_name(add) != "add" or isinstance(add.args[1], fx.Node):
        return "its rsqrt does not read mean(x^2) + eps"
    mean = add.args[0]
    if not isinstance(mean, fx.Node) or op_name(mean) != "mean":
        return "its rsqrt does not read mean(x^2) + eps"
    square = mean.args[0]
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    value = _val(square)
    if value is None or not keepdim or list(dims or []) not in ([-1], [value.ndim - 1]):
        return "the mean is not over the last dim with keepdim"
    if op_name(square) == "pow" and square.args[1] == 2:
        return square.args[0], float(add.args[1])
    if op_name(square) == "mul" and square.args[0] is square.args[1]:
        return square.args[0], float(add.args[1])
    return "the mean is not of x^2"


def _linear_readers(scaled: fx.Node) -> tuple[fx.Node, ...] | str:
    """The ``aten.linear`` nodes reading ``scaled`` (through identity ops), or why not all readers are."""
    linears: list[fx.Node] = []
    frontier = [scaled]
    while frontier:
        value = frontier.pop()
        for user in real_users(value):
            if _identity(user):
                frontier.append(user)
            elif op_name(user) in ("to", "_to_copy"):
                dtype = getattr(_val(user), "dtype", None)
                return (
                    f"the normalized value is rounded to {dtype} before the matmuls: deferring the scale "
                    "would skip that rounding (not exact)"
                )
            elif op_name(user) == "linear" and user.args[0] is value:
                linears.append(user)
            else:
                return f"its output reaches {op_name(user) or user.op}, not only linear layers"
    if not linears:
        return "nothing reads its output"
    return tuple(linears)


class DeferRMS(Pass[DeferSite, DeferPlan, None]):
    """``linear(x * rsqrt(mean(x^2) + eps))`` -> ``linear(x) * rsqrt(...)``, on the exported graph."""

    name: ClassVar[str] = "defer_rms"
    kind: ClassVar[RewriteKind] = RewriteKind.EXACT
    needs: ClassVar[Needs] = Needs.EXPORTED_GRAPH
    doing: ClassVar[str] = "deferring RMS scaling past the matmuls"
    inside_changes: ClassVar[str] = (
        "the normalized value is no longer computed (the matmuls read the unnormalized input, scaled "
        "after): hidden states and outputs do not change"
    )

    def candidates(self, ctx: PassContext, state: None) -> list[DeferSite]:
        """Statistics written out (an ``aten.rsqrt``) and ``aten.rms_norm`` calls (torch's RMSNorm)."""
        assert ctx.captured.graph is not None
        nodes = [n for n in ctx.captured.graph.nodes if op_name(n) in ("rsqrt", "rms_norm")]
        return [DeferSite(module_path(n) or n.name, n) for n in nodes]

    def check(self, site: DeferSite, ctx: PassContext, state: None) -> DeferPlan | str:
        if op_name(site.statistic) == "rms_norm":
            return _check_rms_norm_call(site)
        found = _statistic_input(site.statistic)
        if isinstance(found, str):
            return found
        x, _eps = found
        users = real_users(site.statistic)
        if len(users) != 1 or op_name(users[0]) != "mul":
            return "its rsqrt is read by more than the scaling of x"
        scaled = users[0]
        raw = next((a for a in scaled.args if a is not site.statistic), None)
        if raw is not x:
            return "the scaled value is not the x the statistic was taken of"
        x_val, out_val = _val(x), _val(scaled)
        if x_val is None or out_val is None or x_val.dtype != out_val.dtype:
            return "the statistics are computed in another dtype than x's: deferring would skip a rounding"
        linears = _linear_readers(scaled)
        if isinstance(linears, str):
            return linears
        return DeferPlan(site, x, scaled, linears, _eps)

    def apply(self, plan: DeferPlan, ctx: PassContext, state: None) -> Change:
        graph = plan.scaled.graph
        rsqrt = plan.site.statistic
        if op_name(rsqrt) == "rms_norm":  # write the statistic out, once, where the norm was
            aten = torch.ops.aten
            with graph.inserting_before(plan.scaled):
                square = graph.call_function(aten.pow.Tensor_Scalar, (plan.x, 2))
                mean = graph.call_function(aten.mean.dim, (square, [-1], True))
                shifted = graph.call_function(aten.add.Tensor, (mean, plan.eps))
                rsqrt = graph.call_function(aten.rsqrt.default, (shifted,))
        names = []
        for linear in plan.linears:
            weight = linear.args[1]
            bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
            with graph.inserting_before(linear):
                product = graph.call_function(torch.ops.aten.linear.default, (plan.x, weight))
                out = graph.call_function(torch.ops.aten.mul.Tensor, (product, rsqrt))
                if bias is not None:
                    out = graph.call_function(torch.ops.aten.add.Tensor, (out, bias))
            for node in {product, out}:
                node.meta["val"] = linear.meta.get("val")
            out.meta.update({k: v for k, v in linear.meta.items() if k in ("nn_module_stack", "stack_trace")})
            linear.replace_all_uses_with(out)
            graph.erase_node(linear)
            names.append(module_path(out) or linear.name)
        return Change(
            self.name,
            plan.site.path,
            self.kind,
            f"RMS scale applied after {len(names)} linear layer(s) ({', '.join(names)}) "
            f"(the model is now a {GRAPH_MODULE})",
            {"readers": names, "output": GRAPH_MODULE},
        )


def _check_rms_norm_call(site: DeferSite) -> DeferPlan | str:
    """An ``aten.rms_norm(x, [N], weight, eps)`` over the last dim, without weight, read by linears."""
    node = site.statistic
    x = node.args[0]
    shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    eps = node.args[3] if len(node.args) > 3 else node.kwargs.get("eps")
    value = _val(x)
    if not isinstance(x, fx.Node) or value is None or list(shape or []) != [value.shape[-1]]:
        return "it does not normalize the last dim alone"
    if weight is not None:
        return "it multiplies by its weight: fold that into the readers first (--fold-norm-affine)"
    if not value.is_floating_point() or value.dtype != torch.float32:
        return f"its input is {value.dtype}: deferring the scale is exact in float32 only"
    linears = _linear_readers(node)
    if isinstance(linears, str):
        return linears
    return DeferPlan(site, x, node, linears, float(eps) if eps is not None else torch.finfo(value.dtype).eps)
