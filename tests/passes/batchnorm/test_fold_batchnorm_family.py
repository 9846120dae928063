"""The whole BatchNorm fold family: ConvTranspose, forward folds, stand-alone affines, F.batch_norm,
timm's BatchNormAct2d, fp64 math with bf16 results. Every positive case asserts numbers; every refusal
asserts its reason and that the model still computes the same thing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import model_zoo
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from normswap.modules.affine import ChannelAffine
from normswap.passes import FoldBatchNorm
from normswap.passes.batchnorm.arithmetic import bn_scale_shift
from normswap.util.tolerance import exact_tolerance


def _rel_error(model: nn.Module, other: nn.Module, *args: torch.Tensor) -> float:
    """max |other - model| / max |model| on ``args``."""
    with torch.no_grad():
        ref, out = model(*args), other(*args)
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def _assert_exact(model: nn.Module, folded: nn.Module, *args: torch.Tensor) -> None:
    dtype = next(model.parameters()).dtype
    assert _rel_error(model, folded, *args) <= exact_tolerance(dtype)


def _skip_reasons(report) -> dict[str, str]:
    return {s.site: s.reason for s in report.skips}


def _no_batchnorm(model: nn.Module) -> bool:
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _fold(model: nn.Module, *args: torch.Tensor):
    model = model_zoo.randomize_norms(model).eval()
    folded, report = FoldBatchNorm()(model, args)
    return model, folded, report


# --- backward into ConvTranspose ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layer", "bn", "spatial"),
    [
        (nn.ConvTranspose1d(4, 6, 3, stride=2), nn.BatchNorm1d(6), (5,)),
        (nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), nn.BatchNorm2d(6), (5, 4)),
        (nn.ConvTranspose3d(4, 6, 2, bias=False), nn.BatchNorm3d(6), (3, 3, 3)),
        (nn.ConvTranspose2d(6, 9, 3, groups=3, dilation=2), nn.BatchNorm2d(9), (5, 5)),
    ],
    ids=["1d-stride", "2d-output-padding", "3d-no-bias", "2d-grouped"],
)
def test_conv_transpose_then_batchnorm_folds_exactly(layer, bn, spatial):
    x = torch.randn(2, layer.in_channels, *spatial)
    model, folded, report = _fold(nn.Sequential(layer, bn), x)
    assert [c.description for c in report.changes] == [f"folded into 0 ({type(layer).__name__})"]
    assert isinstance(folded[1], nn.Identity) and folded[0].weight.shape == layer.weight.shape
    _assert_exact(model, folded, x)


def test_grouped_conv_transpose_folds_along_the_output_channel_of_each_group():
    # Regression: a ConvTranspose weight is (in, out / groups, *k); output channel g * out_per_g + j owns
    # W[g * in_per_g : (g + 1) * in_per_g, j]. torch's fuse_conv_bn_eval(transpose=True) scales dim 1
    # by all `out` scales at once and fails on this layer; scaling dim 0 is silently wrong.
    groups, in_per_g, out_per_g = 3, 2, 4
    layer = nn.ConvTranspose2d(groups * in_per_g, groups * out_per_g, 3, groups=groups)
    bn = nn.BatchNorm2d(groups * out_per_g)
    x = torch.randn(2, groups * in_per_g, 6, 6)
    model, folded, report = _fold(nn.Sequential(layer, bn), x)
    assert len(report.changes) == 1
    assert _rel_error(model, folded, x) <= 1e-5
    scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach().double()
    for g in range(groups):
        rows = slice(g * in_per_g, (g + 1) * in_per_g)
        for j in range(out_per_g):
            expected = layer.weight[rows, j].detach().double() * scale[g * out_per_g + j]
            torch.testing.assert_close(
                folded[0].weight[rows, j].detach().double(), expected, rtol=1e-6, atol=0
            )


# --- bias / affine combinations, and refusals that must not crash -----------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("make", [nn.Conv2d, nn.ConvTranspose2d], ids=["conv", "convT"])
def test_layer_bias_and_batchnorm_affine_in_every_combination(bias, affine, make):
    layer = make(3, 5, 3, bias=bias)
    x = torch.randn(2, 3, 7, 7)
    model, folded, report = _fold(nn.Sequential(layer, nn.BatchNorm2d(5, affine=affine)), x)
    assert len(report.changes) == 1 and report.changes[0].details["bias_added"] is (not bias)
    _assert_exact(model, folded, x)


def test_linear_bias_free_with_affine_free_batchnorm():
    x = torch.randn(6, 5)
    model, folded, report = _fold(
        nn.Sequential(nn.Linear(5, 7, bias=False), nn.BatchNorm1d(7, affine=False)), x
    )
    assert report.changes[0].details == {
        "into": "0",
        "layer_class": "Linear",
        "bias_added": True,
        "direction": "backward",
    }
    _assert_exact(model, folded, x)


@pytest.mark.parametrize("make", [nn.Conv2d, nn.ConvTranspose2d, nn.Linear])
def test_batchnorm_without_running_stats_is_refused_not_crashed(make):
    layer = make(4, 4) if make is nn.Linear else make(4, 4, 3)
    bn = (
        nn.BatchNorm1d(4, track_running_stats=False)
        if make is nn.Linear
        else nn.BatchNorm2d(4, track_running_stats=False)
    )
    x = torch.randn(3, 4) if make is nn.Linear else torch.randn(3, 4, 6, 6)
    model = nn.Sequential(layer, bn).eval()
    out, report = FoldBatchNorm()(model, (x,))
    assert _skip_reasons(report) == {"1": "BatchNorm has track_running_stats=False: no statistics to fold"}
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)


class _ConvCalledTwice(nn.Module):
    """torch.fx's ``fuse()`` folds the BN into ``conv`` although the first call must stay unscaled."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(torch.relu(self.conv(x))))


