"""One set of rules for both fused-norm passes (normswap.passes.fuse.legality): the same illegal norm, once
a module of its own (FuseNorm) and once written inline in a larger forward (FuseGraphNorm), is refused
with the same reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn

from normswap.passes import FuseGraphNorm, FuseNorm

NormFn = Callable[[torch.Tensor, nn.Module], torch.Tensor]


def _rms(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.w


def _layer(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    d = x - x.mean(-1, keepdim=True)
    return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) * m.w + m.b


def _batch(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    return (x - m.running_mean) * torch.rsqrt(m.running_var + 1e-5)


class _Norm(nn.Module):
    """A norm written out as a module of its own."""

    def __init__(self, norm: NormFn, **tensors: torch.Tensor) -> None:
        super().__init__()
        self.norm = norm
        for name, tensor in tensors.items():
            if name.startswith("running"):
                self.register_buffer(name, tensor)
            else:
                self.register_parameter(name, nn.Parameter(tensor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self)


class _Block(_Norm):
    """The same norm written inline in a larger forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + 1, self)


CASES = {
    "a bias not of the normalized shape": (
        _layer,
        {"w": torch.rand(8) + 0.5, "b": torch.randn(1, 8)},
        torch.randn(2, 3, 8),
        {},
        "its bias b has shape (1, 8), not the normalized shape (8,)",
    ),
    "a norm over positions": (
        _batch,
        {"running_mean": torch.randn(1, 4, 1, 1), "running_var": torch.rand(1, 4, 1, 1) + 0.5},
        torch.randn(2, 4, 3, 3),
        {},
        "batch norm: the fused kernels normalize features, not over positions",
    ),
    # records no discovery gives today: the same change to the record of a legal norm in both passes
    "a casting mode the kernels do not implement": (
        _rms,
        {"w": torch.rand(8) + 0.5},
        torch.randn(2, 8),
        {"casting": "fp8"},
        "casting mode 'fp8' is not one the kernels implement ('none', 'llama', 'gemma')",
    ),
    "an eps not known": (
        _rms,
        {"w": torch.rand(8) + 0.5},
        torch.randn(2, 8),
        {"eps": None},
        "its normalized shape or eps could not be determined",
    ),
}


class _AlteredFuseNorm(FuseNorm):
    def __init__(self, **changes: object) -> None:
        self.changes = changes

    def candidates(self, ctx, state):
        return [
            dataclasses.replace(s, semantics=dataclasses.replace(s.semantics, **self.changes))
            for s in super().candidates(ctx, state)
        ]


class _AlteredFuseGraphNorm(FuseGraphNorm):
    def __init__(self, **changes: object) -> None:
        self.changes = changes

    def candidates(self, ctx, state):
        return [dataclasses.replace(n, **self.changes) for n in super().candidates(ctx, state)]


@pytest.mark.parametrize("case", list(CASES))
def test_a_module_and_the_same_norm_inline_are_refused_for_the_same_reason(case):
    norm, tensors, x, changes, reason = CASES[case]
    torch.manual_seed(0)
    _, as_module = _AlteredFuseNorm(**changes)(nn.Sequential(nn.Identity(), _Norm(norm, **tensors)), (x,))
    _, inline = _AlteredFuseGraphNorm(**changes)(_Block(norm, **tensors), (x,))
    assert as_module.changes == [] and inline.changes == []
    assert [s.reason for s in as_module.skips] == [reason]
    assert [s.reason for s in inline.skips] == [reason]


def test_the_legal_norm_is_fused_by_both():
    tensors = {"w": torch.rand(8) + 0.5, "b": torch.randn(8)}
    x = torch.randn(2, 3, 8)
    _, as_module = FuseNorm()(nn.Sequential(nn.Identity(), _Norm(_layer, **tensors)), (x,))
    _, inline = FuseGraphNorm()(_Block(_layer, **tensors), (x,))
    assert (len(as_module.changes), len(inline.changes)) == (1, 1)
    for key in ("eps", "casting", "weight_offset", "tolerance", "measured_on"):
        assert as_module.changes[0].details[key] == inline.changes[0].details[key], key
