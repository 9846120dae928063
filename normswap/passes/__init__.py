"""Graph-informed rewrites of a model's norms. One pass per file, every one the same protocol
(:class:`Pass`: prepare, candidates, check into a plan or a refusal, apply; one driver); see
:mod:`normswap.passes.core.base`."""

from normswap.passes.affine.defer_rms import DeferRMS, defer_rms
from normswap.passes.affine.fold import FoldNormAffine, fold_norm_affine
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
from normswap.passes.fuse.add_norm import FuseAddNorm, fuse_add_norm
from normswap.passes.fuse.graph import FuseGraphNorm, fuse_graph_norm
from normswap.passes.fuse.modules import FuseNorm, fuse_norm
from normswap.passes.layerscale.fold import FoldLayerScale
from normswap.passes.recenter.compress import CompressStream
from normswap.passes.recenter.layernorm import RecenterLayerNorm, recenter_layernorm
from normswap.passes.swap.cosine_layers import CosineLayers, cosine_layers
from normswap.passes.swap.swap_norm import SWAP_TARGETS, SwapNorm, swap_norm
from normswap.passes.weightnorm.layers import (
    AddWeightNorm,
    RemoveWeightNorm,
    add_weight_norm,
    remove_weight_norm,
)

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
    "add_weight_norm",
    "build_context",
    "cosine_layers",
    "defer_rms",
    "fold_batchnorm",
    "fold_norm_affine",
    "fuse_add_norm",
    "fuse_graph_norm",
    "fuse_norm",
    "recenter_layernorm",
    "remove_weight_norm",
    "swap_norm",
]
