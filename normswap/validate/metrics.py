"""Numbers that say how far one tensor is from another.

Exact rewrites are judged by max abs error relative to the reference's scale, with the dtype's row of
the tolerance table (:mod:`normswap.util.tolerance`), and outputs that are not floating point (ids, argmax, bool masks) by equality;
architectural ones by signal-to-noise ratio, ``20 log10(||ref|| / ||ref - out||)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from normswap.util.tolerance import exact_tolerance, within_exact_tolerance


def sqnr_db(reference: torch.Tensor, output: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; ``inf`` when the two are identical."""
    ref = reference.detach().double()
    noise = (ref - output.detach().double()).norm()
    if noise == 0:
        return math.inf
    signal = ref.norm()
    if signal == 0:
        return -math.inf
    return float(20 * torch.log10(signal / noise))


@dataclass
class TensorComparison:
    name: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_ref: float
    max_rel: float  # max_abs / max|ref|
    sqnr_db: float
    cosine: float
    tolerance: float
    within_tolerance: bool
    top1_agreement: float | None = None
    # integer and bool outputs: how many elements differ (they are compared for equality)
    mismatched: int | None = None


def compare_tensors(name: str, reference: torch.Tensor, output: torch.Tensor) -> TensorComparison:
    """Every figure of ``output`` against ``reference`` (same shape).

    Integer and bool tensors are within tolerance only when equal, element for element (compared as
    they are, not through float64, which cannot tell large ids apart); the other figures still say how
    far they moved. Complex tensors are compared as their real and imaginary parts.
    """
    dtype = reference.dtype
    # None for floating tensors, judged by the tolerance; else whether the two are equal
    exact_match = (
        None
        if reference.is_floating_point() or reference.is_complex()
        else reference.shape == output.shape
        and reference.dtype == output.dtype
        and torch.equal(reference.detach().cpu(), output.detach().cpu())
    )
    if reference.is_complex():
        reference = torch.view_as_real(reference.detach().resolve_conj())
    if output.is_complex():
        output = torch.view_as_real(output.detach().resolve_conj())
    ref = reference.detach().double().cpu()
    out = output.detach().double().cpu()
    if ref.shape != out.shape:
        raise ValueError(f"output {name!r} changed shape: {tuple(ref.shape)} -> {tuple(out.shape)}")
    diff = (ref - out).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_ref = float(ref.abs().max()) if ref.numel() else 0.0
    tol = exact_tolerance(dtype)
    flat_r, flat_o = ref.flatten(), out.flatten()
    denom = flat_r.norm() * flat_o.norm()
    cosine = float(flat_r @ flat_o / denom) if denom > 0 else (1.0 if max_abs == 0 else 0.0)
    top1 = None
    if ref.ndim >= 2 and ref.shape[-1] > 1 and dtype.is_floating_point:
        top1 = float((ref.argmax(-1) == out.argmax(-1)).double().mean())
    return TensorComparison(
        name=name,
        shape=tuple(ref.shape),
        dtype=str(dtype).replace("torch.", ""),
        max_abs=max_abs,
        max_ref=max_ref,
        max_rel=max_abs / max_ref if max_ref > 0 else (0.0 if max_abs == 0 else math.inf),
        sqnr_db=sqnr_db(ref, out),
        cosine=cosine,
        tolerance=tol,
        within_tolerance=(
            exact_match if exact_match is not None else within_exact_tolerance(max_abs, max_ref, dtype)
        ),
        top1_agreement=top1,
        mismatched=int((diff != 0).sum()) if exact_match is not None else None,
    )


def flatten_outputs(
    value: Any, prefix: str = "output", *, floating_only: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """Tensors of a model output (tensor, tuple, dict, HF ModelOutput), with names.

    ``floating_only`` (the default) keeps floating-point tensors only: what SQNR, losses and layer
    figures need. An exact check passes ``floating_only=False`` so that integer, bool and complex
    outputs (argmax, ids, masks) are compared too.
    """
    if isinstance(value, torch.Tensor):
        return [(prefix, value)] if value.is_floating_point() or not floating_only else []
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            found += flatten_outputs(item, f"{prefix}.{key}", floating_only=floating_only)
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        for i, item in enumerate(value):
            found += flatten_outputs(item, f"{prefix}[{i}]", floating_only=floating_only)
    return found


def record_module_inputs(
    model: nn.Module, modules: list[nn.Module], args: tuple | None, kwargs: dict | None
) -> dict[int, torch.Tensor]:
    """First positional input each of ``modules`` receives in one forward pass, keyed by ``id``."""
    seen: dict[int, torch.Tensor] = {}

    def hook(module: nn.Module, inputs: tuple) -> None:
        if id(module) not in seen and inputs and isinstance(inputs[0], torch.Tensor):
            seen[id(module)] = (
                inputs[0].detach().clone()
            )  # in-place ops later in the forward must not reach it

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        with torch.no_grad():
            model(*(args or ()), **(kwargs or {}))
    finally:
        for h in handles:
            h.remove()
    return seen
