"""Fused norm modules: the reference modules' constructor and state_dict, the fused ops' forward.

``FusedRMSNorm`` / ``FusedLayerNorm`` subclass :class:`normswap.modules.RMSNorm` / ``LayerNorm`` and only
override ``forward``, so a checkpoint moves freely between a reference and a fused model.
``FusedAddRMSNorm`` / ``FusedAddLayerNorm`` take ``(x, residual)`` and return ``(norm(x + residual),
x + residual)``: the pre-norm transformer's residual add and the following norm in one pass. Swapping a
norm for its fused twin is an *exact* rewrite (same function up to float rounding).
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from normswap.kernels.ops import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from normswap.modules.norms import LayerNorm, RMSNorm

_F = TypeVar("_F", bound="_FromModule")


def _settings(module: nn.Module, want: type[nn.Module]) -> dict:
    """Constructor arguments of the reference class ``want`` that reproduce ``module``'s function."""
    if isinstance(module, RMSNorm | LayerNorm):
        if not isinstance(module, want):
            raise TypeError(f"cannot build a fused {want.__name__} from a {type(module).__name__}")
        return {
            "normalized_shape": module.normalized_shape,
            "eps": module.eps,
            "elementwise_affine": module.elementwise_affine,
            "bias": module.bias is not None,
            "casting": module.casting,
            "weight_offset": module.weight_offset,
        }
    torch_twin = nn.RMSNorm if want is RMSNorm else nn.LayerNorm
    if isinstance(module, torch_twin):
        eps = module.eps
        if eps is None:
            # torch's RMSNorm then uses finfo(input dtype).eps: no single constant reproduces it.
            raise ValueError("nn.RMSNorm with eps=None takes eps from the input dtype; set eps explicitly")
        return {
            "normalized_shape": tuple(module.normalized_shape),
            "eps": float(eps),
            "elementwise_affine": module.elementwise_affine,
            "bias": getattr(module, "bias", None) is not None,
            "casting": "none",
            "weight_offset": 0.0,
        }
    raise TypeError(f"cannot build a fused {want.__name__} from a {type(module).__name__}")


class _FromModule(nn.Module):
    _reference: type[nn.Module]

    @classmethod
    def from_module(cls: type[_F], module: nn.Module) -> _F:
        """A fused copy of ``module`` (a normswap reference norm, or torch's ``LayerNorm``/``RMSNorm``).

        Parameters are copied (not shared) with their dtype, device and ``requires_grad``; the training
        flag is kept. ``module`` is left untouched.
        """
        fused = cls(**_settings(module, cls._reference), device="meta")
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        # assign=True takes each tensor's dtype and device as they are (weight and bias may differ).
        fused.load_state_dict(state, assign=True)
        for name, param in module.named_parameters(recurse=False):
            getattr(fused, name).requires_grad_(param.requires_grad)
        return fused.train(module.training)


class FusedRMSNorm(RMSNorm, _FromModule):
    """:class:`normswap.modules.RMSNorm` computed by the ``normswap::rms_norm_fwd`` op."""

    _reference = RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            x, self.weight, self.bias, self.eps, self.casting, self.weight_offset, len(self.normalized_shape)
        )


class FusedLayerNorm(LayerNorm, _FromModule):
    """:class:`normswap.modules.LayerNorm` computed by the ``normswap::layer_norm_fwd`` op."""

    _reference = LayerNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(
            x, self.weight, self.bias, self.eps, self.casting, self.weight_offset, len(self.normalized_shape)
        )


class FusedAddRMSNorm(RMSNorm, _FromModule):
    """``(rms_norm(x + residual), x + residual)``; same constructor and state_dict as RMSNorm."""

    _reference = RMSNorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(
            x,
            residual,
            self.weight,
            self.bias,
            self.eps,
            self.casting,
            self.weight_offset,
            len(self.normalized_shape),
        )


class FusedAddLayerNorm(LayerNorm, _FromModule):
    """``(layer_norm(x + residual), x + residual)``; same constructor and state_dict as LayerNorm."""

    _reference = LayerNorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_layer_norm(
            x,
            residual,
            self.weight,
            self.bias,
            self.eps,
            self.casting,
            self.weight_offset,
            len(self.normalized_shape),
        )


__all__ = ["FusedAddLayerNorm", "FusedAddRMSNorm", "FusedLayerNorm", "FusedRMSNorm"]
