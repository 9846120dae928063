"""How close a result must stay to its reference: one table by dtype, read by validation, by the fused
kernels' checks and tests, and by the ONNX export.

Three rules read it, each for its own kind of comparison:

- **exact rewrites** (:func:`exact_tolerance`, :func:`within_exact_tolerance`): max abs error relative to
  the reference's scale, ``|out - ref|max <= exact * |ref|max`` (DESIGN.md: fp32 within 1e-5 x
  max|reference|); outputs that are not floating point have no rounding and must be equal;
- **fused kernels against the reference math** (:func:`kernel_tolerance`, :func:`within_kernel_tolerance`):
  elementwise ``|out - ref| <= atol + rtol * |ref|``. fp32 and bf16 are the Liger-Kernel / QuACK test
  tolerances DESIGN.md holds the kernels to; fp16 has three more mantissa bits than bf16. Outputs and
  gradients are held to the same figures;
- **onnxruntime against torch** (:func:`onnx_tolerance`): ``|ort - torch|max <= onnx * |torch|max``,
  looser than the exact rule: onnxruntime fuses and reorders reductions (e.g. its LayerNormalization
  kernel) on purpose.

A dtype missing from the table (complex, fp8...) is held to fp32's row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class Tolerance:
    """The figures one dtype is held to (see the module docstring for the rule each one feeds)."""

    exact: float  # exact rewrites: |out - ref|max <= exact * |ref|max
    atol: float  # fused kernels: |out - ref| <= atol + rtol * |ref|, elementwise
    rtol: float
    onnx: float  # onnxruntime: |ort - torch|max <= onnx * |torch|max


TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(exact=1e-10, atol=1e-4, rtol=1e-5, onnx=1e-4),
    torch.float32: Tolerance(exact=1e-5, atol=1e-4, rtol=1e-5, onnx=1e-4),
    torch.float16: Tolerance(exact=2e-3, atol=1e-2, rtol=5e-3, onnx=1e-2),
    torch.bfloat16: Tolerance(exact=1.6e-2, atol=1e-1, rtol=2e-2, onnx=2e-2),
}

# The exact column of the table, for callers that index it by dtype (never edited on its own).
EXACT_TOLERANCE: Mapping[torch.dtype, float] = MappingProxyType({d: t.exact for d, t in TOLERANCE.items()})


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The table's row for ``dtype``; fp32's for a dtype the table does not list."""
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])


def exact_tolerance(dtype: torch.dtype) -> float:
    """Relative max-abs tolerance of exact rewrites; 0 (equal or wrong) for integer and bool outputs,
    which have no rounding."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0
    return tolerance(dtype).exact


def within_exact_tolerance(max_abs: float, max_ref: float, dtype: torch.dtype) -> bool:
    """The exact-rewrite rule: ``max_abs <= exact * max_ref`` (an all-zero reference needs an all-zero
    difference)."""
    return max_abs <= exact_tolerance(dtype) * max(max_ref, 1e-30) or max_abs == 0


def kernel_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of fused-kernel outputs and gradients of ``dtype``."""
    row = tolerance(dtype)
    return row.atol, row.rtol


def within_kernel_tolerance(reference: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether ``output`` is within the kernel tolerance of ``reference`` everywhere."""
    atol, rtol = kernel_tolerance(reference.dtype)
    ref = reference.detach().double()
    out = output.detach().double().to(ref.device)
    return bool(((out - ref).abs() <= atol + rtol * ref.abs()).all())


def kernel_difference(reference: torch.Tensor, output: torch.Tensor) -> tuple[float, bool]:
    """(max abs difference, whether ``output`` reproduces ``reference``: same shape and dtype, within the
    kernel tolerance everywhere); the difference is inf when the shapes differ."""
    if output.shape != reference.shape:
        return math.inf, False
    diff = float((output.double() - reference.double()).abs().max()) if reference.numel() else 0.0
    return diff, output.dtype == reference.dtype and within_kernel_tolerance(reference, output)


def onnx_tolerance(dtype_name: str) -> float:
    """Relative max-abs tolerance of onnxruntime's outputs, for an output dtype as comparisons record it
    ("float32", "bfloat16")."""
    dtype = getattr(torch, dtype_name, torch.float32)
    return tolerance(dtype if isinstance(dtype, torch.dtype) else torch.float32).onnx
