"""Calibrate cosine layers (``convert --to cosine``) back towards the original: their per-output scales
refitted on data, layer by layer in execution order, as :mod:`normswap.calibrate.affine_fit` does for
swapped norms.

Layer k's input comes from the converted model (earlier layers already refitted, so their remaining
error is compensated downstream); its target is the original layer's output on the same batch. The
scale is the least-squares fit of :func:`normswap.modules.cosine.fit_cosine_scale` over every row of
every batch: per output, or one common factor times the weight norms where the conversion found that
only LayerNorms/RMSNorms read the layer (that form is what makes it lossless there; the layer keeps it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from normswap.calibrate.affine_fit import AffineCalibrationReport, SiteFit, fit_sites_in_order
from normswap.modules.cosine import CosineConv, CosineLinear, feature_rows, fit_cosine_scale
from normswap.verify.metrics import sqnr_db


def calibrate_cosine_layers(
    original: nn.Module,
    converted: nn.Module,
    sites: list[str],
    batches: Iterable[Any],
    *,
    on_site: Callable[[str], None] | None = None,
) -> AffineCalibrationReport:
    """Refit the scales of the cosine layers at ``sites`` of ``converted`` (in place) to the original
    layers' outputs on ``batches``; the same report as
    :func:`~normswap.calibrate.affine_fit.calibrate_swapped_norms`."""
    return fit_sites_in_order(original, converted, sites, batches, _fit_scale, on_site)


def _fit_scale(module: nn.Module, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> SiteFit | str:
    """The least-squares scale of one cosine layer, from its inputs and the original layer's outputs."""
    if not isinstance(module, CosineLinear | CosineConv):
        return "not a cosine layer"
    if not inputs:
        return "never ran on the calibration data (a branch the inputs do not take)"
    conv = isinstance(module, CosineConv)
    with torch.no_grad():
        cos = torch.cat([feature_rows(module.cosine(x), conv) for x in inputs])
        want = torch.cat([feature_rows(y, conv) for y in outputs])
        before = sqnr_db(want, cos * module.scale)
        shared = module.shared_scale  # the form the conversion chose, not one read off rounded values
        scale = fit_cosine_scale(cos, want, module.weight_norms() if shared else None)
        module.scale.copy_(scale.to(module.scale.dtype))
        after = sqnr_db(want, cos * module.scale)
    return SiteFit("", type(module).__name__, before, after, note="shared factor" if shared else "per output")