def test_conv_called_twice_is_refused_where_fx_fuse_corrupts_it():
    model = model_zoo.randomize_norms(_ConvCalledTwice()).eval()
    x = torch.randn(2, 4, 5, 5)
    out, report = FoldBatchNorm()(model, (x,))
    assert _skip_reasons(report) == {"bn": "conv is called at 2 sites; folding would change the others"}
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)
    from torch.fx.experimental.optimization import fuse

    fused = fuse(model)  # the other tool, for the record: it folds into the shared conv
    assert _rel_error(model, fused, x) > 1e-3


class _TiedConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)
        self.b.weight = self.a.weight
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.a(x)) + self.b(x)


def test_a_layer_whose_weight_is_shared_is_refused():
    model = model_zoo.randomize_norms(_TiedConvs()).eval()
    x = torch.randn(2, 4, 5, 5)
    out, report = FoldBatchNorm()(model, (x,))
    assert _skip_reasons(report) == {
        "bn": "a shares its weights with b.weight; folding would change that module too"
    }
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)


# --- forward into the next layer -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("bn", "layer", "x"),
    [
        (nn.BatchNorm1d(5), nn.Linear(5, 3), torch.randn(4, 5)),
        (nn.BatchNorm1d(5), nn.Linear(5, 3, bias=False), torch.randn(4, 5)),
        (nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, stride=2, dilation=1), torch.randn(2, 4, 9, 9)),
        (nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, groups=2, bias=False), torch.randn(2, 4, 7, 7)),
        (nn.BatchNorm2d(6), nn.Conv2d(6, 6, 3, groups=6), torch.randn(2, 6, 7, 7)),  # depthwise
        (nn.BatchNorm1d(4), nn.Conv1d(4, 8, 3, groups=4), torch.randn(2, 4, 9)),  # channel multiplier 2
        (nn.BatchNorm2d(4), nn.Conv2d(4, 5, 3, padding=1, padding_mode="reflect"), torch.randn(2, 4, 6, 6)),
        (nn.BatchNorm3d(3), nn.Conv3d(3, 4, 2, padding="valid"), torch.randn(1, 3, 4, 4, 4)),
        (nn.BatchNorm2d(3, affine=False), nn.Conv2d(3, 4, 1, padding="same"), torch.randn(2, 3, 5, 5)),
    ],
    ids=[
        "linear",
        "linear-no-bias",
        "conv-stride",
        "grouped",
        "depthwise",
        "conv1d-mult",
        "reflect",
        "3d-valid",
        "same-1x1",
    ],
)
def test_batchnorm_with_nothing_before_folds_forward_into_the_next_layer(bn, layer, x):
    model, folded, report = _fold(nn.Sequential(bn, layer), x)
    assert [c.description for c in report.changes] == [
        f"folded forward into the next layer 1 ({type(layer).__name__})"
    ]
    assert report.changes[0].details["direction"] == "forward" and isinstance(folded[0], nn.Identity)
    _assert_exact(model, folded, x)


