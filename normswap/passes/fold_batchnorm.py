"""Fold each eval-mode BatchNorm into a neighbouring Conv/ConvTranspose/Linear, or make it an affine (exact).

An eval BN is the per-channel affine ``y = s * x + t`` with ``s = gamma / sqrt(var + eps)`` and
``t = beta - mean * s`` (math in :mod:`normswap.passes.weights`). For each BN site, in this order:

1. **backward** into the Conv1d/2d/3d, ConvTranspose1d/2d/3d (grouped included) or Linear whose output
   it normalizes: ``W' = W * s`` per output channel, ``b' = b * s + t``; the BN becomes ``nn.Identity``
   (for timm's BatchNormAct2d / FrozenBatchNormAct2d: its ``drop`` and ``act``, so the forward keeps them);
2. **forward**, only when it cannot fold backward, into the Conv1d/2d/3d (grouped and depthwise
   included) or Linear that is the only reader of its output: ``W'[:, c] = W[:, c] * s_c``,
   ``b' = b + sum_{c,k} W[:, c, k] * t_c``; the BN becomes ``nn.Identity``;
3. when it has no conv/linear on either side: a :class:`~normswap.modules.affine.ChannelAffine`
   (``x * scale + shift``), which computes the same function without statistics or eps.

A BN that has a conv/linear beside it but cannot fold into it is skipped with the reason, never turned
into an affine: the reason is what the user needs to see (shared conv, other readers, zero padding...).

Legality, each refused with a reason:
- the BN is in eval mode and has running statistics (in training mode it uses batch statistics); its
  forward is BatchNorm's own or a known norm+act one (another subclass may do more than normalize);
- the BN, and the layer it folds into, are each called at exactly one site (folding changes every call),
  and the layer's weight is not shared with another module nor read outside the layer's own call;
- backward: the layer's output feeds nothing but the BN; for Linear, the BN's channel dim is the
  Linear's output dim (a 2-D input only: BatchNorm1d on (B, T, C) normalizes T, not C);
- forward: the BN's output feeds nothing but the layer; a Linear reads a 2-D input (channel dim = its
  in_features); a conv does no zero padding (a padded zero is not ``s * x + t``, so the shift does not
  commute with it; reflect/replicate/circular padding copies inputs and does commute); a ConvTranspose
  spreads a constant unevenly over its output (borders, strides), so nothing folds forward into one.

A layer is judged by what the captured graph shows it computes, not by its class. A subclass with its
own ``forward`` or ``_conv_forward`` (EfficientNet ports' ``Conv2dStaticSamePadding``, timm's
``Conv2dSame``, a Linear that casts its parameters) folds like the plain class, into its own ``weight``
and ``bias`` (the model keeps the user's class), when its call in the graph is **one** conv/linear op
of the layer's kind and groups that reads ``self.weight`` as stored (casts aside; nothing else reads
it) and ``self.bias`` as its bias. A layer without a bias gains one, so its forward must add
``self.bias`` once one exists; the graph cannot show that (its op reads None whether the code passes
``self.bias`` or ``None``), so it is measured: the forward with and without a bias, on a random input
of the recorded shape, must differ by exactly that bias. Then, by direction:

- backward: the layer computes ``z = op(P(x); W, b)``, where ``P`` is whatever its forward does to its
  input first (zero, constant, reflect, replicate or circular padding, a padding module, any op that
  reads neither ``W`` nor ``b``). Output channel ``c`` of a conv/linear depends on ``W_c`` and ``b_c``
  only, linearly, so for every value of ``P(x)``:
  ``s_c * op(P(x); W, b)_c + t_c = op(P(x); s W, s b + t)_c``.
  The fold never touches the input side, so every padding is legal backward: a padded zero or
  constant is multiplied by the rescaled weight exactly as it was by the old one. What must hold is the
  other side: the op's output is the layer's output (casts aside) and nothing in the forward reads it
  or acts on it before the BN (an activation, a hand-added bias: refused with what the graph shows);
- forward: the layer computes ``op(P(y); W, b)`` of the BN's output ``y = s x + t``, and the fold needs
  ``P(s x + t) = s P(x) + t`` per channel. That holds when every value ``P`` outputs is a copy of an input
  value of the same channel (reflect, replicate, circular padding along the spatial dims, casts) and
  fails for a padded constant ``v`` (it would have to be ``s v + t``), zeros included; a constant pad
  whose widths are 0 in the graph is refused too, since the graph holds widths computed for the
  example's size. Nothing else in the forward may read ``y``.

A computed weight (weight standardization, ``w = (w - w.mean()) / w.std()``, timm's StdConv2d), the weight
read twice, or any op the graph shows outside this shape is refused with what it shows.

A functional ``F.batch_norm`` call cannot be removed from someone's forward by editing modules. Its
owner module (the one whose forward makes the call) is replaced by a ``torch.fx.GraphModule`` of its
own forward with the call removed and the BN folded into the conv feeding it; the Change says so. (A
call in the root module's forward makes the whole model that GraphModule.) The
alternative, keeping the call and turning its statistics into an identity (mean 0, var 1 - eps,
gamma 1, beta 0), is not sound: it needs ``fl(fl(1 - eps) + eps) == 1`` and ``rsqrt(1) == 1`` in
whatever dtype and kernel later run it. The model's var rounds to exactly 1 once it passes through
bf16/fp16 (a half-precision checkpoint loaded back into fp32), after which var + eps > 1 and the
"identity" scales every activation; approximate GPU rsqrt promises nothing about 1; and the call stays in
the forward, the very cost folding exists to remove. Removing the node is exact by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils import parametrize

from normswap.discover import NormSite
from normswap.graph.analysis import GraphView, ModuleCall, normalize_module_path
from normswap.graph.ops import CAST_OPS, arg, op_name, rank, real_users, strip_casts, tensor_meta
from normswap.modules.affine import ChannelAffine
from normswap.modules.copying import weight_norm_hooks
from normswap.passes.base import Change, Pass, PassContext, PassReport, RewriteKind, replace_submodule
from normswap.passes.norm_act import is_identity, norm_act_tail, with_tail
from normswap.passes.weights import (
    bn_scale_shift,
    fold_bn_into_conv_transpose_weights,
    fold_bn_into_conv_weights,
    fold_bn_into_next_layer_weights,
)

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# A BN that reads one of these folds back into it; a BN that one of these reads is a forward candidate.
FOLDABLE_LAYERS = (*CONVS, *CONV_TRANSPOSES, nn.Linear)
_LAYERS_TEXT = "a Conv, ConvTranspose or Linear"
# BatchNorm forwards that compute nothing but the normalization in eval mode.
_PLAIN_BN_FORWARDS = (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward)
# timm's norm+act classes: normalize, then run ``self.drop`` and ``self.act`` (in that order).
# Argument order of the two spellings of batch norm found in graphs (fx keeps F.batch_norm calls).
_ATEN_BN_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
_F_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_F_BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
# Ops that read a tensor's shape, not its values.
_SHAPE_OPS = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "dim", "stride"})
# Padding modules by what they put at the border: copies of the input, or a constant.
_COPY_PAD_MODULES = (
    nn.modules.padding._ReflectionPadNd,
    nn.modules.padding._ReplicationPadNd,
    nn.modules.padding._CircularPadNd,
)


def _class(module: nn.Module) -> str:
    return type(module).__name__


def _named(path: str, module: nn.Module) -> str:
    return f"{path} ({_class(module)})"


def _base_class(layer: nn.Module) -> type[nn.Module]:
    return next(cls for cls in FOLDABLE_LAYERS if isinstance(layer, cls))


def _computes_as_base(layer: nn.Module) -> bool:
    """True when ``layer``'s class computes what its torch.nn base computes: it overrides neither
    ``forward`` nor the conv's ``_conv_forward`` (where weight standardization can hide)."""
    base = _base_class(layer)
    return all(
        getattr(type(layer), name, None) is getattr(base, name, None) for name in ("forward", "_conv_forward")
    )


