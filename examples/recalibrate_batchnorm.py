"""Recalibrate BatchNorm statistics after a change upstream of the BatchNorms.

A BatchNorm in eval mode normalizes with the statistics it saw in training. Change a layer before it and
those statistics go stale; re-estimating them on a few batches of data fixes that without training.
This script shows it on the small conv net of ``small_convnet.py``:

1. a reference model whose statistics fit the data (estimated on calibration batches),
2. the stem conv's weights halved: BatchNorm in training mode would not notice (it divides the scale out),
   so recalibrating recovers the reference up to BatchNorm's eps, while the stale statistics do not,
3. half of every conv's weights pruned by magnitude: no exact answer exists, but the recalibrated model
   is much closer to the reference than the pruned model with stale statistics.

The same from the command line, on a file of batches:

    normswap recalibrate examples/small_convnet.py:build --data calib.pt --batch-size 16 -o recal.pt2

Run: ``python examples/recalibrate_batchnorm.py``.
"""

from __future__ import annotations

import copy

import torch
from small_convnet import build
from torch import nn

from normswap.calibrate import recalibrate_batchnorm
from normswap.verify import sqnr_db


def calibration_batches(count: int = 9, batch_size: int = 16, seed: int = 0) -> list[torch.Tensor]:
    """Smooth random images: upsampled noise, so neighbouring pixels correlate as in real ones."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count * batch_size, 3, 8, 8, generator=generator)
    images = nn.functional.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    return list(images.split(batch_size))


def prune_convs(model: nn.Module, fraction: float) -> None:
    """Zero the smallest-magnitude ``fraction`` of every conv's weights."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                w = module.weight
                threshold = w.abs().flatten().kthvalue(int(fraction * w.numel())).values
                w.mul_(w.abs() > threshold)


def main() -> None:
    model, _ = build()
    data = calibration_batches()
    test = calibration_batches(count=1, batch_size=64, seed=1)[0]

    # 1. statistics that fit the data, as training would have left them
    reference, report = recalibrate_batchnorm(model, data)
    print(
        f"reference: {len(report.layers)} BatchNorm layers estimated on {report.batches} batches "
        f"({report.samples} samples)"
    )
    with torch.no_grad():
        expected = reference(test)

    def sqnr(candidate: nn.Module) -> float:
        with torch.no_grad():
            return sqnr_db(expected, candidate(test))

    # 2. an upstream change BatchNorm can absorb exactly
    scaled = copy.deepcopy(reference)
    with torch.no_grad():
        scaled.stem.conv.weight.mul_(0.5)
    recalibrated, report = recalibrate_batchnorm(scaled, data)
    moved = report.layers[0]
    print(
        f"stem conv x0.5: stale statistics {sqnr(scaled):.1f} dB SQNR vs reference, "
        f"recalibrated {sqnr(recalibrated):.1f} dB (stem.bn var ratio {moved.var_ratio_min:.3f}.."
        f"{moved.var_ratio_max:.3f})"
    )

    # 3. an upstream change with no exact fix
    pruned = copy.deepcopy(reference)
    prune_convs(pruned, 0.5)
    recalibrated, _ = recalibrate_batchnorm(pruned, data)
    print(
        f"50% of conv weights pruned: stale statistics {sqnr(pruned):.1f} dB SQNR vs reference, "
        f"recalibrated {sqnr(recalibrated):.1f} dB"
    )


if __name__ == "__main__":
    main()
