"""Pre-CRMSNorm's norm (Jiang et al., NeurIPS 2023): an RMSNorm that reads a zero-sum vector stored
without its last coordinate.

After recentering, every vector of a pre-LN transformer's residual stream sums to zero, so its last
coordinate is minus the sum of the others and need not be stored: the stream can be ``d - 1`` wide.
:class:`ZeroSumRMSNorm` completes the vector (``x_d = -sum(z)``) and normalizes it as the RMSNorm it
replaces, with the same ``d`` weights, bias, eps and casting mode, so what it returns, and everything
after it, is unchanged.
"""

from __future__ import annotations

import torch

from normswap.modules.norms import RMSNorm


def complete_zero_sum(z: torch.Tensor) -> torch.Tensor:
    """``[z, -sum(z)]`` over the last dim: the zero-sum vector whose first ``d - 1`` coordinates are ``z``.
    The sum accumulates in float32 for half-precision inputs, as their norms compute their statistics."""
    accumulate = torch.float32 if z.dtype in (torch.float16, torch.bfloat16) else z.dtype
    last = z.sum(dim=-1, keepdim=True, dtype=accumulate).neg().to(z.dtype)
    return torch.cat([z, last], dim=-1)


class ZeroSumRMSNorm(RMSNorm):
    """RMSNorm over ``d`` features of an input stored as its first ``d - 1`` (module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.normalized_shape[-1] - 1:
            raise ValueError(
                f"ZeroSumRMSNorm over {self.normalized_shape[-1]} features reads {self.normalized_shape[-1] - 1}, "
                f"got {x.shape[-1]}"
            )
        return super().forward(complete_zero_sum(x))
