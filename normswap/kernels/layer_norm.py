"""Triton launchers for LayerNorm and residual-add + LayerNorm (tier 1: no autograd, no dispatch).

``y = (x - mean) / sqrt(var + eps) * (offset + w) + b`` over the last dim (biased variance), with the
casting modes of :mod:`normswap.modules.functional`. These run the Triton kernels on whatever device the
tensors are on: CUDA, or CPU under ``TRITON_INTERPRET=1``. Most code wants
:func:`normswap.kernels.layer_norm` instead, which dispatches and differentiates.
"""

from __future__ import annotations

import torch

from normswap.kernels._launch import norm_bwd, norm_fwd


def layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str = "none",
    weight_offset: float = 0.0,
    *,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, mean, rstd); mean and rstd are fp32 with shape ``x.shape[:-1]``."""
    y, _, mean, rstd = norm_fwd("layer", x, None, weight, bias, eps, casting, weight_offset, max_block_n)
    assert mean is not None
    return y, mean, rstd


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    casting: str = "none",
    weight_offset: float = 0.0,
    *,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (dx, dweight or None, dbias or None) given dy and what the forward saved."""
    return norm_bwd("layer", dy, None, x, weight, bias, mean, rstd, casting, weight_offset, max_block_n)


def add_layer_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str = "none",
    weight_offset: float = 0.0,
    *,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = x + residual (in x's dtype), y = layer_norm(h): returns (y, h, mean, rstd)."""
    y, h, mean, rstd = norm_fwd("layer", x, residual, weight, bias, eps, casting, weight_offset, max_block_n)
    assert h is not None and mean is not None
    return y, h, mean, rstd


def add_layer_norm_bwd(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    casting: str = "none",
    weight_offset: float = 0.0,
    *,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (dh_total, dweight, dbias): dh_total is the gradient of both x and residual."""
    return norm_bwd("layer", dy, dh, h, weight, bias, mean, rstd, casting, weight_offset, max_block_n)
