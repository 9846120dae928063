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

Legal when the norm normalizes the trailing dims or one channel dim (moved last around the kernel, as
timm's LayerNorm2d does); its eps is a constant; its weight and bias, if any, are stored tensors of the
normalized shape; and the fused call, run on the input this norm sees on the example inputs, matches
the norm's output there in dtype and within the kernel tolerance (``normswap.util.tolerance``). Each
change records that measured difference. Needs example inputs: the pass asks the driver for an exported
graph (``Needs.EXPORTED_GRAPH``), records every norm's values on it once per run (``prepare``), and
checks each norm into a plan holding the fused call's arguments it measured, so applying it measures
nothing again. The rewritten model is a
``torch.fx.GraphModule`` with the model's state_dict keys, not the user's class; every change says so.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from normswap.graph.analysis import GraphView, module_path
from normswap.graph.capture import CapturedGraph
from normswap.graph.ops import CAST_OPS, arg, op_name, tensor_meta
from normswap.graph.patterns import find_norm_patterns
from normswap.kernels import fused_norm
from normswap.kernels.reference import CASTING_MODES
from normswap.modules.fused import channel_dim_of
from normswap.passes.core.base import Change, Needs, Pass, PassContext, PassReport, RewriteKind
from normswap.passes.core.graph_rewrite import GRAPH_MODULE
from normswap.util.tolerance import kernel_difference, kernel_tolerance


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
    diff: float


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
        if isinstance(measured, str):
            return measured
        call, diff = measured
        return GraphNormPlan(site, call, diff)

    def apply(self, plan: GraphNormPlan, ctx: PassContext, state: GraphNormRun) -> Change:
        norm, call, diff, replaced = plan.norm, plan.call, plan.diff, state.replaced
        graph = norm.output.graph
        source = replaced.get(norm.input, norm.input)
        with graph.inserting_after(norm.output):
            fused = graph.call_function(fused_norm, (source, norm.weight, norm.bias), call)
        fused.meta.update({k: v for k, v in norm.output.meta.items() if k in ("nn_module_stack", "val")})
        norm.output.replace_all_uses_with(fused)
        replaced[norm.output] = fused
        atol, rtol = kernel_tolerance(norm.output.meta["val"].dtype)
        layout = (
            f"over dim {call['channel_dim']}" if call["channel_dim"] is not None else "over trailing dims"
        )
        return Change(
            self.name,
            norm.path,
            self.kind,
            f"{norm.source} {norm.kind} norm ({layout}) -> normswap fused_norm (the model is now a "
            f"{GRAPH_MODULE}); site max abs diff {diff:.3g}",
            {
                "source": norm.source,
                **call,
                "max_abs_diff": diff,
                "tolerance": {"atol": atol, "rtol": rtol},
                "measured_on": "the example inputs",
                "output": GRAPH_MODULE,
            },
        )


def fuse_graph_norm(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict | None = None,
    *,
    inplace: bool = False,
) -> tuple[nn.Module, PassReport]:
    """Functional form of :class:`FuseGraphNorm`."""
    return FuseGraphNorm()(model, example_args, example_kwargs, inplace=inplace)


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


def _measure(norm: GraphNorm, values: dict[fx.Node, Any]) -> tuple | str:
    """(fused_norm keyword arguments, max abs difference) when the fused call reproduces ``norm``.

    Also settles ``norm.output`` among its trailing casts: the first with the fused call's dtype.
    """
    if norm.kind not in ("rms", "layer"):
        return f"{norm.kind} norm: the fused kernels normalize features, not over positions"
    if isinstance(norm.output.meta.get("val"), tuple | list):
        return "its statistics (mean, rstd) are read too: only the normalized value can be replaced"
    x, out = values.get(norm.input), values.get(norm.output)
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return "it did not run on the example inputs"
    if norm.eps is None:
        return "its eps is not a constant"
    if norm.casting not in CASTING_MODES:
        return f"casting mode {norm.casting!r} is not one the kernels implement {CASTING_MODES}"
    dims = norm.dims
    trailing = dims is not None and dims == tuple(range(-len(dims), 0))
    if not trailing and channel_dim_of(dims) is None:
        return f"normalizes dims {dims}: neither the trailing dims nor one channel dim"
    assert dims is not None
    normalized_shape = tuple(x.shape[d] for d in dims)
    tensors = []
    for role, node in (("weight", norm.weight), ("bias", norm.bias)):
        if node is None:
            tensors.append(None)
            continue
        if node.op != "get_attr":
            return f"its {role} is computed in the forward, not a stored tensor"
        tensor = values.get(node)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != normalized_shape:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
            return f"its {role} has shape {shape}, not the normalized shape {normalized_shape}"
        tensors.append(tensor)
    call = {
        "eps": norm.eps,
        "kind": norm.kind,
        "casting": norm.casting,
        "weight_offset": norm.weight_offset,
        "normalized_ndim": len(dims) if trailing else 1,
        "channel_dim": dims[0] if not trailing else None,
    }
    with torch.no_grad():
        got = fused_norm(x, *tensors, **call)
    for cast in (norm.output, *norm.trailing_casts):
        value = values.get(cast)
        if isinstance(value, torch.Tensor) and value.dtype == got.dtype:
            norm.output, out = cast, value
            break
    diff, reproduced = kernel_difference(out, got)
    if not reproduced:
        atol, rtol = kernel_tolerance(out.dtype)
        return (
            f"the fused call gives {got.dtype} {tuple(got.shape)} differing by {diff:.3g} from its "
            f"{out.dtype} {tuple(out.shape)} output (atol {atol:g}, rtol {rtol:g}): its semantics are not "
            "the ones read off the graph"
        )
    return call, diff
