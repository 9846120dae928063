"""Property: an exact pass never gives a silent wrong answer.

Random ``nn.Sequential`` stacks of Conv1d/Conv2d/ConvTranspose2d/Linear/BatchNorm/LayerNorm blocks, with
random channels, groups, kernels, strides, padding (and padding modes), biases, BN affine flags and
statistics, go through each exact pass. Every site the pass must consider is either changed or skipped
with a non-empty reason, every change is recorded as exact, the input model is left untouched, and the
output matches the original in every case (a skipped site stays as it was, so the whole model must still
match): within the exact tolerance, or within the rounding noise the stack amplifies on its own where
that is larger (measured as the fp32 model against its fp64 copy).

To cover another exact pass, add an :class:`ExactPassCase` to ``EXACT_PASSES``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import model_zoo
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from normswap.passes import (
    AddWeightNorm,
    FoldBatchNorm,
    FoldNormAffine,
    Pass,
    RecenterLayerNorm,
    RewriteKind,
)
from normswap.util.tolerance import exact_tolerance


@dataclass(frozen=True)
class ExactPassCase:
    name: str
    make: Callable[[], Pass]
    # Module paths the pass must report on (changed or skipped); an empty set checks only the numbers.
    sites: Callable[[nn.Module], set[str]]


def _batchnorm_paths(model: nn.Module) -> set[str]:
    return {p for p, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def _layernorm_paths(model: nn.Module) -> set[str]:
    return {p for p, m in model.named_modules() if isinstance(m, nn.LayerNorm)}


def _weight_layer_paths(model: nn.Module) -> set[str]:
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d)
    return {p for p, m in model.named_modules() if isinstance(m, kinds)}


EXACT_PASSES = [
    ExactPassCase("fold_batchnorm", FoldBatchNorm, _batchnorm_paths),
    ExactPassCase("recenter_layernorm", RecenterLayerNorm, _layernorm_paths),
    ExactPassCase("fold_norm_affine", FoldNormAffine, _layernorm_paths),
    ExactPassCase("add_weight_norm", AddWeightNorm, _weight_layer_paths),
]


# A stack is a start shape and a list of plain-tuple layer specs, so a failing example prints readably.
Spec = tuple


def _conv_out(size: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def _convt_out(size: int, k: int, stride: int, pad: int, dil: int, out_pad: int) -> int:
    return (size - 1) * stride - 2 * pad + dil * (k - 1) + out_pad + 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _grouped_channels(draw, cin: int) -> tuple[int, int]:
    groups = draw(st.sampled_from(_divisors(cin)[::-1]))  # grouped more often than not
    return groups, groups * draw(st.integers(1, max(1, 6 // groups)))


@dataclass
class _Shape:
    rank: int
    channels: int
    spatial: list[int]


def _bn_spec(draw: Callable, shape: _Shape) -> Spec:
    stats = draw(st.sampled_from([True, True, True, False]))  # mostly with running statistics
    return ("bn", shape.rank, shape.channels, draw(st.booleans()), stats)


def _layer_spec(draw: Callable, shape: _Shape) -> Spec | None:
    """A Conv/ConvTranspose/Linear that fits ``shape`` (updated in place), or None if the draw does not fit."""
    kinds = {2: ["linear"], 3: ["conv", "conv", "linear"], 4: ["conv", "convT"]}[shape.rank]
    kind = draw(st.sampled_from(kinds))
    bias = draw(st.booleans())
    if kind == "linear":
        width = shape.channels if shape.rank == 2 else shape.spatial[-1]
        out = draw(st.integers(1, 6))
        if shape.rank == 2:
            shape.channels = out
        else:  # a Linear over the last dim of (N, C, L): the case BatchNorm1d must not fold into
            shape.spatial[-1] = out
        return ("linear", width, out, bias)
    groups, cout = draw(_grouped_channels(shape.channels))
    k, stride, dil = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    pad = draw(st.integers(0, 1))
    if kind == "conv":
        mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "circular"]))
        new = [_conv_out(n, k, stride, pad, dil) for n in shape.spatial]
        if min(new) < 2 or (mode == "reflect" and pad >= min(shape.spatial)):
            return None
        spec = ("conv", shape.rank, shape.channels, cout, k, stride, pad, dil, groups, bias, mode)
    else:
        out_pad = draw(st.integers(0, stride - 1))
        new = [_convt_out(n, k, stride, pad, dil, out_pad) for n in shape.spatial]
        if min(new) < 2 or max(new) > 12 or out_pad >= max(stride, dil):
            return None
        spec = ("convT", shape.channels, cout, k, stride, pad, dil, out_pad, groups, bias)
    shape.channels, shape.spatial = cout, new
    return spec


@st.composite
def stacks(draw) -> tuple[tuple[int, ...], list[Spec]]:
    """Blocks of ``[ReLU | LayerNorm | Flatten] [BN] layer [BN]``: a BN after a layer folds backward, one
    after a ReLU/LayerNorm/BN or at the start folds forward or becomes an affine, and every kind of
    refusal shows up (zero padding, ConvTranspose after, Linear over the last dim, no statistics)."""
    rank = draw(st.sampled_from([4, 3, 4, 2]))
    shape = _Shape(rank, draw(st.integers(2, 6)), [draw(st.integers(4, 8)) for _ in range(rank - 2)])
    start = (shape.channels, *shape.spatial)
    specs: list[Spec] = []
    for _ in range(draw(st.integers(1, 5))):
        pre = draw(st.sampled_from(["relu", "none", "ln", "relu", "flatten"]))
        if pre == "relu":
            specs.append(("relu",))
        elif pre == "ln":
            specs.append(("ln", shape.channels if shape.rank == 2 else shape.spatial[-1]))
        elif pre == "flatten" and shape.rank > 2 and shape.channels * math.prod(shape.spatial) <= 96:
            shape = _Shape(2, shape.channels * math.prod(shape.spatial), [])
            specs.append(("flatten",))
        if draw(st.booleans()):
            specs.append(_bn_spec(draw, shape))
        layer = _layer_spec(draw, shape)
        if layer is not None:
            specs.append(layer)
        if draw(st.booleans()):
            specs.append(_bn_spec(draw, shape))
    return start, specs


def _build(spec: Spec) -> nn.Module:
    op, *a = spec
    if op == "bn":
        rank, channels, affine, stats = a
        cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[rank]
        return cls(channels, affine=affine, track_running_stats=stats)
    if op == "ln":
        return nn.LayerNorm(a[0])
    if op == "relu":
        return nn.ReLU()
    if op == "flatten":
        return nn.Flatten()
    if op == "linear":
        return nn.Linear(a[0], a[1], bias=a[2])
    if op == "conv":
        rank, cin, cout, k, stride, pad, dil, groups, bias, mode = a
        cls = nn.Conv1d if rank == 3 else nn.Conv2d
        return cls(cin, cout, k, stride, pad, dil, groups, bias, padding_mode=mode)
    cin, cout, k, stride, pad, dil, out_pad, groups, bias = a
    return nn.ConvTranspose2d(cin, cout, k, stride, pad, out_pad, groups, bias, dil)


# Known traps of other tools, always tried first (spec layouts as in _build).
_REGRESSIONS = [
    # grouped ConvTranspose -> BN: the scale runs along dim 1 within each group
    ((4, 5, 5), [("convT", 4, 6, 3, 2, 1, 1, 1, 2, True), ("bn", 4, 6, True, True)]),
    # BN -> grouped conv without padding: folds forward, each group reading its own input channels
    ((4, 7, 7), [("relu",), ("bn", 4, 4, True, True), ("conv", 4, 4, 8, 3, 1, 0, 1, 2, False, "zeros")]),
    # BN -> zero-padded conv: refused; BN -> reflect-padded conv: folds
    ((4, 7, 7), [("bn", 4, 4, False, True), ("conv", 4, 4, 4, 3, 1, 1, 1, 1, True, "zeros")]),
    ((4, 7, 7), [("bn", 4, 4, True, True), ("conv", 4, 4, 4, 3, 1, 1, 1, 4, True, "reflect")]),
    # Linear over the last dim of (N, C, L), then BatchNorm1d over C: refused
    ((3, 8), [("linear", 8, 5, True), ("bn", 3, 3, True, True)]),
]


def _with_regressions(test: Callable) -> Callable:
    for stack in _REGRESSIONS:
        test = example(stack=stack, seed=0)(test)
    return test


@pytest.mark.parametrize("case", EXACT_PASSES, ids=lambda c: c.name)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stack=stacks(), seed=st.integers(0, 2**16))
@_with_regressions
def test_exact_pass_changes_or_explains_and_never_changes_the_output(case, stack, seed):
    start, specs = stack
    torch.manual_seed(seed)
    model = model_zoo.randomize_norms(nn.Sequential(*[_build(s) for s in specs]), seed=seed).eval()
    x = torch.randn(2, *start)
    with torch.no_grad():
        ref = model(x)
        # How much float rounding this very stack amplifies on its own (fp32 against fp64): a
        # BatchNorm with batch statistics over an input that is constant across the batch turns
        # 1-ulp differences into output-sized ones. A rewrite is exact when it moves the output
        # no more than that; a wrong fold moves it by the size of the output.
        noise = float((copy.deepcopy(model).double()(x.double()) - ref.double()).abs().max())

    out_model, report = case.make()(model, (x,))

    reported = [c.site for c in report.changes] + [s.site for s in report.skips]
    assert len(reported) == len(set(reported)), reported
    assert case.sites(model) <= set(reported), (case.sites(model) - set(reported), report)
    assert all(c.kind is RewriteKind.EXACT for c in report.changes)
    assert all(s.reason.strip() for s in report.skips), report.skips
    with torch.no_grad():
        out = out_model(x)
        assert torch.equal(model(x), ref)  # the pass worked on a copy
    err = float((out.double() - ref.double()).abs().max())
    scale = float(ref.double().abs().max())
    assert err <= max(exact_tolerance(ref.dtype) * scale, 100 * noise), (err, scale, noise, specs, report)
