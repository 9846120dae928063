"""``--fold-bn`` as per-tensor edits for a streamed checkpoint, and the check of each folded group.

The sites and their folds are :class:`~normswap.passes.batchnorm.fold.FoldBatchNorm`'s own checks, run on
the model built on the meta device. A group is one BatchNorm with the Conv/Linear it folds into, the
group the in-memory pass runs too (:class:`~normswap.passes.batchnorm.group.FoldGroup`):

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

Each group's ``check`` verifies a written result group by group: each group's function on random inputs,
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
from torch.nn.modules.batchnorm import _BatchNorm

from normswap.discover.own_forward import norm_act_tail
from normswap.errors import BrokenModelError
from normswap.modules.recipes import build_from_recipe, module_recipe
from normswap.passes.batchnorm.fold import FoldBatchNorm, FoldPlan
from normswap.passes.batchnorm.group import FoldGroup, fold_group
from normswap.passes.batchnorm.layers import class_name, layer_text
from normswap.passes.batchnorm.match import bn_eps, bn_statistics_problem
from normswap.passes.core.base import Change, PassContext, Skip
from normswap.passes.core.edits import EditPlan, Tensors, plan_for
from normswap.passes.swap.norm_act import is_identity
from normswap.util.finite import NOTHING_COMPARED
from normswap.verify.metrics import TensorComparison, compare_tensors

# The layer classes a recipe rebuilds: a subclass with a forward of its own would lose it.
STREAM_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


@dataclass(frozen=True)
class FoldedGroup:
    """One streamed fold: the group both routes run (:class:`~normswap.passes.batchnorm.group.FoldGroup`),
    with the layer as it was (on the meta device) and as it is recorded, for its check."""

    group: FoldGroup
    original: nn.Module
    recipe: dict[str, Any]

    def check(
        self, read_original: Callable[[str], torch.Tensor], read_written: Callable[[str], torch.Tensor]
    ) -> TensorComparison:
        """:func:`check_fold` of this group, its tensors read now."""
        group = self.group
        names = [group.weight, *((group.bias,) if group.bias_stored else ())]
        names += [n for n in group.stats.values() if n is not None]
        original = {name: read_original(name) for name in names}
        written = {name: read_written(name) for name in (group.weight, group.bias)}
        return check_fold(self, original, written)


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
) -> FoldedGroup | Skip | str:
    fold, site = plan.fold, plan.site
    layer = model.get_submodule(fold.layer) if fold.layer else None
    why = _unstreamable(plan, layer)
    if why is not None:
        return why
    assert layer is not None and site.module is not None
    group = fold_group(site.path, site.module, bn_eps(site, site.module), fold.layer, layer, fold.how)
    names = [group.weight, *((group.bias,) if group.bias_stored else ())]
    missing = [n for n in (*names, *group.stats.values()) if n is not None and n not in stored]
    if missing:
        return f"{missing[0]} is not in the checkpoint's files"
    # the check the model's values would have had in memory, on the stored statistics (two vectors)
    mean, var = group.stats["running_mean"], group.stats["running_var"]
    assert mean is not None and var is not None
    # read() refuses a NaN (normswap.util.finite); refuse_broken_batchnorms refused what computes NaN/Inf
    problem = bn_statistics_problem(read(mean), read(var), group.eps)
    if problem is not None:  # a variance of +Inf: its channel computes its bias; no affine map to fold
        return Skip(FoldBatchNorm.name, site.path, problem)  # in memory's skip, its cause (none) too
    recipe = module_recipe(layer)
    assert recipe is not None  # a class of STREAM_LAYERS has one
    return FoldedGroup(group, layer, {**recipe, "kwargs": {**recipe["kwargs"], "bias": True}})


def refuse_broken_batchnorms(model: nn.Module, stored: set[str], read: Callable[[str], torch.Tensor]) -> None:
    """Every BatchNorm of ``model`` (a directory's model on the meta device) whose stored statistics make
    it compute NaN or Inf on every input (running_var + eps <= 0, an infinite mean) is the model broken,
    which the in-memory route finds in the model's outputs; a stream runs no whole model, so it refuses
    the model here before any work, whatever the rewrite, by the same rule and exit code."""
    for path, bn in model.named_modules():
        names = [f"{path}.{stat}" if path else stat for stat in ("running_mean", "running_var")]
        if isinstance(bn, _BatchNorm) and all(n in stored for n in names):
            _refuse_nonfinite_batchnorm(path, names[0], read(names[0]), names[1], read(names[1]), bn.eps)


def _refuse_nonfinite_batchnorm(
    path: str, mean_name: str, mean: torch.Tensor, var_name: str, var: torch.Tensor, eps: float
) -> None:
    low = (var.double() + eps <= 0).nonzero()
    infinite = mean.double().isinf().nonzero()
    if len(low) or len(infinite):
        name, tensor, index = (var_name, var, low) if len(low) else (mean_name, mean, infinite)
        at = int(index[0, 0])
        what = "+ eps is not positive" if len(low) else "is infinite"
        raise BrokenModelError(
            f"the model is broken: its {name} {what} at [{at}] ({float(tensor[at])}), so {path} computes NaN "
            f"or Inf there; {NOTHING_COMPARED}"
        )


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
        folded = _group_of(checked, model, stored, read)
        if isinstance(folded, FoldedGroup) and folded.group.weight in plan.writes:
            folded = f"{folded.group.layer} takes another BatchNorm's fold already; a stream writes each tensor once"
        if isinstance(folded, Skip):
            plan.cannot_stream(rewrite, site.path, folded.reason, folded.cause)
            continue
        if isinstance(folded, str):
            plan.cannot_stream(rewrite, site.path, folded)
            continue
        group = folded.group
        edit = group.edit()
        # the BatchNorm's tensors leave the output: it is recorded as an Identity
        edit.drops = tuple(n for n in sorted(stored) if n.startswith(group.bn + "."))
        plan.edits.append(edit)
        plan.checks.append(folded)
        plan.recorded[group.bn] = {"class": "Identity", "kwargs": {}}
        plan.recorded[group.layer] = folded.recipe
        into = "folded into" if group.direction == "backward" else "folded forward into the next layer"
        plan.report.changes.append(
            Change(
                rewrite.name,
                group.bn,
                rewrite.kind,
                f"{into} {layer_text(group.layer, folded.original)}",
                {
                    "into": group.layer,
                    "layer_class": class_name(folded.original),
                    "direction": group.direction,
                },
            )
        )
    return plan


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


def check_fold(folded: FoldedGroup, original: Tensors, written: Tensors) -> TensorComparison:
    """The group's function before (``original``: its stored input tensors) and after (``written``: the
    layer's weight and bias as written), on a random input, in the stored dtype."""
    group = folded.group
    dtype = original[group.weight].dtype
    before = layer_filled(folded.original, original, group.layer, dtype)
    after = layer_filled(build_from_recipe(folded.recipe), written, group.layer, dtype)
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

    x = layer_probe(folded.original, dtype)
    with torch.no_grad():
        reference = bn(before(x)) if group.direction == "backward" else before(bn(x))
        return compare_tensors(f"{group.bn} -> {group.layer}", reference, after(x))
