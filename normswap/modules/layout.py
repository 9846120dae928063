"""Norms defined by the dim that holds the features, for swaps between channel-first and channel-last norms.

A BatchNorm on NCHW features and a LayerNorm on (batch, tokens, hidden) both carry one weight and one
bias per feature, but the feature dim differs (1 vs -1). When one replaces the other, the new norm
must keep acting on the same features; these modules take that dim (``dim``) as a parameter:

- :class:`FeatureLayerNorm`: normalize over the features at each position (for NCHW, ConvNeXt's
  LayerNorm2d; ``rms=True`` without centering);
- :class:`FeatureBatchNorm`: normalize each feature over every other dim (batch, tokens, positions),
  with running statistics like ``nn.BatchNorm*`` (same state_dict keys);
- :class:`FeatureGroupNorm`: groups of features; on channel-last input it acts at each position, on
  channel-first input over the group's channels and all positions (``nn.GroupNorm``);
- :class:`FeatureInstanceNorm`: each feature over the positions of each sample;
- :class:`DyT`: Dynamic Tanh, ``tanh(alpha * x) * w + b`` (Zhu et al., "Transformers without
  Normalization", CVPR 2025), no statistics at all;
- :class:`FeatureAffine`: ``x * w + b``, what is left when a norm is removed.

Every module's parameters are ``weight`` and ``bias`` of shape ``(num_features,)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _along(t: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    """View a (C,) tensor so it broadcasts along ``dim`` of an ``ndim``-D tensor."""
    shape = [1] * ndim
    shape[dim] = -1
    return t.reshape(shape)


class PerFeature(nn.Module):
    def __init__(self, num_features: int, dim: int, affine: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.num_features = int(num_features)
        self.dim = int(dim)
        factory = {"device": device, "dtype": dtype}
        if affine:
            self.weight = nn.Parameter(torch.ones(self.num_features, **factory))
            self.bias = nn.Parameter(torch.zeros(self.num_features, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def _affine(self, y: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            y = y * _along(self.weight, self.dim, y.ndim)
        if self.bias is not None:
            y = y + _along(self.bias, self.dim, y.ndim)
        return y

    def extra_repr(self) -> str:
        return f"{self.num_features}, dim={self.dim}"


class FeatureLayerNorm(PerFeature):
    """LayerNorm (or RMSNorm with ``rms=True``) over the feature dim ``dim`` only, at each position."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        dim: int = 1,
        rms: bool = False,
        affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, dim, affine, device, dtype)
        self.eps = float(eps)
        self.rms = rms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # fp64 stays fp64
        if not self.rms:
            xf = xf - xf.mean(dim=self.dim, keepdim=True)
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=self.dim, keepdim=True) + self.eps)
        return self._affine(y.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}, rms={self.rms}"


class FeatureBatchNorm(_BatchNorm):
    """BatchNorm of the features at ``dim``: each feature normalized over every other dim.

    Subclasses torch's ``_BatchNorm``, so running statistics, momentum and state_dict keys are
    BatchNorm's; on (batch, tokens, hidden) with ``dim=-1`` it normalizes each hidden feature over batch
    and tokens.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        dim: int = -1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.dim = int(dim)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input, got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moved = x.movedim(self.dim, 1)
        # contiguous: callers such as HF GPT-2's Conv1D .view() the result
        return super().forward(moved).movedim(1, self.dim).contiguous()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dim={self.dim}"


class FeatureGroupNorm(nn.GroupNorm):
    """GroupNorm over groups of the features at ``dim``.

    Channel-first input (``dim=1``) is torch's GroupNorm; channel-last input (``dim=-1``, e.g. tokens)
    is normalized at each position separately, over the features of each group, as a LayerNorm would
    be per token.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        dim: int = 1,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self.dim = int(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim in (1, 1 - x.ndim):
            return super().forward(x)
        moved = x.movedim(self.dim, -1)
        flat = moved.reshape(-1, self.num_channels)
        return super().forward(flat).reshape(moved.shape).movedim(-1, self.dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dim={self.dim}"


class FeatureInstanceNorm(PerFeature):
    """Each feature at ``dim`` normalized over the positions of each sample (dims other than 0 and ``dim``)."""

    def __init__(
        self, num_features: int, eps: float = 1e-5, dim: int = 1, affine: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__(num_features, dim, affine, device, dtype)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 3:
            raise ValueError(
                "instance norm needs positions to normalize over: (N, C, *) with at least one more dim"
            )
        moved = x.movedim(self.dim, 1)
        y = F.instance_norm(moved, eps=self.eps).movedim(1, self.dim).contiguous()
        return self._affine(y)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}"


class DyT(PerFeature):
    """Dynamic Tanh: ``tanh(alpha * x) * weight + bias`` with a learnable scalar ``alpha``."""

    def __init__(self, num_features: int, alpha: float = 0.5, dim: int = -1, device=None, dtype=None) -> None:
        super().__init__(num_features, dim, True, device, dtype)
        self.alpha = nn.Parameter(torch.full((), float(alpha), device=device, dtype=dtype))

    # the scalars the calibration fits, and the S-curve they shape (normswap.calibrate.affine_fit)
    scalars = ("alpha",)

    @staticmethod
    def curve(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return torch.tanh(alpha * x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._affine(self.curve(x, self.alpha))


class Derf(PerFeature):
    """Dynamic erf: ``erf(alpha * x + shift) * weight + bias`` with learnable scalars ``alpha`` and
    ``shift`` (Chen et al. 2025, "Stronger Normalization-Free Transformers", the successor of DyT). erf
    saturates faster than tanh; the shift lets the S-curve sit off-centre, as a LayerNorm's input mean
    would have it."""

    def __init__(
        self,
        num_features: int,
        alpha: float = 0.5,
        shift: float = 0.0,
        dim: int = -1,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, dim, True, device, dtype)
        self.alpha = nn.Parameter(torch.full((), float(alpha), device=device, dtype=dtype))
        self.shift = nn.Parameter(torch.full((), float(shift), device=device, dtype=dtype))

    scalars = ("alpha", "shift")

    @staticmethod
    def curve(x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return torch.erf(alpha * x + shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._affine(self.curve(x, self.alpha, self.shift))


class FeatureAffine(PerFeature):
    """``x * weight + bias`` along ``dim``: a norm removed, its affine parameters kept."""

    def __init__(self, num_features: int, dim: int = -1, device=None, dtype=None) -> None:
        super().__init__(num_features, dim, True, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._affine(x)