def test_backward_is_preferred_and_a_conv_can_take_folds_from_both_sides():
    # bn0 has nothing before it and folds forward into conv; bn1 folds backward into the same conv
    x = torch.randn(2, 3, 8, 8)
    model, folded, report = _fold(nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5)), x)
    assert [(c.site, c.details["into"], c.details["direction"]) for c in report.changes] == [
        ("0", "1", "forward"),
        ("2", "1", "backward"),
    ]
    assert _no_batchnorm(folded)
    _assert_exact(model, folded, x)


class _BNFeedsTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        return self.conv(y) + y


class _Transposed(nn.Module):
    """BatchNorm1d over dim 1 of (batch, tokens, features) feeding a Linear over the last dim."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x))


@pytest.mark.parametrize(
    ("model", "x", "site", "reason"),
    [
        (
            nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)),
            torch.randn(2, 4, 6, 6),
            "0",
            "next layer 1 (Conv2d) pads its input with zeros (padding=(1, 1)): "
            "zero padding does not commute with the BatchNorm's shift",
        ),
        (
            nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding="same")),
            torch.randn(2, 4, 6, 6),
            "0",
            "next layer 1 (Conv2d) pads its input with zeros (padding=(2, 2)): "
            "zero padding does not commute with the BatchNorm's shift",
        ),
        (
            nn.Sequential(nn.BatchNorm2d(4), nn.ConvTranspose2d(4, 4, 3)),
            torch.randn(2, 4, 6, 6),
            "0",
            "next layer 1 (ConvTranspose2d) spreads each input over overlapping, border-cropped outputs, "
            "so the BatchNorm's shift does not become a per-channel bias",
        ),
        (_BNFeedsTwo(), torch.randn(2, 4, 6, 6), "bn", "BatchNorm output also feeds add, not only conv"),
        (
            _Transposed(),
            torch.randn(2, 6, 6),
            "bn",
            "BatchNorm normalizes dim 1 of a 3-D input while fc (Linear) reads the last dim",
        ),
    ],
    ids=["zero-padding", "same-padding", "conv-transpose", "other-reader", "3d-linear"],
)
def test_forward_folds_that_would_be_wrong_are_refused(model, x, site, reason):
    model, out, report = _fold(model, x)
    assert report.changes == [] and _skip_reasons(report) == {site: reason}
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)


class _SharedThenPadded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(self.conv(x))))


def test_when_neither_direction_folds_both_reasons_are_given():
    x = torch.randn(2, 4, 5, 5)
    _, _, report = _fold(_SharedThenPadded(), x)
    assert _skip_reasons(report) == {
        "bn": "conv is called at 2 sites; folding would change the others; next layer head (Conv2d) pads its "
        "input with zeros (padding=(1, 1)): zero padding does not commute with the BatchNorm's shift"
    }


# --- stand-alone: a per-channel affine -----------------------------------------------------------


class _Standalone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn2d = nn.BatchNorm2d(4)
        self.bn1d = nn.BatchNorm1d(4, affine=False)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2d(torch.relu(self.conv(x)))
        return self.fc(torch.relu(self.bn1d(y.mean((2, 3)))))


def test_a_batchnorm_with_nothing_to_fold_into_becomes_a_channel_affine():
    x = torch.randn(3, 3, 8, 8)
    model, folded, report = _fold(_Standalone(), x)
    description = (
        "no conv or linear on either side to fold into: replaced by a per-channel affine "
        "(ChannelAffine, x * scale + shift)"
    )
    assert [(c.site, c.description) for c in report.changes] == [("bn2d", description), ("bn1d", description)]
    assert isinstance(folded.bn2d, ChannelAffine) and isinstance(folded.bn1d, ChannelAffine)
    assert folded.bn2d.scale.dtype == torch.float32 and _no_batchnorm(folded)
    _assert_exact(model, folded, x)


def test_channel_affine_matches_batchnorm_on_every_rank():
    for bn, shape in (
        (nn.BatchNorm1d(5), (4, 5)),
        (nn.BatchNorm1d(5), (4, 5, 3)),
        (nn.BatchNorm3d(5), (2, 5, 2, 3, 2)),
    ):
        bn = model_zoo.randomize_norms(bn).eval()
        x = torch.randn(shape)
        scale, shift = bn_scale_shift(bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias)
        affine = ChannelAffine.from_scale_shift(scale, shift, dtype=torch.float32)
        assert _rel_error(bn, affine, x) <= 1e-6


# --- F.batch_norm inside a forward ---------------------------------------------------------------


class _FunctionalConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, training: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.register_buffer("rm", 0.5 * torch.randn(cout))
        self.register_buffer("rv", torch.rand(cout) + 0.5)
        self.w = nn.Parameter(1 + 0.3 * torch.randn(cout))
        self.b = nn.Parameter(0.3 * torch.randn(cout))
        self.bn_training = training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            self.conv(x), self.rm, self.rv, self.w, self.b, training=self.bn_training, eps=1e-3
        )


def test_functional_batch_norm_folds_and_its_owner_becomes_a_graph_module():
    torch.manual_seed(0)
    model = nn.Sequential(_FunctionalConvBN(3, 8), nn.ReLU(), _FunctionalConvBN(8, 4)).eval()
    x = torch.randn(2, 3, 8, 8)
    folded, report = FoldBatchNorm()(model, (x,))
    assert [c.site for c in report.changes] == ["0::batch_norm", "2::batch_norm_1"]
    assert report.changes[0].description == (
        "folded into 0.conv (Conv2d); 0 is now a torch.fx GraphModule of its forward without the "
        "F.batch_norm call (a module edit cannot remove a call from a forward)"
    )
    assert report.changes[0].details["removed_state"] == ["0.rm", "0.rv", "0.w", "0.b"]
    assert isinstance(folded[0], fx.GraphModule) and type(folded[0]).__name__ == "_FunctionalConvBN"
    assert type(folded) is nn.Sequential  # only the owner changed class
    assert set(folded.state_dict()) == {"0.conv.weight", "0.conv.bias", "2.conv.weight", "2.conv.bias"}
    _assert_exact(model, folded, x)
    graph = torch.export.export(folded, (x,), strict=False).graph
    assert not [n for n in graph.nodes if "batch_norm" in str(n.target)]


class _TwoFunctional(nn.Module):
    """Two F.batch_norm calls in one forward: the second site edits the GraphModule the first made."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _FunctionalConvBN(3, 4)
        self.conv = nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2)
        self.register_buffer("rm", 0.5 * torch.randn(6))
        self.register_buffer("rv", torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.batch_norm(self.a.conv(x), self.a.rm, self.a.rv, self.a.w, self.a.b, eps=1e-3)
        return F.batch_norm(self.conv(torch.relu(y)), self.rm, self.rv)


def test_two_functional_batch_norms_in_one_forward():
    torch.manual_seed(0)
    model = nn.Sequential(_TwoFunctional()).eval()
    x = torch.randn(2, 3, 8, 8)
    folded, report = FoldBatchNorm()(model, (x,))
    assert [c.details["into"] for c in report.changes] == ["0.a.conv", "0.conv"]
    assert isinstance(folded[0], fx.GraphModule) and not any("rm" in k for k in folded.state_dict())
    _assert_exact(model, folded, x)


def test_functional_batch_norm_in_the_root_forward_makes_the_model_a_graph_module():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    root = _FunctionalConvBN(3, 4).eval()
    folded, report = FoldBatchNorm()(root, (x,))
    assert report.skips == [] and report.changes[0].details["graph_module"] == ""
    assert "the root module is now a torch.fx GraphModule" in report.changes[0].description
    assert isinstance(folded, fx.GraphModule) and not isinstance(root, fx.GraphModule)
    assert not any(n.op == "call_function" and "batch_norm" in str(n.target) for n in folded.graph.nodes)
    assert sorted(folded.state_dict()) == ["conv.bias", "conv.weight"]  # the statistics left with the call
    _assert_exact(root, folded, x)


def test_functional_batch_norm_refusals():
    x = torch.randn(2, 3, 8, 8)
    training = nn.Sequential(_FunctionalConvBN(3, 4, training=True)).eval()
    _, report = FoldBatchNorm()(training, (x,))
    assert _skip_reasons(report)["0::batch_norm"].startswith("F.batch_norm is called with training=True")


# --- timm: BatchNormAct2d and FrozenBatchNormAct2d -----------------------------------------------


def test_timm_mobilenetv3_folds_every_batchnorm_act_and_keeps_activations():
    import timm
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    model = model_zoo.randomize_norms(timm.create_model("mobilenetv3_small_050", num_classes=10)).eval()
    x = torch.randn(1, 3, 64, 64)
    count = sum(isinstance(m, BatchNormAct2d) for m in model.modules())
    folded, report = FoldBatchNorm()(model, (x,))
    assert count == 34 and len(report.changes) == count and report.skips == []
    assert _no_batchnorm(folded)
    assert type(folded.bn1.act).__name__ == type(model.bn1.act).__name__ == "Hardswish"
    assert _rel_error(model, folded, x) <= 1e-5


def test_frozen_batchnorm_act_folds_and_keeps_its_activation():
    from timm.layers import FrozenBatchNormAct2d

    x = torch.randn(2, 3, 6, 6)
    bnact = FrozenBatchNormAct2d(4, act_layer=nn.SiLU)
    model, folded, report = _fold(nn.Sequential(nn.Conv2d(3, 4, 3), bnact), x)
    assert [c.description for c in report.changes] == ["folded into 0 (Conv2d); kept its act"]
    assert isinstance(folded[1].act, nn.SiLU)
    _assert_exact(model, folded, x)


def test_batchnorm_act_with_nothing_before_becomes_affine_then_act():
    from timm.layers import BatchNormAct2d

    x = torch.randn(2, 4, 6, 6)
    model, folded, report = _fold(nn.Sequential(BatchNormAct2d(4), nn.Conv2d(4, 4, 1)), x)
    assert report.changes[0].description.endswith("(ChannelAffine, x * scale + shift), then its drop and act")
    assert list(dict(folded[0].named_children())) == ["affine", "drop", "act"]
    _assert_exact(model, folded, x)


# --- precision -----------------------------------------------------------------------------------


def test_bf16_model_folds_within_the_bf16_tolerance():
    model, args, _ = model_zoo.resnet18(size=32)
    reference = model(*args)  # fp32
    model = model.to(torch.bfloat16)
    x = args[0].to(torch.bfloat16)
    folded, report = FoldBatchNorm()(model, (x,))
    assert len(report.changes) == 20
    assert folded.conv1.weight.dtype == torch.bfloat16 and folded.conv1.bias.dtype == torch.bfloat16
    assert _rel_error(model, folded, x) <= exact_tolerance(torch.bfloat16)  # measured 1.2e-2
    # Folding rounds W * s and the new bias to bf16 once each; the bf16 model already rounds every
    # layer's output, so the folded model is about as far from the fp32 model as the original bf16 one
    # (measured 1.3e-2 and 0.9e-2 at this size; at 64x64 0.7e-2 and 1.3e-2).
    with torch.no_grad():
        own_noise = float((model(x).double() - reference.double()).abs().max())
        folded_noise = float((folded(x).double() - reference.double()).abs().max())
    assert folded_noise <= 2 * own_noise


def test_weights_are_computed_in_fp64():
    # var 1e-8 (scale 1e4), mean 1e3, beta 1e7: (b - mean) * s + beta cancels; fp32 arithmetic on the
    # way would be off by ~0.4, the fp64 path is off by at most the final rounding to fp32
    conv, bn = nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2, eps=0.0)
    with torch.no_grad():
        bn.running_var.fill_(1e-8)
        bn.running_mean.fill_(1e3)
        bn.bias.fill_(1e7 + 0.5)
    model = nn.Sequential(conv, bn).eval()
    folded, _ = FoldBatchNorm()(model, (torch.randn(1, 2, 3, 3),))
    w, b, rm, rv, beta = (
        t.detach().double() for t in (bn.weight, conv.bias, bn.running_mean, bn.running_var, bn.bias)
    )
    expected = ((b - rm) * w * torch.rsqrt(rv) + beta).float()
    torch.testing.assert_close(folded[0].bias.detach(), expected, rtol=0, atol=0)
    in_fp32 = (conv.bias - bn.running_mean) * bn.weight * torch.rsqrt(bn.running_var) + bn.bias
    assert (in_fp32.detach() - expected).abs().max() > 0.1


