"""Fused norm modules: the reference modules' constructor and state_dict, the fused ops' forward.

``FusedRMSNorm`` / ``FusedLayerNorm`` subclass :class:`normswap.modules.RMSNorm` / ``LayerNorm`` and only
override ``forward``, so a checkpoint moves freely between a reference and a fused model.
``FusedAddRMSNorm`` / ``FusedAddLayerNorm`` take ``(x, residual)`` and return ``(norm(x + residual),
x + residual)``: the pre-norm transformer's residual add and the following norm in one pass. Swapping a
norm for its fused twin is an *exact* rewrite (same function up to float rounding).

A fused module built from a hand-written norm keeps that norm's parameter names (``gain``/``shift``
rather than ``weight``/``bias``), so the original checkpoint still loads into the converted model; its
``weight`` and ``bias`` attributes still read those parameters.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from normswap.kernels.ops import apply_norm
from normswap.modules.norms import LayerNorm, RMSNorm
from normswap.modules.semantics import NormKind, NormSemantics, declared_semantics

_F = TypeVar("_F", bound="FusedNorm")
_C = TypeVar("_C", bound="_ChannelDim")


def _parameter_property(key_attr: str, default: str) -> property:
    # ``weight``/``bias`` read whatever name the parameter is stored under. Raising AttributeError while
    # it is not registered yet lets nn.Module.__setattr__ register it under ``weight`` as usual.
    def get(self: nn.Module) -> nn.Parameter | None:
        key = self.__dict__.get(key_attr, default)
        if key not in self._parameters:
            raise AttributeError(key)
        return self._parameters[key]

    return property(get)


class FusedNorm(nn.Module):
    """Base of every fused norm module: ``from_module``, and weight/bias under the source's names."""

    _reference: type[nn.Module]
    _kind: NormKind
    # the state_dict names of weight and bias (an instance renamed by _rename_parameters has its own)
    _weight_key = "weight"
    _bias_key = "bias"

    weight = _parameter_property("_weight_key", "weight")
    bias = _parameter_property("_bias_key", "bias")

    @classmethod
    def from_module(cls: type[_F], module: nn.Module, semantics: NormSemantics | None = None) -> _F:
        """A fused copy of ``module``, a norm that ``semantics`` describes (discovery's record).

        Without ``semantics``, ``module`` must be a norm whose class states them (normswap's reference
        norms, torch's ``LayerNorm``/``RMSNorm``): they are read by
        :func:`normswap.modules.semantics.declared_semantics`. With them, any module whose function they
        state (a hand-written or third-party norm) and whose state_dict holds exactly its weight and bias,
        under the record's names. Parameters are copied (not shared) with their dtype, device and
        ``requires_grad``, under those names; the training flag is kept. ``module`` is left untouched.
        """
        if semantics is None:
            semantics = declared_semantics(module)
        if semantics is None or semantics.kind is not cls._kind:
            raise TypeError(f"cannot build a fused {cls._reference.__name__} from a {type(module).__name__}")
        fused = cls(**semantics.module_kwargs(), device="meta")
        fused._rename_parameters(semantics.weight_name or "weight", semantics.bias_name or "bias")
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        # assign=True takes each tensor's dtype and device as they are (weight and bias may differ).
        fused.load_state_dict(state, assign=True)
        for name, param in module.named_parameters(recurse=False):
            getattr(fused, name).requires_grad_(param.requires_grad)
        return fused.train(module.training)

    def _rename_parameters(self, weight_name: str, bias_name: str) -> None:
        """Store weight and bias under other state_dict names, keeping their order."""
        renames = {"weight": weight_name, "bias": bias_name}
        if all(k == v for k, v in renames.items()):
            return
        if len(set(renames.values())) != 2:
            raise ValueError(f"weight and bias need distinct names, got {weight_name!r} twice")
        self._parameters = {renames.get(k, k): v for k, v in self._parameters.items()}
        self._weight_key, self._bias_key = weight_name, bias_name

    def _numerics(self) -> tuple:
        """The op arguments after the input(s): weight, bias, eps, casting, offset, normalized ndim.

        Read from ``_parameters`` without the ``weight``/``bias`` properties: every forward asks, and
        inside a model each Python call of a norm costs the model (see normswap.kernels._eager)."""
        parameters, w_key, b_key = self._parameters, self._weight_key, self._bias_key
        return (
            # a parametrized weight (torch.nn.utils.parametrize) has left _parameters: its attribute,
            # under the name it is stored by (not .get(key, getattr(...)): that would compute it every call)
            parameters[w_key] if w_key in parameters else getattr(self, w_key),
            parameters[b_key] if b_key in parameters else getattr(self, b_key),
            self.eps,
            self.casting,
            self.weight_offset,
            len(self.normalized_shape),
        )


