"""fold_batchnorm: exact on real models, and a stated reason wherever folding would be wrong."""

from __future__ import annotations

import model_zoo
import pytest
import torch
from torch import nn

from normswap.passes import FoldBatchNorm, Pipeline
from normswap.verify import compare_models


def _batchnorms(model: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _skip_reasons(report) -> dict[str, str]:
    return {s.site: s.reason for s in report.skips}


def test_resnet18_folds_every_batchnorm_exactly():
    model, args, _ = model_zoo.resnet18()
    folded, report = FoldBatchNorm()(model, args)
    assert len(report.changes) == 20 and report.skips == []
    assert _batchnorms(folded) == 0 and _batchnorms(model) == 20  # the input model is untouched
    cmp = compare_models(model, folded, args)
    assert cmp.within_tolerance, cmp.outputs[0]
    assert cmp.outputs[0].max_rel <= 1e-5
    # the downsample BN folds into the 1x1 conv beside it, which gains a bias
    assert folded.layer2[0].downsample[0].bias is not None


def test_fold_writes_fp64_math_back_in_the_parameter_dtype():
    torch.manual_seed(0)
    model = model_zoo.randomize_norms(nn.Sequential(nn.Conv2d(3, 8, 3, bias=True), nn.BatchNorm2d(8))).eval()
    model = model.double().float()  # fp32 parameters
    x = torch.randn(2, 3, 9, 9)
    folded, report = FoldBatchNorm()(model, (x,))
    assert folded[0].weight.dtype == torch.float32 and report.changes[0].details["bias_added"] is False
    torch.testing.assert_close(folded(x), model(x), rtol=0, atol=1e-5 * model(x).abs().max().item())


@pytest.mark.parametrize("conv", [nn.Conv1d(4, 6, 3, groups=2), nn.Conv3d(4, 6, 3, bias=False)])
def test_conv1d_grouped_and_conv3d(conv):
    bn = nn.BatchNorm1d(6) if isinstance(conv, nn.Conv1d) else nn.BatchNorm3d(6)
    model = model_zoo.randomize_norms(nn.Sequential(conv, bn)).eval()
    x = torch.randn(2, 4, *([7] * (conv.weight.ndim - 2)))
    folded, report = FoldBatchNorm()(model, (x,))
    assert len(report.changes) == 1
    assert compare_models(model, folded, (x,)).within_tolerance


def test_linear_then_batchnorm1d_on_2d_input_folds():
    model = model_zoo.randomize_norms(nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7))).eval()
    x = torch.randn(4, 5)
    folded, report = FoldBatchNorm()(model, (x,))
    assert len(report.changes) == 1 and isinstance(folded[1], nn.Identity)
    assert compare_models(model, folded, (x,)).within_tolerance


