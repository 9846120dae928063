"""Input shapes as the reports write them: every tensor's shape among nested inputs, and ``2x12``."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


def input_shapes(args: tuple | None, kwargs: dict | None) -> list[list[int]]:
    """The shape of every tensor among the inputs, in argument order (nested containers included)."""
    leaves, _ = pytree.tree_flatten((tuple(args or ()), dict(kwargs or {})))
    return [list(t.shape) for t in leaves if isinstance(t, torch.Tensor)]


def format_shapes(shapes: list[list[int]]) -> str:
    """``1x3x16x16``, or ``2x12 + 2x12`` for several tensors (a 0-dim tensor reads ``scalar``)."""
    return " + ".join("x".join(str(s) for s in shape) or "scalar" for shape in shapes) or "no tensor"


__all__ = ["format_shapes", "input_shapes"]
