"""Fuse the norms that are no module of their own. A graph rewrite: the result is a GraphModule.

:class:`normswap.passes.FuseNorm` replaces norm *modules*. A norm computed inside a larger forward
(``F.layer_norm`` in a block's forward, ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w``
written in line) has no module to replace, so this pass exports the model (non-strict) and replaces each
such norm's nodes by one call of :func:`normswap.kernels.fused_norm`, which reaches the same
``normswap::`` ops as the fused modules. It finds, on the exported graph:

- ``aten.layer_norm`` / ``aten.rms_norm`` calls: the functional calls, and torch.nn norm modules that
  were not fused as modules. ``rms_norm``'s ``eps=None`` means the epsilon of the input's dtype, which a
  captured graph fixes;
- norms written out as elementary ops (:mod:`normswap.graph.patterns`): RMSNorm and LayerNorm forms,
  with their casts (the ``llama`` and ``gemma`` casting modes), a ``(1 + w)`` weight, and a weight
  reshaped along the normalized dim.

Legal by the rules both fused-norm passes apply (:mod:`.legality`; one channel dim is moved last around
the kernel, as timm's LayerNorm2d does), and when the fused call, run on the input this norm sees on the
example inputs, matches the norm's output there in dtype and within the kernel tolerance. Needs example
inputs: the pass asks the driver for an exported graph (``Needs.EXPORTED_GRAPH``), records every norm's
values on it once per run (``prepare``), and checks each norm into a plan holding the fused call's
arguments it measured, so applying it measures nothing again. The rewritten model is a
``torch.fx.GraphModule`` with the model's state_dict keys, not the user's class; every change says so.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from normswap.discover import NormKind, NormSemantics
from normswap.graph.analysis import GraphView, module_path
from normswap.graph.capture import CapturedGraph
from normswap.graph.ops import CAST_OPS, arg, op_name, tensor_meta
from normswap.graph.patterns import find_norm_patterns
from normswap.kernels import fused_norm
from normswap.passes.core.base import Change, Needs, Pass, PassContext, RewriteKind
from normswap.passes.core.graph_rewrite import GRAPH_MODULE
from normswap.passes.fuse.legality import Measured, fused_call, measure


@dataclass
class GraphNorm:
    """A norm found on the exported graph, with what the fused call needs to reproduce it."""

    path: str  # "<module path>::<node name>", what the report shows
    kind: str  # "rms" | "layer" (other kinds are found, and skipped with the reason)
    source: str  # "functional" | "pattern"
    input: fx.Node
    output: fx.Node  # the node whose value is the norm's result (readers are moved off it)
    weight: fx.Node | None
    bias: fx.Node | None
    eps: float | None
    casting: str
    weight_offset: float
    dims: tuple[int, ...] | None  # normalized dims, negative
    # Casts a written-out norm ends with, innermost first: one of them may belong to the next reader
    # (the next norm's ``.float()``), so the output is the first whose dtype is the fused call's.
    trailing_casts: tuple[fx.Node, ...] = ()


@dataclass
class GraphNormRun:
    """What every site of one run shares: the recorded values, and the replacements made so far."""

    norms: list[GraphNorm]
    # values of every norm's input, output and affine tensors on the example inputs
    values: dict[fx.Node, Any]
    # A norm may read another one's output (a norm of a norm): it must read the replacement.
    replaced: dict[fx.Node, fx.Node] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphNormPlan:
    """A norm the fused call reproduces: its keyword arguments and the measured difference."""

    norm: GraphNorm
    call: dict[str, Any]
    measured: Measured


class FuseGraphNorm(Pass[GraphNorm, GraphNormPlan, GraphNormRun]):
    """Functional and written-out norms -> ``normswap.kernels.fused_norm`` calls, on the exported graph."""

    name: ClassVar[str] = "fuse_graph_norm"
    kind: ClassVar[RewriteKind] = RewriteKind.EXACT
    needs: ClassVar[Needs] = Needs.EXPORTED_GRAPH
    doing: ClassVar[str] = "fusing norms inside other forwards"

    def prepare(self, ctx: PassContext) -> GraphNormRun:
        assert isinstance(ctx.model, fx.GraphModule)
        norms = find_graph_norms(ctx.model)
        return GraphNormRun(norms, _record(ctx.model, norms, ctx.example_args, ctx.example_kwargs))

    def candidates(self, ctx: PassContext, state: GraphNormRun) -> list[GraphNorm]:
        return state.norms

    def check(self, site: GraphNorm, ctx: PassContext, state: GraphNormRun) -> GraphNormPlan | str:
        measured = _measure(site, state.values)
        return measured if isinstance(measured, str) else GraphNormPlan(site, *measured)

    def apply(self, plan: GraphNormPlan, ctx: PassContext, state: GraphNormRun) -> Change:
        norm, call, replaced = plan.norm, plan.call, state.replaced
        graph = norm.output.graph
        source = replaced.get(norm.input, norm.input)
        with graph.inserting_after(norm.output):
            fused = graph.call_function(fused_norm, (source, norm.weight, norm.bias), call)
        fused.meta.update({k: v for k, v in norm.output.meta.items() if k in ("nn_module_stack", "val")})
        norm.output.replace_all_uses_with(fused)
        replaced[norm.output] = fused
        layout = (
            f"over dim {call['channel_dim']}" if call["channel_dim"] is not None else "over trailing dims"
        )
        return Change(
            self.name,
            norm.path,
            self.kind,
            f"{norm.source} {norm.kind} norm ({layout}) -> normswap fused_norm (the model is now a "
            f"{GRAPH_MODULE}); {plan.measured.summary}",
            {"source": norm.source, **call, **plan.measured.details(), "output": GRAPH_MODULE},
        )


# ---------------------------------------------------------------------------------------------------
# Finding


def find_graph_norms(gm: fx.GraphModule) -> list[GraphNorm]:
    """Every written-out and functional norm of ``gm``'s graph, in graph order (RMSNorm and LayerNorm,
    and the written-out batch and instance norms that are reported but not fused)."""
    view = GraphView(CapturedGraph(gm.graph, "export"))
    found: list[GraphNorm] = []
    covered: set[fx.Node] = set()
    for match in find_norm_patterns(view, gm):
        covered.update(match.nodes)
        output, casts = match.output, []
        while op_name(output) in CAST_OPS and output.args and output.args[0] in match.nodes:
            casts.append(output)
            output = output.args[0]
        found.append(
            GraphNorm(
                path=_site(output),
                kind=match.kind,
                source="pattern",
                input=match.input,
                output=output,
                trailing_casts=tuple(reversed(casts)),
                weight=match.weight,
                bias=match.bias,
                eps=match.eps,
                casting=match.casting,
                weight_offset=match.weight_offset,
                dims=match.dims if all(d < 0 for d in match.dims) else None,
            )
        )
    for node in gm.graph.nodes:
        if node not in covered and op_name(node) in ("layer_norm", "rms_norm"):
            found.append(_functional(node))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(found, key=lambda norm: order[norm.output])


def _functional(node: fx.Node) -> GraphNorm:
    is_layer = op_name(node) == "layer_norm"
    shape = arg(node, 1, "normalized_shape")
    dims = tuple(range(-len(shape), 0)) if isinstance(shape, list | tuple) else None
    # native_layer_norm / _fused_rms_norm return (y, statistics...): the norm's value is item 0
    output = node
    if isinstance(node.meta.get("val"), tuple | list):
        firsts = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        output = firsts[0] if len(firsts) == 1 and len(node.users) == 1 else node
    return GraphNorm(
        path=_site(node),
        kind="layer" if is_layer else "rms",
        source="functional",
        input=node.args[0],  # type: ignore[arg-type]
        output=output,
        weight=arg(node, 2, "weight"),
        bias=arg(node, 3, "bias") if is_layer else None,
        eps=_eps(node, arg(node, 4 if is_layer else 3, "eps", 1e-5 if is_layer else None)),
        casting="none",
        weight_offset=0.0,
        dims=dims,
    )


def _eps(node: fx.Node, eps: object) -> float | None:
    if isinstance(eps, int | float) and not isinstance(eps, bool):
        return float(eps)
    meta = tensor_meta(node.args[0]) if eps is None and isinstance(node.args[0], fx.Node) else None
    if meta is None or not meta[1].is_floating_point:
        return None
    # rms_norm(eps=None) takes the epsilon of its accumulation dtype: fp64 for fp64 inputs, fp32 for
    # fp32 and the half precisions (which it computes in fp32); fixed once the graph is captured
    return float(torch.finfo(torch.float64 if meta[1] == torch.float64 else torch.float32).eps)


def _site(node: fx.Node) -> str:
    return f"{module_path(node) or '<root>'}::{node.name}"


# ---------------------------------------------------------------------------------------------------
# Checking by measurement


def _record(
    gm: fx.GraphModule, norms: list[GraphNorm], args: tuple | None, kwargs: dict | None
) -> dict[fx.Node, Any]:
    """Values of every norm's input and output, and of the tensors they read, on the example inputs."""
    wanted = {
        n
        for norm in norms
        for n in (norm.input, norm.output, *norm.trailing_casts, norm.weight, norm.bias)
        if n is not None
    }

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            if n in wanted and isinstance(value, torch.Tensor):
                seen[n] = value.detach().clone()  # later in-place ops must not reach it
            return value

    seen: dict[fx.Node, Any] = {}
    inputs = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
    flat = fx_pytree.tree_flatten_spec((tuple(inputs[0] or ()), dict(inputs[1] or {})), gm._in_spec)
    # The run must leave no trace: a train-mode BatchNorm's statistics or a step counter would advance.
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    try:
        with torch.no_grad():
            Recorder(gm).run(*flat)
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])
    return seen


