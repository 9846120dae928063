"""fold_batchnorm into conv/linear subclasses: judged by what the captured graph shows the layer computes.

A subclass of nn.Conv2d/nn.Linear with its own forward folds when its output is one convolution/linear
of its own weight and bias: after any padding for a BatchNorm after it, after copying padding only for
a BatchNorm before it. A computed weight, a second use of the weight, a bias the forward does not add,
or an op between the layer and the BatchNorm is refused with the reason.
"""

from __future__ import annotations

import math

import model_zoo
import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from normswap.passes import FoldBatchNorm, Pipeline

_BN = nn.modules.batchnorm._BatchNorm


def _batchnorms(model: nn.Module) -> int:
    return sum(isinstance(m, _BN) for m in model.modules())


def _skip_reasons(report) -> dict[str, str]:
    return {s.site: s.reason for s in report.passes[0].skips}


def _fold(model: nn.Module, *args: torch.Tensor):
    """Fold through the pipeline (which checks exactness on the example and on other input sizes),
    and check the result here too: within 1e-5 x max|output| in fp32."""
    model = model_zoo.randomize_norms(model).eval()
    folded, report = Pipeline([FoldBatchNorm()])(model, args)
    assert report.ok, report.exact_failures
    assert len(report.passes[0].validation["verified_inputs"]) > 1  # not only the example
    with torch.no_grad():
        ref, out = model(*args), folded(*args)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    return model, folded, report.passes[0]


