"""Graph-informed rewrites of a model's norms. One pass per file, every one the same protocol
(:class:`Pass`: prepare, candidates, check into a plan or a refusal, apply; one driver); see
:mod:`normswap.passes.core.base`."""

from normswap.passes.affine.defer_rms import DeferRMS
from normswap.passes.affine.fold import FoldNormAffine
from normswap.passes.batchnorm.fold import FoldBatchNorm, fold_batchnorm
from normswap.passes.core.base import (
    Change,
    Needs,
    Pass,
    PassContext,
    PassReport,
    Refusal,
    RewriteKind,
    Skip,
    SkipCause,
    build_context,
)
from normswap.passes.core.pipeline import ExactOnlyError, Pipeline, PipelineReport
from normswap.passes.fuse.add_norm import FuseAddNorm
from normswap.passes.fuse.graph import FuseGraphNorm
from normswap.passes.fuse.modules import FuseNorm
from normswap.passes.layerscale.fold import FoldLayerScale
from normswap.passes.recenter.compress import CompressStream
from normswap.passes.recenter.layernorm import RecenterLayerNorm
from normswap.passes.swap.cosine_layers import CosineLayers
from normswap.passes.swap.swap_norm import SWAP_TARGETS, SwapNorm, swap_norm
from normswap.passes.weightnorm.layers import AddWeightNorm, RemoveWeightNorm

__all__ = [
    "SWAP_TARGETS",
    "AddWeightNorm",
    "Change",
    "CompressStream",
    "CosineLayers",
    "DeferRMS",
    "ExactOnlyError",
    "FoldBatchNorm",
    "FoldLayerScale",
    "FoldNormAffine",
    "FuseAddNorm",
    "FuseGraphNorm",
    "FuseNorm",
    "Needs",
    "Pass",
    "PassContext",
    "PassReport",
    "Pipeline",
    "PipelineReport",
    "RecenterLayerNorm",
    "Refusal",
    "RemoveWeightNorm",
    "RewriteKind",
    "Skip",
    "SkipCause",
    "SwapNorm",
    "build_context",
    "fold_batchnorm",
    "swap_norm",
]
