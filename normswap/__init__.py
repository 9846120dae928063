"""normswap: find, rewrite and verify the normalization layers of trained PyTorch models.

The public names load on first use (PEP 562), so that what needs no model, such as the list of
rewrites (:mod:`normswap.rewrites`) that ``normswap --help`` reads, imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from normswap.errors import BadInputError, CheckFailedError, NormswapError, OutputExistsError

if TYPE_CHECKING:
    from normswap.api import (
        ConversionResult,
        ConvertConfig,
        SavedOutput,
        Validation,
        Verdict,
        convert,
        distill,
        export_onnx,
        inspect,
        recalibrate,
        save,
        validate,
    )
    from normswap.discover import NormInventory, NormSite, find_norms
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

# public name -> the module that defines it
_LAZY = {
    **dict.fromkeys(
        (
            "ConversionResult",
            "ConvertConfig",
            "SavedOutput",
            "Validation",
            "Verdict",
            "convert",
            "distill",
            "export_onnx",
            "inspect",
            "recalibrate",
            "save",
            "validate",
        ),
        "normswap.api",
    ),
    **dict.fromkeys(("NormInventory", "NormSite", "find_norms"), "normswap.discover"),
    "load_model": "normswap.load",
    **dict.fromkeys(
        (
            "FoldBatchNorm",
            "Pipeline",
            "PipelineReport",
            "RewriteKind",
            "SwapNorm",
            "fold_batchnorm",
            "swap_norm",
        ),
        "normswap.passes",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'normswap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BadInputError",
    "CheckFailedError",
    "ConversionResult",
    "ConvertConfig",
    "FoldBatchNorm",
    "NormInventory",
    "NormSite",
    "NormswapError",
    "OutputExistsError",
    "Pipeline",
    "PipelineReport",
    "RewriteKind",
    "SavedOutput",
    "SwapNorm",
    "Validation",
    "Verdict",
    "convert",
    "distill",
    "export_onnx",
    "find_norms",
    "fold_batchnorm",
    "inspect",
    "load_model",
    "recalibrate",
    "save",
    "swap_norm",
    "validate",
]
