"""The per-tensor edits of the exact rewrite a streamed conversion asks for (:mod:`normswap.passes.core.edits`).

Each family states its own groups in its ``stream.py``; :data:`PLANNERS` maps a rewrite's option (as
:mod:`normswap.rewrites` spells it) to them. The registry's ``streams`` says the same set
(``tests/test_rewrites.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from normswap.passes.affine.stream import plan_fold
from normswap.passes.batchnorm.stream import plan_batchnorm_folds
from normswap.passes.core.base import PassContext, build_context
from normswap.passes.core.edits import EditPlan
from normswap.passes.layerscale.stream import plan_layerscale_folds
from normswap.passes.recenter.stream import plan_recenter
from normswap.passes.weightnorm.layers import AddWeightNorm, RemoveWeightNorm
from normswap.passes.weightnorm.stream import plan_weight_norm

Read = Callable[[str], torch.Tensor]
# option -> the family's planner: (model on meta, the pass context on its graph, stored names, read)
GRAPH_PLANNERS: dict[str, Callable[[nn.Module, PassContext, set[str], Read], EditPlan]] = {
    "--fold-bn": plan_batchnorm_folds,
    "--fold-layerscale": lambda model, ctx, stored, read: plan_layerscale_folds(model, ctx, stored),
    "--fold-norm-affine": lambda model, ctx, stored, read: plan_fold(model, ctx, stored),
    "--to rmsnorm": lambda model, ctx, stored, read: plan_recenter(model, ctx, stored),
}
# the parameters passes: no graph, the pass itself is given (it carries its options)
PARAMETER_PLANNERS = frozenset({"--add-weight-norm", "--remove-weight-norm"})


def plan_edits(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: dict[str, Any],
    stored: set[str],
    option: str,
    *,
    read: Read,
    weight_norm: AddWeightNorm | RemoveWeightNorm | None = None,
) -> EditPlan:
    """The edit groups of the exact rewrite ``option`` of ``model`` (on the meta device), whose checkpoint
    stores the tensors named in ``stored``. The pass's own checks decide every site, on the captured
    graph; ``read`` gives a stored tensor by name, for the checks that need values (BatchNorm
    statistics); ``weight_norm`` is the weight-norm pass, for those options."""
    if option in PARAMETER_PLANNERS:
        if weight_norm is None:
            raise ValueError(f"{option} streams its pass: give weight_norm")
        return plan_weight_norm(model, weight_norm, stored)
    planner = GRAPH_PLANNERS.get(option)
    if planner is None:
        raise ValueError(f"{option} does not stream")
    ctx = build_context(model, example_args, example_kwargs)
    plan = planner(model, ctx, stored, read)
    if plan.report is not None:  # what the in-memory driver says of its capture, said here too
        plan.report.graph_method = ctx.captured.method
        plan.report.graph_error = ctx.captured.reason
    return plan
