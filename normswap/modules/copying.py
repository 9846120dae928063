"""Copy a model so that a pass can edit the copy: ``copy.deepcopy`` plus what deepcopy cannot do alone."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn.utils.weight_norm import WeightNorm


def weight_norm_hooks(module: nn.Module) -> list[tuple[Any, WeightNorm]]:
    """The deprecated ``torch.nn.utils.weight_norm`` hooks on ``module`` (key, hook)."""
    return [(k, h) for k, h in module._forward_pre_hooks.items() if isinstance(h, WeightNorm)]


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy`` that also copies models using the deprecated ``torch.nn.utils.weight_norm``.

    That API keeps the computed weight as a non-leaf tensor attribute, which deepcopy refuses; it is
    left out of the copy and recomputed from the copied ``g`` and ``v``, as the hook would do.
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for _, hook in weight_norm_hooks(module):
            computed = module.__dict__.get(hook.name)
            if isinstance(computed, torch.Tensor):
                memo[id(computed)] = None
    copied = copy.deepcopy(model, memo)
    for module in copied.modules():
        for _, hook in weight_norm_hooks(module):
            setattr(module, hook.name, hook.compute_weight(module))
    return copied
