"""Fold an eval-mode BatchNorm into the Conv1d/2d/3d or Linear that feeds it (exact).

Math (see :mod:`normswap.passes.weights`): with s = gamma / sqrt(var + eps),
``W' = W * s`` per output channel and ``b' = (b - mean) * s + beta``; the BN becomes ``nn.Identity``.

Legal only when the result computes the same function:
- the BN is in eval mode and has running statistics (in training mode it uses batch statistics);
- its forward is BatchNorm's own (a subclass that adds an activation would lose it);
- the BN and the layer feeding it are each called at exactly one site (folding changes every call);
- the layer's output feeds nothing but the BN (other readers would see scaled values);
- for Linear + BatchNorm1d, the BN's channel dim is the Linear's output dim: a 2-D input only.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.discover import NormSite
from normswap.passes.base import Change, Pass, PassContext, PassReport, RewriteKind, replace_submodule
from normswap.passes.weights import bn_scale_shift, fold_bn_into_conv_weights

FOLDABLE_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_BASE_FORWARDS = {cls: cls.forward for cls in FOLDABLE_LAYERS}


def _uses_base_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    return type(module).forward is base.forward


def _class(module: nn.Module) -> str:
    return type(module).__name__


class FoldBatchNorm(Pass):
    name = "fold_batchnorm"
    kind = RewriteKind.EXACT

    def candidates(self, ctx: PassContext) -> list[NormSite]:
        return [s for s in ctx.inventory if s.kind == "batch"]

    def check(self, site: NormSite, ctx: PassContext) -> str | None:
        if not site.is_module:
            return (
                f"{site.source} batch_norm inside a forward, not a module: folding it needs a graph rewrite"
            )
        bn = site.module
        assert bn is not None
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            if type(bn).forward is not nn.modules.batchnorm._BatchNorm.forward and type(bn).forward not in (
                nn.BatchNorm1d.forward,
                nn.BatchNorm2d.forward,
                nn.BatchNorm3d.forward,
            ):
                return f"{_class(bn)}.forward does more than normalize (e.g. an activation); folding it would drop that"
            if bn.training:
                return "BatchNorm is in training mode: it normalizes with batch statistics; call model.eval() first"
            if not bn.track_running_stats or bn.running_mean is None:
                return "BatchNorm has track_running_stats=False: no statistics to fold"
        if ctx.view is None:
            return f"no graph captured, so the layer feeding the BatchNorm is unknown ({ctx.captured.reason})"
        calls = ctx.view.calls.get(site.path, [])
        if len(calls) != 1:
            return f"BatchNorm is called at {len(calls)} sites; folding needs exactly one"
        inputs = calls[0].inputs(ctx.view)
        if len(inputs) != 1:
            return "BatchNorm input could not be traced to a single producer"
        producer = inputs[0]
        layer_path = ctx.view.innermost_path(producer)
        layer = ctx.modules.get(layer_path)
        if layer is None or not layer_path or not isinstance(layer, FOLDABLE_LAYERS):
            what = (
                f"{layer_path} ({_class(layer)})"
                if layer is not None and layer_path
                else ctx.view.describe(producer)
            )
            return f"input comes from {what}, not a Conv1d/2d/3d or Linear"
        base = next(cls for cls in FOLDABLE_LAYERS if isinstance(layer, cls))
        if not _uses_base_forward(layer, base):
            return (
                f"{layer_path} ({_class(layer)}) overrides forward; its output is not a plain {base.__name__}"
            )
        layer_calls = ctx.view.calls.get(layer_path, [])
        if len(layer_calls) != 1:
            return f"{layer_path} is called at {len(layer_calls)} sites; folding would change the others"
        outputs = layer_calls[0].outputs()
        if outputs != [producer]:
            return f"input is an intermediate value of {layer_path}, not its output"
        readers = [u for u in layer_calls[0].consumers() if u not in calls[0].node_set]
        if readers:
            return f"{layer_path} output also feeds {ctx.view.describe(readers[0], ctx.modules)}"
        if isinstance(layer, nn.Linear):
            meta = producer.meta.get("val")
            if meta is None or meta.ndim != 2:
                ndim = "an unknown rank" if meta is None else f"a {meta.ndim}-D"
                return f"BatchNorm normalizes dim 1 of {ndim} input while {layer_path} (Linear) acts on the last dim"
        channels = site.normalized_shape[0] if site.normalized_shape else None
        out_channels = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        if channels != out_channels:
            return f"BatchNorm has {channels} channels but {layer_path} produces {out_channels}"
        return None

    def rewrite(self, site: NormSite, ctx: PassContext) -> Change:
        assert ctx.view is not None and site.module is not None
        bn = site.module
        producer = ctx.view.calls[site.path][0].inputs(ctx.view)[0]
        layer_path = ctx.view.innermost_path(producer)
        layer = ctx.modules[layer_path]
        had_bias = layer.bias is not None
        scale, shift = bn_scale_shift(
            bn.running_mean,
            bn.running_var,
            float(site.eps if site.eps is not None else bn.eps),
            getattr(bn, "weight", None),
            getattr(bn, "bias", None),
        )
        weight, bias = fold_bn_into_conv_weights(layer.weight, layer.bias, scale, shift, out_channel_dim=0)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if layer.bias is None:
                layer.bias = nn.Parameter(
                    bias.to(layer.weight.device), requires_grad=layer.weight.requires_grad
                )
            else:
                layer.bias.copy_(bias)
        replace_submodule(ctx.model, site.path, nn.Identity())
        return Change(
            self.name,
            site.path,
            self.kind,
            f"folded into {layer_path} ({_class(layer)})",
            {"into": layer_path, "layer_class": _class(layer), "bias_added": not had_bias},
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
