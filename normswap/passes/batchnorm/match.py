"""Which neighbour each BatchNorm site folds into: the layer before it, the layer after it, none (an
affine), or, for an ``F.batch_norm`` call, the layer before it inside the forward that makes the call.

The fold-batchnorm pass (:mod:`normswap.passes.batchnorm.fold`) checks each site here into a
:class:`Fold`; whether a given layer can take the fold is :mod:`normswap.passes.batchnorm.layers`'
question. Everything here reads the captured graph and the modules; nothing is edited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from normswap.discover import NormSite
from normswap.discover.own_forward import norm_act_tail
from normswap.graph.analysis import ModuleCall
from normswap.graph.ops import arg, rank
from normswap.passes.batchnorm.layers import (
    CONV_TRANSPOSES,
    FOLDABLE_LAYERS,
    LAYERS_TEXT,
    class_name,
    computes_as_base,
    computes_own_layer,
    layer_call_guard,
    layer_path_of,
    layer_text,
    zero_padding,
)
from normswap.passes.core.base import PassContext
from normswap.passes.swap.norm_act import is_identity

# BatchNorm forwards that compute nothing but the normalization in eval mode.
_PLAIN_BN_FORWARDS = (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward)
# timm's norm+act classes: normalize, then run ``self.drop`` and ``self.act`` (in that order).
# Argument order of the two spellings of batch norm found in graphs (fx keeps F.batch_norm calls).
_ATEN_BN_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
_F_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_F_BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


@dataclass(frozen=True)
class FunctionalCall:
    """An ``F.batch_norm`` call to remove, as found in the fx trace of the forward that makes it."""

    graph: fx.Graph  # the trace of the owner's own forward (its submodules kept as calls)
    node: fx.Node  # the call in that graph
    input: fx.Node  # the layer's call whose output it reads, which its readers read instead
    # full names (in the model) of running_mean, running_var, weight, bias; None where not given
    names: dict[str, str | None] = field(default_factory=dict)
    eps: float = 1e-5


@dataclass(frozen=True)
class Fold:
    """What to do at one site, as its check decided it: the pass applies it without looking again."""

    how: str  # "backward" | "forward" | "affine" | "functional"
    layer: str = ""  # the conv/linear folded into
    owner: str = ""  # functional: the module whose forward calls F.batch_norm
    call: FunctionalCall | None = None  # functional: the call to remove


def _module_guard(site: NormSite, bn: nn.Module) -> str | None:
    """Reasons that hold whatever the BN's neighbours are."""
    if isinstance(bn, nn.modules.batchnorm._BatchNorm):
        if type(bn).forward not in _PLAIN_BN_FORWARDS and norm_act_tail(bn) is None:
            return f"{class_name(bn)}.forward does more than normalize (e.g. an activation); folding it would drop that"
        if bn.training:
            return (
                "BatchNorm is in training mode: it normalizes with batch statistics; call model.eval() first"
            )
        if not bn.track_running_stats or bn.running_mean is None:
            return "BatchNorm has track_running_stats=False: no statistics to fold"
    elif norm_act_tail(bn) is None and list(bn.children()):
        names = ", ".join(name for name, _ in bn.named_children())
        return f"{class_name(bn)} has submodules ({names}) besides its statistics; folding it would drop them"
    stats = [getattr(bn, name, None) for name in ("running_mean", "running_var", "weight", "bias")]
    if not all(t is None or (isinstance(t, torch.Tensor) and t.ndim == 1) for t in stats[2:]) or not all(
        isinstance(t, torch.Tensor) and t.ndim == 1 for t in stats[:2]
    ):
        # e.g. a hand-written BN keeping (1, C, 1, 1) statistics, or naming them otherwise
        return (
            f"{class_name(bn)} does not keep its statistics and affine as per-channel vectors named "
            "running_mean, running_var, weight, bias"
        )
    if bn.running_var.is_meta:
        return None  # a model on the meta device (a streamed checkpoint): its stream reads the values
    return bn_statistics_problem(bn.running_mean, bn.running_var, bn_eps(site, bn))