@dataclass(frozen=True)
class _Plan:
    """What to do at one site. ``check`` and ``rewrite`` each derive it from the graph, so the pass
    keeps no state between them."""

    how: str  # "backward" | "forward" | "affine" | "functional"
    layer: str = ""  # the conv/linear folded into
    owner: str = ""  # functional: the module whose forward calls F.batch_norm
    bn_args: dict[str, Any] = field(default_factory=dict)  # functional: parameter names and eps


def _module_guard(site: NormSite, bn: nn.Module) -> str | None:
    """Reasons that hold whatever the BN's neighbours are."""
    if isinstance(bn, nn.modules.batchnorm._BatchNorm):
        if type(bn).forward not in _PLAIN_BN_FORWARDS and norm_act_tail(bn) is None:
            return f"{_class(bn)}.forward does more than normalize (e.g. an activation); folding it would drop that"
        if bn.training:
            return (
                "BatchNorm is in training mode: it normalizes with batch statistics; call model.eval() first"
            )
        if not bn.track_running_stats or bn.running_mean is None:
            return "BatchNorm has track_running_stats=False: no statistics to fold"
    elif norm_act_tail(bn) is None and list(bn.children()):
        names = ", ".join(name for name, _ in bn.named_children())
        return f"{_class(bn)} has submodules ({names}) besides its statistics; folding it would drop them"
    stats = [getattr(bn, name, None) for name in ("running_mean", "running_var", "weight", "bias")]
    if not all(t is None or (isinstance(t, torch.Tensor) and t.ndim == 1) for t in stats[2:]) or not all(
        isinstance(t, torch.Tensor) and t.ndim == 1 for t in stats[:2]
    ):
        # e.g. a hand-written BN keeping (1, C, 1, 1) statistics, or naming them otherwise
        return (
            f"{_class(bn)} does not keep its statistics and affine as per-channel vectors named "
            "running_mean, running_var, weight, bias"
        )
    var = bn.running_var.detach().double() + _eps(site, bn)
    if not bool(torch.isfinite(var).all() and (var > 0).all()) or not bool(
        torch.isfinite(bn.running_mean).all()
    ):
        return "BatchNorm statistics are not finite with running_var + eps > 0: it is no affine map to fold"
    return None


