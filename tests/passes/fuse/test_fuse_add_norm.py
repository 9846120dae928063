"""fuse_add_norm: residual add + fused norm into one op, on the captured graph; the result is a GraphModule."""

from __future__ import annotations

import re

import model_zoo
import pytest
import torch
from torch import fx, nn

from normswap.kernels import triton_on_cpu
from normswap.kernels.onnx_translation import translation_table
from normswap.modules.fused import FusedLayerNorm, FusedRMSNorm
from normswap.passes import FuseAddNorm, FuseNorm, Pipeline
from normswap.util.tolerance import kernel_tolerance
from tests.kernels.conftest import interpreter  # noqa: F401 (a fixture)

OPS = torch.ops.normswap


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if "normswap" in str(n.target)]


def _fused(name: str, dtype: torch.dtype = torch.float32):
    model, args, kwargs = getattr(model_zoo, name)()
    model = model.to(dtype)
    converted, report = Pipeline([FuseNorm(), FuseAddNorm()])(model, args, kwargs)
    return model, converted, report, args, kwargs


@pytest.mark.parametrize(
    ("name", "first_norm", "first_input", "fused_op"),
    [
        ("llama", "model.layers.0.input_layernorm", "embedding", "normswap.add_rms_norm_fwd.default"),
        ("gpt2", "transformer.h.0.ln_1", "dropout", "normswap.add_layer_norm_fwd.default"),
    ],
)
def test_pre_norm_transformers_fuse_every_residual_add(name, first_norm, first_input, fused_op):
    model, converted, report, _, _ = _fused(name)
    assert report.ok, report.exact_failures
    result = report.passes[1]
    assert isinstance(converted, fx.GraphModule)
    # Every norm but the first reads a residual sum that the next block reads too.
    assert len(result.changes) == 4
    assert {s.site: s.reason for s in result.skips} == {
        first_norm: f"its input comes from {first_input}, not a residual add"
    }
    for change in result.changes:
        assert change.kind.value == "exact" and change.details["output"] == "torch.fx.GraphModule"
        assert change.description.endswith("(the model is now a torch.fx.GraphModule)")
    assert _targets(converted).count(fused_op) == 4
    assert result.validation["outputs"][0]["max_abs"] <= kernel_tolerance(torch.float32)[0]
    # Same parameters under the same names: the original checkpoint loads.
    assert list(converted.state_dict()) == list(model.state_dict())
    converted.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_graph_through_the_triton_kernels(dtype):
    model, converted, _, args, kwargs = _fused("llama", dtype)
    with torch.no_grad(), triton_on_cpu():
        got = converted(*args, **kwargs).logits
    want = model(*args, **kwargs).logits.detach()
    atol, rtol = kernel_tolerance(dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_gradients_through_the_fused_graph():
    # h feeds the next residual, so the fused backward must add the gradient arriving through h.
    model, converted, _, args, kwargs = _fused("gpt2")
    grads = []
    for m in (model, converted):
        m.zero_grad()
        m(*args, **kwargs).logits.square().mean().backward()
        grads.append({k: p.grad for k, p in m.named_parameters() if p.grad is not None})
    assert grads[1].keys() == grads[0].keys()
    for key, want in grads[0].items():
        torch.testing.assert_close(grads[1][key], want, atol=1e-4, rtol=1e-5, msg=key)


def test_fused_graph_exports_again_and_to_onnx():
    _, converted, _, args, kwargs = _fused("llama")
    ep = torch.export.export(converted, args, kwargs, strict=False)
    assert _targets(ep.graph_module).count("normswap.add_rms_norm_fwd.default") == 4
    proto = torch.onnx.export(
        converted, args, kwargs=kwargs, dynamo=True, opset_version=23,
        custom_translation_table=translation_table(23), verbose=False,
    ).model_proto  # fmt: skip
    assert sum(n.op_type == "RMSNormalization" for n in proto.graph.node) == 5


class _Broadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(16))
        self.norm = FusedLayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.bias)


class _Promote(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = FusedRMSNorm(16)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm(x + r.double()).float()


def test_adds_the_fused_op_cannot_take_are_skipped_with_the_reason():
    x = torch.randn(2, 3, 16)
    model, report = FuseAddNorm()(_Broadcast(), (x,))
    assert not isinstance(model, fx.GraphModule)  # nothing fused: the model comes back as it was
    # the batch dim and the length are exported dynamic: symbols in place of 2 and 3
    assert re.fullmatch(
        r"the add broadcasts \(s\d+, s\d+, 16\) \+ \(16,\): the fused op adds two tensors of one shape",
        report.skips[0].reason,
    ), report.skips[0].reason
    _, report = FuseAddNorm()(_Promote(), (x, x))
    assert report.skips[0].reason == (
        "the add promotes torch.float32 + torch.float64: the fused op adds two tensors of one dtype"
    )


def test_without_inputs_nothing_is_captured():
    model = nn.Sequential(FusedRMSNorm(8))
    out, report = FuseAddNorm()(model)
    assert out is model and report.changes == []
    assert report.skips[0].reason == "no example inputs: fusing adds into norms needs a captured graph"


def test_input_model_is_untouched():
    model, args, kwargs = model_zoo.gpt2(layers=1)
    fused, _ = FuseNorm()(model, args, kwargs)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    out, _ = FuseAddNorm()(fused, args, kwargs)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in fused.state_dict().items())


def test_the_fused_graph_takes_other_batch_sizes_and_lengths():
    model, converted, report, _, kwargs = _fused("gpt2")
    assert report.ok
    ids = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(2))  # examples: (2, 12)
    with torch.no_grad():
        torch.testing.assert_close(
            converted(ids, **kwargs).logits, model(ids, **kwargs).logits, atol=1e-4, rtol=1e-5
        )
