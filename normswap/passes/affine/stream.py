"""``--fold-norm-affine`` as per-tensor edits for a streamed checkpoint.

The norms and their readers are :class:`~normswap.passes.affine.fold.FoldNormAffine`'s own checks, run on
the model built on the meta device. One group is one norm with the linears that read it:
``W' = W diag(g)``, ``c' = c + W b`` (:func:`~normswap.passes.affine.fold.fold_affine_into_linear`); the
norm keeps its class, its weight stored as the neutral value (1, or 0 for a ``(1 + w)`` norm) and its
bias as 0, so the stock loader reads the result. A reader without a bias that would need one is refused
(the config builds none).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from normswap.passes.affine.fold import AffinePlan, FoldNormAffine, fold_affine_into_linear
from normswap.passes.core.base import Change
from normswap.passes.core.edits import EditPlan, TensorEdit, Tensors, plan_for


def _fold_in_slices(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gain: torch.Tensor | None,
    shift: torch.Tensor | None,
    in_dim: int,
    slice_elements: int = 1 << 19,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`fold_affine_into_linear` on slices of output features, written over ``weight`` itself, so
    that the group holds the weight once and float64 temporaries of a slice (4 MB, which stay in the
    CPU's cache), not of the weight: an LM head of 32000 x 4096 would need 2 GB of them at once. Each
    output feature's row is computed whole from its own values, read before they are written, so the
    result is the same as on the whole weight."""
    out_dim = 1 - in_dim
    rows = weight.shape[out_dim]
    step = max(1, slice_elements // max(1, weight.numel() // max(1, rows)))
    new_b: torch.Tensor | None = None
    for start in range(0, rows, step):
        end = min(rows, start + step)
        part_b = bias[start:end] if bias is not None else None
        part_w = weight.narrow(out_dim, start, end - start)
        w, b = fold_affine_into_linear(part_w, part_b, gain, shift, in_dim)
        part_w.copy_(w)
        if b is not None:
            if new_b is None:
                new_b = torch.empty(rows, dtype=b.dtype)
            new_b[start:end] = b
    return weight, new_b


def _fold_edit(plan: AffinePlan, stored: set[str]) -> TensorEdit | str:
    site = plan.site
    norm_w = f"{site.path}.{plan.weight_name}" if plan.weight_name else None
    norm_b = f"{site.path}.{plan.bias_name}" if plan.bias_name else None
    offset = float(site.weight_offset)
    readers = [(f"{r.path}.{r.weight_name}", f"{r.path}.{r.bias_name}", r.in_dim) for r in plan.readers]
    for weight, bias, _ in readers:
        if weight not in stored:
            return f"{weight} is not in the checkpoint's files"
        if norm_b is not None and bias not in stored:
            return f"folding the norm's bias needs a bias in {weight.rpartition('.')[0]}, which the config does not build"
    reads = tuple(n for n in (norm_w, norm_b) if n) + tuple(
        n for w, b, _ in readers for n in (w, b) if n in stored
    )

    def compute(t: Tensors) -> Tensors:
        gain = t[norm_w].double() + offset if norm_w else None
        shift = t[norm_b] if norm_b else None
        out: Tensors = {}
        for weight, bias, in_dim in readers:
            new_w, new_b = _fold_in_slices(t[weight], t.get(bias), gain, shift, in_dim)
            out[weight] = new_w
            if new_b is not None:
                out[bias] = new_b
        if norm_w:  # neutral: the stored w with which the norm's own multiply is the identity
            out[norm_w] = torch.full_like(t[norm_w], 1.0 - offset)
        if norm_b:
            out[norm_b] = torch.zeros_like(t[norm_b])
        return out

    writes = reads
    return TensorEdit(f"fold {site.path}", reads, compute, writes)


def plan_fold(model: nn.Module, ctx: Any, stored: set[str]) -> EditPlan:
    """The groups of ``--fold-norm-affine`` on ``model`` (meta device), whose files store ``stored``."""
    rewrite = FoldNormAffine()
    plan = plan_for(rewrite)
    for site, checked in plan.decided(rewrite, ctx, rewrite.prepare(ctx)):
        edit = _fold_edit(checked, stored)
        if isinstance(edit, str):
            plan.cannot_stream(rewrite, site.path, edit)
            continue
        plan.edits.append(edit)
        into = ", ".join(r.path for r in checked.readers)
        plan.report.changes.append(
            Change(rewrite.name, site.path, rewrite.kind, f"affine folded into {into}; stored neutral")
        )
    return plan