def _eps(site: NormSite, bn: nn.Module) -> float:
    return float(site.eps if site.eps is not None else bn.eps)


def _scale_shift(site: NormSite, bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return bn_scale_shift(
        bn.running_mean,
        bn.running_var,
        _eps(site, bn),
        getattr(bn, "weight", None),
        getattr(bn, "bias", None),
    )


def _bn_rank(value: fx.Node, bn: nn.Module) -> int | None:
    """Rank of the tensor a BN normalizes: recorded in the graph (export), else implied by the BN's
    class where it accepts only one rank (fx tracing without example inputs records no shapes)."""
    known = rank(value)
    if known is None and isinstance(bn, (nn.BatchNorm2d, nn.BatchNorm3d)):
        return 4 if isinstance(bn, nn.BatchNorm2d) else 5
    return known


def _unbatched(layer_path: str, value_rank: int | None) -> str:
    if value_rank is None:
        return (
            f"the graph records no shapes (no example inputs), so whether BatchNorm's dim 1 is the channel "
            f"dim of {layer_path} is unknown"
        )
    return f"{layer_path} runs on an unbatched input, so its channels are not BatchNorm's dim 1"


def _shared_weight(layer_path: str, layer: nn.Module, ctx: PassContext) -> str | None:
    """Name of another module's parameter that is the same tensor as the layer's weight or bias."""
    own = {id(p) for p in (layer.weight, layer.bias) if p is not None}
    for name, p in ctx.model.named_parameters(remove_duplicate=False):
        if id(p) in own and not name.startswith(layer_path + "."):
            return name
    return None


def _layer_path(node: fx.Node, ctx: PassContext) -> str:
    """The innermost Conv/ConvTranspose/Linear whose call ran ``node`` ("" for none): a padding module
    that a conv subclass calls in its forward ran the node, but the node is part of that conv's output."""
    view = ctx.view
    assert view is not None
    stack = [normalize_module_path(entry[0]) for entry in (node.meta.get("nn_module_stack") or {}).values()]
    for path in [view.innermost_path(node), *reversed(stack)]:
        if path and isinstance(ctx.modules.get(path), FOLDABLE_LAYERS):
            return path
    return ""


def _kind(layer: nn.Module) -> str:
    if isinstance(layer, CONVS):
        return "Conv"
    return "ConvTranspose" if isinstance(layer, CONV_TRANSPOSES) else "Linear"


def _op_kind(node: fx.Node) -> str | None:
    """Which layer's computation an op is ("Conv", "ConvTranspose", "Linear"), None for any other op."""
    name = op_name(node) or ""
    if name in ("conv1d", "conv2d", "conv3d"):
        return "Conv"
    if name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"):
        return "ConvTranspose"
    if name in ("convolution", "_convolution"):
        return "ConvTranspose" if arg(node, 6, "transposed", False) else "Conv"
    return "Linear" if name == "linear" else None


def _op_groups(node: fx.Node) -> int:
    if _op_kind(node) == "Linear":
        return 1
    return int(
        arg(node, 8, "groups", 1)
        if op_name(node) in ("convolution", "_convolution")
        else arg(node, 6, "groups", 1)
    )


def _name(node: fx.Node) -> str:
    return op_name(node) or str(node.target)


def _names(nodes: list[fx.Node]) -> str:
    return ", ".join(_name(n) for n in nodes)


def _param_nodes(view: GraphView, name: str) -> list[fx.Node]:
    return [n for n in view.nodes if view.param_name(n) == name]


def _value_readers(node: fx.Node) -> list[fx.Node]:
    """Nodes that read ``node``'s values (checks and shape queries excluded)."""
    return [u for u in real_users(node) if op_name(u) not in _SHAPE_OPS]


def _readers(nodes: list[fx.Node]) -> list[fx.Node]:
    """What reads these values, looking through casts."""
    found: list[fx.Node] = []
    todo = list(nodes)
    while todo:
        for u in _value_readers(todo.pop(0)):
            if op_name(u) in CAST_OPS:
                todo.append(u)
            elif u not in found:
                found.append(u)
    return found


def _between(sources: list[fx.Node], target: fx.Node, call: ModuleCall) -> list[fx.Node]:
    """Nodes of ``call`` on a path from ``sources`` to ``target`` (both excluded), in graph order."""
    inside = call.node_set
    down: set[fx.Node] = set()
    todo = list(sources)
    while todo:
        for u in todo.pop().users:
            if u in inside and u not in down:
                down.add(u)
                todo.append(u)
    up: set[fx.Node] = set()
    todo = [target]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in inside and a not in up:
                up.add(a)
                todo.append(a)
    return [n for n in call.nodes if n in down and n in up and n is not target and n not in sources]


def _padding(node: fx.Node, ctx: PassContext) -> tuple[str, float, tuple[int, ...]] | None:
    """``(mode, value, widths)`` of a padding op or padding module call: "copy" where every value it
    outputs is a copy of an input value (reflect, replicate, circular), "constant" where it adds
    ``value`` at the border; None for any other node.

    A constant pad of width 0 stays "constant": the graph holds the widths computed for the example's
    size, and a forward computing them (TensorFlow "same" padding) pads other sizes."""
    name = op_name(node) or ""
    if node.op == "call_module":
        module = ctx.modules.get(str(node.target))
        if not isinstance(module, (nn.modules.padding._ConstantPadNd, *_COPY_PAD_MODULES)):
            return None
        widths = tuple(module.padding)
        constant = isinstance(module, nn.modules.padding._ConstantPadNd)
        value = float(module.value) if constant else 0.0
    elif name in ("pad", "constant_pad_nd"):
        widths = tuple(arg(node, 1, "pad", ()))
        constant = name == "constant_pad_nd" or (arg(node, 2, "mode", "constant") or "constant") == "constant"
        value = float(arg(node, 2 if name == "constant_pad_nd" else 3, "value", None) or 0.0)
    elif name.startswith(("reflection_pad", "replication_pad")) or name in ("_pad_circular", "pad_circular"):
        widths, constant, value = tuple(arg(node, 1, "padding", ())), False, 0.0
    else:
        return None
    return ("constant" if constant else "copy"), value, widths


def _conv_zero_padding(op: fx.Node, weight: torch.Tensor) -> tuple[int, ...] | None:
    """The zero padding a conv op applies itself (its ``padding`` argument), None for none."""
    padding = arg(op, 4, "padding", 0)
    if padding == "valid":
        return None
    if padding == "same":
        dilation = arg(op, 5, "dilation", 1)
        dilation = [dilation] * (weight.ndim - 2) if isinstance(dilation, int) else list(dilation)
        pads = tuple(d * (k - 1) for d, k in zip(dilation, weight.shape[2:], strict=True))
    else:
        pads = (padding,) if isinstance(padding, int) else tuple(padding)
    return pads if any(pads) else None


def _adds_new_bias(layer_path: str, layer: nn.Module, call: ModuleCall, ctx: PassContext) -> str | None:
    """None when ``layer``'s forward, once it has a bias, adds it once per output channel; else why not.

    The graph of a layer without a bias cannot show this (its op reads None either way, written
    ``self.bias`` or ``None``), so it is measured: the forward on a random input of the recorded
    shape, with and without a bias, must differ by exactly that bias."""
    assert ctx.view is not None
    named = _named(layer_path, layer)
    inputs = call.inputs(ctx.view)
    meta = tensor_meta(inputs[0]) if len(inputs) == 1 else None
    weight = layer.weight
    if meta is None or not meta[1].is_floating_point or weight.is_meta:
        return (
            f"{named} has no bias, and the graph records no input shape to check that its forward would "
            "add one (give example inputs so that torch.export records it)"
        )
    channels = layer.out_channels if hasattr(layer, "out_channels") else layer.out_features
    x = torch.randn(meta[0], generator=torch.Generator().manual_seed(0)).to(weight.device, meta[1])
    bias = torch.linspace(1.0, 2.0, channels, dtype=weight.dtype, device=weight.device)
    try:
        with torch.no_grad():
            plain = layer(x)
            biased = torch.func.functional_call(layer, {"bias": bias}, (x,))
    except Exception as exc:  # a forward can fail in many ways; the user needs the reason only
        return (
            f"{named} has no bias, and running its forward with one, to check that it would add it, failed "
            f"({type(exc).__name__})"
        )
    shape = [1] * plain.ndim
    shape[-1 if isinstance(layer, nn.Linear) else 1] = -1
    tol = 64 * torch.finfo(plain.dtype).eps * (float(plain.abs().max()) + 2.0)
    if biased.shape != plain.shape or float((biased - plain - bias.reshape(shape)).abs().max()) > tol:
        return (
            f"{named} has no bias, and its forward does not add self.bias once one is set: the BatchNorm's "
            "shift would have nowhere to go"
        )
    return None


def _computes_own_layer(
    layer_path: str,
    layer: nn.Module,
    call: ModuleCall,
    ctx: PassContext,
    *,
    output: fx.Node | None = None,
    input: fx.Node | None = None,
) -> str | None:
    """Why the graph does not show ``layer``'s call as what the fold assumes, or None.

    The fold assumes one conv/linear op of the layer's own weight and bias. Every layer: its weight is
    read nowhere else. A class with its own forward: the graph must show that op reading
    ``self.weight`` as stored (casts aside) and nothing else reading it, ``self.bias`` as the op's bias
    (or, without a bias, the forward adding one once it exists), and then, folding backward, the op's
    output as ``output`` (the value the BatchNorm reads) with nothing after it; folding forward, the
    op reading ``input`` (the BatchNorm's output) through casts and copying pads only."""
    view = ctx.view
    assert view is not None
    named = _named(layer_path, layer)
    inside = call.node_set
    weights = _param_nodes(view, f"{layer_path}.weight")
    readers = _readers(weights)
    elsewhere = [r for r in readers if r not in inside]
    if elsewhere:
        what = view.describe(elsewhere[0], ctx.modules)
        return f"{layer_path}'s weight is also read outside it, by {what}; folding would change that use too"
    if _computes_as_base(layer):
        return None  # torch's own forward: the op of its weight and bias, padding as its attributes say
    ops = [r for r in readers if _op_kind(r) and strip_casts(arg(r, 1, "weight")) in weights]
    if not ops:
        op = next((n for n in call.nodes if _op_kind(n)), None)
        computed = _between(weights, op, call) if op is not None else []
        if op is None or not computed:
            return (
                f"{named} uses self.weight in its forward through {_names(readers) or 'nothing'}, not as the "
                "weight of a convolution or linear op, so there is nothing the fold could rewrite"
            )
        return (
            f"{named} computes the weight of its {_name(op)} in its forward ({_names(computed)}; e.g. weight "
            "standardization): a fold written into self.weight would pass through that computation, so it "
            "would not be exact"
        )
    if len(readers) > 1:
        return (
            f"{named} reads self.weight {len(readers)} times in its forward ({_names(readers)}); folding "
            "would rescale every use, not only the one the BatchNorm reads"
        )
    op = ops[0]
    name = _name(op)
    if _op_kind(op) != _kind(layer):
        return f"{named} computes a {name} in its forward, not a {_kind(layer)}"
    if _op_groups(op) != getattr(layer, "groups", 1):
        return (
            f"{named} runs its {name} with groups={_op_groups(op)} in its forward, not its own "
            f"groups={layer.groups}, so the fold would pair weights and channels wrongly"
        )
    bias = strip_casts(arg(op, 2, "bias"))
    if layer.bias is not None:
        biases = _param_nodes(view, f"{layer_path}.bias")
        if bias not in biases:
            return (
                f"{named} does not pass self.bias to its {name} (it adds it by hand, or not at all): the "
                "fold writes the BatchNorm's shift into self.bias and cannot tell how it would be applied"
            )
        if _readers(biases) != [op]:
            return f"{named} reads self.bias more than once in its forward; folding would change every use"
    elif bias is not None:
        return (
            f"{named} has no bias, and its {name} adds {view.describe(bias, ctx.modules)} instead: the "
            "BatchNorm's shift would have nowhere to go"
        )
    else:
        reason = _adds_new_bias(layer_path, layer, call, ctx)
        if reason is not None:
            return reason
    if output is not None:
        return _nothing_after(named, op, output, call)
    if input is not None:
        return _copies_only_before(named, layer, op, input, call, ctx)
    return None


def _nothing_after(named: str, op: fx.Node, output: fx.Node, call: ModuleCall) -> str | None:
    """Folding backward: the op's output reaches ``output`` through casts alone, read by nothing else."""
    inside = call.node_set
    node = op
    while node is not output:
        inner = [u for u in _value_readers(node) if u in inside]
        if len(inner) != 1 or op_name(inner[0]) not in CAST_OPS:
            break
        node = inner[0]
    if node is not output:
        after = [n for n in [*_between([op], output, call), output] if op_name(n) not in CAST_OPS]
        return (
            f"{named} applies {_names(after) or 'more'} to the output of its {_name(op)} in its forward; the "
            f"BatchNorm reads that, not the {_name(op)}'s output"
        )
    also = [u for u in _value_readers(output) if u in inside]
    if also:
        return f"{named} also reads the output of its {_name(op)} in its forward ({_names(also)})"
    return None


def _copies_only_before(
    named: str, layer: nn.Module, op: fx.Node, input: fx.Node, call: ModuleCall, ctx: PassContext
) -> str | None:
    """Folding forward: the op reads ``input`` through casts and padding that copies the input (each
    padded value then is ``s * x + t`` too), along the spatial dims, and nothing else reads it."""
    inside = call.node_set
    spatial = layer.weight.ndim - 2 if isinstance(layer, CONVS) else 0  # dims F.pad may pad
    chain = [op]
    node = arg(op, 0, "input")
    while node is not input:
        if not isinstance(node, fx.Node) or node not in inside:
            break
        padding = _padding(node, ctx)
        if padding is None and op_name(node) not in CAST_OPS:
            break
        if padding is not None:
            mode, value, widths = padding
            if mode == "constant":
                what, kind = ("zeros", "zero") if value == 0 else (f"the constant {value:g}", "constant")
                return (
                    f"next layer {named} pads its input with {what} in its forward ({_name(node)}): {kind} "
                    "padding does not commute with the BatchNorm's shift"
                )
            if len(widths) > 2 * spatial:  # it pads the channel dim too: channels move
                return f"next layer {named} pads the channel dim of its input in its forward ({_name(node)})"
        chain.append(node)
        node = node.args[0] if node.args else None
    if node is not input:
        before = [n for n in _between([input], op, call) if n not in chain]
        return (
            f"next layer {named} computes {_names(before) or 'more'} on its input before its {_name(op)} in "
            "its forward; the BatchNorm's affine does not pass through that"
        )
    for value, reader in zip([input, *reversed(chain[1:])], reversed(chain), strict=True):
        if [u for u in _value_readers(value) if u in inside] != [reader]:
            return f"next layer {named} reads the BatchNorm's output more than once in its forward"
    pads = _conv_zero_padding(op, layer.weight) if _op_kind(op) == "Conv" else None
    if pads is not None:
        return (
            f"next layer {named} pads its input with zeros (padding={pads}): zero padding does not commute "
            "with the BatchNorm's shift"
        )
    return None


def _layer_call_guard(layer_path: str, layer: nn.Module, ctx: PassContext) -> str | ModuleCall:
    """The single call of ``layer`` that can be rewritten, or why not (what the call computes is
    :func:`_computes_own_layer`'s question)."""
    assert ctx.view is not None
    if parametrize.is_parametrized(layer) or weight_norm_hooks(layer):
        # writing into a computed weight changes a temporary, not the parameters it is computed from
        return f"{layer_path}'s weight is computed by a parametrization (e.g. weight norm); remove it first"
    layer_calls = ctx.view.calls.get(layer_path, [])
    if len(layer_calls) != 1:
        return f"{layer_path} is called at {len(layer_calls)} sites; folding would change the others"
    shared = _shared_weight(layer_path, layer, ctx)
    if shared is not None:
        return f"{layer_path} shares its weights with {shared}; folding would change that module too"
    return layer_calls[0]


def _backward(
    bn: nn.Module, bn_call: ModuleCall, producer: fx.Node, channels: int | None, ctx: PassContext
) -> str | _Plan | None:
    """Fold into the layer whose output the BN reads; None when no such layer is there at all."""
    view = ctx.view
    assert view is not None
    layer_path = _layer_path(producer, ctx)
    layer = ctx.modules.get(layer_path)
    if not layer_path or not isinstance(layer, FOLDABLE_LAYERS):
        return None
    layer_call = _layer_call_guard(layer_path, layer, ctx)
    if isinstance(layer_call, str):
        return layer_call
    if layer_call.outputs() != [producer]:
        return f"input is an intermediate value of {layer_path}, not its output"
    readers = [u for u in layer_call.consumers() if u not in bn_call.node_set]
    if readers:
        return f"{layer_path} output also feeds {view.describe(readers[0], ctx.modules)}"
    out_rank = _bn_rank(producer, bn)
    if isinstance(layer, nn.Linear):
        if out_rank != 2:
            ndim = "an unknown rank" if out_rank is None else f"a {out_rank}-D"
            return (
                f"BatchNorm normalizes dim 1 of {ndim} input while {layer_path} (Linear) acts on the last dim"
            )
        out_channels = layer.out_features
    else:
        if out_rank != layer.weight.ndim:
            return _unbatched(layer_path, out_rank)
        out_channels = layer.out_channels
    if channels != out_channels:
        return f"BatchNorm has {channels} channels but {layer_path} produces {out_channels}"
    return _computes_own_layer(layer_path, layer, layer_call, ctx, output=producer) or _Plan(
        "backward", layer=layer_path
    )


def _zero_padding(conv: nn.Module) -> tuple[int, ...] | None:
    """The zero padding a conv applies to its input, or None when it pads nothing with zeros."""
    if conv.padding_mode != "zeros":
        return None  # reflect/replicate/circular pad with copies of the input, which commute with s*x+t
    if conv.padding == "valid":
        return None
    if conv.padding == "same":
        pads = tuple(d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size, strict=True))
    else:
        pads = tuple(conv.padding)
    return pads if any(pads) else None