def bn_statistics_problem(running_mean: torch.Tensor, running_var: torch.Tensor, eps: float) -> str | None:
    """Why statistics of these values make no affine map to fold, or None."""
    var = running_var.detach().double() + eps
    if not bool(torch.isfinite(var).all() and (var > 0).all()) or not bool(
        torch.isfinite(running_mean).all()
    ):
        return "BatchNorm statistics are not finite with running_var + eps > 0: it is no affine map to fold"
    return None


def bn_eps(site: NormSite, bn: nn.Module) -> float:
    return float(site.eps if site.eps is not None else bn.eps)


def _bn_rank(value: fx.Node, bn: nn.Module) -> int | None:
    """Rank of the tensor a BN normalizes: recorded in the graph (export), else implied by the BN's
    class where it accepts only one rank (fx tracing without example inputs records no shapes)."""
    known = rank(value)
    if known is None and isinstance(bn, (nn.BatchNorm2d, nn.BatchNorm3d)):
        return 4 if isinstance(bn, nn.BatchNorm2d) else 5
    return known


def unbatched(layer_path: str, value_rank: int | None) -> str:
    if value_rank is None:
        return (
            f"the graph records no shapes (no example inputs), so whether BatchNorm's dim 1 is the channel "
            f"dim of {layer_path} is unknown"
        )
    return f"{layer_path} runs on an unbatched input, so its channels are not BatchNorm's dim 1"


def _layer_channels(layer_path: str, layer: nn.Module, bn_rank: int | None, direction: str) -> str | int:
    """The channels of ``layer`` on the BatchNorm's side (its output folding backward, its input forward),
    or why BatchNorm's dim 1 (of a ``bn_rank``-D tensor) is not them: a Linear acts on the last dim, so
    only a 2-D BatchNorm input is its features; a conv's channels are dim 1 of a batched input."""
    backward = direction == "backward"
    if isinstance(layer, nn.Linear):
        if bn_rank != 2:
            ndim = "an unknown rank" if bn_rank is None else f"a {bn_rank}-D"
            acts = "acts on" if backward else "reads"
            return (
                f"BatchNorm normalizes dim 1 of {ndim} input while {layer_path} (Linear) {acts} the last dim"
            )
        return layer.out_features if backward else layer.in_features
    if bn_rank != layer.weight.ndim:
        return unbatched(layer_path, bn_rank)
    return layer.out_channels if backward else layer.in_channels


def _backward(
    bn: nn.Module, bn_call: ModuleCall, producer: fx.Node, channels: int | None, ctx: PassContext
) -> str | Fold | None:
    """Fold into the layer whose output the BN reads; None when no such layer is there at all."""
    view = ctx.view
    assert view is not None
    layer_path = layer_path_of(producer, ctx)
    layer = ctx.modules.get(layer_path)
    if not layer_path or not isinstance(layer, FOLDABLE_LAYERS):
        return None
    layer_call = layer_call_guard(layer_path, layer, ctx)
    if isinstance(layer_call, str):
        return layer_call
    if layer_call.outputs() != [producer]:
        return f"input is an intermediate value of {layer_path}, not its output"
    readers = [u for u in layer_call.consumers() if u not in bn_call.node_set]
    if readers:
        return f"{layer_path} output also feeds {view.describe(readers[0], ctx.modules)}"
    out_channels = _layer_channels(layer_path, layer, _bn_rank(producer, bn), "backward")
    if isinstance(out_channels, str):
        return out_channels
    if channels != out_channels:
        return f"BatchNorm has {channels} channels but {layer_path} produces {out_channels}"
    return computes_own_layer(layer_path, layer, layer_call, ctx, output=producer) or Fold(
        "backward", layer=layer_path
    )


