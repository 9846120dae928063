"""Weight arithmetic of the rewrites, as plain functions on tensors (fp64 inside, cast back at the end).

Folding an eval-mode BatchNorm into the layer before it. The BN computes, per output channel c,

    y_c = (z_c - mean_c) * gamma_c / sqrt(var_c + eps) + beta_c,   with z = W x + b,

so with s_c = gamma_c / sqrt(var_c + eps):

    W'_c = W_c * s_c          (every weight of output channel c)
    b'_c = (b_c - mean_c) * s_c + beta_c

A missing gamma is 1, a missing beta or conv bias is 0.
"""

from __future__ import annotations

import torch


def bn_scale_shift(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel affine ``y = scale * x + shift`` an eval-mode BatchNorm computes, in fp64."""
    mean = running_mean.detach().double()
    scale = torch.rsqrt(running_var.detach().double() + eps)
    if weight is not None:
        scale = scale * weight.detach().double()
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.detach().double()
    return scale, shift


def fold_bn_into_conv_weights(
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    scale: torch.Tensor,
    shift: torch.Tensor,
    out_channel_dim: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W' = W * scale (along the output-channel dim), b' = b * scale + shift; cast to W's dtype."""
    shape = [1] * conv_weight.ndim
    shape[out_channel_dim] = -1
    w = conv_weight.detach().double() * scale.reshape(shape)
    b = shift.clone()
    if conv_bias is not None:
        b = b + conv_bias.detach().double() * scale
    return w.to(conv_weight.dtype), b.to(conv_weight.dtype)
