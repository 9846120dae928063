"""``--fold-norm-affine`` as per-tensor edits for a streamed checkpoint.

The norms and their readers are :class:`~normswap.passes.affine.fold.FoldNormAffine`'s own checks, run on
the model built on the meta device. One group is one norm with the linears that read it, the group the
in-memory pass runs too (:func:`~normswap.passes.affine.arithmetic.fold_edit`): ``W' = W diag(g)``,
``c' = c + W b``; the norm keeps its class, its weight stored as the neutral value (1, or 0 for a
``(1 + w)`` norm) and its bias as 0, so the stock loader reads the result. A reader without a bias that
needs one gains it, as in memory: the bias is created beside its weight and the layer recorded as torch's
own Linear/Conv with a bias (:mod:`normswap.modules.recipes`), so the directory is judged for stock
loading as the in-memory route's is; a reader of another class is skipped with the reason (a recipe
would lose its forward).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from normswap.modules.recipes import module_recipe
from normswap.passes.affine.arithmetic import fold_edit
from normswap.passes.affine.fold import FoldNormAffine
from normswap.passes.batchnorm.stream import STREAM_LAYERS
from normswap.passes.core.base import Change
from normswap.passes.core.edits import EditPlan, plan_for


def plan_fold(model: nn.Module, ctx: Any, stored: set[str]) -> EditPlan:
    """The groups of ``--fold-norm-affine`` on ``model`` (meta device), whose files store ``stored``."""
    rewrite = FoldNormAffine()
    plan = plan_for(rewrite)
    for site, checked in plan.decided(rewrite, ctx, rewrite.prepare(ctx)):
        edit = fold_edit(checked, stored)
        if isinstance(edit, str):
            plan.cannot_stream(rewrite, site.path, edit)
            continue
        gaining = [r for r in checked.readers if f"{r.path}.{r.bias_name}" in edit.creates]
        other = next((r for r in gaining if type(r.module) not in STREAM_LAYERS), None)
        if other is not None:
            plan.cannot_stream(
                rewrite,
                site.path,
                f"folding the norm's bias gives {other.path} ({type(other.module).__name__}) a bias, which a "
                "stream records only for torch's own Linear/Conv (convert it in memory)",
            )
            continue
        for reader in gaining:
            recipe = module_recipe(reader.module)
            assert recipe is not None  # a class of STREAM_LAYERS has one
            plan.recorded[reader.path] = {**recipe, "kwargs": {**recipe["kwargs"], "bias": True}}
        plan.edits.append(edit)
        into = ", ".join(r.path for r in checked.readers)
        plan.report.changes.append(
            Change(rewrite.name, site.path, rewrite.kind, f"affine folded into {into}; stored neutral")
        )
    return plan