# --- the example script --------------------------------------------------------------------------


def test_example_script_runs_and_reports_every_fold():
    script = Path(__file__).resolve().parents[3] / "examples" / "fold_batchnorm.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "resnet18: folded 20 of 20 BatchNorms, 0 made affine, 0 refused" in result.stdout
    assert "fold family: folded 5 of 7 BatchNorms, 1 made affine, 1 refused" in result.stdout
    assert "FAIL" not in result.stdout and result.stdout.count("PASS") == 2


def test_sync_batchnorm_in_eval_folds_like_batchnorm():
    x = torch.randn(2, 3, 6, 6)
    model, folded, report = _fold(nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4)), x)
    assert [c.description for c in report.changes] == ["folded into 0 (Conv2d)"]
    _assert_exact(model, folded, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_kind_of_change_holds_in_half_precision(dtype):
    # forward fold, grouped ConvTranspose, standalone affine: fp64 math, one rounding to the dtype
    x = torch.randn(2, 4, 6, 6)
    model = nn.Sequential(
        nn.BatchNorm2d(4),
        nn.Conv2d(4, 6, 3, groups=2),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.ConvTranspose2d(6, 6, 2, stride=2, groups=3),
        nn.BatchNorm2d(6),
    )
    model = model_zoo.randomize_norms(model).eval().to(dtype)
    folded, report = FoldBatchNorm()(model, (x.to(dtype),))
    assert [c.details.get("direction", "affine") for c in report.changes] == [
        "forward",
        "backward",
        "affine",
        "backward",
    ]
    assert folded[4].scale.dtype == dtype and folded[6].weight.dtype == dtype
    assert _rel_error(model, folded, x.to(dtype)) <= exact_tolerance(dtype)


def test_a_conv_with_weight_norm_is_refused_not_silently_left_unfolded():
    conv = torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 3))
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    model = nn.Sequential(conv, bn).eval()
    x = torch.randn(2, 3, 8, 8)
    folded, report = FoldBatchNorm()(model, (x,))
    assert report.changes == []
    assert report.skips[0].reason.startswith("0's weight is computed by a parametrization (e.g. weight norm)")
    torch.testing.assert_close(folded(x), model(x), rtol=0, atol=0)


