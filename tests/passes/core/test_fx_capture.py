"""The fx capture for passes that read module-level facts: taken only where its graph computes the model's
outputs and holds nothing a norm pattern reads, and then deciding exactly what torch.export's graph does."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from normswap.graph.capture import capture_graph
from normswap.graph.ops import op_name
from normswap.passes import FoldBatchNorm

timm = pytest.importorskip("timm")


def _random_statistics(model: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model.eval()


def _decisions(report) -> tuple[list, list]:
    return sorted(c.site for c in report.changes), sorted((s.site, s.reason) for s in report.skips)


@pytest.mark.parametrize(
    "build",
    [
        lambda: torchvision.models.resnet18(weights=None),
        lambda: torchvision.models.mobilenet_v3_small(weights=None),
        lambda: torchvision.models.regnet_y_400mf(weights=None),
        lambda: timm.create_model("regnetx_002", pretrained=False),  # BatchNormAct2d, traced through
        lambda: timm.create_model("densenet121", pretrained=False),  # BN before conv: forward folds
        lambda: timm.create_model("resnet18d", pretrained=False),  # avg-pool downsample shortcuts
    ],
    ids=[
        "resnet18",
        "mobilenet_v3_small",
        "regnet_y_400mf",
        "timm_regnetx_002",
        "timm_densenet121",
        "timm_resnet18d",
    ],
)
def test_the_fx_route_folds_what_the_export_route_folds_bit_for_bit(build, monkeypatch):
    torch.manual_seed(0)
    model = _random_statistics(build())
    x = torch.randn(2, 3, 64, 64)
    via_fx, fx_report = FoldBatchNorm()(model, (x,))
    monkeypatch.setattr(FoldBatchNorm, "fx_analysis", False)
    via_export, export_report = FoldBatchNorm()(model, (x,))

    assert (fx_report.graph_method, export_report.graph_method) == ("fx", "export")
    assert fx_report.changes and _decisions(fx_report) == _decisions(export_report)
    folded, reference = via_fx.state_dict(), via_export.state_dict()
    assert folded.keys() == reference.keys()
    for name, tensor in folded.items():
        assert torch.equal(tensor, reference[name]), name
    with torch.no_grad():
        torch.testing.assert_close(via_fx(x), model(x), rtol=1e-4, atol=1e-4)


class _OptionalScale(nn.Module):
    """A forward parameter left to its default: fx would make it a proxy and take the ``is not None`` path."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        if scale is not None:
            x = x * scale
        return self.bn(self.conv(x))


def test_a_parameter_left_to_its_default_is_traced_as_that_value():
    model = _random_statistics(_OptionalScale())
    captured = capture_graph(model, (torch.randn(2, 3, 8, 8),), fx_first=True)
    assert captured.method == "fx" and captured.ran
    assert "mul" not in [op_name(n) for n in captured.graph.nodes]
    # every value has its shape recorded on the meta device, as export records it; no activation is kept
    conv = next(n for n in captured.graph.nodes if n.target == "conv")
    assert conv.meta["val"].device.type == "meta" and tuple(conv.meta["val"].shape) == (2, 8, 6, 6)


class _ChecksTensor(nn.Module):
    """Python that inspects its input: a proxy is no Tensor, so the trace takes the other branch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return y + 1 if isinstance(x, torch.Tensor) else y


class _Rsqrt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y * torch.rsqrt(y.pow(2).mean(1, keepdim=True) + 1e-6)


def test_a_trace_that_computes_something_else_is_not_used():
    model = _random_statistics(_ChecksTensor())
    x = torch.randn(2, 3, 8, 8)
    captured = capture_graph(model, (x,), fx_first=True)
    assert captured.method == "export"
    folded, report = FoldBatchNorm()(model, (x,))
    assert report.graph_method == "export" and [c.site for c in report.changes] == ["bn"]
    torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_forward_with_a_norm_pattern_is_analyzed_on_the_export_graph():
    captured = capture_graph(_Rsqrt().eval(), (torch.randn(2, 3, 8, 8),), fx_first=True)
    assert captured.method == "export"
    # a squeeze-excite's mean outside a module is such an op too (timm's EfficientNet)
    efficientnet = timm.create_model("efficientnet_b0", pretrained=False).eval()
    assert capture_graph(efficientnet, (torch.randn(1, 3, 32, 32),), fx_first=True).method == "export"


def test_a_forward_hook_that_changes_the_output_keeps_the_export_graph():
    model = _random_statistics(_OptionalScale())
    model.register_forward_hook(lambda _m, _args, out: out * 2)
    assert capture_graph(model, (torch.randn(2, 3, 8, 8),), fx_first=True).method == "export"


def test_a_model_in_training_mode_is_not_run_to_judge_a_trace():
    model = _OptionalScale().train()
    before = model.bn.running_mean.clone()
    captured = capture_graph(model, (torch.randn(2, 3, 8, 8),), fx_first=True)
    assert captured.method == "export"
    assert torch.equal(model.bn.running_mean, before)


def test_a_buffer_computed_on_in_the_forward_stays_in_the_graph():
    """fx computes with buffers eagerly by default, folding ``rsqrt(self.running_var + eps)`` into a
    constant that no pattern could see; here the buffer is a graph value and the pattern sends the
    analysis to export."""

    class WrittenOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 1)
            self.register_buffer("running_var", torch.rand(8) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x) * torch.rsqrt(self.running_var + 1e-5).view(1, -1, 1, 1)

    assert capture_graph(WrittenOut().eval(), (torch.randn(1, 3, 4, 4),), fx_first=True).method == "export"


class _MaskAndNaN(nn.Module):
    """Outputs a trace must match exactly: NaNs, a bool mask, integers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.bn(self.conv(x))
        return y / (y - y), y > 0, (y > 0).to(torch.int64)


def test_a_trace_is_judged_on_nan_bool_and_integer_outputs_too():
    model = _random_statistics(_MaskAndNaN())
    x = torch.randn(2, 3, 4, 4)
    captured = capture_graph(model, (x,), fx_first=True)
    assert captured.method == "fx" and captured.ran
    folded, report = FoldBatchNorm()(model, (x,))
    assert [c.site for c in report.changes] == ["bn"] and report.graph_method == "fx"
    with torch.no_grad():
        assert torch.equal(folded(x)[1], model(x)[1])
