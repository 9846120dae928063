"""Fold a LayerScale into the layer that writes the value it scales (exact).

A LayerScale multiplies a branch's output by a learned per-channel vector before the residual add:
timm's ``LayerScale`` (``ls1``/``ls2`` of ViT, DeiT-3, EVA), Hugging Face's ``Dinov2LayerScale``
(``layer_scale1.lambda1``), ConvNeXt's ``gamma`` applied inside the block's own forward. When the value
it scales is the output of a linear layer, read by nothing else, the scale moves into that layer:

    gamma * (W x + b) = (diag(gamma) W) x + gamma * b
    W' = diag(gamma) W    (each output feature's row of W scaled by its gamma)
    b' = gamma * b

computed in float64 and cast back to the layer's dtype. A LayerScale that is a module of its own (its
forward is the multiply and it holds nothing else) becomes ``nn.Identity``, so the scaled branch costs
nothing at inference; a scale inside a larger forward (ConvNeXt's ``gamma``), and any scale of a Hugging
Face model (whose directory must keep every module its architecture has, to load with stock
``from_pretrained``), becomes ones.

Legality is read off the captured graph, never from names. A site is a multiply of a value by a
parameter (possibly reshaped to broadcast); it is refused, with the reason, when:
- the parameter is read anywhere else, or scales more than one channel dim;
- the value, through ops that pass it on unchanged (eval-mode dropout, an identity, a permute, which
  moves the channel dim), is not the output of an ``nn.Linear`` or ``nn.Conv*`` module, or some value
  on that chain is read by anything but the next;
- the scaled dim is not the layer's output-feature dim (the last for a Linear, 1 for a conv);
- the layer is called at more than one site, or its weight is shared (tied) or computed
  (parametrized, e.g. weight norm).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx, nn

from normswap.graph.ops import arg, op_name, real_users, tensor_meta
from normswap.passes.core.base import (
    Change,
    Pass,
    PassContext,
    Refusal,
    RewriteKind,
    SkipCause,
    replace_submodule,
)
from normswap.passes.core.edits import TensorEdit, Tensors, apply_in_memory

_WRITERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# ops a scale parameter may go through to broadcast
_RESHAPES = frozenset({"view", "reshape", "unsqueeze", "_unsafe_view"})
# ops that hand the branch's value on unchanged
_PASS_ON = frozenset({"clone", "contiguous", "alias", "detach", "identity", "dropout"})


def fold_scale_into_writer(
    weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(diag(scale) W, scale * b)`` for a layer whose output features run along ``weight``'s dim 0
    (Linear ``(out, in)``, conv ``(out, in/groups, *k)``), in float64, cast back to each dtype."""
    gain = scale.detach().double().reshape(-1)
    new_weight = (weight.detach().double() * gain.reshape(-1, *[1] * (weight.ndim - 1))).to(weight.dtype)
    new_bias = None if bias is None else (bias.detach().double() * gain).to(bias.dtype)
    return new_weight, new_bias


def scale_edit(plan: LayerScalePlan, layer: nn.Module) -> TensorEdit:
    """The fold of ``plan`` as one group of tensor edits, the same on every route: the layer's weight and
    bias scaled (:func:`fold_scale_into_writer`), the scale written as ones. ``layer``: the module at
    ``plan.writer`` (on any device; only whether it has a bias is read)."""
    weight, scale = f"{plan.writer}.weight", plan.site.path
    bias = f"{plan.writer}.bias" if layer.bias is not None else None
    reads = (weight, *((bias,) if bias else ()), scale)

    def compute(t: Tensors) -> Tensors:
        new_weight, new_bias = fold_scale_into_writer(t[weight], t.get(bias or ""), t[scale])
        out = {weight: new_weight, scale: torch.ones_like(t[scale])}
        if bias is not None and new_bias is not None:
            out[bias] = new_bias
        return out

    return TensorEdit(f"fold {scale}", reads, compute, reads)


@dataclass(frozen=True)
class ScaleSite:
    """A multiply of a value by a parameter, found in the graph; ``path`` names the parameter."""

    path: str
    node: fx.Node


