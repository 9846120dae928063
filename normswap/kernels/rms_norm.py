"""Triton launchers for RMSNorm and residual-add + RMSNorm (tier 1: no autograd, no dispatch).

``y = x / sqrt(mean(x^2) + eps) * (offset + w) + b`` over the last dim, with the casting modes of
:mod:`normswap.modules.functional`. These run the Triton kernels on whatever device the tensors are on:
CUDA, or CPU under ``TRITON_INTERPRET=1`` (which is how the tests reach them without a GPU). Most code
wants :func:`normswap.kernels.rms_norm` instead, which dispatches and differentiates.
"""

from __future__ import annotations

import torch

from normswap.kernels._launch import norm_bwd, norm_fwd


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str = "none",
    weight_offset: float = 0.0,
    *,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, rstd); rstd is fp32 with shape ``x.shape[:-1]``, saved for the backward.

    ``max_block_n`` lowers the longest row normalized in one tile, to reach the chunked kernels with
    small test shapes.
    """
    y, _, _, rstd = norm_fwd("rms", x, None, weight, bias, eps, casting, weight_offset, max_block_n)
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str = "none",
    weight_offset: float = 0.0,
    *,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (dx, dweight or None, dbias or None) given dy and what the forward saved."""
    return norm_bwd("rms", dy, None, x, weight, bias, None, rstd, casting, weight_offset, max_block_n)


def add_rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str = "none",
    weight_offset: float = 0.0,
    *,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = x + residual (in x's dtype), y = rms_norm(h): returns (y, h, rstd)."""
    y, h, _, rstd = norm_fwd("rms", x, residual, weight, bias, eps, casting, weight_offset, max_block_n)
    assert h is not None
    return y, h, rstd


def add_rms_norm_bwd(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str = "none",
    weight_offset: float = 0.0,
    *,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (dh_total, dweight, dbias): dh_total is the gradient of both x and residual.

    ``dh`` is the gradient reaching h from its other readers (the residual stream), or None.
    """
    return norm_bwd("rms", dy, dh, h, weight, bias, None, rstd, casting, weight_offset, max_block_n)