def _forward(
    bn: nn.Module, bn_call: ModuleCall, bn_input: fx.Node, channels: int | None, ctx: PassContext
) -> str | Fold | None:
    """Fold into the layer that reads the BN's output; None when no such layer is there at all."""
    view = ctx.view
    assert view is not None
    if not is_identity(norm_act_tail(bn) or []):
        return None  # the layer after reads the activation's output, not the BN's
    consumers = bn_call.consumers()
    layers = [path for path in (layer_path_of(u, ctx) for u in consumers) if path]
    if not layers:
        return None
    layer_path = layers[0]
    layer = ctx.modules[layer_path]
    outputs = bn_call.outputs()
    others = [u for u in consumers if layer_path_of(u, ctx) != layer_path]
    if len(outputs) != 1 or others:
        what = view.describe(others[0], ctx.modules) if others else "more than one value"
        return f"BatchNorm output also feeds {what}, not only {layer_path}"
    if isinstance(layer, CONV_TRANSPOSES):
        return (
            f"next layer {layer_text(layer_path, layer)} spreads each input over overlapping, border-cropped "
            "outputs, so the BatchNorm's shift does not become a per-channel bias"
        )
    layer_call = layer_call_guard(layer_path, layer, ctx)
    if isinstance(layer_call, str):
        return layer_call
    if layer_call.inputs(view) != outputs:
        return f"{layer_path} reads more than the BatchNorm's output"
    in_channels = _layer_channels(layer_path, layer, _bn_rank(bn_input, bn), "forward")
    if isinstance(in_channels, str):
        return in_channels
    # a class with its own forward pads as its graph shows: computes_own_layer checks that
    pads = zero_padding(layer) if not isinstance(layer, nn.Linear) and computes_as_base(layer) else None
    if pads is not None:
        return (
            f"next layer {layer_text(layer_path, layer)} pads its input with zeros (padding={pads}): "
            "zero padding does not commute with the BatchNorm's shift"
        )
    if channels != in_channels:
        return f"BatchNorm has {channels} channels but {layer_path} reads {in_channels}"
    return computes_own_layer(layer_path, layer, layer_call, ctx, input=outputs[0]) or Fold(
        "forward", layer=layer_path
    )


def plan_module_site(site: NormSite, ctx: PassContext) -> str | Fold:
    bn = site.module
    assert bn is not None
    reason = _module_guard(site, bn)
    if reason is not None:
        return reason
    if ctx.view is None:
        return f"no graph captured, so the layer feeding the BatchNorm is unknown ({ctx.captured.reason})"
    calls = ctx.view.calls.get(site.path, [])
    if len(calls) != 1:
        return f"BatchNorm is called at {len(calls)} sites; folding needs exactly one"
    inputs = calls[0].inputs(ctx.view)
    if len(inputs) != 1:
        return "BatchNorm input could not be traced to a single producer"
    channels = site.normalized_shape[0] if site.normalized_shape else None
    backward = _backward(bn, calls[0], inputs[0], channels, ctx)
    if isinstance(backward, Fold):
        return backward
    forward = _forward(bn, calls[0], inputs[0], channels, ctx)
    if isinstance(forward, Fold):
        return forward
    if backward is None and forward is None:
        return Fold("affine")
    return "; ".join(r for r in (backward, forward) if r is not None)


def _batch_norm_args(node: fx.Node) -> dict[str, Any] | None:
    """The arguments of a batch-norm call, by name, whichever spelling the graph holds."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.name == "aten::batch_norm":
        return {name: arg(node, i, name) for i, name in enumerate(_ATEN_BN_ARGS)}
    if target is torch.batch_norm:
        return {name: arg(node, i, name) for i, name in enumerate(_ATEN_BN_ARGS)}
    if target is F.batch_norm:
        return {name: arg(node, i, name, _F_BN_DEFAULTS.get(name)) for i, name in enumerate(_F_BN_ARGS)}
    return None


def owner_name(owner: str) -> str:
    return owner or "the root module"


class _ChildrenAsLeaves(fx.Tracer):
    """Trace one module's own forward only: every submodule stays a call, so the GraphModule built from
    the graph holds the very submodules (with their classes and state), not a re-traced copy of them."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _owner_graph(owner: nn.Module) -> tuple[fx.Graph | None, str]:
    try:
        return _ChildrenAsLeaves().trace(owner), ""
    except Exception as exc:  # tracing fails in many ways; we only report it
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return None, f"{type(exc).__name__}: {first}"


def _find_owner_bn(graph: fx.Graph, running_mean: str) -> list[fx.Node]:
    found = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        args = _batch_norm_args(n)
        rm = args.get("running_mean") if args else None
        if isinstance(rm, fx.Node) and rm.op == "get_attr" and rm.target == running_mean:
            found.append(n)
    return found