class Conv2dStaticSamePadding(nn.Conv2d):
    """TensorFlow 'SAME' padding as EfficientNet ports write it: pad (possibly unevenly) in forward,
    then convolve with the layer's own weight and bias and no padding of the conv's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ih, iw = x.shape[-2:]
        kh, kw = self.weight.shape[-2:]
        sh, sw = self.stride
        dh, dw = self.dilation
        ph = max((math.ceil(ih / sh) - 1) * sh + (kh - 1) * dh + 1 - ih, 0)
        pw = max((math.ceil(iw / sw) - 1) * sw + (kw - 1) * dw + 1 - iw, 0)
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class _MBConv(nn.Module):
    """Inverted residual block: expand 1x1, depthwise kxk, squeeze-excite, project 1x1 (each conv a
    Conv2dStaticSamePadding, each followed by its own BatchNorm)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        self.expand = expand
        if expand != 1:
            self._expand_conv = Conv2dStaticSamePadding(cin, mid, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(mid, momentum=0.01, eps=1e-3)
        self._depthwise_conv = Conv2dStaticSamePadding(mid, mid, kernel, stride, groups=mid, bias=False)
        self._bn1 = nn.BatchNorm2d(mid, momentum=0.01, eps=1e-3)
        squeezed = max(1, cin // 4)
        self._se_reduce = Conv2dStaticSamePadding(mid, squeezed, 1)
        self._se_expand = Conv2dStaticSamePadding(squeezed, mid, 1)
        self._project_conv = Conv2dStaticSamePadding(mid, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout, momentum=0.01, eps=1e-3)
        self.skip = stride == 1 and cin == cout

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.expand != 1:
            x = F.silu(self._bn0(self._expand_conv(x)))
        x = F.silu(self._bn1(self._depthwise_conv(x)))
        s = F.adaptive_avg_pool2d(x, 1)
        s = self._se_expand(F.silu(self._se_reduce(s)))
        x = torch.sigmoid(s) * x
        x = self._bn2(self._project_conv(x))
        return x + inputs if self.skip else x


class _EfficientNetStyle(nn.Module):
    # (kernel, stride, expand, out): stage openers of EfficientNet-B0, plus one residual repeat
    BLOCKS = ((3, 1, 1, 16), (3, 2, 6, 24), (3, 1, 6, 24), (5, 2, 6, 40))

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self._conv_stem = Conv2dStaticSamePadding(3, 32, 3, stride=2, bias=False)
        self._bn0 = nn.BatchNorm2d(32, momentum=0.01, eps=1e-3)
        blocks, cin = [], 32
        for kernel, stride, expand, cout in self.BLOCKS:
            blocks.append(_MBConv(cin, cout, kernel, stride, expand))
            cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = Conv2dStaticSamePadding(cin, 64, 1, bias=False)
        self._bn1 = nn.BatchNorm2d(64, momentum=0.01, eps=1e-3)
        self._fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = F.silu(self._bn1(self._conv_head(x)))
        return self._fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def test_efficientnet_style_static_same_padding_convs_fold_every_batchnorm():
    torch.manual_seed(0)
    model, folded, report = _fold(_EfficientNetStyle(), torch.randn(1, 3, 33, 31))
    assert len(report.changes) == _batchnorms(model) == 13 and report.skips == []
    assert _batchnorms(folded) == 0
    # the user's class stays; a layer without a bias gains one, which its forward passes to F.conv2d
    assert type(folded._conv_stem) is Conv2dStaticSamePadding and folded._conv_stem.bias is not None
    assert {c.details["bias_added"] for c in report.changes} == {True}


def test_timm_conv2d_same_layers_fold():
    torch.manual_seed(0)
    # tf_ models pad like TensorFlow: timm's Conv2dSame wherever the padding depends on the input size
    model = timm.create_model("tf_mobilenetv3_small_minimal_100", pretrained=False, num_classes=10)
    same = [n for n, m in model.named_modules() if isinstance(m, timm.layers.Conv2dSame)]
    assert len(same) == 5
    model, folded, report = _fold(model, torch.randn(1, 3, 64, 64))
    assert len(report.changes) == _batchnorms(model) == 34 and report.skips == []
    assert {c.details["into"] for c in report.changes} >= set(same)
    assert all(isinstance(folded.get_submodule(n), timm.layers.Conv2dSame) for n in same)


class _CastingLinear(nn.Linear):
    """Casts its parameters to the input's dtype (mixed-precision code does this)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.weight.to(x.dtype), bias)


def test_linear_subclass_with_its_own_forward_folds():
    torch.manual_seed(0)
    model = nn.Sequential(
        _CastingLinear(12, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        _CastingLinear(16, 8, bias=False),
        nn.BatchNorm1d(8),
    )
    _, folded, report = _fold(model, torch.randn(5, 12))
    assert [c.details["into"] for c in report.changes] == ["0", "3"] and report.skips == []
    assert type(folded[3]) is _CastingLinear and folded[3].bias is not None


class _PaddedConv(nn.Conv2d):
    """A conv that applies a padding module first (the module is a child of the conv)."""

    def __init__(self, cin: int, cout: int, pad: nn.Module, **kwargs) -> None:
        super().__init__(cin, cout, 3, **kwargs)
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self.pad(x), self.weight, self.bias)


_PADS = {
    "zeros": lambda: nn.ZeroPad2d((1, 0, 1, 0)),
    "constant": lambda: nn.ConstantPad2d(1, 0.5),
    "reflect": lambda: nn.ReflectionPad2d(1),
    "replicate": lambda: nn.ReplicationPad2d((2, 1, 0, 1)),
}


@pytest.mark.parametrize("pad", _PADS)
def test_a_conv_padding_its_input_first_folds_the_batchnorm_after_it(pad):
    # the fold acts on output channels only: any padding of the input commutes with it
    torch.manual_seed(0)
    model = nn.Sequential(_PaddedConv(3, 8, _PADS[pad](), bias=False), nn.BatchNorm2d(8), nn.ReLU())
    _, folded, report = _fold(model, torch.randn(2, 3, 9, 10))
    assert len(report.changes) == 1 and report.changes[0].details["into"] == "0"
    assert isinstance(folded[1], nn.Identity) and type(folded[0]) is _PaddedConv


def test_a_batchnorm_folds_forward_into_a_conv_that_pads_by_copying():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3), _PaddedConv(3, 8, nn.ReflectionPad2d(1), bias=False))
    _, folded, report = _fold(model, torch.randn(2, 3, 9, 10))
    assert [c.details["direction"] for c in report.changes] == ["forward"]
    assert isinstance(folded[0], nn.Identity) and folded[1].bias is not None


def test_a_batchnorm_does_not_fold_forward_into_a_conv_that_pads_with_zeros():
    model = model_zoo.randomize_norms(
        nn.Sequential(nn.BatchNorm2d(3), _PaddedConv(3, 8, nn.ZeroPad2d(1)))
    ).eval()
    _, report = Pipeline([FoldBatchNorm()])(model, (torch.randn(2, 3, 9, 10),))
    assert report.passes[0].changes == []
    assert _skip_reasons(report) == {
        "0": "next layer 1 (_PaddedConv) pads its input with zeros in its forward (1.pad): zero padding does "
        "not commute with the BatchNorm's shift"
    }


class _PaddedConvTranspose(nn.ConvTranspose2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose2d(
            F.pad(x, (1, 0, 0, 1)), self.weight, self.bias, self.stride, groups=self.groups
        )


def test_a_grouped_conv_transpose_subclass_folds_along_its_output_channels():
    torch.manual_seed(0)
    model = nn.Sequential(_PaddedConvTranspose(4, 6, 3, stride=2, groups=2, bias=False), nn.BatchNorm2d(6))
    _, folded, report = _fold(model, torch.randn(2, 4, 5, 6))
    assert len(report.changes) == 1 and folded[0].bias is not None


# Refusals: the graph shows something the fold would not carry over.


class _StdConv2d(nn.Conv2d):
    """Weight standardization written out (BiT/ResNetV2 style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class _StandardizedConvForward(nn.Conv2d):
    """Weight standardization hidden in ``_conv_forward``: ``forward`` is still nn.Conv2d's."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = weight - weight.mean(dim=(1, 2, 3), keepdim=True)
        return super()._conv_forward(x, weight, bias)


class _ConvReLU(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class _WeightTwice(nn.Conv2d):
    """The same weight applied twice (a weight-tied two-step conv)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(
            F.relu(self._conv_forward(x, self.weight, self.bias)), self.weight, self.bias
        )


class _IgnoresBias(nn.Conv2d):
    """Passes no bias to the conv: a bias the fold adds would never be read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, None, self.stride, self.padding)


class _BiasByHand(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, None, self.stride, self.padding) + self.bias[:, None, None]


@pytest.mark.parametrize(
    ("layer", "reason"),
    [
        (
            _StdConv2d(4, 4, 3, padding=1),
            "0 (_StdConv2d) computes the weight of its conv2d in its forward (mean, sub, std, add, div; "
            "e.g. weight standardization): a fold written into self.weight would pass through that "
            "computation, so it would not be exact",
        ),
        (
            timm.layers.StdConv2d(4, 4, 3, padding=1),
            "0 (StdConv2d) computes the weight of its conv2d in its forward (reshape, batch_norm, "
            "reshape_as; e.g. weight standardization): a fold written into self.weight would pass through "
            "that computation, so it would not be exact",
        ),
        (
            _StandardizedConvForward(4, 4, 3, padding=1),
            "0 (_StandardizedConvForward) computes the weight of its conv2d in its forward (mean, sub; e.g. "
            "weight standardization): a fold written into self.weight would pass through that computation, "
            "so it would not be exact",
        ),
        (
            _ConvReLU(4, 4, 3, padding=1),
            "0 (_ConvReLU) applies relu to the output of its conv2d in its forward; the BatchNorm reads "
            "that, not the conv2d's output",
        ),
        (
            _WeightTwice(4, 4, 3, padding=1),
            "0 (_WeightTwice) reads self.weight 2 times in its forward (conv2d, conv2d); folding would "
            "rescale every use, not only the one the BatchNorm reads",
        ),
        (
            _IgnoresBias(4, 4, 3, padding=1, bias=False),
            "0 (_IgnoresBias) has no bias, and its forward does not add self.bias once one is set: the "
            "BatchNorm's shift would have nowhere to go",
        ),
        (
            _BiasByHand(4, 4, 3, padding=1),
            "0 (_BiasByHand) does not pass self.bias to its conv2d (it adds it by hand, or not at all): "
            "the fold writes the BatchNorm's shift into self.bias and cannot tell how it would be applied",
        ),
    ],
    ids=[
        "std-conv",
        "timm-std-conv",
        "std-conv-forward",
        "relu-in-forward",
        "weight-twice",
        "ignores-bias",
        "bias-by-hand",
    ],
)
def test_a_layer_whose_graph_shows_more_than_one_conv_of_its_own_weight_is_refused(layer, reason):
    model = model_zoo.randomize_norms(nn.Sequential(layer, nn.BatchNorm2d(4))).eval()
    x = torch.randn(2, 4, 7, 7)
    folded, report = Pipeline([FoldBatchNorm()])(model, (x,))
    assert report.passes[0].changes == []
    assert _skip_reasons(report)["1"] == reason  # timm's also has an F.batch_norm on the weight: a site
    torch.testing.assert_close(folded(x), model(x), rtol=0, atol=0)


class _ConvOutputAlsoAdded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = Conv2dStaticSamePadding(4, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


def test_a_subclass_conv_whose_output_has_another_reader_is_refused():
    model = model_zoo.randomize_norms(_ConvOutputAlsoAdded()).eval()
    _, report = Pipeline([FoldBatchNorm()])(model, (torch.randn(2, 4, 7, 7),))
    assert _skip_reasons(report) == {"bn": "conv output also feeds add"}
