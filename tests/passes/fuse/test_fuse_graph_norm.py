"""fuse_graph_norm: norms that are no module of their own -> fused calls on the captured graph."""

from __future__ import annotations

import model_zoo
import pytest
import torch
from torch import nn

from normswap.kernels import triton_on_cpu
from normswap.passes import FuseGraphNorm, FuseNorm, Pipeline
from normswap.util.tolerance import kernel_tolerance
from tests.kernels.conftest import interpreter  # noqa: F401 (a fixture)


def _aten_norm_ops(model: nn.Module, inputs: tuple) -> list[str]:
    """Norm-like aten ops left when the model is exported again."""
    graph = torch.export.export(model, inputs, strict=False).graph
    names = [n.target._opname for n in graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    return [n for n in names if n in ("layer_norm", "rms_norm", "rsqrt", "sqrt", "var")]


def test_functional_and_written_out_norms_of_a_forward_are_fused():
    model = model_zoo.HandWrittenNet()
    x = torch.randn(3, 16)
    converted, report = Pipeline([FuseNorm(), FuseGraphNorm()])(model, (x,))
    assert report.ok, report.exact_failures
    graph_pass = report.passes[1]
    assert [(c.site, c.details["source"], c.details["kind"]) for c in graph_pass.changes] == [
        ("<root>::layer_norm", "functional", "layer"),
        # a hand-written LayerNorm of the functional one's output: it reads the fused call, not the old node
        ("<root>::mul", "pattern", "layer"),
    ]
    assert graph_pass.skips == []
    assert all(c.details["max_abs_diff"] < 1e-5 for c in graph_pass.changes)
    assert isinstance(converted, torch.fx.GraphModule)
    assert _aten_norm_ops(converted, (x,)) == []
    assert list(converted.state_dict()) == list(model.state_dict())
    torch.testing.assert_close(converted(x), model(x), atol=1e-5, rtol=1e-5)


class _Block(nn.Module):
    """Norms written out inside a larger forward, in the styles real model code uses."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.w = nn.Parameter(1 + 0.3 * torch.randn(dim))
        self.g = nn.Parameter(0.3 * torch.randn(dim))
        self.conv = nn.Conv2d(3, dim, 1)
        self.cw = nn.Parameter(1 + 0.3 * torch.randn(dim))

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        # HF Llama's casting: statistics in fp32, the normalized value cast back before the weight
        f = h.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.w * f.to(h.dtype)
        # Gemma's: fp32 throughout, weight used as (1 + w)
        f = h.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = (f * (1.0 + self.g.float())).type_as(h)
        # an RMSNorm over the channels of NCHW, its weight reshaped along them
        c = self.conv(image)
        c = c * torch.rsqrt(c.pow(2).mean(1, keepdim=True) + 1e-5) * self.cw.view(1, -1, 1, 1)
        # F.rms_norm without eps: the epsilon of the input's dtype
        return nn.functional.rms_norm(h, (h.shape[-1],)) + c.mean((2, 3))[:, None].to(h.dtype)


def _block_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 5, 32, generator=g) * 3).to(dtype), torch.randn(2, 3, 6, 6, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_casting_modes_channel_norms_and_default_eps(dtype):
    torch.manual_seed(0)
    model = _Block().to(dtype).eval()
    inputs = _block_inputs(dtype)
    converted, report = FuseGraphNorm()(model, inputs)
    assert report.skips == []
    calls = [
        (c.details["casting"], c.details["weight_offset"], c.details["channel_dim"], c.details["eps"])
        for c in report.changes
    ]
    assert calls == [
        ("llama", 0.0, None, 1e-6),
        ("gemma", 1.0, None, 1e-6),
        ("none", 0.0, -3, 1e-5),
        ("none", 0.0, None, torch.finfo(torch.float32).eps),  # half inputs too: torch accumulates in fp32
    ]
    atol, rtol = kernel_tolerance(dtype)
    with torch.no_grad():
        torch.testing.assert_close(converted(*inputs), model(*inputs), atol=atol, rtol=rtol)
    assert _aten_norm_ops(converted, inputs) == []
    graph = torch.export.export(converted, inputs, strict=False).graph
    assert [str(n.target) for n in graph.nodes].count("normswap.rms_norm_fwd.default") == 4


@pytest.mark.usefixtures("interpreter")
def test_through_the_triton_kernels_in_bf16():
    torch.manual_seed(0)
    model = _Block().to(torch.bfloat16).eval()
    inputs = _block_inputs(torch.bfloat16)
    converted, report = FuseGraphNorm()(model, inputs)
    assert len(report.changes) == 4
    atol, rtol = kernel_tolerance(torch.bfloat16)
    with triton_on_cpu(), torch.no_grad():
        torch.testing.assert_close(converted(*inputs), model(*inputs), atol=atol, rtol=rtol)


def test_gradients_match_the_original():
    torch.manual_seed(0)
    model = _Block()
    inputs = _block_inputs(torch.float32)
    converted, _ = FuseGraphNorm()(model, inputs)
    grads = []
    for m in (model, converted):
        m.zero_grad()
        m(*inputs).square().sum().backward()
        grads.append({k: p.grad for k, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for key, want in grads[0].items():
        torch.testing.assert_close(grads[1][key], want, atol=1e-4, rtol=1e-4, msg=key)


class _Refused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.running_mean = nn.Buffer(torch.randn(1, 4, 1, 1))
        self.running_var = nn.Buffer(torch.rand(1, 4, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        # a weight computed in the forward
        y = nn.functional.layer_norm(x, (8,), self.w * 2)
        # an eval BatchNorm written out: it normalizes over positions, not features
        z = (image - self.running_mean) * torch.rsqrt(self.running_var + 1e-5)
        return y.sum() + z.sum()


def test_refusals_carry_their_reason():
    model = _Refused()
    inputs = (torch.randn(2, 8), torch.randn(2, 4, 3, 3))
    converted, report = FuseGraphNorm()(model, inputs)
    assert converted is model and report.changes == []
    assert sorted(s.reason for s in report.skips) == [
        "batch norm: the fused kernels normalize features, not over positions",
        "its weight is computed in the forward, not a stored tensor",
    ]
    _, report = FuseGraphNorm()(model)
    assert [s.reason for s in report.skips] == [
        "no example inputs: fusing norms inside other forwards needs a captured graph"
    ]


def test_a_model_that_does_not_export_is_returned_with_the_reason():
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return nn.functional.layer_norm(x, (4,))
            return x

    model = DataDependent()
    converted, report = FuseGraphNorm()(model, (torch.randn(2, 4),))
    assert converted is model
    assert report.skips[0].reason.startswith("torch.export failed:")


def test_the_fused_graph_takes_other_batch_sizes():
    model = model_zoo.HandWrittenNet()
    converted, report = FuseGraphNorm()(model, (torch.randn(3, 16),))
    assert len(report.changes) == 4
    x = torch.randn(5, 16)
    torch.testing.assert_close(converted(x), model(x), atol=1e-5, rtol=1e-5)


def test_measuring_leaves_no_trace_on_the_model_or_the_inputs():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(8)  # train mode: every forward would move its statistics

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)  # an in-place op on the input
            return nn.functional.layer_norm(self.bn(x), (8,))

    model = Net().train()
    x = torch.randn(4, 8)
    given = x.clone()
    converted, report = FuseGraphNorm()(model, (x,))
    assert len(report.changes) == 1
    torch.testing.assert_close(x, given)  # the example input is what the caller gave
    assert int(converted.bn.num_batches_tracked) == 0
    torch.testing.assert_close(converted.bn.running_mean, torch.zeros(8))
