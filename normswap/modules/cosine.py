"""Cosine-normalized layers (Luo et al. 2017, "Cosine Normalization"): the dot product of a Linear or a
Conv replaced by the cosine of the angle between the input and each weight row, times a learnable
per-output scale.

    Linear:  y_j = s_j * <w_j, x> / (||w_j|| ||x||)
    Conv:    y_j(p) = s_j * <w_j, x_p> / (||w_j|| ||x_p||)    x_p: the receptive field at position p

With a bias the cosine is taken between augmented vectors, as in the paper: ``[w_j, b_j]`` against
``[x, 1]``, so ``<[w_j, b_j], [x, 1]> = w_j x + b_j`` is the original pre-activation and the input's
norm becomes ``sqrt(||x||^2 + 1)``. Either way the original layer's output is exactly
``||x~|| * ||w~_j|| * cos_j`` (``~`` the augmented vectors): a per-row (per-sample, per-position)
scalar times a per-output scalar times what this module computes. That identity is why a cosine layer
followed by a norm that removes a per-row scale (LayerNorm/RMSNorm over the output features) loses
nothing but eps (README, ``convert --to cosine``).

Both norms are clamped below at ``eps`` (``F.normalize``'s convention: a zero row gives 0, not NaN).
The patch norm of a conv is ``sqrt(conv(x^2, ones))`` with the conv's own stride, padding and dilation,
so zero padding contributes zeros to it as it does to the numerator. Grouped convs and padding modes
other than zeros are not built (the converting pass refuses them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _clamped_norm(squares: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    # squares are summed in float32 at least: a half-precision sum of squares overflows (fp16 beyond
    # 65504: a 4096-wide row of values around 5) where the norm itself fits
    return squares.sqrt().clamp_min(eps).to(dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class CosineLinear(nn.Module):
    """``y = scale * cos([x, 1], [W, b])`` row by row (``[x]``/``[W]`` without a bias); see the module doc.

    Parameters ``weight`` ``(out, in)``, ``bias`` ``(out,)`` or None, ``scale`` ``(out,)``: the same
    names and shapes as ``nn.Linear`` plus ``scale``, so a Linear's weight and bias load unchanged."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        eps: float = 1e-12,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.eps = int(in_features), int(out_features), float(eps)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.scale = nn.Parameter(torch.ones(out_features, device=device, dtype=dtype))
        # the scale is one factor times the weight norms (a layer only row-scale-free norms read), which
        # calibration keeps; else one free value per output
        self.shared_scale = False
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def weight_norms(self) -> torch.Tensor:
        """``||[w_j, b_j]||`` per output (``||w_j||`` without a bias)."""
        squares = _wide(self.weight).square().sum(1)
        if self.bias is not None:
            squares = squares + _wide(self.bias).square()
        return _clamped_norm(squares, self.eps, self.weight.dtype)

    def input_norms(self, x: torch.Tensor) -> torch.Tensor:
        """``||[x, 1]||`` per row of ``x`` (``||x||`` without a bias), keeping a trailing dim of 1."""
        squares = _wide(x).square().sum(-1, keepdim=True)
        if self.bias is not None:
            squares = squares + 1.0
        return _clamped_norm(squares, self.eps, x.dtype)

    def cosine(self, x: torch.Tensor) -> torch.Tensor:
        """The cosines alone (``scale`` left out): what the scale is fitted against."""
        return F.linear(x, self.weight, self.bias) / self.input_norms(x) / self.weight_norms()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cosine(x) * self.scale

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class CosineConv(nn.Module):
    """A Conv1d/2d/3d whose output at each position is ``scale * cos([x_p, 1], [w_j, b_j])`` (see the
    module doc). Parameters ``weight`` ``(out, in, *k)``, ``bias`` or None, ``scale`` ``(out,)``: a
    conv's weight and bias load unchanged. ``groups`` is 1 and padding zeros (others are not built)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: tuple[int, ...],
        stride: tuple[int, ...],
        padding: tuple[int, ...] | str,
        dilation: tuple[int, ...],
        bias: bool = True,
        eps: float = 1e-12,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size, self.stride = tuple(kernel_size), tuple(stride)
        self.padding = padding if isinstance(padding, str) else tuple(padding)
        self.dilation, self.eps = tuple(dilation), float(eps)
        self.weight = nn.Parameter(
            torch.empty(out_channels, in_channels, *self.kernel_size, device=device, dtype=dtype)
        )
        self.bias = nn.Parameter(torch.zeros(out_channels, device=device, dtype=dtype)) if bias else None
        self.scale = nn.Parameter(torch.ones(out_channels, device=device, dtype=dtype))
        self.shared_scale = False  # as CosineLinear's
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        conv = _CONVS[len(self.kernel_size)]
        return conv(x, weight, bias, self.stride, self.padding, self.dilation)

    def _per_channel(self, t: torch.Tensor, ndim: int) -> torch.Tensor:
        return t.reshape(1, -1, *([1] * (ndim - 2)))

    def weight_norms(self) -> torch.Tensor:
        squares = _wide(self.weight).flatten(1).square().sum(1)
        if self.bias is not None:
            squares = squares + _wide(self.bias).square()
        return _clamped_norm(squares, self.eps, self.weight.dtype)

    def input_norms(self, x: torch.Tensor) -> torch.Tensor:
        """``||[x_p, 1]||`` at every output position, shape ``(N, 1, *out)``."""
        wide = _wide(x)
        ones = torch.ones(1, self.in_channels, *self.kernel_size, device=x.device, dtype=wide.dtype)
        squares = self._conv(wide.square(), ones, None)
        if self.bias is not None:
            squares = squares + 1.0
        return _clamped_norm(squares, self.eps, x.dtype)

    def cosine(self, x: torch.Tensor) -> torch.Tensor:
        out = self._conv(x, self.weight, self.bias) / self.input_norms(x)
        return out / self._per_channel(self.weight_norms(), out.ndim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.cosine(x)
        return out * self._per_channel(self.scale, out.ndim)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, bias={self.bias is not None}"
        )


COSINE_LAYERS: tuple[type[nn.Module], ...] = (CosineLinear, CosineConv)


def fit_cosine_scale(
    cosines: torch.Tensor, targets: torch.Tensor, base: torch.Tensor | None = None
) -> torch.Tensor:
    """The least-squares scale ``s`` of ``targets ~ cosines * s``, both ``(rows, out)``, in float64.

    Per output (``base`` None): ``s_j = sum_r c_rj y_rj / sum_r c_rj^2``, the minimum of
    ``sum_r (s_j c_rj - y_rj)^2`` for each j (a zero column keeps ``s_j = 1``). With ``base`` (the weight
    norms), one common factor: ``s = k * base``, ``k = sum (base c) y / sum (base c)^2``. That is the form
    to take when a LayerNorm/RMSNorm over these outputs reads them: it removes a common factor but not a
    per-output one, so a per-output fit (whose ``s_j / base_j`` varies with the rows each output weighs
    most) would leave an error there that ``k * base`` does not (module doc of :mod:`normswap.modules.cosine`).
    """
    c, y = cosines.detach().double(), targets.detach().double()
    if base is None:
        energy = (c * c).sum(0)
        fitted = (c * y).sum(0) / energy.clamp_min(1e-300)
        return torch.where(energy > 0, fitted, torch.ones_like(fitted))
    scaled = c * base.detach().double()
    energy = (scaled * scaled).sum()
    k = (scaled * y).sum() / energy if energy > 0 else torch.ones((), dtype=torch.float64)
    return k * base.detach().double()


def feature_rows(t: torch.Tensor, conv: bool) -> torch.Tensor:
    """``(rows, features)`` view of a layer's output (or cosines): features last for a Linear, dim 1 for a conv."""
    return (t.movedim(1, -1) if conv else t).reshape(-1, t.shape[1 if conv else -1])
