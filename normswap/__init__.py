"""normswap: find, rewrite and verify the normalization layers of trained PyTorch models."""

from normswap.discover import NormInventory, NormSite, find_norms
from normswap.errors import BadInputError, CheckFailedError, NormswapError
from normswap.passes import (
    FoldBatchNorm,
    Pipeline,
    PipelineReport,
    RewriteKind,
    SwapNorm,
    fold_batchnorm,
    swap_norm,
)

__version__ = "0.1.0"

__all__ = [
    "BadInputError",
    "CheckFailedError",
    "FoldBatchNorm",
    "NormInventory",
    "NormSite",
    "NormswapError",
    "Pipeline",
    "PipelineReport",
    "RewriteKind",
    "SwapNorm",
    "find_norms",
    "fold_batchnorm",
    "swap_norm",
]
