"""timm's norm+act modules (BatchNormAct2d and kin): the norm, then a dropout and an activation.

A pass that replaces such a module's norm must keep what runs after it, under the same names. Which
classes these are is discovery's to say (:func:`normswap.discover.own_forward.norm_act_tail`).
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn


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