class _HandBatchNorm(nn.Module):
    """An eval BatchNorm written out with (1, C, 1, 1) statistics."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.randn(1, channels, 1, 1))
        self.register_buffer("running_var", torch.rand(1, channels, 1, 1) + 0.5)
        self.weight = nn.Parameter(torch.rand(channels) + 0.5)
        self.bias = nn.Parameter(torch.randn(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x - self.running_mean) * torch.rsqrt(self.running_var + 1e-5)
        return y * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def test_a_hand_written_batchnorm_without_vector_statistics_is_refused():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), _HandBatchNorm()).eval()
    _, report = FoldBatchNorm()(model, (torch.randn(2, 3, 5, 6),))
    assert report.changes == []
    assert report.skips[0].reason == (
        "_HandBatchNorm does not keep its statistics and affine as per-channel vectors named running_mean, "
        "running_var, weight, bias"
    )


class _RootAndBlock(nn.Module):
    """F.batch_norm in the root's forward, then a custom block with its own call and a timm norm+act."""

    def __init__(self) -> None:
        from timm.layers import BatchNormAct2d

        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.register_buffer("rm", 0.5 * torch.randn(4))
        self.register_buffer("rv", torch.rand(4) + 0.5)
        self.blk = _FunctionalConvBN(4, 4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.bn2 = BatchNormAct2d(4)
        self.frozen = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blk(F.batch_norm(self.conv(x), self.rm, self.rv, None, None, False, 0.1, 1e-5))
        return self.frozen(self.bn2(self.conv2(y)))


def test_root_fold_keeps_submodules_their_classes_and_modes():
    torch.manual_seed(0)
    model = model_zoo.randomize_norms(_RootAndBlock()).train()
    for child in (model.frozen, model.bn2, model.blk):  # frozen parts of a model in train mode
        child.eval()
    x = torch.randn(2, 3, 6, 6)
    folded, report = FoldBatchNorm()(model, (x,))
    assert sorted(c.site for c in report.changes) == [
        "<root>::batch_norm",
        "blk::batch_norm_1",
        "bn2",
        "frozen",
    ]
    assert isinstance(folded, fx.GraphModule) and folded.training
    # the root's own flag only: the block and its conv keep the eval mode they were in
    assert isinstance(folded.blk, fx.GraphModule) and not folded.blk.training and not folded.blk.conv.training
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), atol=1e-5, rtol=1e-5)


