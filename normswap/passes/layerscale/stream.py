"""``--fold-layerscale`` as per-tensor edits for a streamed checkpoint, and the check of each folded group.

The scales and their layers are :class:`~normswap.passes.layerscale.fold.FoldLayerScale`'s own checks,
run on the model built on the meta device. A group is one scale with the Linear or conv that writes what
it scales: ``W' = diag(g) W``, ``b' = g b``, the scale written as ones (so the directory keeps every
module its config builds and loads with stock ``from_pretrained``): the group the in-memory pass runs
too (:func:`~normswap.passes.layerscale.fold.scale_edit`). A group's memory is its layer's weight and bias and the scale.

Each group is checked where it was written: the layer and its scale as written against the layer and
its scale as they were, on a random input, in the stored dtype. A block-by-block check would need every
block to keep one width (ConvNeXt's stages do not), and the fold changes nothing but these tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from normswap.passes.batchnorm.stream import layer_filled, layer_probe
from normswap.passes.core.base import PassContext
from normswap.passes.core.edits import EditPlan, Tensors, plan_for
from normswap.passes.layerscale.fold import FoldLayerScale, LayerScalePlan, scale_edit
from normswap.verify.metrics import TensorComparison, compare_tensors


@dataclass(frozen=True)
class LayerScaleGroup:
    """One folded scale: its stored name, the layer that writes what it scales (on the meta device) and
    that layer's stored weight and bias."""

    scale: str
    layer_path: str
    layer: nn.Module
    weight: str
    bias: str | None

    def _scaled(self, tensors: Tensors, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        layer = layer_filled(self.layer, tensors, self.layer_path, dtype)
        feature_dim = -1 if isinstance(self.layer, nn.Linear) else 1
        scale = tensors[self.scale].reshape(-1)

        def run(x: torch.Tensor) -> torch.Tensor:
            y = layer(x)
            shape = [1] * y.ndim
            shape[feature_dim] = -1
            return y * scale.reshape(shape)

        return run

    def check(
        self, read_original: Callable[[str], torch.Tensor], read_written: Callable[[str], torch.Tensor]
    ) -> TensorComparison:
        """The layer times its scale as written against the same as it was, on a random input."""
        names = [self.weight, *((self.bias,) if self.bias else ()), self.scale]
        original = {name: read_original(name) for name in names}
        written = {name: read_written(name) for name in names}
        dtype = original[self.weight].dtype
        x = layer_probe(self.layer, dtype)
        with torch.no_grad():
            reference = self._scaled(original, dtype)(x)
            return compare_tensors(
                f"{self.scale} -> {self.layer_path}", reference, self._scaled(written, dtype)(x)
            )


def _group(plan: LayerScalePlan, model: nn.Module, stored: set[str]) -> LayerScaleGroup | str:
    if plan.replace:
        return f"{plan.owner} would become Identity, which a model directory cannot say"
    layer = model.get_submodule(plan.writer)
    weight = f"{plan.writer}.weight"
    bias = f"{plan.writer}.bias" if layer.bias is not None else None
    for name in (weight, bias, plan.site.path):
        if name is not None and name not in stored:
            return f"{name} is not in the checkpoint's files"
    return LayerScaleGroup(plan.site.path, plan.writer, layer, weight, bias)


def plan_layerscale_folds(model: nn.Module, ctx: PassContext, stored: set[str]) -> EditPlan:
    """The groups of ``--fold-layerscale`` on ``model`` (meta device), whose files store ``stored``, each
    with its check."""
    rewrite = FoldLayerScale()
    plan = plan_for(rewrite)
    for site, checked in plan.decided(rewrite, ctx):
        group = _group(checked, model, stored)
        if not isinstance(group, str) and group.weight in plan.writes:
            group = f"{group.layer_path} takes another scale's fold already; a stream writes each tensor once"
        if isinstance(group, str):
            plan.cannot_stream(rewrite, site.path, group)
            continue
        plan.edits.append(scale_edit(checked, group.layer))
        plan.checks.append(group)
        plan.report.changes.append(rewrite.change(checked))
    return plan
