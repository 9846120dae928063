"""Fold every BatchNorm of a model, and show what happened at each site and why.

    python examples/fold_batchnorm.py

Two models, both with BatchNorm statistics far from the identity (as after training):
- torchvision's resnet18: every BatchNorm follows a conv and folds into it (20 of 20);
- a small model with one of each case of the fold family: conv and grouped ConvTranspose followed by
  BN (folded into the layer before), a BN with only a Linear after it (folded forward into it), a BN
  with nothing to fold into (a per-channel affine), an ``F.batch_norm`` call inside a forward (its
  owner becomes a torch.fx GraphModule without the call), and a BN before a zero-padded conv (refused:
  zero padding does not commute with the BN's shift).

Each folded model is checked against the original: the exact tolerance is 1e-5 x max|output| (fp32).
``build()`` gives the second model to the command line:

    normswap convert examples/fold_batchnorm.py:build --fold-bn -o folded.pt2
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from normswap.passes import FoldBatchNorm, PassReport
from normswap.verify import compare_models


def randomize_batchnorms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm trained-looking statistics and affine parameters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                n = m.num_features
                m.running_mean.copy_(0.5 * torch.randn(n, generator=generator))
                m.running_var.copy_(torch.rand(n, generator=generator) * 1.5 + 0.5)
                if m.affine:
                    m.weight.copy_(1 + 0.3 * torch.randn(n, generator=generator))
                    m.bias.copy_(0.3 * torch.randn(n, generator=generator))
    return model.eval()


class ConvWithFunctionalBN(nn.Module):
    """Research code: a conv followed by ``F.batch_norm`` on buffers, inside one forward."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.register_buffer("mean", 0.5 * torch.randn(c_out))
        self.register_buffer("var", torch.rand(c_out) + 0.5)
        self.gamma = nn.Parameter(1 + 0.3 * torch.randn(c_out))
        self.beta = nn.Parameter(0.3 * torch.randn(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(self.conv(x), self.mean, self.var, self.gamma, self.beta, training=False)


class FoldFamily(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)  # folds back into stem
        self.up = nn.ConvTranspose2d(8, 12, 2, stride=2, groups=4)
        self.up_bn = nn.BatchNorm2d(12)  # folds back into the grouped ConvTranspose
        self.pre_bn = nn.BatchNorm2d(12)  # after a ReLU, before a zero-padded conv: refused
        self.mix = nn.Conv2d(12, 8, 3, padding=1)
        self.block = ConvWithFunctionalBN(8, 8)  # F.batch_norm: folded, owner becomes a GraphModule
        self.pooled_bn = nn.BatchNorm1d(8)  # only a Linear after it: folds forward into head
        self.head = nn.Linear(8, 10)
        self.out_bn = nn.BatchNorm1d(10, affine=False)  # folds back into head
        self.alone_bn = nn.BatchNorm1d(10)  # nothing on either side: a per-channel affine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.up_bn(self.up(torch.relu(self.stem_bn(self.stem(x))))))
        x = torch.relu(self.block(self.mix(self.pre_bn(x))))
        x = self.out_bn(self.head(self.pooled_bn(x.mean((2, 3)))))
        return self.alone_bn(torch.tanh(x))


def print_report(title: str, report: PassReport) -> None:
    print(f"== {title}")
    for change in report.changes:
        print(f"  changed  {change.site:<22} {change.description}")
    for skip in report.skips:
        print(f"  skipped  {skip.site:<22} {skip.reason}")


def fold_and_check(title: str, model: nn.Module, x: torch.Tensor) -> int:
    folded, report = FoldBatchNorm()(model, (x,))
    print_report(title, report)
    sites = len(report.changes) + len(report.skips)
    folds = sum(1 for c in report.changes if c.details.get("into"))
    affines = len(report.changes) - folds
    cmp = compare_models(model, folded, (x,))
    out = cmp.outputs[0]
    print(
        f"  {title}: folded {folds} of {sites} BatchNorms, {affines} made affine, {len(report.skips)} "
        f"refused; max abs error {out.max_abs:.2e} = {out.max_rel:.2e} x max|output| "
        f"(tolerance 1e-05) {'PASS' if cmp.within_tolerance else 'FAIL'}"
    )
    return 0 if cmp.within_tolerance else 1


def build() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The fold-family model and an example input, in the factory form the CLI accepts:
    ``normswap convert examples/fold_batchnorm.py:build --fold-bn -o folded.pt2``."""
    torch.manual_seed(0)
    return randomize_batchnorms(FoldFamily()), (torch.randn(4, 3, 16, 16),)


def main() -> int:
    import torchvision

    torch.manual_seed(0)
    resnet = randomize_batchnorms(torchvision.models.resnet18(num_classes=10))
    status = fold_and_check("resnet18", resnet, torch.randn(2, 3, 64, 64))
    family, (x,) = build()
    status |= fold_and_check("fold family", family, x)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
