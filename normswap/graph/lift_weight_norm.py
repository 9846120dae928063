"""Weight-normed layers of a flat program put back as torch's own layers with their weight norm.

A model with weight norm, exported with ``torch.export``, computes each such layer's weight as an op:
``aten._weight_norm(v, g, dim)`` feeding ``aten.conv1d``/``conv2d``/``conv3d``/``linear``, with ``v`` and
``g`` held on bare modules at the layer's path: ``c.parametrizations.weight.original1``/``original0``
(``torch.nn.utils.parametrizations.weight_norm``) or ``c.weight_v``/``weight_g`` (the deprecated
``torch.nn.utils.weight_norm`` hook). Each such layer whose tensors are all its holder's, read by nothing
else, becomes the torch.nn layer with the same weight norm registered over the very same Parameter
objects (the same state-dict keys; the weight computed by the same op, so the function does not change by
one bit). Weight-norm removal and addition, and the BatchNorm fold's check of a layer's weight, then see
in a ``.pt2`` what they see in the model it was exported from.
"""

from __future__ import annotations

import warnings

import torch
from torch import fx, nn
from torch.nn.utils.weight_norm import WeightNorm

from normswap.graph.lift import layer_of
from normswap.graph.ops import arg, op_name

_LAYER_OPS = ("conv1d", "conv2d", "conv3d", "linear")
_FORMS = {  # (v's name, g's name) under the layer's path -> the weight norm's form
    ("parametrizations.weight.original1", "parametrizations.weight.original0"): "parametrization",
    ("weight_v", "weight_g"): "hook",
}


def _holder(gm: fx.GraphModule, v: fx.Node, g: fx.Node, bias: fx.Node | None) -> tuple[str, str] | None:
    """(the layer's path, the form) when ``v``, ``g`` and ``bias`` are exactly what one bare module holds."""
    for (v_name, g_name), form in _FORMS.items():
        prefix = str(v.target).removesuffix("." + v_name)
        if prefix == str(v.target) or str(g.target) != f"{prefix}.{g_name}":
            continue
        if bias is not None and str(bias.target) != f"{prefix}.bias":
            return None
        try:
            holder = gm.get_submodule(prefix)
        except AttributeError:
            return None
        if type(holder) is not nn.Module or any(type(m) is not nn.Module for m in holder.modules()):
            return None
        held = {f"{prefix}.{n}" for n, _ in [*holder.named_parameters(), *holder.named_buffers()]}
        read = {str(a.target) for a in (v, g, bias) if a is not None}
        return (prefix, form) if held == read else None
    return None


def _weight_normed(layer: nn.Module, form: str, v: torch.Tensor, g: torch.Tensor, dim: int) -> None:
    """Register weight norm of ``form`` on ``layer`` over the parameters ``v`` and ``g`` themselves."""
    if form == "parametrization":
        nn.utils.parametrizations.weight_norm(layer, "weight", dim=None if dim == -1 else dim)
        weights = layer.parametrizations.weight
        weights.original0, weights.original1 = g, v
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the hook form is deprecated; the model uses it
        nn.utils.weight_norm(layer, "weight", dim=None if dim == -1 else dim)
    layer.weight_g, layer.weight_v = g, v
    hook = next(h for h in layer._forward_pre_hooks.values() if isinstance(h, WeightNorm))
    with torch.no_grad():  # a leaf, as a copy of the model needs: the hook recomputes it on each forward
        layer.weight = hook.compute_weight(layer)


def lift_weight_normed_layers(gm: fx.GraphModule) -> int:
    """Lift every weight-normed layer of ``gm`` (see the module doc), in place; returns how many."""
    lifted = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or op_name(node) != "_weight_norm" or len(node.users) != 1:
            continue
        (call,) = node.users
        if op_name(call) not in _LAYER_OPS or arg(call, 1, "weight") is not node:
            continue
        v_node, g_node, bias_node = node.args[0], node.args[1], arg(call, 2, "bias")
        attrs = [a for a in (v_node, g_node, bias_node) if a is not None]
        if any(not isinstance(a, fx.Node) or a.op != "get_attr" or len(a.users) != 1 for a in attrs):
            continue
        found = _holder(gm, v_node, g_node, bias_node)
        if found is None:
            continue
        prefix, form = found
        v, g = gm.get_parameter(str(v_node.target)), gm.get_parameter(str(g_node.target))
        bias = gm.get_parameter(str(bias_node.target)) if bias_node is not None else None
        if v.is_meta:
            continue  # a program read without its weights: nothing to build the weight norm from
        # built on meta: every tensor it holds is replaced by the program's own below (no weight allocated)
        layer = layer_of(call, v.shape, bias is not None)
        if bias is not None:
            layer.bias = bias
        _weight_normed(layer, form, v, g, int(arg(node, 2, "dim", 0)))
        gm.set_submodule(prefix, layer)
        with gm.graph.inserting_before(call):
            replacement = gm.graph.call_module(prefix, (call.args[0],))
        replacement.meta = dict(call.meta)
        call.replace_all_uses_with(replacement)
        for done in (call, node, *attrs):
            gm.graph.erase_node(done)
        lifted += 1
    return lifted