@dataclass(frozen=True)
class LayerScalePlan:
    """Fold the scale ``site.path`` into the layer at ``writer``; ``owner`` is the scale's module, made
    an Identity when ``replace`` (its forward is the multiply alone), else the scale becomes ones."""

    site: ScaleSite
    writer: str
    owner: str
    replace: bool


def _shape(node: object) -> tuple[int, ...] | None:
    meta = tensor_meta(node) if isinstance(node, fx.Node) else None
    return meta[0] if meta else None


class FoldLayerScale(Pass[ScaleSite, LayerScalePlan, None]):
    """Fold every foldable LayerScale into the Linear or conv that writes the value it scales."""

    name: ClassVar[str] = "fold_layerscale"
    kind: ClassVar[RewriteKind] = RewriteKind.EXACT
    inside_changes: ClassVar[str] = (
        "the scaled layer's output carries its LayerScale already (the scale is gone or ones): a hook on "
        "that layer sees the scaled values; hidden states and outputs do not change"
    )

    def candidates(self, ctx: PassContext, state: None) -> list[ScaleSite]:
        if ctx.view is None:
            return []
        found = []
        for node in ctx.captured.graph.nodes if ctx.captured.graph is not None else []:
            if op_name(node) != "mul" or len(node.args) != 2:
                continue
            for operand, other in (node.args, node.args[::-1]):
                param = _scale_param(ctx, operand)
                if param is None:
                    continue
                name = str(ctx.view.param_name(param))
                owner, _, attr = name.rpartition(".")
                # a LayerScale: a module that is the scale alone, or a scale of a layer's output (a norm's
                # own weight multiply is neither, and is not listed)
                if _only_the_scale(ctx, owner, attr) or _writer_path(ctx, _passed_on(other)) is not None:
                    found.append(ScaleSite(name, node))
        return found

    def check(self, site: ScaleSite, ctx: PassContext, state: None) -> LayerScalePlan | Refusal:
        view = ctx.view
        assert view is not None
        node = site.node
        unsupported = SkipCause.UNSUPPORTED
        scale_arg, value = (node.args[0], node.args[1])
        if _scale_param(ctx, scale_arg) is None:
            scale_arg, value = value, scale_arg
        param = _scale_param(ctx, scale_arg)
        assert param is not None
        if len(real_users(param)) != 1 or any(len(real_users(n)) != 1 for n in _reshapes(scale_arg)):
            return Refusal(
                "the scale is read elsewhere too: folding it would change that use", SkipCause.ARCHITECTURE
            )
        out_shape, scale_shape = _shape(node), _shape(scale_arg)
        if out_shape is None or scale_shape is None or not isinstance(value, fx.Node):
            return Refusal("the shapes around the multiply are unknown", unsupported)
        channels = [i for i, size in enumerate(scale_shape) if size != 1]
        if len(channels) != 1:
            return Refusal(f"the scale {tuple(scale_shape)} does not scale one channel dim", unsupported)
        dim = len(out_shape) - len(scale_shape) + channels[0]
        writer = value
        while op_name(writer) in _PASS_ON or op_name(writer) == "permute":
            if len(real_users(writer)) != 1:
                return Refusal(f"{view.describe(writer)} is read elsewhere too", SkipCause.ARCHITECTURE)
            if op_name(writer) == "dropout" and arg(writer, 2, "train", False):
                return Refusal(
                    "a dropout in training mode stands between the layer and its scale", unsupported
                )
            if op_name(writer) == "permute":
                dim = list(arg(writer, 1, "dims"))[dim] % (len(_shape(writer) or ()) or 1)
            writer = writer.args[0]  # type: ignore[assignment]
        if not isinstance(writer, fx.Node) or len(real_users(writer)) != 1:
            return Refusal("the scaled value is read by something else too", SkipCause.ARCHITECTURE)
        path = _writer_path(ctx, writer)
        module = ctx.modules.get(path) if path is not None else None
        if path is None or not isinstance(module, _WRITERS):
            return Refusal(
                f"the scaled value comes from {view.describe(writer)}, not a Linear or conv layer",
                unsupported,
            )
        rank = len(_shape(writer) or ())
        feature_dim = rank - 1 if isinstance(module, nn.Linear) else 1
        if dim != feature_dim:
            return Refusal(
                f"the scale runs along dim {dim} of {path}'s output, not its features", unsupported
            )
        if view.call_count(path) != 1:
            return Refusal(f"{path} is called at {view.call_count(path)} sites", SkipCause.ARCHITECTURE)
        if type(module.weight) is not nn.Parameter or hasattr(module, "parametrizations"):
            return Refusal(f"{path} has a computed (parametrized) weight", unsupported)
        tied = [n for n, p in ctx.model.named_parameters(remove_duplicate=False) if p is module.weight]
        if len(tied) != 1:
            return Refusal(
                f"{path}.weight is shared with {', '.join(t for t in tied if t != path + '.weight')}",
                SkipCause.ARCHITECTURE,
            )
        owner, _, attr = site.path.rpartition(".")
        # a Hugging Face model keeps its modules (its directory then loads with stock from_pretrained, whose
        # key conversions expect every module of the architecture): its scale becomes ones. So does a bare
        # holder of a loaded program (.pt2), which has no forward to drop: the program reads the scale.
        replace = (
            _only_the_scale(ctx, owner, attr)
            and type(ctx.modules[owner]) is not nn.Module
            and not _transformers_model(ctx.model)
        )
        return LayerScalePlan(site, path, owner, replace)

    def apply(self, plan: LayerScalePlan, ctx: PassContext, state: None) -> Change:
        apply_in_memory(ctx.model, scale_edit(plan, ctx.modules[plan.writer]))
        if plan.replace:  # the scale's own module does nothing now: gone
            replace_submodule(ctx.model, plan.owner, nn.Identity())
        return self.change(plan)

    def change(self, plan: LayerScalePlan) -> Change:
        """What folding ``plan`` does, said the same on every route."""
        now = f"{plan.owner} is now Identity" if plan.replace else f"{plan.site.path} is now ones"
        return Change(
            self.name,
            plan.site.path,
            self.kind,
            f"folded into {plan.writer}; {now}",
            {"into": plan.writer, "replaced": plan.replace},
        )


