"""normswap: find, rewrite and verify the normalization layers of trained PyTorch models."""

from normswap.api import ConversionResult, ConvertConfig, SavedOutput, Verdict, convert, save
from normswap.discover import NormInventory, NormSite, find_norms
from normswap.errors import BadInputError, CheckFailedError, NormswapError
from normswap.load import load_model
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
    "ConversionResult",
    "ConvertConfig",
    "FoldBatchNorm",
    "NormInventory",
    "NormSite",
    "NormswapError",
    "Pipeline",
    "PipelineReport",
    "RewriteKind",
    "SavedOutput",
    "SwapNorm",
    "Verdict",
    "convert",
    "find_norms",
    "fold_batchnorm",
    "load_model",
    "save",
    "swap_norm",
]
