"""Reference norm modules: the modules normswap puts into a model when it swaps a norm.

Their state_dict keys are ``weight`` and ``bias`` like torch.nn's, so a checkpoint of a swapped model
loads back into the same architecture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from normswap.kernels.reference import CASTING_MODES, layer_norm_reference, rms_norm_reference


def _as_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(d) for d in normalized_shape)


class _AffineNorm(nn.Module):
    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float,
        elementwise_affine: bool,
        bias: bool,
        casting: str,
        weight_offset: float,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        if casting not in CASTING_MODES:
            raise ValueError(f"casting must be one of {CASTING_MODES}, got {casting!r}")
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        self.casting = casting
        self.weight_offset = float(weight_offset)
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            # With an offset the neutral weight is 0 (Gemma stores w with y = x * (1 + w)).
            init = 1.0 - self.weight_offset
            self.weight = nn.Parameter(torch.full(self.normalized_shape, init, **factory))
        else:
            self.register_parameter("weight", None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory))
        else:
            self.register_parameter("bias", None)

    def _plain_fp32(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and self.casting == "none" and not self.weight_offset

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}, casting={self.casting!r}, weight_offset={self.weight_offset}"
        )


class RMSNorm(_AffineNorm):
    """RMSNorm with optional bias, explicit casting mode and weight offset (Gemma's ``1 + w``)."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        bias: bool = False,
        casting: str = "none",
        weight_offset: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, bias, casting, weight_offset, device, dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._plain_fp32(x):
            # same fp32 math as the reference; as one aten op it exports to ONNX RMSNormalization (opset 23)
            y = F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
            return y + self.bias if self.bias is not None else y
        return rms_norm_reference(
            x, len(self.normalized_shape), self.weight, self.bias, self.eps, self.casting, self.weight_offset
        )


class LayerNorm(_AffineNorm):
    """LayerNorm with the same knobs as :class:`RMSNorm` (casting mode, weight offset)."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        casting: str = "none",
        weight_offset: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, bias, casting, weight_offset, device, dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._plain_fp32(x):
            # same fp32 math as the reference; as one aten op it exports to ONNX LayerNormalization
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return layer_norm_reference(
            x, len(self.normalized_shape), self.weight, self.bias, self.eps, self.casting, self.weight_offset
        )


class ChannelLayerNorm(nn.LayerNorm):
    """torch's LayerNorm over the one dim ``channel_dim`` (-3: the C of NCHW), computed as timm's and
    torchvision's LayerNorm2d compute it: moved to last, normalized, moved back. What such a norm in a
    ``.pt2`` lifts to (:mod:`normswap.graph.lift`), so the program's norm is read as the module's was."""

    channel_dim: int = -3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.movedim(self.channel_dim, -1)).movedim(-1, self.channel_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, channel_dim={self.channel_dim}"


class ChannelRMSNorm(nn.RMSNorm):
    """torch's RMSNorm over the one dim ``channel_dim``, as :class:`ChannelLayerNorm` (timm's RmsNorm2d)."""

    channel_dim: int = -3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.movedim(self.channel_dim, -1)).movedim(-1, self.channel_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, channel_dim={self.channel_dim}"


# A norm whose affine was folded into its readers is weightless in memory; a model directory keeps the
# stock class (what the config builds), with the stored values under which it computes the same: weight 1
# (0 for a (1 + w) norm), bias 0. The fold's one edit computes them (passes/affine/arithmetic.fold_edit);
# they travel on the weightless module to the directory writer, which stores them.
_FOLDED_AFFINE = "normswap_folded_affine"


def mark_folded_affine(module: nn.Module, stored: dict[str, torch.Tensor]) -> None:
    """Record on ``module`` (a weightless norm a fold made) the values its stock class stores instead."""
    setattr(module, _FOLDED_AFFINE, {name: value.detach().clone() for name, value in stored.items()})


def folded_affine(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The values :func:`mark_folded_affine` recorded on ``module``, or None."""
    found = getattr(module, _FOLDED_AFFINE, None)
    return dict(found) if isinstance(found, dict) else None