class _Transposed(nn.Module):
    """BatchNorm1d over dim 1 of (batch, tokens, features) while the Linear acts on the last dim."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def test_linear_batchnorm1d_on_3d_input_is_refused():
    model = model_zoo.randomize_norms(_Transposed()).eval()
    _, report = FoldBatchNorm()(model, (torch.randn(2, 6, 6),))
    assert report.changes == []
    assert _skip_reasons(report)["bn"] == (
        "BatchNorm normalizes dim 1 of a 3-D input while fc (Linear) acts on the last dim"
    )


class _SharedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(self.conv(x)))


class _ConvWithTwoReaders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


class _BNTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + self.bn(x)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (_SharedConv(), "conv is called at 2 sites; folding would change the others"),
        (_ConvWithTwoReaders(), "conv output also feeds add"),
        (_BNTwice(), "BatchNorm is called at 2 sites; folding needs exactly one"),
    ],
)
def test_illegal_folds_are_skipped_with_the_reason(model, reason):
    model = model_zoo.randomize_norms(model).eval()
    x = torch.randn(2, 4, 5, 5)
    out, report = FoldBatchNorm()(model, (x,))
    assert report.changes == []
    assert _skip_reasons(report)["bn" if hasattr(model, "bn") else "1"] == reason
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)


def test_training_mode_and_missing_statistics_are_refused():
    train = model_zoo.randomize_norms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    _, report = FoldBatchNorm()(train, (torch.randn(2, 3, 6, 6),))
    assert _skip_reasons(report)["1"].startswith("BatchNorm is in training mode")
    nostats = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    _, report = FoldBatchNorm()(nostats, (torch.randn(2, 3, 6, 6),))
    assert _skip_reasons(report)["1"] == "BatchNorm has track_running_stats=False: no statistics to fold"


def test_batchnorm_act_folds_and_keeps_its_activation():
    from timm.layers import BatchNormAct2d

    model = model_zoo.randomize_norms(nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2d(4))).eval()
    x = torch.randn(2, 3, 6, 6)
    folded, report = FoldBatchNorm()(model, (x,))
    assert [c.description for c in report.changes] == ["folded into 0 (Conv2d); kept its act"]
    assert isinstance(folded[1], nn.Sequential) and isinstance(folded[1].act, nn.ReLU)
    ref = model(x)
    assert (folded(x) - ref).abs().max() <= 1e-5 * ref.abs().max()


class _BatchNormTimesTwo(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_an_unknown_batchnorm_subclass_that_does_more_is_refused():
    model = model_zoo.randomize_norms(nn.Sequential(nn.Conv2d(3, 4, 3), _BatchNormTimesTwo(4))).eval()
    x = torch.randn(2, 3, 6, 6)
    out, report = FoldBatchNorm()(model, (x,))
    # its batch_norm is a call inside its forward (normswap.discover.own_forward), refused for the class
    assert _skip_reasons(report)["1::batch_norm"] == (
        "_BatchNormTimesTwo.forward does more than normalize (e.g. an activation); folding it would drop that"
    )
    torch.testing.assert_close(out(x), model(x), rtol=0, atol=0)


def test_frozen_batchnorm_folds_exactly():
    from torchvision.ops.misc import FrozenBatchNorm2d

    model = model_zoo.randomize_norms(nn.Sequential(nn.Conv2d(3, 4, 3), FrozenBatchNorm2d(4))).eval()
    x = torch.randn(2, 3, 6, 6)
    folded, report = FoldBatchNorm()(model, (x,))
    assert len(report.changes) == 1
    assert compare_models(model, folded, (x,)).within_tolerance


def test_without_a_graph_every_site_says_why():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn(y) if y.sum() > 0 else y

    _, report = FoldBatchNorm()(Branchy().eval(), (torch.randn(1, 3, 5, 5),))
    assert _skip_reasons(report)["bn"].startswith(
        "no graph captured, so the layer feeding the BatchNorm is unknown"
    )


def test_pipeline_validates_each_exact_pass():
    model, args, _ = model_zoo.resnet18(size=32)
    _, report = Pipeline([FoldBatchNorm()])(model, args)
    assert report.ok
    validation = report.passes[0].validation
    assert validation["within_tolerance"] and validation["outputs"][0]["max_rel"] <= 1e-5
    assert report.overall.worst_sqnr_db > 100


def test_without_example_inputs_fx_tracing_still_folds_what_its_shapes_allow():
    # fx records no shapes: BatchNorm2d implies a 4-D input, so resnet18 folds; a BatchNorm1d could
    # read (N, C) or (N, C, L), so next to a Linear or Conv1d it is refused with the reason
    model, args, _ = model_zoo.resnet18(size=32)
    folded, report = FoldBatchNorm()(model)
    assert report.graph_method == "fx" and len(report.changes) == 20 and report.skips == []
    ref = model(*args)
    assert (folded(*args) - ref).abs().max() <= 1e-5 * ref.abs().max()
    seq = model_zoo.randomize_norms(nn.Sequential(nn.Conv1d(4, 5, 1), nn.BatchNorm1d(5))).eval()
    _, report = FoldBatchNorm()(seq)
    assert _skip_reasons(report) == {
        "1": "the graph records no shapes (no example inputs), so whether BatchNorm's dim 1 is the channel "
        "dim of 0 is unknown"
    }