def _transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face transformers model (without importing transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _passed_on(node: object) -> object:
    """What ``node`` hands on unchanged (through pass-on ops and permutes), as far back as it goes."""
    while isinstance(node, fx.Node) and (op_name(node) in _PASS_ON or op_name(node) == "permute"):
        node = node.args[0]
    return node


def _reshapes(node: object) -> list[fx.Node]:
    chain = []
    while isinstance(node, fx.Node) and op_name(node) in _RESHAPES:
        chain.append(node)
        node = node.args[0]
    return chain


def _scale_param(ctx: PassContext, operand: object) -> fx.Node | None:
    """The parameter ``operand`` is (through reshapes), if it is a floating parameter of the model."""
    assert ctx.view is not None
    chain = _reshapes(operand)
    source = chain[-1].args[0] if chain else operand
    if not isinstance(source, fx.Node) or not ctx.view.is_param(source):
        return None
    name = ctx.view.param_name(source)
    params = dict(ctx.model.named_parameters())
    return source if name in params and params[name].is_floating_point() else None


def _writer_path(ctx: PassContext, node: object) -> str | None:
    """The module whose weight the op ``node`` applies (linear, convolution), by the weight's name."""
    assert ctx.view is not None
    if (
        not isinstance(node, fx.Node)
        or op_name(node) not in ("linear", "convolution", "conv1d", "conv2d", "conv3d")
        or len(node.args) < 2
    ):
        return None
    if op_name(node) == "convolution" and arg(node, 6, "transposed"):
        return None
    name = ctx.view.param_name(node.args[1])
    return name.rpartition(".")[0] if name and name.endswith(".weight") else None


def _only_the_scale(ctx: PassContext, owner: str, attr: str) -> bool:
    """Whether the module ``owner`` is the LayerScale alone: it holds only the scale, and its forward
    (every graph op attributed to it) is the multiply and reshapes of the scale."""
    module = ctx.modules.get(owner)
    if module is None or owner == "" or list(module.children()):
        return False
    if [n for n, _ in module.named_parameters()] != [attr] or list(module.buffers()):
        return False
    assert ctx.view is not None
    calls = ctx.view.calls.get(owner, [])
    if len(calls) != 1:
        return False
    ops = {op_name(n) for n in calls[0].nodes if n.op == "call_function"}
    return ops <= {"mul", *_RESHAPES}
