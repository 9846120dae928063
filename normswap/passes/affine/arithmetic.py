"""The arithmetic of ``--fold-norm-affine``, and the fold of one norm as a group of tensor edits that both
routes run: the in-memory pass on the model's own tensors, the stream on stored ones.

One group is one norm with the linears that read it: ``W' = W diag(g)``, ``c' = c + W b``
(:func:`fold_affine_into_linear`, in float64, on slices of the weight: :func:`fold_in_slices`); the
norm's weight becomes the neutral value (1, or 0 for a ``(1 + w)`` norm) and its bias 0, so a model
directory keeps the norm's class and loads with stock ``from_pretrained`` (in memory the pass then
replaces the norm by one without affine). A reader without a bias that the norm's shift needs gains one
on both routes (the stream records that layer's class with its bias).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from normswap.passes.core.edits import TensorEdit, Tensors

if TYPE_CHECKING:
    from normswap.passes.affine.fold import AffinePlan


def fold_affine_into_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gain: torch.Tensor | None,
    shift: torch.Tensor | None,
    in_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorb ``y = x * gain + shift`` (per input feature) into a linear map that reads ``y``.

    ``in_dim`` is the weight's input-feature dim: 1 for ``nn.Linear`` (``(out, in)``), 0 for HF
    ``Conv1D`` (``(in, out)``). Returns ``(W', b')`` in ``weight``'s dtype; ``b'`` is None only when
    there was no bias and no shift. Math in float64.
    """
    weight = weight.detach()
    shape = [1, 1]
    shape[in_dim] = -1
    new_w = torch.empty_like(weight, memory_format=torch.contiguous_format)
    if gain is not None:
        # the product promotes to float64 and rounds once into new_w's dtype: no float64 copy of W
        torch.mul(weight, gain.detach().double().reshape(shape), out=new_w)
    else:
        new_w.copy_(weight)
    new_b = bias.detach().double() if bias is not None else None
    if shift is not None:
        w, s = weight.double(), shift.detach().double()
        moved = w @ s if in_dim == 1 else s @ w  # the shift as every output feature sees it
        new_b = moved if new_b is None else new_b + moved
    dtype = weight.dtype
    return new_w, (new_b.to(bias.dtype if bias is not None else dtype) if new_b is not None else None)


def fold_in_slices(
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
                new_b = torch.empty(rows, dtype=b.dtype, device=b.device)
            new_b[start:end] = b
    return weight, new_b


def fold_edit(plan: AffinePlan, stored: set[str]) -> TensorEdit | str:
    """The fold of ``plan`` as one group, reading the tensors named in ``stored`` (a checkpoint's, or a
    model's own); a reader without a bias gains one where the norm's shift needs it, on every route.
    Returns the group or why not."""
    site = plan.site
    norm_w = f"{site.path}.{plan.weight_name}" if plan.weight_name else None
    norm_b = f"{site.path}.{plan.bias_name}" if plan.bias_name else None
    offset = float(site.weight_offset)
    readers = [(f"{r.path}.{r.weight_name}", f"{r.path}.{r.bias_name}", r.in_dim) for r in plan.readers]
    creates: dict[str, tuple[str, tuple[int, ...]]] = {}
    for reader, (weight, bias, in_dim) in zip(plan.readers, readers, strict=True):
        if weight not in stored:
            return f"{weight} is not in the checkpoint's files"
        if norm_b is not None and bias not in stored:
            creates[bias] = (weight, (getattr(reader.module, reader.weight_name).shape[1 - in_dim],))
    reads = tuple(n for n in (norm_w, norm_b) if n) + tuple(
        n for w, b, _ in readers for n in (w, b) if n in stored
    )

    def compute(t: Tensors) -> Tensors:
        gain = t[norm_w].double() + offset if norm_w else None
        shift = t[norm_b] if norm_b else None
        out: Tensors = {}
        for weight, bias, in_dim in readers:
            new_w, new_b = fold_in_slices(t[weight], t.get(bias), gain, shift, in_dim)
            out[weight] = new_w
            if new_b is not None:
                out[bias] = new_b
        if norm_w:  # neutral: the stored w with which the norm's own multiply is the identity
            out[norm_w] = torch.full_like(t[norm_w], 1.0 - offset)
        if norm_b:
            out[norm_b] = torch.zeros_like(t[norm_b])
        return out

    return TensorEdit(f"fold {site.path}", reads, compute, reads + tuple(creates), creates=creates)
