"""Weight arithmetic of the rewrites, as plain functions on tensors (fp64 inside, cast back at the end).

An eval-mode BatchNorm is a per-channel affine map. Per channel c,

    y_c = (z_c - mean_c) * gamma_c / sqrt(var_c + eps) + beta_c = s_c * z_c + t_c,
    s_c = gamma_c / sqrt(var_c + eps),   t_c = beta_c - mean_c * s_c,

with a missing gamma read as 1 and a missing beta (or layer bias) as 0 (:func:`bn_scale_shift`).

Folding it into the layer **before** it (z = W x + b, c an output channel of W):

    W'_c = W_c * s_c          (every weight of output channel c)
    b'_c = b_c * s_c + t_c

A Conv's output channel is weight dim 0. A ConvTranspose's weight is ``(in, out / groups, *k)``: output
channel ``g * out_per_group + j`` owns the weights ``W[g * in_per_group : (g + 1) * in_per_group, j]``,
so the scale runs along dim 1 *within each group* (:func:`fold_bn_into_conv_transpose_weights`).

Folding it into the layer **after** it (the layer reads x' = s * x + t; c an input channel of W):

    W'[o, c, k] = W[o, c, k] * s_c
    b'_o        = b_o + sum_{c, k} W[o, c, k] * t_c

which holds only when every input position the layer reads is s * x + t, i.e. no zero padding
(:func:`fold_bn_into_next_layer_weights`; the legality is the pass's business). In a grouped conv the
weight ``W[o, j]`` reads input channel ``(o // out_per_group) * in_per_group + j``.
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


def grouped_channel_index(weight_shape: torch.Size | tuple[int, ...], groups: int) -> torch.Tensor:
    """For each ``(i, j)`` of a grouped weight ``(C0, C1, *k)``, the channel on the side dim 1 indexes.

    A grouped layer's weight holds, along dim 1, only the channels of its own group. Entry ``(i, j)``
    belongs to group ``i // (C0 / groups)`` and touches channel ``group * C1 + j`` on the side dim 1
    indexes: the output channel of a ConvTranspose ``(in, out / groups, *k)``, the input channel of a
    Conv or Linear ``(out, in / groups, *k)``.
    """
    rows, per_group = int(weight_shape[0]), int(weight_shape[1])
    group = torch.arange(rows) // (rows // groups)
    return group[:, None] * per_group + torch.arange(per_group)[None, :]


def fold_bn_into_conv_transpose_weights(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    shift: torch.Tensor,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a BN that reads a ConvTranspose's output into its weight ``(in, out / groups, *k)``."""
    index = grouped_channel_index(weight.shape, groups).to(scale.device)
    per_weight = scale[index].reshape(*index.shape, *([1] * (weight.ndim - 2)))
    w = weight.detach().double() * per_weight
    b = shift.clone()
    if bias is not None:
        b = b + bias.detach().double() * scale
    return w.to(weight.dtype), b.to(weight.dtype)


def fold_bn_into_next_layer_weights(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    shift: torch.Tensor,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a BN whose output a Conv (without zero padding) or Linear reads: scale the input channels,
    push the shift through the weights into the bias. Returns ``(W', b')`` in W's dtype."""
    index = grouped_channel_index(weight.shape, groups).to(scale.device)
    spatial = [1] * (weight.ndim - 2)
    w64 = weight.detach().double()
    s = scale[index].reshape(*index.shape, *spatial)
    t = shift[index].reshape(*index.shape, *spatial)
    # the shift term uses the original weights: W (s x + t) + b = (W s) x + (W t + b)
    b = (w64 * t).flatten(1).sum(1)
    if bias is not None:
        b = b + bias.detach().double()
    return (w64 * s).to(weight.dtype), b.to(weight.dtype)
