"""The per-tensor edits of the exact rewrite a streamed conversion asks for (:mod:`normswap.passes.core.edits`).

Each family states its own groups in its ``stream.py``; this picks one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from normswap.passes.affine.stream import plan_fold
from normswap.passes.batchnorm.stream import plan_batchnorm_folds
from normswap.passes.core.base import build_context
from normswap.passes.core.edits import EditPlan
from normswap.passes.recenter.stream import plan_recenter
from normswap.passes.weightnorm.layers import AddWeightNorm, RemoveWeightNorm
from normswap.passes.weightnorm.stream import plan_weight_norm


def plan_edits(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: dict[str, Any],
    stored: set[str],
    *,
    fold_norm_affine: bool = False,
    recenter: bool = False,
    fold_bn: bool = False,
    read: Callable[[str], torch.Tensor] | None = None,
    weight_norm: AddWeightNorm | RemoveWeightNorm | None = None,
) -> EditPlan:
    """The edit groups of one exact rewrite of ``model`` (on the meta device), whose checkpoint stores the
    tensors named in ``stored``. The pass's own checks decide every site, on the captured graph; ``read``
    gives a stored tensor by name, for the checks that need values (BatchNorm statistics)."""
    if [fold_norm_affine, recenter, fold_bn, weight_norm is not None].count(True) != 1:
        raise ValueError("plan one rewrite: fold_norm_affine, recenter, fold_bn or weight_norm")
    if weight_norm is not None:  # a parameters pass: no graph
        return plan_weight_norm(model, weight_norm, stored)
    ctx = build_context(model, example_args, example_kwargs)
    if fold_norm_affine:
        return plan_fold(model, ctx, stored)
    if fold_bn:
        if read is None:
            raise ValueError("fold_bn reads the stored BatchNorm statistics: give read")
        return plan_batchnorm_folds(model, ctx, stored, read)
    return plan_recenter(model, ctx, stored)
