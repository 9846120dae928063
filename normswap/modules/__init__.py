"""Reference norm modules (plain torch) that define the semantics of what normswap writes."""

from normswap.modules.affine import ChannelAffine
from normswap.modules.functional import CASTING_MODES, layer_norm_reference, rms_norm_reference
from normswap.modules.norms import LayerNorm, RMSNorm

__all__ = [
    "CASTING_MODES",
    "ChannelAffine",
    "LayerNorm",
    "RMSNorm",
    "layer_norm_reference",
    "rms_norm_reference",
]
