"""When the fused kernels compute a norm, stated once for :class:`normswap.passes.FuseNorm` (norm modules)
and :class:`normswap.passes.FuseGraphNorm` (norms inside a forward). Both describe the norm by its record
(:class:`normswap.discover.NormSemantics`) and the tensors it stores; :func:`fused_call` says whether the
kernels compute it (an RMSNorm or LayerNorm over the trailing dims, or over one channel dim with vector
affine tensors; known shape and eps; a casting mode they implement; stored weight and bias of the
normalized shape), and :func:`measure` whether the fused result, run on the norm's input, reproduces its
output: same shape and dtype, within the kernel tolerance (``normswap.util.tolerance``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from normswap.discover import NormKind, NormSemantics
from normswap.kernels.reference import CASTING_MODES
from normswap.modules.fused import channel_dim_of
from normswap.util.tolerance import kernel_difference, kernel_tolerance

FUSED_KINDS = (NormKind.RMS, NormKind.LAYER)


def kind_refusal(kind: str) -> str | None:
    """Why the fused kernels cannot compute a norm of ``kind``, or None for RMSNorm and LayerNorm."""
    if kind in FUSED_KINDS:
        return None
    return f"{kind} norm: the fused kernels normalize features, not over positions"


def fused_call(norm: NormSemantics, stored: Mapping[str, torch.Tensor]) -> dict[str, Any] | str:
    """The keyword arguments of :func:`normswap.kernels.fused_norm` that compute ``norm``, or why there
    are none. ``stored``: the tensors the norm's owner stores, by the names of ``norm``."""
    if (refusal := kind_refusal(norm.kind)) is not None:
        return refusal
    shape, dims = norm.normalized_shape, norm.normalized_dims
    if shape is None or norm.eps is None:
        return "its normalized shape or eps could not be determined"
    channel_dim = channel_dim_of(dims)
    if channel_dim is not None and len(shape) != 1:
        return (
            f"normalizes dim {channel_dim} with affine tensors of shape {shape}: the fused channel norm "
            "keeps them as vectors, which would change the checkpoint"
        )
    if dims != tuple(range(-len(shape), 0)) and channel_dim is None:
        return (
            f"normalizes dims {dims}: neither the trailing {len(shape)} dim(s) nor one channel dim, which "
            "the fused kernels normalize"
        )
    if norm.casting not in CASTING_MODES:
        return f"casting mode {norm.casting!r} is not one the kernels implement {CASTING_MODES}"
    for role, has, name in (("weight", norm.affine, norm.weight_name), ("bias", norm.bias, norm.bias_name)):
        if not has:
            continue
        if name is None:
            return f"its {role} is computed in the forward, not a stored tensor"
        if name not in stored:
            return f"its {role} {name} is not a tensor it stores"
        if (got := tuple(stored[name].shape)) != shape:
            return f"its {role} {name} has shape {got}, not the normalized shape {shape}"
    return {
        "eps": norm.eps,
        "kind": str(norm.kind),
        "casting": norm.casting,
        "weight_offset": norm.weight_offset,
        "normalized_ndim": len(shape) if channel_dim is None else 1,
        "channel_dim": channel_dim,
    }


@dataclass(frozen=True)
class Measured:
    """The fused result's max abs difference from the norm's output, its tolerance, what it ran on."""

    diff: float
    atol: float
    rtol: float
    where: str

    @property
    def summary(self) -> str:
        return f"site max abs diff {self.diff:.3g}"

    def details(self) -> dict[str, Any]:
        tolerance = {"atol": self.atol, "rtol": self.rtol}
        return {"max_abs_diff": self.diff, "tolerance": tolerance, "measured_on": self.where}


def measure(reference: torch.Tensor, fused: torch.Tensor | None, what: str, where: str) -> Measured | str:
    """``fused``, the fused ``what`` ("module", "call") run on the norm's input from ``where`` (None: it
    failed on it), against the norm's output ``reference``; or why it does not reproduce it."""
    atol, rtol = kernel_tolerance(reference.dtype)
    if fused is None or fused.shape != reference.shape:
        problem = f"does not give its output's shape on {where}"
    else:
        diff, reproduced = kernel_difference(reference, fused)
        if reproduced:
            return Measured(diff, atol, rtol, where)
        problem = (
            f"gives {fused.dtype}, not its output's {reference.dtype}, on {where}"
            if fused.dtype != reference.dtype
            else f"differs from it by {diff:.3g} on {where}, beyond the kernel tolerance (atol {atol:g}, "
            f"rtol {rtol:g})"
        )
    return f"the fused {what} {problem}: its semantics are not the ones read off it"
