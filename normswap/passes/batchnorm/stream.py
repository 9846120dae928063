"""``--fold-bn`` as per-tensor edits for a streamed checkpoint, and the check of each folded group.

The sites and their folds are :class:`~normswap.passes.batchnorm.fold.FoldBatchNorm`'s own checks, run on
the model built on the meta device. A group is one BatchNorm with the Conv/Linear it folds into:

- reads the layer's weight (and bias, when stored) and the BN's running_mean, running_var, weight, bias;
- writes ``W' = W * s`` and ``b' = b * s + t`` (backward: the BN reads the layer) or ``W' = W s`` along
  the input channels and ``b' = b + W t`` (forward: the layer reads the BN), in float64, cast back to
  the weight's stored dtype; a layer without a bias gets one (a new tensor after its weight);
- drops the BN's tensors: the BN becomes ``nn.Identity`` and the layer a plain layer with a bias, both
  recorded as module recipes, so normswap's loader rebuilds the model (the stock classes build the BN).

What a stream of tensors cannot write is refused with the reason, and ``convert`` in memory does it: an
``F.batch_norm`` call (removing it rebuilds the forward that makes it), a BN with no layer beside it (it
becomes a ChannelAffine), a norm+act BN keeping its activation, a layer whose class is not torch's own
Conv1d/2d/3d or Linear (a recipe names only those), and a second fold into a layer another fold writes.

each group's ``check`` verifies a written result group by group: each group's function on random inputs,
``bn(layer(x))`` (or ``layer(bn(x))``) from the input's tensors against ``layer'(x)`` from the output's,
within the exact tolerance of the stored dtype. Memory is one group's tensors, whatever the model's size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from normswap.modules.recipes import build_from_recipe, module_recipe
from normswap.passes.batchnorm.arithmetic import (
    bn_scale_shift,
    fold_bn_into_conv_weights,
    fold_bn_into_next_layer_weights,
)
from normswap.passes.batchnorm.fold import FoldBatchNorm, FoldPlan
from normswap.passes.batchnorm.layers import class_name, layer_text
from normswap.passes.batchnorm.match import bn_eps, bn_statistics_problem
from normswap.passes.core.base import Change, PassContext
from normswap.passes.core.edits import EditPlan, TensorEdit, Tensors, plan_for
from normswap.passes.swap.norm_act import is_identity, norm_act_tail
from normswap.verify.metrics import TensorComparison, compare_tensors

# The layer classes a recipe rebuilds: a subclass with a forward of its own would lose it.
STREAM_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


@dataclass(frozen=True)
class FoldedGroup:
    """One streamed fold, as its check reads it: the BN's tensor names (None where it has none), the
    layer's, the direction, eps, and the layer as it was (on the meta device) and as it is recorded."""

    bn: str
    layer: str
    direction: str  # "backward" (the BN reads the layer) | "forward" (the layer reads the BN)
    eps: float
    stats: dict[str, str | None]  # running_mean, running_var, weight, bias -> stored name
    weight: str
    bias: str
    bias_stored: bool
    original: nn.Module
    recipe: dict[str, Any]

    def check(
        self, read_original: Callable[[str], torch.Tensor], read_written: Callable[[str], torch.Tensor]
    ) -> TensorComparison:
        """:func:`check_fold` of this group, its tensors read now."""
        names = [self.weight, *((self.bias,) if self.bias_stored else ())]
        names += [n for n in self.stats.values() if n is not None]
        original = {name: read_original(name) for name in names}
        written = {name: read_written(name) for name in (self.weight, self.bias)}
        return check_fold(self, original, written)


def _bn_names(path: str, bn: nn.Module, stored: set[str]) -> dict[str, str | None] | str:
    names: dict[str, str | None] = {}
    for key in ("running_mean", "running_var", "weight", "bias"):
        if getattr(bn, key, None) is None:
            names[key] = None
            continue
        name = f"{path}.{key}"
        if name not in stored:
            return f"{name} is not in the checkpoint's files"
        names[key] = name
    return names


def _unstreamable(plan: FoldPlan, layer: nn.Module | None) -> str | None:
    fold = plan.fold
    if fold.call is not None:
        return (
            "an F.batch_norm call is folded by rebuilding the forward that makes it, which a stream of "
            "tensors cannot write (convert it in memory)"
        )
    if fold.how == "affine" or layer is None:
        return "no conv or linear beside it: it would become a ChannelAffine, which a stream does not write"
    tail = norm_act_tail(plan.site.module) or []  # type: ignore[arg-type]
    if not is_identity(tail):
        kept = " and ".join(name for name, m in tail if not isinstance(m, nn.Identity))
        return f"its {kept} would stay after the fold, in a module a stream does not record"
    if type(layer) not in STREAM_LAYERS:
        return (
            f"{layer_text(fold.layer, layer)} is not torch's own Conv1d/2d/3d or Linear: the recipe that "
            "records its new bias would lose its own forward (convert it in memory)"
        )
    return None


def _group_of(
    plan: FoldPlan, model: nn.Module, stored: set[str], read: Callable[[str], torch.Tensor]
) -> FoldedGroup | str:
    fold, site = plan.fold, plan.site
    layer = model.get_submodule(fold.layer) if fold.layer else None
    why = _unstreamable(plan, layer)
    if why is not None:
        return why
    assert layer is not None and site.module is not None
    stats = _bn_names(site.path, site.module, stored)
    if isinstance(stats, str):
        return stats
    # the check the model's values would have had in memory, on the stored statistics (two vectors)
    mean, var = stats["running_mean"], stats["running_var"]
    assert mean is not None and var is not None
    problem = bn_statistics_problem(read(mean), read(var), bn_eps(site, site.module))
    if problem is not None:
        return problem
    weight, bias = f"{fold.layer}.weight", f"{fold.layer}.bias"
    if weight not in stored or (layer.bias is not None and bias not in stored):
        return f"{fold.layer}'s tensors are not in the checkpoint's files"
    recipe = module_recipe(layer)
    assert recipe is not None  # a class of STREAM_LAYERS has one
    recipe = {**recipe, "kwargs": {**recipe["kwargs"], "bias": True}}
    return FoldedGroup(
        site.path,
        fold.layer,
        fold.how,
        bn_eps(site, site.module),
        stats,
        weight,
        bias,
        layer.bias is not None,
        layer,
        recipe,
    )