def _measure(norm: GraphNorm, values: dict[fx.Node, Any]) -> tuple[dict[str, Any], Measured] | str:
    """(fused_norm keyword arguments, measured difference) when the fused call reproduces ``norm``.

    Also settles ``norm.output`` among its trailing casts: the first with the fused call's dtype.
    """
    if isinstance(norm.output.meta.get("val"), tuple | list):
        return "its statistics (mean, rstd) are read too: only the normalized value can be replaced"
    x, out = values.get(norm.input), values.get(norm.output)
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return "it did not run on the example inputs"
    affine = {"weight": norm.weight, "bias": norm.bias}
    names = {role: str(n.target) for role, n in affine.items() if n is not None and n.op == "get_attr"}
    tensors = {role: values[n] for role, n in affine.items() if n in values}
    semantics = NormSemantics(
        kind=NormKind(norm.kind),
        normalized_shape=tuple(x.shape[d] for d in norm.dims) if norm.dims is not None else None,
        normalized_dims=norm.dims,
        eps=norm.eps,
        affine=norm.weight is not None,
        bias=norm.bias is not None,
        weight_name=names.get("weight"),
        bias_name=names.get("bias"),
        casting=norm.casting,
        weight_offset=norm.weight_offset,
    )
    call = fused_call(semantics, {names[role]: t for role, t in tensors.items() if role in names})
    if isinstance(call, str):
        return call
    with torch.no_grad():
        got = fused_norm(x, tensors.get("weight"), tensors.get("bias"), **call)
    for cast in (norm.output, *norm.trailing_casts):
        value = values.get(cast)
        if isinstance(value, torch.Tensor) and value.dtype == got.dtype:
            norm.output, out = cast, value
            break
    measured = measure(out, got, "call", "the example inputs")
    return measured if isinstance(measured, str) else (call, measured)
