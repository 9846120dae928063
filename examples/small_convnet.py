"""A small conv net with BatchNorm, a functional-free LayerNorm head and trained-looking statistics.

Used by the README quick start:

    normswap convert examples/small_convnet.py:build --fold-bn -o out/small_convnet_folded.pt2

``build()`` returns ``(model, example_inputs)``, the factory form normswap accepts.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class SmallConvNet(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBlock(3, 16)
        self.block1 = ConvBlock(16, 32, stride=2)
        self.block2 = ConvBlock(32, 64, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.stem(x)))
        return self.head(self.norm(self.pool(x).flatten(1)))


def build() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model in eval mode with non-trivial norm parameters and statistics, and an example input."""
    generator = torch.Generator().manual_seed(0)
    # the conv weights from a fixed seed too (the caller's RNG left as it was): the examples print figures
    # that their tests read, and those must not change from run to run
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = SmallConvNet()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                n = module.num_features
                module.running_mean.copy_(torch.randn(n, generator=generator) * 0.5)
                module.running_var.copy_(torch.rand(n, generator=generator) * 1.5 + 0.5)
                module.weight.copy_(1 + 0.3 * torch.randn(n, generator=generator))
                module.bias.copy_(0.3 * torch.randn(n, generator=generator))
            elif isinstance(module, nn.LayerNorm):
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.3 * torch.randn(module.bias.shape, generator=generator))
    return model.eval(), (torch.randn(2, 3, 32, 32, generator=generator),)
