"""``--add-weight-norm`` and ``--remove-weight-norm`` as per-tensor edits for a streamed checkpoint.

The layers are chosen by :class:`~normswap.passes.weightnorm.layers.AddWeightNorm` /
:class:`~normswap.passes.weightnorm.layers.RemoveWeightNorm`'s own checks on the model built on the meta
device. A group is one layer's weight:

- adding: reads ``weight``, writes ``parametrizations.weight.original0`` (``g = ||w||`` over every dim but
  ``dim``, in float64, rounded once) and ``original1`` (``v = w``, the input's values); drops ``weight``.
  The values a check needs (an all-zero slice, ``g * v / ||v||`` missing ``w`` in its dtype) are judged
  when the group is read: a layer that fails stops the run with the reason, and nothing is written;
- removing: reads ``original0`` and ``original1``, writes ``weight = g * v / ||v||`` (float64, cast to
  ``v``'s dtype); drops the two.

Either way the layer's class changes against what the config builds (a parametrized layer, or a plain one
where the config builds weight norm, as wav2vec2's positional conv), so each is recorded as a recipe
(:mod:`normswap.modules.recipes`, ``weight_norm: {dim}`` for a parametrized one) and normswap's loader
rebuilds it. Refused in a stream, with the reason: a layer that is not torch's own Conv1d/2d/3d or
Linear (a recipe names only those), and the deprecated hook form (``weight_g``/``weight_v``).

each group's ``check`` verifies a written result layer by layer: the layer as it was (from the input's
tensors) and as written, on a random input, within the exact tolerance of the stored dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from normswap.modules.recipes import build_from_recipe, module_recipe
from normswap.passes.batchnorm.stream import STREAM_LAYERS, layer_filled, layer_probe
from normswap.passes.core.base import Change, parameters_context
from normswap.passes.core.edits import EditPlan, TensorEdit, Tensors, plan_for
from normswap.passes.weightnorm.layers import (
    AddPlan,
    AddWeightNorm,
    RemovePlan,
    RemoveWeightNorm,
    weight_from_weight_norm,
    weight_norm_magnitude,
    weight_norm_problem,
)
from normswap.verify.metrics import TensorComparison, compare_tensors


class WeightNormValueError(ValueError):
    """A layer's values that weight norm cannot take over exactly, found while streaming."""


@dataclass(frozen=True)
class WeightNormGroup:
    """One streamed layer: its path, the direction, the dim, its tensors before and after, and the layer
    as it was (on the meta device) and as recorded."""

    path: str
    adding: bool
    dim: int
    before: tuple[str, ...]  # stored names read (weight; or g, v)
    after: tuple[str, ...]  # names written (g, v; or weight)
    original: nn.Module
    recipe: dict[str, Any]
    own: tuple[str, ...]  # the layer's own stored tensors (its bias, as it was)

    def check(
        self, read_original: Callable[[str], torch.Tensor], read_written: Callable[[str], torch.Tensor]
    ) -> TensorComparison:
        """The layer as written against the layer as it was, on a random input, in the stored dtype."""
        original = {name: read_original(name) for name in dict.fromkeys((*self.before, *self.own))}
        written = {name: read_written(name) for name in self.after}
        written.update({n: original[n] for n in self.own if n not in self.before})
        dtype = original[self.before[-1]].dtype
        before = layer_filled(self.original, original, self.path, dtype)
        after = layer_filled(build_from_recipe(self.recipe, device="meta"), written, self.path, dtype)
        x = layer_probe(before, dtype)
        with torch.no_grad():
            return compare_tensors(self.path, before(x), after(x))


