"""Every rewrite normswap offers, listed once.

A rewrite is asked for by a field of :class:`normswap.ConvertConfig` and an option of ``normswap
convert``; it is exact, architectural or data-driven; it belongs to a family (its ``--help`` panel and
its docs page); and it either streams (a model directory rewritten tensor by tensor,
:mod:`normswap.passes.core.edits`) or does not, and either keeps the user's module or makes an
exported graph (which only ``.pt2`` and ``.onnx`` can hold). Those facts are read from here, never
kept in a second list: the config's ``given`` and graph checks, which conversions stream, the command's
options and help panels, and the README's table (``tests/test_rewrites.py`` checks it against this
list).

This module imports nothing of normswap's or torch's, so ``normswap --help`` reads it at no cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

EXACT, ARCHITECTURAL, DATA_DRIVEN = "exact", "architectural", "data-driven"

# families: the help panels of ``normswap convert`` and the docs pages of docs/convert/
SWAP = "Swap norms"
FOLDS = "Exact folds"
FUSED = "Fused kernels"
WEIGHT_NORM = "Weight norm"


# The stages in which a conversion's passes run, in this order. Plain weights first, so the folds see
# and rewrite real parameters; the folds into layers; the norm swaps; the affine folds into the readers
# of the (swapped) norms; weight norm added last among the module edits. Graph rewrites come after every
# module edit, since they replace the user's module with an exported graph: norms fused before adds are
# fused into them, and a deferred RMS scale last, after the norms' weights are folded.
PLAIN_WEIGHTS, LAYER_FOLDS, LAYERSCALE_FOLDS, NORM_SWAPS, AFFINE_FOLDS, ADD_WEIGHT_NORM = range(6)
GRAPH_STREAM, GRAPH_FUSE_NORMS, GRAPH_FUSE_ADDS, GRAPH_DEFER_RMS = range(6, 10)


@dataclass(frozen=True)
class Rewrite:
    """One rewrite: ``field`` of ConvertConfig (for a ``--to`` target, the target's name), ``option`` on
    the command line, ``kind``, ``family``, ``help`` (its ``--help`` line), ``docs`` (its page under
    docs/), ``stage`` (when its passes run, above), ``streams`` (a model directory can be rewritten
    tensor by tensor; a ``--to`` target only under ``--exact``), ``graph`` (the result is an exported
    GraphModule), ``needs`` (the option it refines, if any), ``runs_also`` (the rewrite whose passes it
    needs run first, at their own stage)."""

    field: str
    option: str
    kind: str
    family: str
    help: str
    docs: str
    stage: int
    streams: bool = False
    graph: bool = False
    needs: str | None = None
    runs_also: str | None = None


# The on/off rewrites, each a boolean (or, for --add-weight-norm, a module list) of ConvertConfig.
OPTIONS: tuple[Rewrite, ...] = (
    Rewrite(
        "fold_bn",
        "--fold-bn",
        EXACT,
        FOLDS,
        "Fold eval-mode BatchNorm into the conv/linear beside it (exact).",
        "convert/fold-batchnorm.md",
        LAYER_FOLDS,
        streams=True,
    ),
    Rewrite(
        "fold_layerscale",
        "--fold-layerscale",
        EXACT,
        FOLDS,
        "Fold each LayerScale (ViT's ls1/ls2, DINOv2's layer_scale, ConvNeXt's gamma) into the Linear or conv "
        "that writes what it scales (exact).",
        "convert/fold-layerscale.md",
        LAYERSCALE_FOLDS,
        streams=True,
    ),
    Rewrite(
        "fold_norm_affine",
        "--fold-norm-affine",
        EXACT,
        FOLDS,
        "Fold each norm's weight and bias into the Linear layers that read it (exact).",
        "convert/fold-affine.md",
        AFFINE_FOLDS,
        streams=True,
    ),
    Rewrite(
        "defer_rms",
        "--defer-rms",
        EXACT,
        FOLDS,
        "Fold norm weights into their Linear readers, then apply each RMSNorm's scale after those matmuls "
        "(FlashNorm; exact; the result is a GraphModule: save as .pt2 or .onnx).",
        "convert/fold-affine.md",
        GRAPH_DEFER_RMS,
        graph=True,
        runs_also="fold_norm_affine",
    ),
    Rewrite(
        "fuse_add",
        "--fuse-add",
        EXACT,
        FUSED,
        "With --to fused: also fuse each residual add into the norm after it (the output becomes a "
        "torch.fx GraphModule; exact).",
        "convert/fused.md",
        GRAPH_FUSE_ADDS,
        graph=True,
        needs="--to fused",
    ),
    Rewrite(
        "fuse_inline",
        "--fuse-inline",
        EXACT,
        FUSED,
        "With --to fused: also fuse norms that are no module of their own (functional calls and norms "
        "written out inside another forward; the output becomes a torch.fx GraphModule; exact).",
        "convert/fused.md",
        GRAPH_FUSE_NORMS,
        graph=True,
        needs="--to fused",
    ),
    Rewrite(
        "add_weight_norm",
        "--add-weight-norm",
        EXACT,
        WEIGHT_NORM,
        "Wrap these Conv/ConvTranspose/Linear layers in weight norm: comma-separated module paths, or "
        "'all' (exact).",
        "convert/weight-norm.md",
        ADD_WEIGHT_NORM,
        streams=True,
    ),
    Rewrite(
        "remove_weight_norm",
        "--remove-weight-norm",
        EXACT,
        WEIGHT_NORM,
        "Fold every weight norm back into a plain weight (exact).",
        "convert/weight-norm.md",
        PLAIN_WEIGHTS,
        streams=True,
    ),
)

# The targets of ``--to``. rmsnorm is exact where the residual stream can be recentered (and streams
# then, under --exact) and architectural elsewhere.
_SWAPS = ("layernorm", "batchnorm", "groupnorm", "instancenorm", "dyt", "derf", "identity")
TARGETS: tuple[Rewrite, ...] = (
    Rewrite(
        "rmsnorm",
        "--to rmsnorm",
        EXACT,
        SWAP,
        "exact where the residual stream can be recentered, architectural elsewhere",
        "convert/recenter.md",
        NORM_SWAPS,
        streams=True,
    ),
    Rewrite(
        "crmsnorm",
        "--to crmsnorm",
        EXACT,
        SWAP,
        "Pre-CRMSNorm: the recentered residual stream stored in d-1 dims; exact, a graph rewrite",
        "convert/recenter.md",
        GRAPH_STREAM,
        graph=True,
    ),
    Rewrite(
        "fused",
        "--to fused",
        EXACT,
        FUSED,
        "the same norms on normswap's fused kernels; exact",
        "convert/fused.md",
        NORM_SWAPS,
    ),
    Rewrite(
        "cosine",
        "--to cosine",
        ARCHITECTURAL,
        SWAP,
        "Linear/Conv layers become cosine-normalized ones (architectural; see --layers)",
        "convert/cosine.md",
        NORM_SWAPS,
    ),
    *(
        Rewrite(
            name,
            f"--to {name}",
            ARCHITECTURAL,
            SWAP,
            "a norm of another kind (architectural)",
            "convert/swap.md",
            NORM_SWAPS,
        )
        for name in _SWAPS
    ),
)

REWRITES: tuple[Rewrite, ...] = (*OPTIONS, *TARGETS)
BY_OPTION: Mapping[str, Rewrite] = MappingProxyType({r.option: r for r in REWRITES})
BY_FIELD: Mapping[str, Rewrite] = MappingProxyType({r.field: r for r in REWRITES})


def to_help() -> str:
    """The help of ``--to``, from the targets."""
    parts = [f"{r.field} ({r.help})" for r in TARGETS if r.field not in _SWAPS]
    return (
        "Swap norms to this kind: "
        + "; ".join(parts)
        + f"; or {', '.join(_SWAPS)}: a norm of another kind (architectural)."
    )


def streamed_options() -> str:
    """The options a model directory streams, one at a time (``--to rmsnorm`` under ``--exact``), said
    as a choice: "--fold-bn, ... or --to rmsnorm --exact"."""
    options = [r.option + (" --exact" if r.field == "rmsnorm" else "") for r in REWRITES if r.streams]
    return ", ".join(options[:-1]) + " or " + options[-1]


def graph_options() -> list[str]:
    """The options whose result is an exported GraphModule (only .pt2 and .onnx hold one)."""
    return [r.option for r in REWRITES if r.graph]