def _forward(
    bn: nn.Module, bn_call: ModuleCall, bn_input: fx.Node, channels: int | None, ctx: PassContext
) -> str | _Plan | None:
    """Fold into the layer that reads the BN's output; None when no such layer is there at all."""
    view = ctx.view
    assert view is not None
    if not is_identity(norm_act_tail(bn) or []):
        return None  # the layer after reads the activation's output, not the BN's
    consumers = bn_call.consumers()
    layers = [path for path in (_layer_path(u, ctx) for u in consumers) if path]
    if not layers:
        return None
    layer_path = layers[0]
    layer = ctx.modules[layer_path]
    outputs = bn_call.outputs()
    others = [u for u in consumers if _layer_path(u, ctx) != layer_path]
    if len(outputs) != 1 or others:
        what = view.describe(others[0], ctx.modules) if others else "more than one value"
        return f"BatchNorm output also feeds {what}, not only {layer_path}"
    if isinstance(layer, CONV_TRANSPOSES):
        return (
            f"next layer {_named(layer_path, layer)} spreads each input over overlapping, border-cropped "
            "outputs, so the BatchNorm's shift does not become a per-channel bias"
        )
    layer_call = _layer_call_guard(layer_path, layer, ctx)
    if isinstance(layer_call, str):
        return layer_call
    if layer_call.inputs(view) != outputs:
        return f"{layer_path} reads more than the BatchNorm's output"
    in_rank = _bn_rank(bn_input, bn)
    if isinstance(layer, nn.Linear):
        if in_rank != 2:
            ndim = "an unknown rank" if in_rank is None else f"a {in_rank}-D"
            return (
                f"BatchNorm normalizes dim 1 of {ndim} input while {layer_path} (Linear) reads the last dim"
            )
        in_channels = layer.in_features
    else:
        if in_rank != layer.weight.ndim:
            return _unbatched(layer_path, in_rank)
        # a class with its own forward pads as its graph shows: _computes_own_layer checks that
        pads = _zero_padding(layer) if _computes_as_base(layer) else None
        if pads is not None:
            return (
                f"next layer {_named(layer_path, layer)} pads its input with zeros (padding={pads}): "
                "zero padding does not commute with the BatchNorm's shift"
            )
        in_channels = layer.in_channels
    if channels != in_channels:
        return f"BatchNorm has {channels} channels but {layer_path} reads {in_channels}"
    return _computes_own_layer(layer_path, layer, layer_call, ctx, input=outputs[0]) or _Plan(
        "forward", layer=layer_path
    )


