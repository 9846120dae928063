"""How close the fused ops must stay to the reference math: one table, for tests and passes alike.

``|fused - reference| <= atol + rtol * |reference|`` elementwise, by the reference's dtype. fp32 and
bf16 are the Liger-Kernel / QuACK test tolerances DESIGN.md holds the kernels to; fp16 has three more
mantissa bits than bf16. Outputs and gradients are held to the same figures.
"""

from __future__ import annotations

import math

import torch

KERNEL_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 5e-3),
    torch.bfloat16: (1e-1, 2e-2),
}


def kernel_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for outputs of ``dtype``; dtypes the kernels do not take (fp64) get fp32's."""
    return KERNEL_TOLERANCE.get(dtype, KERNEL_TOLERANCE[torch.float32])


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
