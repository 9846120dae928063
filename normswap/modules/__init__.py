"""Reference norm modules (plain torch) that define the semantics of what normswap writes; their math
is :mod:`normswap.kernels.reference`."""

from normswap.modules.affine import ChannelAffine
from normswap.modules.norms import LayerNorm, RMSNorm

__all__ = ["ChannelAffine", "LayerNorm", "RMSNorm"]