class FusedRMSNorm(RMSNorm, FusedNorm):
    """:class:`normswap.modules.RMSNorm` computed by the ``normswap::rms_norm_fwd`` op."""

    _reference = RMSNorm
    _kind = NormKind.RMS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm("rms", x, None, *self._numerics())[0]


class FusedLayerNorm(LayerNorm, FusedNorm):
    """:class:`normswap.modules.LayerNorm` computed by the ``normswap::layer_norm_fwd`` op."""

    _reference = LayerNorm
    _kind = NormKind.LAYER

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm("layer", x, None, *self._numerics())[0]


def channel_dim_of(dims: tuple[int, ...] | None) -> int | None:
    """The ``channel_dim`` of a fused channel norm for a norm over ``dims`` (negative): the one dim it
    normalizes when that is not the last (-3 for timm's LayerNorm2d on NCHW), else None."""
    if dims is None or len(dims) != 1 or dims[0] >= -1:
        return None
    return dims[0]


class _ChannelDim(FusedNorm):
    """Mixin: normalize one channel dim instead of the trailing dims (timm's LayerNorm2d, RmsNorm2d).

    ``channel_dim`` counts from the end, so it names the same dim at any batch rank: -3 is C of an NCHW
    tensor. The kernels normalize the last dim, so the forward moves the channel dim last and back, as
    timm's LayerNorm2d does around ``F.layer_norm``; for a channels_last tensor the move is a free view.
    """

    channel_dim: int = -1

    @classmethod
    def from_channel_norm(
        cls: type[_C], module: nn.Module, semantics: NormSemantics | None, channel_dim: int
    ) -> _C:
        """A fused copy of ``module``, a norm over dim ``channel_dim`` that ``semantics`` describes."""
        if semantics is None:
            semantics = declared_semantics(module)
        shape = semantics.normalized_shape if semantics is not None else None
        if channel_dim >= 0 or shape is None or len(shape) != 1:
            raise ValueError(
                "a channel norm normalizes one dim counted from the end (e.g. -3 for NCHW), got "
                f"dim {channel_dim} of shape {shape}"
            )
        fused = cls.from_module(module, semantics)
        fused.channel_dim = channel_dim
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moved = x.movedim(self.channel_dim, -1)
        return super().forward(moved).movedim(-1, self.channel_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, channel_dim={self.channel_dim}"


class FusedChannelRMSNorm(_ChannelDim, FusedRMSNorm):
    """:class:`FusedRMSNorm` over dim ``channel_dim`` (timm's RmsNorm2d: -3, the C of NCHW)."""


class FusedChannelLayerNorm(_ChannelDim, FusedLayerNorm):
    """:class:`FusedLayerNorm` over dim ``channel_dim`` (timm's LayerNorm2d: -3, the C of NCHW)."""


class FusedAddRMSNorm(RMSNorm, FusedNorm):
    """``(rms_norm(x + residual), x + residual)``; same constructor and state_dict as RMSNorm."""

    _reference = RMSNorm
    _kind = NormKind.RMS

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = apply_norm("rms", x, residual, *self._numerics())
        return y, h


class FusedAddLayerNorm(LayerNorm, FusedNorm):
    """``(layer_norm(x + residual), x + residual)``; same constructor and state_dict as LayerNorm."""

    _reference = LayerNorm
    _kind = NormKind.LAYER

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = apply_norm("layer", x, residual, *self._numerics())
        return y, h


__all__ = [
    "FusedAddLayerNorm",
    "FusedAddRMSNorm",
    "FusedChannelLayerNorm",
    "FusedChannelRMSNorm",
    "FusedLayerNorm",
    "FusedNorm",
    "FusedRMSNorm",
    "channel_dim_of",
]