def test_an_in_place_root_fold_leaves_the_model_passed_in_consistent():
    """A call in the root's forward needs a new root. It is built last, beside the model passed in, with
    its own folded copy of the conv: the model passed in keeps its module edits and still computes
    what it did (no half-rewritten model, no rebound forward)."""
    torch.manual_seed(0)
    model = model_zoo.randomize_norms(_RootAndBlock()).eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        want = model(x)
    conv_weight = model.conv.weight.detach().clone()
    folded, report = FoldBatchNorm()(model, (x,), inplace=True)
    # module sites first, the call inside blk's forward next, the root's own call last
    assert [c.site for c in report.changes] == ["bn2", "frozen", "blk::batch_norm_1", "<root>::batch_norm"]
    assert isinstance(folded, fx.GraphModule) and folded is not model
    # the module edits were made on the model passed in, and the new root shares them
    assert isinstance(model.frozen, ChannelAffine) and folded.frozen is model.frozen
    assert isinstance(model.blk, fx.GraphModule) and folded.blk is model.blk
    # the conv the old root's own forward feeds to F.batch_norm is untouched; the new root has a copy
    assert folded.conv is not model.conv and torch.equal(model.conv.weight, conv_weight)
    assert not torch.allclose(folded.conv.weight, conv_weight)
    assert not hasattr(folded, "rm") and hasattr(model, "rm")
    with torch.no_grad():
        torch.testing.assert_close(folded(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    assert "forward" not in vars(model)  # nothing rebound on the live object


def test_an_in_place_fold_of_a_call_in_a_submodule_keeps_the_replaced_owner_valid():
    torch.manual_seed(0)
    model = nn.Sequential(_FunctionalConvBN(3, 4), nn.ReLU()).eval()
    owner = model[0]
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        want, want_owner = model(x), owner(x)
    folded, report = FoldBatchNorm()(model, (x,), inplace=True)
    assert folded is model and isinstance(model[0], fx.GraphModule)
    assert report.changes[0].details["removed_state"] == ["0.rm", "0.rv", "0.w", "0.b"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
        # whoever still holds the old owner holds a module that computes what it did
        torch.testing.assert_close(owner(x), want_owner, atol=0, rtol=0)