def _base_class(module: nn.Module) -> type[nn.Module]:
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def _group(plan: AddPlan | RemovePlan, adding: bool, stored: set[str]) -> WeightNormGroup | str:
    site = plan.site
    module, path = site.module, site.module_path
    if _base_class(module) not in STREAM_LAYERS:
        return (
            f"{type(module).__name__} is not torch's own Conv1d/2d/3d or Linear: a recorded recipe would lose "
            "its class (convert it in memory)"
        )
    g, v = (f"{path}.parametrizations.weight.original{i}" for i in (0, 1))
    weight = f"{path}.weight"
    if adding:
        assert isinstance(plan, AddPlan)
        dim, before, after = plan.dim, (weight,), (g, v)
        plain = module_recipe(module)
        recipe = None if plain is None else {**plain, "weight_norm": {"dim": dim}}

    else:
        if site.name != "weight" or not parametrize.is_parametrized(module, "weight"):
            return "the hook form of weight norm (weight_g, weight_v) does not stream (convert it in memory)"
        dim, before, after = int(module.parametrizations.weight[0].dim), (g, v), (weight,)
        recipe = module_recipe(module)
        recipe = None if recipe is None else {k: value for k, value in recipe.items() if k != "weight_norm"}
    missing = [name for name in before if name not in stored]
    if missing:
        return f"{missing[0]} is not in the checkpoint's files"
    assert recipe is not None  # a class of STREAM_LAYERS has one
    own = tuple(sorted(n for n in stored if n.startswith(path + ".") and "." not in n[len(path) + 1 :]))
    return WeightNormGroup(path, adding, dim, before, after, module, recipe, own)


def _compute(group: WeightNormGroup) -> Callable[[Tensors], Tensors]:
    def compute(t: Tensors) -> Tensors:
        if group.adding:
            weight = t[group.before[0]]
            problem = weight_norm_problem(weight, group.dim)
            if problem is not None:
                raise WeightNormValueError(f"{group.path}: {problem}")
            g = weight_norm_magnitude(weight, group.dim).to(weight.dtype)
            return {group.after[0]: g, group.after[1]: weight}
        g, v = (t[name] for name in group.before)
        return {group.after[0]: weight_from_weight_norm(g, v, group.dim)}

    return compute


def _shapes(group: WeightNormGroup) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors a group writes, from the layer's weight shape (g's as torch stores it)."""
    weight = torch.empty(tuple(_base_weight(group.original).shape), device="meta")
    if not group.adding:
        return {group.after[0]: tuple(weight.shape)}
    return {
        group.after[0]: tuple(weight_norm_magnitude(weight, group.dim).shape),
        group.after[1]: tuple(weight.shape),
    }


def _base_weight(module: nn.Module) -> torch.Tensor:
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations.weight.original1
    return module.weight


def plan_weight_norm(
    model: nn.Module,
    rewrite: AddWeightNorm | RemoveWeightNorm,
    stored: set[str],
) -> EditPlan:
    """The edit groups of one weight-norm pass on ``model`` (meta device), with the layers for
    their checks, the recipes and the report."""
    adding = isinstance(rewrite, AddWeightNorm)
    ctx = parameters_context(model)
    plan = plan_for(rewrite)
    for site, checked in plan.decided(rewrite, ctx):
        group = _group(checked, adding, stored)
        if isinstance(group, str):
            plan.cannot_stream(rewrite, site.path, group)
            continue
        shapes = _shapes(group)
        anchor = group.before[-1]  # new tensors go where the layer's weight was
        creates = {name: (anchor, shapes[name]) for name in group.after}
        plan.edits.append(
            TensorEdit(
                f"{rewrite.name} {group.path}",
                group.before,
                _compute(group),
                group.after,
                creates=creates,
                drops=group.before,
            )
        )
        plan.checks.append(group)
        plan.recorded[group.path] = group.recipe
        dim = "all" if group.dim == -1 else group.dim
        what = (
            f"weight -> g * v / ||v|| (dim {dim})"
            if adding
            else f"g * v / ||v|| folded into a plain weight (dim {dim})"
        )
        plan.report.changes.append(
            Change(
                rewrite.name, site.path, rewrite.kind, what, {"dim": None if group.dim == -1 else group.dim}
            )
        )
    return plan
