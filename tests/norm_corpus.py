"""Hand-written normalizations in the styles of public codebases, each with what discovery must say.

Every class here was written for this corpus from the public description of the code it imitates (the
style named in its docstring); none is copied. Positive entries declare the norm discovery must find
(kind, normalized dims, eps, the names of its weight and bias, weight offset, casting mode, and how it is
found); negative entries declare that no norm may be found, or only the parameter-free part of one.

Parameters are drawn away from the identity (weights around 1, biases around 0, both with spread), so a
weight or bias read wrongly changes the numbers the tests compare.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 24  # hidden size of token inputs (batch, tokens, WIDTH)
CHANNELS = 12  # channels of image inputs (batch, CHANNELS, H, W)
TOKENS = (2, 5, WIDTH)
IMAGE = (2, CHANNELS, 5, 6)


def _weight(n: int) -> nn.Parameter:
    return nn.Parameter(1 + 0.3 * torch.randn(n))


def _bias(n: int) -> nn.Parameter:
    return nn.Parameter(0.3 * torch.randn(n))


# ---------------------------------------------------------------------------------------------------
# Norms that must be found


class VarMeanLayerNorm(nn.Module):
    """The form of issue 11: both statistics from ``torch.var_mean``, the weight multiplied first."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.gamma, self.beta, self.eps = _weight(dim), _bias(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
        return self.gamma * (x - mean) / torch.sqrt(var + self.eps) + self.beta


class ChannelsFirstLayerNorm(nn.Module):
    """ConvNeXt's LayerNorm for ``channels_first`` data: statistics over dim 1 of NCHW, the affine
    applied as ``weight[:, None, None]``."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = _weight(channels), _bias(channels), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ScaledL2RMSNorm(nn.Module):
    """lucidrains' RMSNorm: the unit-L2 direction rescaled by ``sqrt(dim)``, times a gain."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = _weight(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class OptionalBiasLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: ``F.layer_norm`` with a bias that may be None."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = _weight(ndim)
        self.bias = _bias(ndim) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class FP32VarianceRMSNorm(nn.Module):
    """T5's LayerNorm (an RMSNorm): the variance in fp32, the weight dtype restored for half weights."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = _weight(hidden_size)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: fp32 throughout, a zero-initialized weight used as ``1 + w``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _bias(dim)  # spread around 0: the norm applies 1 + w

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class ReciprocalRMSNorm(nn.Module):
    """Mamba's reference RMSNorm: ``rstd = 1 / sqrt(mean(x.square()) + eps)``, an optional bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _weight(hidden_size)
        self.bias = _bias(hidden_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rstd = 1 / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + self.eps)
        out = x * rstd * self.weight
        return out + self.bias if self.bias is not None else out


class NonParametricLayerNorm(nn.Module):
    """OLMo's non-parametric LayerNorm: ``F.layer_norm`` without weight or bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, None, None, eps=self.eps)


class NonParametricRMSNorm(nn.Module):
    """OLMo's RMSNorm with ``elementwise_affine=False``: fp32 statistics, the input dtype restored."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        og_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return x.to(og_dtype)


