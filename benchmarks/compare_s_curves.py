"""DyT against Derf in place of GPT-2's LayerNorms, calibrated the same way, side by side in one run.

    python benchmarks/compare_s_curves.py [--layers 2] [--width 64] [--batches 4]

A GPT-2 from a config (random weights, LayerNorm affines randomized so that the norms matter), every
LayerNorm swapped for the S-curve (``--to dyt`` / ``--to derf``), then ``--calibrate`` on batches of random
token ids: the whole model's SQNR against the original before and after the fit, and each site's fitted
scalars. Any machine; seconds.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from torch import nn

import normswap
from normswap.api import ConvertConfig


def gpt2(layers: int, width: int) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=max(1, width // 16), vocab_size=128, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model, {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batches", type=int, default=4)
    options = parser.parse_args()
    model, example = gpt2(options.layers, options.width)
    data = [
        {"input_ids": torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))}
        for seed in range(2, 2 + options.batches)
    ]
    for target in ("dyt", "derf"):
        result = normswap.convert(model, ConvertConfig(to=target, calibration_data=data), None, example)
        assert result.calibration is not None
        fit = result.calibration.fit
        scalars = [
            (f"alpha {s.alpha:.3f}" + (f", s {s.shift:+.3f}" if s.shift is not None else ""))
            for s in fit.sites
        ]
        print(
            f"{target}: whole model SQNR {fit.model_sqnr_before_db:.2f} -> {fit.model_sqnr_after_db:.2f} dB on the "
            f"calibration data, {result.calibration.overall.worst_sqnr_db:.2f} dB on the example; {'; '.join(scalars)}"
        )


if __name__ == "__main__":
    main()
