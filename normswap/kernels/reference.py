"""Reference math for the norms normswap writes: plain torch, the definition of their semantics.

The reference modules (:mod:`normswap.modules.norms`) compute with it, and the fused ops
(:mod:`.ops`) run it, with its hand-derived backward (:func:`reference_bwd`), wherever Triton does not,
and are held to it.

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
KernelNormKind = Literal["rms", "layer"]


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The tensor in the precision the statistics are computed in: float32, or float64 for float64 (a
    float64 model must not be rounded to float32 inside its norms)."""
    return t if t.dtype == torch.float64 else t.float()


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
        y32 = y32 * (_wide(weight) + weight_offset)
    if bias is not None:
        y32 = y32 + _wide(bias)
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
    x32 = _wide(x)
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
    x32 = _wide(x)
    dims = _reduce_dims(x, normalized_ndim)
    mean = x32.mean(dim=dims, keepdim=True)
    centered = x32 - mean
    rstd = torch.rsqrt(centered.pow(2).mean(dim=dims, keepdim=True) + eps)
    return _apply_affine(centered * rstd, x.dtype, weight, bias, casting, weight_offset)


REFERENCES = {"rms": rms_norm_reference, "layer": layer_norm_reference}


# ---------------------------------------------------------------------------------------------------
# The fused ops' forward and backward by the reference math (CPU and anything Triton does not take)


def reference_fwd(
    kind: KernelNormKind,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(y, h, mean, rstd) of a fused op's forward, by the reference math (``h``: ``x + residual``, None
    without a residual; ``mean`` None for RMSNorm)."""
    h = x + residual if residual is not None else None
    src = h if h is not None else x
    reference = REFERENCES[kind]
    # The reference function defines y; the statistics are recomputed beside it the same way, for the
    # backward. Outputs are made contiguous because the fake implementations promise that.
    y = reference(src, 1, weight, bias, eps, casting, weight_offset).contiguous()
    x32 = src.float()
    mean = None
    if kind == "rms":
        rstd = torch.rsqrt(x32.pow(2).mean(dim=-1) + eps)
    else:
        mean = x32.mean(dim=-1)
        rstd = torch.rsqrt((x32 - mean.unsqueeze(-1)).pow(2).mean(dim=-1) + eps)
        mean = mean.contiguous()
    return y, h.contiguous() if h is not None else None, mean, rstd.contiguous()


def reference_bwd(
    kind: KernelNormKind,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward of the reference math in fp32, from the saved statistics (see ``_kernels`` docs)."""
    n_features = x.shape[-1]
    x32 = x.float()
    dy32 = dy.float()
    rstd_ = rstd.float().unsqueeze(-1)
    if kind == "rms":
        n = x32 * rstd_
    else:
        assert mean is not None
        n = (x32 - mean.float().unsqueeze(-1)) * rstd_
    dw = None
    if weight is not None:
        if casting == "llama":
            # What the reference multiplies: (w + offset) rounded in w's dtype, n rounded to x's dtype.
            w_eff = (weight + weight_offset).float() if weight_offset else weight.float()
            n_w = n.to(x.dtype).float()
        else:
            w_eff = weight.float() + weight_offset
            n_w = n
        g = dy32 * w_eff
        dw = (dy32 * n_w).reshape(-1, n_features).sum(0).to(weight.dtype)
    else:
        g = dy32
    db = dy32.reshape(-1, n_features).sum(0).to(bias.dtype) if bias is not None else None
    dx = g - n * (g * n).mean(dim=-1, keepdim=True)
    if kind == "layer":
        dx = dx - g.mean(dim=-1, keepdim=True)
    dx = dx * rstd_
    if dh is not None:
        dx = dx + dh.float()
    return dx.to(x.dtype).contiguous(), dw, db
