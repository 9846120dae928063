"""A per-channel affine map: what an eval-mode BatchNorm computes once its statistics are frozen in.

``y = x * scale + shift`` with ``scale`` and ``shift`` of shape ``(C,)`` broadcast along dim 1 (the
channel dim of ``(N, C, *)``, as BatchNorm). The fold pass puts one where a BatchNorm has no conv or
linear beside it to fold into; the function is unchanged and the statistics and eps are gone.
"""

from __future__ import annotations

import torch
from torch import nn

# Half-precision inputs are computed in fp32 and rounded once at the end, as BatchNorm's kernels do.
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class ChannelAffine(nn.Module):
    """``y = x * scale + shift`` per channel along dim 1."""

    def __init__(
        self,
        num_features: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_features = int(num_features)
        factory = {"device": device, "dtype": dtype}
        self.scale = nn.Parameter(torch.ones(self.num_features, **factory))
        self.shift = nn.Parameter(torch.zeros(self.num_features, **factory))

    @classmethod
    def from_scale_shift(
        cls, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None
    ) -> ChannelAffine:
        """Build from (typically fp64) ``scale``/``shift``, rounded once to ``dtype``."""
        module = cls(scale.numel(), device=device, dtype=dtype)
        with torch.no_grad():
            module.scale.copy_(scale.detach().reshape(-1).to(dtype))
            module.shift.copy_(shift.detach().reshape(-1).to(dtype))
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 2:
            raise ValueError(f"ChannelAffine expects (N, C, *) input, got {x.ndim}-D")
        shape = (1, -1) + (1,) * (x.ndim - 2)
        compute = _UPCAST.get(x.dtype, x.dtype)
        scale = self.scale.reshape(shape).to(compute)
        shift = self.shift.reshape(shape).to(compute)
        return (x.to(compute) * scale + shift).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_features}"
