"""Graph-informed rewrites of a model's norms. One pass per file; see :mod:`normswap.passes.base`."""

from normswap.passes.base import Change, Pass, PassContext, PassReport, RewriteKind, Skip, build_context
from normswap.passes.fold_batchnorm import FoldBatchNorm, fold_batchnorm
from normswap.passes.pipeline import ExactOnlyError, Pipeline, PipelineReport
from normswap.passes.recenter_layernorm import RecenterLayerNorm, recenter_layernorm
from normswap.passes.swap_norm import SWAP_TARGETS, SwapNorm, swap_norm

__all__ = [
    "SWAP_TARGETS",
    "Change",
    "ExactOnlyError",
    "FoldBatchNorm",
    "Pass",
    "PassContext",
    "PassReport",
    "Pipeline",
    "PipelineReport",
    "RecenterLayerNorm",
    "RewriteKind",
    "Skip",
    "SwapNorm",
    "build_context",
    "fold_batchnorm",
    "recenter_layernorm",
    "swap_norm",
]