def _plan_module_site(site: NormSite, ctx: PassContext) -> str | _Plan:
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
    if isinstance(backward, _Plan):
        return backward
    forward = _forward(bn, calls[0], inputs[0], channels, ctx)
    if isinstance(forward, _Plan):
        return forward
    if backward is None and forward is None:
        return _Plan("affine")
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


def _owner_name(owner: str) -> str:
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


def _plan_functional(site: NormSite, ctx: PassContext) -> str | _Plan:
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
    layer_path = _layer_path(producer, ctx)
    layer = ctx.modules.get(layer_path)
    if not layer_path or not layer_path.startswith(prefix):
        inner = view.innermost_path(producer)
        module = ctx.modules.get(inner)
        what = _named(inner, module) if module is not None and inner else view.describe(producer)
        return f"input comes from {what}, not {_LAYERS_TEXT} inside {_owner_name(owner)}"
    assert layer is not None
    layer_call = _layer_call_guard(layer_path, layer, ctx)
    if isinstance(layer_call, str):
        return layer_call
    if layer_call.outputs() != [producer] or layer_call.consumers() != [node]:
        return f"{layer_path} output also feeds something besides F.batch_norm"
    out_rank = rank(producer)
    if out_rank != layer.weight.ndim:  # Linear included: BN's dim 1 is its output dim only in 2-D
        if out_rank is None:
            return _unbatched(layer_path, None)
        return f"F.batch_norm normalizes dim 1 of {layer_path}'s output, which is not its channel dim"
    reason = _computes_own_layer(layer_path, layer, layer_call, ctx, output=producer)
    if reason is not None:
        return reason
    eps = args["eps"]
    if not isinstance(eps, (int, float)):
        return "F.batch_norm's eps is not a constant"
    rel = {key: name[len(prefix) :] if name else None for key, name in names.items()}
    graph, error = _owner_graph(ctx.modules[owner])
    if graph is None:
        return f"removing F.batch_norm needs an fx trace of {_owner_name(owner)}, which failed: {error}"
    found = _find_owner_bn(graph, rel["running_mean"] or "")
    if len(found) != 1:
        return (
            f"the fx trace of {_owner_name(owner)} holds {len(found)} batch_norm calls on "
            f"{rel['running_mean']}"
        )
    traced_input = (_batch_norm_args(found[0]) or {}).get("input")
    if not (
        isinstance(traced_input, fx.Node)
        and traced_input.op == "call_module"
        and traced_input.target == layer_path[len(prefix) :]
        and list(traced_input.users) == [found[0]]
    ):
        return f"in the fx trace of {_owner_name(owner)}, F.batch_norm does not read {layer_path} alone"
    return _Plan("functional", layer=layer_path, owner=owner, bn_args={**names, "eps": float(eps)})


