"""timm's norm+act modules (BatchNormAct2d and kin): the norm, then a dropout and an activation.

A pass that replaces such a module's norm must keep what runs after it, under the same names.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

from torch import nn

_TIMM_NORM_ACT = ("BatchNormAct2d", "SyncBatchNormAct", "FrozenBatchNormAct2d")


def norm_act_tail(bn: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """``[("drop", m), ("act", m)]`` for timm's norm+act classes (what runs after the norm, in order),
    None for any other class."""
    timm_layers = sys.modules.get("timm.layers.norm_act")  # imported already if the model uses it
    if timm_layers is None:
        return None
    for name in _TIMM_NORM_ACT:
        cls = getattr(timm_layers, name, None)
        if cls is not None and type(bn).forward is cls.forward:
            return [(part, getattr(bn, part)) for part in ("drop", "act") if hasattr(bn, part)]
    return None


def is_identity(modules: list[tuple[str, nn.Module]]) -> bool:
    return all(isinstance(m, nn.Identity) for _, m in modules)


def with_tail(
    tail: list[tuple[str, nn.Module]], head: nn.Module | None = None, head_name: str = "affine"
) -> nn.Module:
    """What takes the norm+act module's place: ``head`` (or nothing) followed by the kept tail.

    The tail keeps its names (``bn1.act``), so its parameters keep their state_dict keys."""
    parts = ([(head_name, head)] if head is not None else []) + (tail if not is_identity(tail) else [])
    if not parts:
        return nn.Identity()
    if len(parts) == 1 and head is not None:
        return head
    return nn.Sequential(OrderedDict(parts))
