"""Fold each eval-mode BatchNorm into a neighbouring Conv/ConvTranspose/Linear, or make it an affine (exact).

An eval BN is the per-channel affine ``y = s * x + t`` with ``s = gamma / sqrt(var + eps)`` and
``t = beta - mean * s`` (math in :mod:`normswap.passes.batchnorm.arithmetic`). For each BN site, in this order:

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

How each site's neighbour is found is :mod:`normswap.passes.batchnorm.match`; what a layer must
compute to take a fold (subclasses with their own forward, padding, computed weights) is
:mod:`normswap.passes.batchnorm.layers`; the arithmetic is :mod:`normswap.passes.batchnorm.arithmetic`.

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

The check of a site decides everything (:class:`FoldPlan`: the direction, the layer, for a call the fx
trace of its owner with the call found in it), and applying the plan looks nothing up again, so the
owner is traced once. Calls are folded after every module BN, the root's own last, and the rebuilt
owner takes a folded copy of its layer: the owner it replaces (with ``inplace=True``, for a call in the
root's forward, the model passed in) keeps computing what it did (:mod:`normswap.passes.core.base`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import fx, nn

from normswap.discover import NormSite
from normswap.discover.own_forward import norm_act_tail
from normswap.modules.affine import ChannelAffine
from normswap.passes.batchnorm.arithmetic import bn_scale_shift
from normswap.passes.batchnorm.group import fold_group, folded_weights
from normswap.passes.batchnorm.layers import class_name, layer_text
from normswap.passes.batchnorm.match import (
    Fold,
    FunctionalCall,
    bn_eps,
    owner_name,
    plan_functional,
    plan_module_site,
)
from normswap.passes.core.base import Change, Pass, PassContext, PassReport, RewriteKind, replace_submodule
from normswap.passes.core.edits import apply_in_memory
from normswap.passes.swap.norm_act import is_identity, with_tail


def _scale_shift(site: NormSite, bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return bn_scale_shift(
        bn.running_mean,
        bn.running_var,
        bn_eps(site, bn),
        getattr(bn, "weight", None),
        getattr(bn, "bias", None),
    )


def _set_weights(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Write the folded weights; True when the layer had no bias and gains one."""
    with torch.no_grad():
        layer.weight.copy_(weight)
        if layer.bias is None:
            layer.bias = nn.Parameter(bias.to(layer.weight.device), requires_grad=layer.weight.requires_grad)
            return True
        layer.bias.copy_(bias)
    return False


@dataclass(frozen=True)
class FoldPlan:
    """A BatchNorm site and the fold its check decided on."""

    site: NormSite
    fold: Fold


def _rebuild_order(site: NormSite) -> int:
    """Module BNs first, then calls inside a submodule's forward, then calls in the root's forward.

    Removing a call rebuilds its owner as a GraphModule that shares the owner's other submodules; made
    after every module edit, it leaves the owner it replaces (for the root: the model passed in, with
    ``inplace=True``) a consistent model, with each module edit applied and its own forward as it was."""
    if site.source != "functional":
        return 0
    return 2 if site.path.rpartition("::")[0] in ("", "<root>") else 1