def _set_weights(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Write the folded weights; True when the layer had no bias and gains one."""
    with torch.no_grad():
        layer.weight.copy_(weight)
        if layer.bias is None:
            layer.bias = nn.Parameter(bias.to(layer.weight.device), requires_grad=layer.weight.requires_grad)
            return True
        layer.bias.copy_(bias)
    return False


def _fold_backward(layer: nn.Module, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    if isinstance(layer, CONV_TRANSPOSES):
        weight, bias = fold_bn_into_conv_transpose_weights(
            layer.weight, layer.bias, scale, shift, groups=layer.groups
        )
    else:
        weight, bias = fold_bn_into_conv_weights(layer.weight, layer.bias, scale, shift, out_channel_dim=0)
    return _set_weights(layer, weight, bias)


class FoldBatchNorm(Pass):
    name = "fold_batchnorm"
    kind = RewriteKind.EXACT

    def candidates(self, ctx: PassContext) -> list[NormSite]:
        return [s for s in ctx.inventory if s.kind == "batch"]

    def check(self, site: NormSite, ctx: PassContext) -> str | None:
        plan = self._plan(site, ctx)
        return plan if isinstance(plan, str) else None

    def rewrite(self, site: NormSite, ctx: PassContext) -> Change:
        plan = self._plan(site, ctx)
        assert isinstance(plan, _Plan), plan
        if plan.how == "functional":
            return self._rewrite_functional(site, plan, ctx)
        bn = site.module
        assert bn is not None
        tail = norm_act_tail(bn) or []
        scale, shift = _scale_shift(site, bn)
        if plan.how == "affine":
            dtype = bn.weight.dtype if getattr(bn, "weight", None) is not None else bn.running_mean.dtype
            affine = ChannelAffine.from_scale_shift(scale, shift, dtype, bn.running_mean.device)
            replace_submodule(ctx.model, site.path, with_tail(tail, affine))
            kept = f", then its {' and '.join(n for n, _ in tail)}" if not is_identity(tail) else ""
            return Change(
                self.name,
                site.path,
                self.kind,
                f"no conv or linear on either side to fold into: replaced by a per-channel affine "
                f"(ChannelAffine, x * scale + shift){kept}",
                {"into": None, "replacement": "ChannelAffine"},
            )
        layer = ctx.modules[plan.layer]
        if plan.how == "backward":
            bias_added = _fold_backward(layer, scale, shift)
            description = f"folded into {_named(plan.layer, layer)}"
            if not is_identity(tail):
                description += (
                    f"; kept its {' and '.join(n for n, m in tail if not isinstance(m, nn.Identity))}"
                )
        else:
            groups = getattr(layer, "groups", 1)
            weight, bias = fold_bn_into_next_layer_weights(layer.weight, layer.bias, scale, shift, groups)
            bias_added = _set_weights(layer, weight, bias)
            description = f"folded forward into the next layer {_named(plan.layer, layer)}"
        replace_submodule(ctx.model, site.path, with_tail(tail))
        return Change(
            self.name,
            site.path,
            self.kind,
            description,
            {
                "into": plan.layer,
                "layer_class": _class(layer),
                "bias_added": bias_added,
                "direction": plan.how,
            },
        )

    def _plan(self, site: NormSite, ctx: PassContext) -> str | _Plan:
        if site.source == "functional":
            return _plan_functional(site, ctx)
        if not site.is_module:
            return (
                f"{site.source} batch_norm written out inside a forward: neither a module nor a single call"
            )
        return _plan_module_site(site, ctx)

    def _rewrite_functional(self, site: NormSite, plan: _Plan, ctx: PassContext) -> Change:
        names = plan.bn_args

        def tensor(key: str) -> torch.Tensor | None:
            name = names[key]
            if name is None:
                return None
            try:
                return ctx.model.get_parameter(name)
            except AttributeError:
                return ctx.model.get_buffer(name)

        rm, rv = tensor("running_mean"), tensor("running_var")
        assert rm is not None and rv is not None
        scale, shift = bn_scale_shift(rm, rv, names["eps"], tensor("weight"), tensor("bias"))
        layer = ctx.modules[plan.layer]
        bias_added = _fold_backward(layer, scale, shift)
        # Trace the owner as it is now: an earlier site may already have made it a GraphModule.
        owner = ctx.model.get_submodule(plan.owner)
        graph, _ = _owner_graph(owner)
        assert graph is not None
        prefix = plan.owner + "." if plan.owner else ""
        (bn_node,) = _find_owner_bn(graph, names["running_mean"][len(prefix) :])
        read = bn_node.all_input_nodes
        bn_node.replace_all_uses_with((_batch_norm_args(bn_node) or {})["input"])
        graph.erase_node(bn_node)
        for n in read:
            if n.op == "get_attr" and not n.users:
                graph.erase_node(n)
        # Built after the edit, the GraphModule copies only what its graph still reads: the BN's
        # statistics and affine leave the state_dict.
        module = fx.GraphModule(owner, graph, class_name=type(owner).__name__)
        # its own flag only: its submodules are the owner's, each in the mode it was in
        module.training = owner.training
        if plan.owner:
            ctx.model.set_submodule(plan.owner, module)
        else:
            # the call is in the model's own forward: the returned model is this GraphModule
            ctx.replace_model(module)
        removed = [n for n in names.values() if isinstance(n, str)]
        return Change(
            self.name,
            site.path,
            self.kind,
            f"folded into {_named(plan.layer, layer)}; {_owner_name(plan.owner)} is now a torch.fx "
            "GraphModule of its forward without the F.batch_norm call (a module edit cannot remove a call "
            "from a forward)",
            {
                "into": plan.layer,
                "layer_class": _class(layer),
                "bias_added": bias_added,
                "direction": "backward",
                "graph_module": plan.owner,
                "removed_state": removed,
            },
        )


def fold_batchnorm(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict | None = None,
    *,
    inplace: bool = False,
) -> tuple[nn.Module, PassReport]:
    """Functional form of :class:`FoldBatchNorm`."""
    return FoldBatchNorm()(model, example_args, example_kwargs, inplace=inplace)