def plan_functional(site: NormSite, ctx: PassContext) -> str | Fold:
    """The fold of an ``F.batch_norm`` call into the layer before it, inside the forward that makes the
    call. The owner is traced as it is now (an earlier site may have made it a GraphModule already):
    that trace is what the pass edits, so it is taken once, here."""
    if site.inside() != "inside a forward":  # a BatchNorm class whose forward does more than normalize
        name = (site.class_name or "").rsplit(".", 1)[-1]
        return f"{name}.forward does more than normalize (e.g. an activation); folding it would drop that"
    view = ctx.view
    if view is None:
        return f"no graph captured, so the conv feeding F.batch_norm is unknown ({ctx.captured.reason})"
    owner, _, node_name = site.path.rpartition("::")
    node = next((n for n in view.nodes if n.name == node_name), None)
    args = _batch_norm_args(node) if node is not None else None
    if node is None or args is None:
        return f"batch_norm call {node_name} is in a form this pass does not read"
    if args["training"] is not False:
        return (
            "F.batch_norm is called with training=True (or a value known only at run time): batch statistics"
        )
    names = {key: view.param_name(args[key]) for key in ("running_mean", "running_var", "weight", "bias")}
    if names["running_mean"] is None or names["running_var"] is None:
        return "F.batch_norm's running statistics are not buffers or parameters of the model"
    for key in ("weight", "bias"):
        if args[key] is not None and names[key] is None:
            return f"F.batch_norm's {key} is computed in the forward, not a parameter of the model"
    owner = "" if owner == "<root>" else owner
    prefix = owner + "." if owner else ""
    if not all(name is None or name.startswith(prefix) for name in names.values()):
        return f"F.batch_norm's tensors do not all belong to {owner}, whose forward calls it"
    if owner and len(view.calls.get(owner, [])) != 1:
        return (
            f"{owner}, whose forward calls F.batch_norm, is called at {len(view.calls.get(owner, []))} sites"
        )
    producer = args["input"]
    if not isinstance(producer, fx.Node):
        return "F.batch_norm input could not be traced to a producer"
    layer_path = layer_path_of(producer, ctx)
    layer = ctx.modules.get(layer_path)
    if not layer_path or not layer_path.startswith(prefix):
        inner = view.innermost_path(producer)
        module = ctx.modules.get(inner)
        what = layer_text(inner, module) if module is not None and inner else view.describe(producer)
        return f"input comes from {what}, not {LAYERS_TEXT} inside {owner_name(owner)}"
    assert layer is not None
    layer_call = layer_call_guard(layer_path, layer, ctx)
    if isinstance(layer_call, str):
        return layer_call
    if layer_call.outputs() != [producer] or layer_call.consumers() != [node]:
        return f"{layer_path} output also feeds something besides F.batch_norm"
    out_rank = rank(producer)
    if out_rank != layer.weight.ndim:  # Linear included: BN's dim 1 is its output dim only in 2-D
        if out_rank is None:
            return unbatched(layer_path, None)
        return f"F.batch_norm normalizes dim 1 of {layer_path}'s output, which is not its channel dim"
    reason = computes_own_layer(layer_path, layer, layer_call, ctx, output=producer)
    if reason is not None:
        return reason
    eps = args["eps"]
    if not isinstance(eps, (int, float)):
        return "F.batch_norm's eps is not a constant"
    rel = {key: name[len(prefix) :] if name else None for key, name in names.items()}
    graph, error = _owner_graph(ctx.model.get_submodule(owner))
    if graph is None:
        return f"removing F.batch_norm needs an fx trace of {owner_name(owner)}, which failed: {error}"
    found = _find_owner_bn(graph, rel["running_mean"] or "")
    if len(found) != 1:
        return (
            f"the fx trace of {owner_name(owner)} holds {len(found)} batch_norm calls on "
            f"{rel['running_mean']}"
        )
    traced_input = (_batch_norm_args(found[0]) or {}).get("input")
    if not (
        isinstance(traced_input, fx.Node)
        and traced_input.op == "call_module"
        and traced_input.target == layer_path[len(prefix) :]
        and list(traced_input.users) == [found[0]]
    ):
        return f"in the fx trace of {owner_name(owner)}, F.batch_norm does not read {layer_path} alone"
    call = FunctionalCall(graph, found[0], traced_input, names, float(eps))
    return Fold("functional", layer=layer_path, owner=owner, call=call)
