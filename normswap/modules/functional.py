"""Reference math for the norms normswap writes: plain torch, the definition of their semantics.

Casting modes (the same names the fused kernels take):

- ``"none"``: compute in fp32 from the input, apply weight and bias in fp32, cast once at the end.
  This is what ``torch.nn.functional.rms_norm``/``layer_norm`` do for reduced-precision inputs.
- ``"llama"``: HF Llama / T5: the statistics and the normalization run in fp32, the normalized value is
  cast back to the input dtype *before* the weight multiply, so the multiply rounds in the input dtype.
- ``"gemma"``: Gemma: everything in fp32, the weight enters as ``(weight_offset + w)``, cast at the end.

``weight_offset`` is independent of the casting mode so a (1 + w) norm with llama casting can be stated.
"""

from __future__ import annotations

from typing import Literal

import torch

CastingMode = Literal["none", "llama", "gemma"]
CASTING_MODES: tuple[str, ...] = ("none", "llama", "gemma")


def _reduce_dims(x: torch.Tensor, normalized_ndim: int) -> tuple[int, ...]:
    return tuple(range(x.ndim - normalized_ndim, x.ndim))


def _apply_affine(
    y32: torch.Tensor,
    x_dtype: torch.dtype,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    casting: str,
    weight_offset: float,
) -> torch.Tensor:
    if casting == "llama":
        y = y32.to(x_dtype)
        if weight is not None:
            y = (weight + weight_offset) * y if weight_offset else weight * y
        if bias is not None:
            y = y + bias
        return y
    if weight is not None:
        y32 = y32 * (weight.float() + weight_offset)
    if bias is not None:
        y32 = y32 + bias.float()
    return y32.to(x_dtype)


def rms_norm_reference(
    x: torch.Tensor,
    normalized_ndim: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str = "none",
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * (offset + w) + b over the last ``normalized_ndim`` dims."""
    x32 = x.float()
    dims = _reduce_dims(x, normalized_ndim)
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + eps)
    return _apply_affine(x32 * rstd, x.dtype, weight, bias, casting, weight_offset)


def layer_norm_reference(
    x: torch.Tensor,
    normalized_ndim: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str = "none",
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """y = (x - mean(x)) / sqrt(var(x) + eps) * (offset + w) + b, biased variance, last dims."""
    x32 = x.float()
    dims = _reduce_dims(x, normalized_ndim)
    mean = x32.mean(dim=dims, keepdim=True)
    centered = x32 - mean
    rstd = torch.rsqrt(centered.pow(2).mean(dim=dims, keepdim=True) + eps)
    return _apply_affine(centered * rstd, x.dtype, weight, bias, casting, weight_offset)
