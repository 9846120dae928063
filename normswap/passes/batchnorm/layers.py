"""Whether a BatchNorm can fold into a Conv/ConvTranspose/Linear: what the captured graph shows the layer
computes (the fold-batchnorm pass, :mod:`normswap.passes.batchnorm.fold`, asks; this file answers).

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

"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from normswap.graph.analysis import GraphView, ModuleCall, normalize_module_path
from normswap.graph.ops import CAST_OPS, arg, op_name, real_users, strip_casts, tensor_meta
from normswap.modules.copying import weight_norm_hooks
from normswap.passes.core.base import PassContext

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# A BN that reads one of these folds back into it; a BN that one of these reads is a forward candidate.
FOLDABLE_LAYERS = (*CONVS, *CONV_TRANSPOSES, nn.Linear)
LAYERS_TEXT = "a Conv, ConvTranspose or Linear"
# Ops that read a tensor's shape, not its values.
_SHAPE_OPS = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "dim", "stride"})
# Padding modules by what they put at the border: copies of the input, or a constant.
_COPY_PAD_MODULES = (
    nn.modules.padding._ReflectionPadNd,
    nn.modules.padding._ReplicationPadNd,
    nn.modules.padding._CircularPadNd,
)


def class_name(module: nn.Module) -> str:
    return type(module).__name__


def layer_text(path: str, module: nn.Module) -> str:
    return f"{path} ({class_name(module)})"


def _base_class(layer: nn.Module) -> type[nn.Module]:
    return next(cls for cls in FOLDABLE_LAYERS if isinstance(layer, cls))


def computes_as_base(layer: nn.Module) -> bool:
    """True when ``layer``'s class computes what its torch.nn base computes: it overrides neither
    ``forward`` nor the conv's ``_conv_forward`` (where weight standardization can hide)."""
    base = _base_class(layer)
    return all(
        getattr(type(layer), name, None) is getattr(base, name, None) for name in ("forward", "_conv_forward")
    )


def _shared_weight(layer_path: str, layer: nn.Module, ctx: PassContext) -> str | None:
    """Name of another module's parameter that is the same tensor as the layer's weight or bias."""
    own = {id(p) for p in (layer.weight, layer.bias) if p is not None}
    for name, p in ctx.model.named_parameters(remove_duplicate=False):
        if id(p) in own and not name.startswith(layer_path + "."):
            return name
    return None


def layer_path_of(node: fx.Node, ctx: PassContext) -> str:
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
    named = layer_text(layer_path, layer)
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


def computes_own_layer(
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
    named = layer_text(layer_path, layer)
    inside = call.node_set
    weights = _param_nodes(view, f"{layer_path}.weight")
    readers = _readers(weights)
    elsewhere = [r for r in readers if r not in inside]
    if elsewhere:
        what = view.describe(elsewhere[0], ctx.modules)
        return f"{layer_path}'s weight is also read outside it, by {what}; folding would change that use too"
    if computes_as_base(layer):
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


def layer_call_guard(layer_path: str, layer: nn.Module, ctx: PassContext) -> str | ModuleCall:
    """The single call of ``layer`` that can be rewritten, or why not (what the call computes is
    :func:`computes_own_layer`'s question)."""
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


def zero_padding(conv: nn.Module) -> tuple[int, ...] | None:
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