class FoldBatchNorm(Pass[NormSite, FoldPlan, None]):
    name = "fold_batchnorm"
    kind = RewriteKind.EXACT
    # producers, readers, call counts and layer forwards: module-level facts a faithful fx graph has
    fx_analysis = True

    def candidates(self, ctx: PassContext, state: None) -> list[NormSite]:
        return sorted((s for s in ctx.inventory if s.kind == "batch"), key=_rebuild_order)

    def check(self, site: NormSite, ctx: PassContext, state: None) -> FoldPlan | str:
        if site.source == "functional":
            fold = plan_functional(site, ctx)
        elif not site.is_module:
            return (
                f"{site.source} batch_norm written out inside a forward: neither a module nor a single call"
            )
        else:
            fold = plan_module_site(site, ctx)
        return fold if isinstance(fold, str) else FoldPlan(site, fold)

    def apply(self, plan: FoldPlan, ctx: PassContext, state: None) -> Change:
        site, fold = plan.site, plan.fold
        if fold.call is not None:
            return self._remove_call(site, fold, fold.call, ctx)
        bn = site.module
        assert bn is not None
        tail = norm_act_tail(bn) or []
        if fold.how == "affine":
            scale, shift = _scale_shift(site, bn)
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
        layer = ctx.model.get_submodule(fold.layer)
        # the group a stream writes, run on the model's own tensors (a layer without a bias gains one)
        group = fold_group(site.path, bn, bn_eps(site, bn), fold.layer, layer, fold.how)
        bias_added = bool(apply_in_memory(ctx.model, group.edit()))
        if fold.how == "backward":
            description = f"folded into {layer_text(fold.layer, layer)}"
            if not is_identity(tail):
                description += (
                    f"; kept its {' and '.join(n for n, m in tail if not isinstance(m, nn.Identity))}"
                )
        else:
            description = f"folded forward into the next layer {layer_text(fold.layer, layer)}"
        replace_submodule(ctx.model, site.path, with_tail(tail))
        return Change(
            self.name,
            site.path,
            self.kind,
            description,
            {
                "into": fold.layer,
                "layer_class": class_name(layer),
                "bias_added": bias_added,
                "direction": fold.how,
            },
        )

    def _remove_call(self, site: NormSite, fold: Fold, call: FunctionalCall, ctx: PassContext) -> Change:
        """Fold an ``F.batch_norm`` call into the layer before it and rebuild the owner without the call.

        The new owner gets its own folded copy of the layer, so the owner it replaces keeps computing
        what it did (see :func:`_rebuild_order`)."""
        names = call.names

        def tensor(key: str) -> torch.Tensor | None:
            name = names[key]
            if name is None:
                return None
            try:
                return ctx.model.get_parameter(name)
            except AttributeError:
                return ctx.model.get_buffer(name)

        # the group both other routes run (a module's fold, the stream), on the call's tensors and the layer's
        layer = ctx.model.get_submodule(fold.layer)
        group = fold_group(site.path, names, call.eps, fold.layer, layer, "backward")
        tensors = {name: tensor(key) for key, name in names.items() if name is not None}
        tensors.update({group.weight: layer.weight, group.bias: layer.bias})
        with torch.no_grad():
            weight, bias = folded_weights(group, tensors)
        owner = ctx.model.get_submodule(fold.owner)
        graph, bn_node = call.graph, call.node
        read = bn_node.all_input_nodes
        bn_node.replace_all_uses_with(call.input)
        graph.erase_node(bn_node)
        for n in read:
            if n.op == "get_attr" and not n.users:
                graph.erase_node(n)
        # Built after the edit, the GraphModule copies only what its graph still reads: the BN's
        # statistics and affine leave the state_dict.
        module = fx.GraphModule(owner, graph, class_name=type(owner).__name__)
        # its own flag only: its submodules are the owner's, each in the mode it was in
        module.training = owner.training
        inner = str(call.input.target)  # the layer's path inside the owner
        layer = copy.deepcopy(module.get_submodule(inner))
        bias_added = _set_weights(layer, weight, bias)
        module.set_submodule(inner, layer)
        if fold.owner:
            ctx.model.set_submodule(fold.owner, module)
        else:
            # the call is in the model's own forward: the returned model is this GraphModule
            ctx.replace_model(module)
        removed = [n for n in names.values() if n is not None]
        return Change(
            self.name,
            site.path,
            self.kind,
            f"folded into {layer_text(fold.layer, layer)}; {owner_name(fold.owner)} is now a torch.fx "
            "GraphModule of its forward without the F.batch_norm call (a module edit cannot remove a call "
            "from a forward)",
            {
                "into": fold.layer,
                "layer_class": class_name(layer),
                "bias_added": bias_added,
                "direction": "backward",
                "graph_module": fold.owner,
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