class CastingRMSNorm(nn.Module):
    """Llama's RMSNorm: fp32 statistics, the normalized value cast back before the weight multiply."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = _weight(hidden_size)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class MethodChainLayerNorm(nn.Module):
    """A LayerNorm written as a chain of tensor methods: ``x.sub(mu).div(std).mul(w).add(b)``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.w, self.b, self.eps = _weight(dim), _bias(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        std = x.var(-1, keepdim=True, unbiased=False).add(self.eps).sqrt()
        return x.sub(mu).div(std).mul(self.w).add(self.b)


class PowHalfRMSNorm(nn.Module):
    """The reciprocal square root as ``pow(-0.5)``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.g, self.eps = _weight(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (x.pow(2).mean(-1, keepdim=True) + self.eps).pow(-0.5) * self.g


class WeightFirstRMSNorm(nn.Module):
    """The weight multiplied first, the mean square of ``x * x`` through ``torch.mean``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = _weight(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)


class CenteredRsqrtLayerNorm(nn.Module):
    """The form matched before issue 11: centered input, ``rsqrt`` of its mean square."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = _weight(dim), _bias(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(-1, keepdim=True)
        return (
            centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
            + self.bias
        )


class MomentsLayerNorm(nn.Module):
    """The variance as ``E[x^2] - E[x]^2``, as one-pass kernels compute it."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = _weight(dim), _bias(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mu * mu
        return (x - mu) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class ChannelRMSNorm(nn.Module):
    """An RMSNorm over the channels of NCHW, its weight viewed as (1, C, 1, 1) (timm's RmsNorm2d style)."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = _weight(channels), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps)
        return x * self.weight.view(1, -1, 1, 1)


class SqueezedStatRMSNorm(nn.Module):
    """The mean square without ``keepdim``, its dim put back by indexing."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = _weight(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.pow(2).mean(-1)
        return x * torch.rsqrt(ms + self.eps)[..., None] * self.weight


class SumOverWidthRMSNorm(nn.Module):
    """The mean square as a sum divided by the width, the root as ``1 / sqrt`` via division."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = _weight(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.pow(2).sum(-1, keepdim=True) / x.shape[-1]
        return x / torch.sqrt(ms + self.eps) * self.weight


class OnePlusLayerNorm(nn.Module):
    """A LayerNorm with a zero-centered gain applied as ``1 + w`` (Megatron's ``layernorm_1p`` idea)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = _bias(dim), _bias(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.var(-1, keepdim=True, correction=0) + self.eps)
        return (x - mu) * rstd * (1 + self.weight) + self.bias


class StdFromVarianceLayerNorm(nn.Module):
    """``std`` with eps inside the root: ``sqrt(x.std(correction=0) ** 2 + eps)``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = _weight(dim), _bias(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = x.std(-1, keepdim=True, correction=0)
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(std**2 + self.eps)
        return self.bias + y * self.weight


class ChannelRMSNormSubclass(ChannelRMSNorm):
    """A subclass of another hand-written norm with its own forward: fp32 statistics, the weight
    reshaped with ``unsqueeze`` and applied before the statistics multiply."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.float().pow(2).mean(dim=1, keepdim=True)
        return self.weight.unsqueeze(-1).unsqueeze(-1) * x * torch.rsqrt(ms + self.eps)


class InlineNormBlock(nn.Module):
    """A block with a LayerNorm written inline in its forward (``var_mean``, weight first), between
    two projections: a norm with no module of its own."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_w, self.norm_b, self.eps = _weight(dim), _bias(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        var, mu = torch.var_mean(h, dim=-1, keepdim=True, correction=0)
        h = self.norm_w * (h - mu) * torch.rsqrt(var + self.eps) + self.norm_b
        return x + self.out(h)


class InlineRMSBlock(nn.Module):
    """A residual block with an inline RMSNorm through ``F.normalize`` (lucidrains style)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.g = _weight(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.normalize(x, dim=-1) * math.sqrt(x.shape[-1]) * self.g
        return x + self.fc(h)


# ---------------------------------------------------------------------------------------------------
# Computations that are not norms, or only partly


class AdaptiveLayerNorm(nn.Module):
    """DiT-style modulation: a parameter-free LayerNorm scaled and shifted by values computed from the
    input. Only the parameter-free LayerNorm is a norm; the modulation is not its affine."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.mod = nn.Linear(dim, 2 * dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, shift = self.mod(x.mean(1)).chunk(2, dim=-1)
        mu = x.mean(-1, keepdim=True)
        ln = (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + self.eps)
        return ln * (1 + scale[:, None]) + shift[:, None]


class Softmax(nn.Module):
    """A hand-written softmax: a reduction and a division, no norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = (x - x.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)


class SumNormalize(nn.Module):
    """``x / x.sum(-1)``: divided by a first moment, not a root mean square."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.sum(-1, keepdim=True)


class CenterOnly(nn.Module):
    """Mean removal alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)


class UnitL2Normalize(nn.Module):
    """``F.normalize(x) * g`` without the ``sqrt(d)``: the unit sphere (cosine-similarity heads, QK-norm).
    It equals an RMSNorm only with the gain ``g / sqrt(d)``, which is not the module's own tensor."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.g = _weight(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.g


class StdEpsOutsideLayerNorm(nn.Module):
    """``(x - mean) / (std + eps)``: eps added to the standard deviation, not inside the root. Not a
    LayerNorm: the two differ wherever the variance is comparable to eps."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.g, self.b, self.eps = _weight(dim), _bias(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        return self.g * (x - mean) / (x.std(-1, unbiased=False, keepdim=True) + self.eps) + self.b


class AnnotatedTransformerLayerNorm(nn.Module):
    """The Annotated Transformer's LayerNorm: unbiased std, eps outside the root."""

    def __init__(self, features: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.a_2, self.b_2, self.eps = _weight(features), _bias(features), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class UnbiasedVarianceLayerNorm(nn.Module):
    """The unbiased variance under the root: the output is ``sqrt((n-1)/n)`` times a LayerNorm with
    another eps, which no LayerNorm with this module's weight computes."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = _weight(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(x.var(-1, keepdim=True) + self.eps) * self.weight


class ClampedRMSNorm(nn.Module):
    """``x / rms(x).clamp_min(eps) * w``: the RMS floored at 1e-6, not an eps under the root. Read as an
    RMSNorm with eps = 1e-12 it was rewritten "exactly" and moved rows of RMS 1e-6 by 29%."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, _weight(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(self.eps) * self.weight


class EpsOutsideRMSNorm(nn.Module):
    """The RMSNorm paper's reference code: ``x / (||x|| d^-1/2 + eps)``, eps added to the RMS."""

    def __init__(self, d: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.d, self.eps, self.scale = d, eps, _weight(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms_x = x.norm(2, dim=-1, keepdim=True) * self.d ** (-1.0 / 2)
        return self.scale * (x / (rms_x + self.eps))


class GlobalResponseNorm(nn.Module):
    """ConvNeXt-V2's GRN (channels last): a spatial L2 norm divided by its channel mean, a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma, self.beta = _bias(dim), _bias(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


class MeanSquareNoRoot(nn.Module):
    """Divided by the mean square itself, not its root."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = _weight(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class CenteredOverRawRMS(nn.Module):
    """A centered input over the raw (uncentered) RMS: neither a LayerNorm nor an RMSNorm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = _weight(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MisalignedStatistic(nn.Module):
    """The mean square without ``keepdim`` and without its dim put back: on an (n, n) input it
    broadcasts along the normalized dim, so each column is scaled by another row's RMS. It reads like an
    RMSNorm; only running it shows that it is not one."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = _weight(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1) + self.eps) * self.weight


# ---------------------------------------------------------------------------------------------------
# The corpus


@dataclass(frozen=True)
class Entry:
    """One corpus model: ``nn.Sequential(layer, norm)``, the norm (or block) at path "1"."""

    name: str
    build: Callable[[], nn.Module]
    shape: tuple[int, ...] = TOKENS
    kind: str | None = None  # None: no norm may be found under "1"
    dims: tuple[int, ...] = (-1,)
    eps: float | None = None
    weight: str | None = None  # name of the weight inside the module at "1"
    bias: str | None = None
    offset: float = 0.0
    casting: str = "none"
    source: str = "structural"  # "structural" (a module of its own) or "pattern" (inside a forward)
    why: str = ""  # for negatives: why it is not a norm

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        features = self.shape[1] if len(self.shape) == 4 else self.shape[-1]
        layer = nn.Conv2d(features, features, 1) if len(self.shape) == 4 else nn.Linear(features, features)
        return nn.Sequential(layer, self.build()).eval()

    def inputs(self, seed: int = 1) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(self.shape, generator=g) * 2 + 0.5,)


W, C = WIDTH, CHANNELS
POSITIVE = [
    Entry(
        "var_mean_weight_first",
        lambda: VarMeanLayerNorm(W),
        kind="layer",
        eps=1e-5,
        weight="gamma",
        bias="beta",
    ),
    Entry(
        "convnext_channels_first",
        lambda: ChannelsFirstLayerNorm(C),
        shape=IMAGE,
        kind="layer",
        dims=(-3,),
        eps=1e-6,
        weight="weight",
        bias="bias",
    ),
    # F.normalize clamps ||x|| at 1e-12 instead of adding eps under the root: see normswap.graph.patterns
    Entry("lucidrains_l2_rmsnorm", lambda: ScaledL2RMSNorm(W), kind="rms", eps=1e-24 / W, weight="gamma"),
    Entry(
        "nanogpt_layernorm_bias",
        lambda: OptionalBiasLayerNorm(W, True),
        kind="layer",
        eps=1e-5,
        weight="weight",
        bias="bias",
    ),
    Entry(
        "nanogpt_layernorm_no_bias",
        lambda: OptionalBiasLayerNorm(W, False),
        kind="layer",
        eps=1e-5,
        weight="weight",
    ),
    Entry("t5_fp32_variance", lambda: FP32VarianceRMSNorm(W), kind="rms", eps=1e-6, weight="weight"),
    Entry(
        "gemma_one_plus_w",
        lambda: OffsetRMSNorm(W),
        kind="rms",
        eps=1e-6,
        weight="weight",
        offset=1.0,
        casting="gemma",
    ),
    Entry("mamba_reciprocal_rms", lambda: ReciprocalRMSNorm(W), kind="rms", eps=1e-5, weight="weight"),
    Entry(
        "mamba_rms_with_bias",
        lambda: ReciprocalRMSNorm(W, bias=True),
        kind="rms",
        eps=1e-5,
        weight="weight",
        bias="bias",
    ),
    Entry("olmo_nonparametric_layernorm", lambda: NonParametricLayerNorm(W), kind="layer", eps=1e-5),
    Entry("olmo_nonparametric_rmsnorm", lambda: NonParametricRMSNorm(), kind="rms", eps=1e-6),
    Entry("llama_casts", lambda: CastingRMSNorm(W), kind="rms", eps=1e-6, weight="weight", casting="llama"),
    Entry(
        "sub_div_method_chain", lambda: MethodChainLayerNorm(W), kind="layer", eps=1e-5, weight="w", bias="b"
    ),
    Entry("pow_minus_half", lambda: PowHalfRMSNorm(W), kind="rms", eps=1e-6, weight="g"),
    Entry("weight_first_x_times_x", lambda: WeightFirstRMSNorm(W), kind="rms", eps=1e-6, weight="weight"),
    Entry(
        "centered_rsqrt",
        lambda: CenteredRsqrtLayerNorm(W),
        kind="layer",
        eps=1e-5,
        weight="weight",
        bias="bias",
    ),
    Entry(
        "moments_variance", lambda: MomentsLayerNorm(W), kind="layer", eps=1e-5, weight="weight", bias="bias"
    ),
    Entry(
        "channel_rms_view",
        lambda: ChannelRMSNorm(C),
        shape=IMAGE,
        kind="rms",
        dims=(-3,),
        eps=1e-6,
        weight="weight",
    ),
    Entry("squeezed_statistic", lambda: SqueezedStatRMSNorm(W), kind="rms", eps=1e-6, weight="weight"),
    Entry("sum_over_width", lambda: SumOverWidthRMSNorm(W), kind="rms", eps=1e-5, weight="weight"),
    Entry(
        "one_plus_w_layernorm",
        lambda: OnePlusLayerNorm(W),
        kind="layer",
        eps=1e-5,
        weight="weight",
        bias="bias",
        offset=1.0,
        casting="gemma",
    ),
    Entry(
        "std_squared_eps_inside",
        lambda: StdFromVarianceLayerNorm(W),
        kind="layer",
        eps=1e-5,
        weight="weight",
        bias="bias",
    ),
    Entry(
        "subclass_own_forward",
        lambda: ChannelRMSNormSubclass(C),
        shape=IMAGE,
        kind="rms",
        dims=(-3,),
        eps=1e-6,
        weight="weight",
    ),
    Entry(
        "inline_var_mean_block",
        lambda: InlineNormBlock(W),
        kind="layer",
        eps=1e-5,
        weight="norm_w",
        bias="norm_b",
        source="pattern",
    ),
    Entry(
        "inline_l2_block", lambda: InlineRMSBlock(W), kind="rms", eps=1e-24 / W, weight="g", source="pattern"
    ),
    # Only the parameter-free LayerNorm inside is a norm: the modulation computed from the input is not
    # taken as its weight and bias.
    Entry("adaptive_layernorm_core", lambda: AdaptiveLayerNorm(W), kind="layer", eps=1e-6, source="pattern"),
]

NEGATIVE = [
    Entry("softmax", Softmax, why="a reduction and a division, no second moment"),
    Entry("divide_by_sum", SumNormalize, why="divided by a first moment"),
    Entry("center_only", CenterOnly, why="mean removal without scaling"),
    Entry("unit_l2_normalize", lambda: UnitL2Normalize(W), why="an RMSNorm only with gain g / sqrt(d)"),
    Entry("std_eps_outside", lambda: StdEpsOutsideLayerNorm(W), why="eps added outside the root"),
    Entry("annotated_transformer", lambda: AnnotatedTransformerLayerNorm(W), why="unbiased std, eps outside"),
    Entry("unbiased_variance", lambda: UnbiasedVarianceLayerNorm(W), why="unbiased variance under the root"),
    Entry("rms_eps_outside", lambda: EpsOutsideRMSNorm(W), why="eps added to the RMS, outside the root"),
    Entry("clamped_rms_floor", lambda: ClampedRMSNorm(W), why="the RMS floored at 1e-6: no eps, not exact"),
    Entry(
        "global_response_norm",
        lambda: GlobalResponseNorm(W),
        shape=(2, 5, 6, W),  # channels last
        why="a spatial L2 norm over its channel mean",
    ),
    Entry("mean_square_no_root", lambda: MeanSquareNoRoot(W), why="divided by the mean square, not its root"),
    Entry("centered_over_raw_rms", lambda: CenteredOverRawRMS(W), why="centered numerator, raw statistic"),
    Entry(
        "misaligned_statistic",
        lambda: MisalignedStatistic(W),
        shape=(W, W),
        why="the statistic broadcasts along the normalized dim (refused by running it)",
    ),
]