def folded_weights(group: FoldedGroup, t: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's new weight and bias from the group's stored tensors ``t`` (fp64 inside, stored dtype out)."""
    stats = {key: (t[name] if name is not None else None) for key, name in group.stats.items()}
    scale, shift = bn_scale_shift(
        stats["running_mean"],
        stats["running_var"],
        group.eps,
        stats["weight"],
        stats["bias"],  # type: ignore[arg-type]
    )
    bias = t[group.bias] if group.bias_stored else None
    if group.direction == "backward":
        return fold_bn_into_conv_weights(t[group.weight], bias, scale, shift, out_channel_dim=0)
    groups = getattr(group.original, "groups", 1)
    return fold_bn_into_next_layer_weights(t[group.weight], bias, scale, shift, groups)


def _edit_parts(group: FoldedGroup) -> tuple[tuple[str, ...], Callable[[Tensors], Tensors], tuple[str, ...]]:
    reads = (group.weight, *((group.bias,) if group.bias_stored else ()))
    reads += tuple(name for name in group.stats.values() if name is not None)

    def compute(t: Tensors) -> Tensors:
        weight, bias = folded_weights(group, t)
        return {group.weight: weight, group.bias: bias}

    return reads, compute, (group.weight, group.bias)


def plan_batchnorm_folds(
    model: nn.Module,
    ctx: PassContext,
    stored: set[str],
    read: Callable[[str], torch.Tensor],
) -> EditPlan:
    """The edit groups of ``--fold-bn`` on ``model`` (meta device), each group with its check,
    the module recipes and the report. ``read`` gives a stored tensor by name (the statistics are
    checked before the stream)."""
    rewrite = FoldBatchNorm()
    plan = plan_for(rewrite)
    for site, checked in plan.decided(rewrite, ctx):
        group = _group_of(checked, model, stored, read)
        if not isinstance(group, str) and group.weight in plan.writes:
            group = f"{group.layer} takes another BatchNorm's fold already; a stream writes each tensor once"
        if isinstance(group, str):
            plan.cannot_stream(rewrite, site.path, group)
            continue
        reads, compute, writes = _edit_parts(group)
        drops = tuple(n for n in sorted(stored) if n.startswith(group.bn + "."))
        creates = {} if group.bias_stored else {group.bias: (group.weight, (_out_features(group.original),))}
        plan.edits.append(
            TensorEdit(f"fold {group.bn}", reads, compute, writes, creates=creates, drops=drops)
        )
        plan.checks.append(group)
        plan.recorded[group.bn] = {"class": "Identity", "kwargs": {}}
        plan.recorded[group.layer] = group.recipe
        into = "folded into" if group.direction == "backward" else "folded forward into the next layer"
        plan.report.changes.append(
            Change(
                rewrite.name,
                group.bn,
                rewrite.kind,
                f"{into} {layer_text(group.layer, group.original)}",
                {
                    "into": group.layer,
                    "layer_class": class_name(group.original),
                    "direction": group.direction,
                },
            )
        )
    return plan


def _out_features(layer: nn.Module) -> int:
    return int(layer.weight.shape[0])


def layer_probe(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A random input of a Conv or Linear layer's width, spatially large enough for its kernel with a
    border, for a layer's check before and after a rewrite."""
    generator = torch.Generator().manual_seed(0)
    if isinstance(layer, nn.Linear):
        shape: tuple[int, ...] = (3, layer.in_features)
    else:
        spatial = [
            (k - 1) * d + 2 * s + 5
            for k, d, s in zip(layer.kernel_size, layer.dilation, layer.stride, strict=True)
        ]
        shape = (2, layer.in_channels, *spatial)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def layer_filled(module: nn.Module, tensors: Tensors, prefix: str, dtype: torch.dtype) -> nn.Module:
    """A CPU copy of ``module`` (on the meta device, or a fresh recipe build) in ``dtype``, its tensors
    taken from ``tensors`` by their full names (``prefix.name``), for a layer's check."""
    built = copy.deepcopy(module).to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for name, tensor in built.state_dict(keep_vars=True).items():
            key = f"{prefix}.{name}"
            if key in tensors:
                tensor.copy_(tensors[key])
    return built.eval()


def check_fold(group: FoldedGroup, original: Tensors, written: Tensors) -> TensorComparison:
    """The group's function before (``original``: its stored input tensors) and after (``written``: the
    layer's weight and bias as written), on a random input, in the stored dtype."""
    dtype = original[group.weight].dtype
    before = layer_filled(group.original, original, group.layer, dtype)
    after = layer_filled(build_from_recipe(group.recipe), written, group.layer, dtype)
    stats = {key: (original[name] if name is not None else None) for key, name in group.stats.items()}

    def bn(y: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            y,
            stats["running_mean"],
            stats["running_var"],
            stats["weight"],
            stats["bias"],
            False,
            0.0,
            group.eps,
        )

    x = layer_probe(group.original, dtype)
    with torch.no_grad():
        reference = bn(before(x)) if group.direction == "backward" else before(bn(x))
        return compare_tensors(f"{group.bn} -> {group.layer}", reference, after(x))
