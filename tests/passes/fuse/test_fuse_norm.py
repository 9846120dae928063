"""fuse_norm: norms swapped for fused modules, same function within the kernel tolerance, same checkpoint.

Real models from configs (HF Llama, Gemma, GPT-2, T5; timm), in fp32 and bf16, compared logit by logit
against the original with the kernel tolerance table; hand-written norms keep their parameter names;
every refusal carries its reason.
"""

from __future__ import annotations

import model_zoo
import pytest
import torch
from torch import nn

from normswap.discover import NormSemantics, NormSite
from normswap.kernels import triton_on_cpu
from normswap.modules.fused import FusedLayerNorm, FusedRMSNorm
from normswap.passes import FuseNorm, Pipeline, build_context
from normswap.util.tolerance import kernel_tolerance
from tests.kernels.conftest import interpreter  # noqa: F401 (a fixture)

DTYPES = [torch.float32, torch.bfloat16]


def gemma(layers: int = 2) -> tuple[nn.Module, tuple, dict]:
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    config = GemmaConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=64,
    )
    model = model_zoo.randomize_norms(GemmaForCausalLM(config)).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, (ids,), {"use_cache": False}


def t5_encoder() -> tuple[nn.Module, tuple, dict]:
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, vocab_size=128)
    model = model_zoo.randomize_norms(T5EncoderModel(config)).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, (ids,), {}


MODELS = {
    "llama": (model_zoo.llama, FusedRMSNorm, "llama", 0.0),
    "gemma": (gemma, FusedRMSNorm, "gemma", 1.0),
    "gpt2": (model_zoo.gpt2, FusedLayerNorm, "none", 0.0),
}


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _assert_logits_close(original: nn.Module, converted: nn.Module, args: tuple, kwargs: dict) -> None:
    with torch.no_grad():
        want, got = _logits(original(*args, **kwargs)), _logits(converted(*args, **kwargs))
    atol, rtol = kernel_tolerance(want.dtype)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_models_fuse_every_norm_exactly(name, dtype):
    build, fused_cls, casting, offset = MODELS[name]
    model, args, kwargs = build()
    model = model.to(dtype)
    converted, report = Pipeline([FuseNorm()])(model, args, kwargs)
    assert report.ok, report.exact_failures
    changes = report.passes[0].changes
    assert len(changes) == 5 and report.passes[0].skips == []
    atol, rtol = kernel_tolerance(dtype)
    for change in changes:
        assert change.kind.value == "exact"
        assert change.details["measured_on"] == "the example inputs"
        assert change.details["tolerance"] == {"atol": atol, "rtol": rtol}
        assert 0 <= change.details["max_abs_diff"] <= atol
        new = converted.get_submodule(change.site)
        assert type(new) is fused_cls
        assert (new.casting, new.weight_offset) == (casting, offset)
        old = model.get_submodule(change.site)
        assert new.eps == getattr(old, "eps", getattr(old, "variance_epsilon", None))
        assert new.weight.dtype == dtype and not new.training
    _assert_logits_close(model, converted, args, kwargs)
    # A checkpoint of the original loads, strictly, into the converted model.
    assert list(converted.state_dict()) == list(model.state_dict())
    converted.load_state_dict(model.state_dict(), strict=True)
    assert type(model.get_submodule(changes[0].site)) is not fused_cls  # the input is untouched


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_converted_models_through_the_triton_kernels(name, dtype):
    """The same comparison with the fused modules running the Triton kernels (interpreter on CPU)."""
    model, args, kwargs = MODELS[name][0]()
    model = model.to(dtype)
    converted, _ = FuseNorm()(model, args, kwargs)
    with triton_on_cpu():
        _assert_logits_close(model, converted, args, kwargs)


def test_t5_rmsnorm_is_fused():
    model, args, kwargs = t5_encoder()
    converted, report = FuseNorm()(model, args, kwargs)
    assert {type(converted.get_submodule(c.site)) for c in report.changes} == {FusedRMSNorm}
    assert len(report.changes) == 5 and report.skips == []
    _assert_logits_close(model, converted, args, kwargs)


def test_export_of_the_converted_model_keeps_the_ops():
    model, args, kwargs = model_zoo.llama()
    converted, _ = FuseNorm()(model, args, kwargs)
    ep = torch.export.export(converted, args, kwargs, strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("normswap.rms_norm_fwd.default") == 5
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*args, **kwargs).logits, converted(*args, **kwargs).logits)


def test_compile_without_graph_breaks():
    model, args, kwargs = model_zoo.gpt2(layers=1)
    converted, _ = FuseNorm()(model, args, kwargs)
    explained = torch._dynamo.explain(converted)(*args, **kwargs)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_autograd_through_the_converted_model():
    model, args, kwargs = model_zoo.llama()
    converted, _ = FuseNorm()(model, args, kwargs)
    grads = []
    for m in (model, converted):
        m.train()
        m.zero_grad()
        m(*args, **kwargs).logits.square().mean().backward()
        grads.append({k: p.grad for k, p in m.named_parameters() if "norm" in k})
    assert len(grads[0]) == 5
    for key, want in grads[0].items():
        torch.testing.assert_close(grads[1][key], want, atol=1e-4, rtol=1e-5, msg=key)


def test_hand_written_norms_keep_their_parameter_names():
    model = model_zoo.HandWrittenNet()
    x = torch.randn(2, 16)
    converted, report = FuseNorm()(model, (x,))
    assert {c.site: c.description.split(";")[0] for c in report.changes} == {
        "ln": "HandLayerNorm -> FusedLayerNorm",
        "rms": "HandRMSNorm -> FusedRMSNorm",
    }
    assert report.changes[1].description.endswith(
        f"site max abs diff {report.changes[1].details['max_abs_diff']:.3g}"
    )
    assert isinstance(converted.ln, FusedLayerNorm) and isinstance(converted.rms, FusedRMSNorm)
    assert [n for n, _ in converted.ln.named_parameters()] == ["gain", "shift"]
    assert converted.rms.weight is converted.rms.scale
    assert list(converted.state_dict()) == list(model.state_dict())
    converted.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(converted(x), model(x), atol=1e-6, rtol=1e-6)
    reasons = {s.site: s.reason for s in report.skips}
    assert reasons == {
        "<root>::layer_norm": "functional norm computed inside the root module's forward, not a module "
        "of its own: fusing it needs a graph rewrite (FuseGraphNorm; convert --fuse-inline)",
        "<root>::mul_3": "pattern norm computed inside the root module's forward, not a module of its "
        "own: fusing it needs a graph rewrite (FuseGraphNorm; convert --fuse-inline)",
    }


def _timm_norms() -> nn.Module:
    import timm.layers

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln2d = timm.layers.LayerNorm2d(24)  # nn.LayerNorm subclass, permutes around it
            self.rms2d = timm.layers.RmsNorm2d(24)  # written out over dim 1, w.reshape(1, -1, 1, 1)
            self.seq = nn.Sequential(timm.layers.RmsNorm(24), nn.Linear(24, 24), timm.layers.LayerNorm(24))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.rms2d(self.ln2d(x))
            return self.seq(y.permute(0, 2, 3, 1))

    return model_zoo.randomize_norms(Net()).eval()


def test_timm_norms_over_the_last_dim_and_over_channels():
    model = _timm_norms()
    x = torch.randn(2, 24, 5, 7) * 3 + 1
    converted, report = FuseNorm()(model, (x,))
    described = {c.site: c.description.split(";")[0] for c in report.changes}
    assert described == {
        "ln2d": "LayerNorm2d -> FusedChannelLayerNorm",
        "rms2d": "RmsNorm2d -> FusedChannelRMSNorm",
        # timm's RmsNorm is one F.rms_norm call on its own weight: discovery takes the module as the site.
        "seq.0": "RmsNorm -> FusedRMSNorm",
        "seq.2": "LayerNorm -> FusedLayerNorm",
    }
    assert report.skips == []
    assert converted.ln2d.channel_dim == converted.rms2d.channel_dim == -3
    for change in report.changes:
        assert change.details["max_abs_diff"] < 1e-5
    torch.testing.assert_close(converted(x), model(x), atol=1e-5, rtol=1e-5)
    # channels_last input: the moved view is contiguous, and the result matches timm's layout too
    x_cl = x.to(memory_format=torch.channels_last)
    torch.testing.assert_close(converted(x_cl), model(x_cl), atol=1e-5, rtol=1e-5)
    converted.load_state_dict(model.state_dict(), strict=True)


def test_channel_norm_gradients_match_timm():
    model = _timm_norms().train()
    converted, _ = FuseNorm()(model, (torch.randn(2, 24, 5, 7),))
    x = torch.randn(2, 24, 5, 7, requires_grad=True)
    grads = []
    for m in (model, converted):
        x.grad = None
        m.zero_grad()
        m(x).square().mean().backward()
        grads.append({"x": x.grad.clone(), **{k: p.grad for k, p in m.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for key, want in grads[0].items():
        torch.testing.assert_close(grads[1][key], want, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.usefixtures("interpreter")
def test_channel_norms_through_the_triton_kernels():
    model = _timm_norms().to(torch.bfloat16)
    x = torch.randn(2, 24, 5, 7, dtype=torch.bfloat16)
    converted, report = FuseNorm()(model, (x,))
    assert len(report.changes) == 4
    with triton_on_cpu(), torch.no_grad():
        got, want = converted(x), model(x)
    atol, rtol = kernel_tolerance(torch.bfloat16)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_timm_convnext_fuses_every_norm():
    model, args, kwargs = model_zoo.convnext_tiny()
    converted, report = FuseNorm()(model, args, kwargs)
    assert report.skips == []
    classes = [type(converted.get_submodule(c.details["module"])).__name__ for c in report.changes]
    # the stem's, 3 downsamples' and the head's are LayerNorm2d over NCHW channels; the blocks' run on NHWC
    assert len(classes) == 23 and classes.count("FusedChannelLayerNorm") == 5
    with torch.no_grad():
        want, got = model(*args), converted(*args)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def test_norm_over_several_trailing_dims_is_fused():
    model = model_zoo.randomize_norms(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm((4, 8), eps=1e-3)))
    x = torch.randn(3, 4, 8)
    converted, report = FuseNorm()(model, (x,))
    assert isinstance(converted[1], FusedLayerNorm) and converted[1].normalized_shape == (4, 8)
    assert report.changes[0].details["max_abs_diff"] < 1e-5
    torch.testing.assert_close(converted(x), model(x))


def test_refusals_carry_their_reason():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.GroupNorm(2, 4),
    ).eval()
    _, report = FuseNorm()(model, (torch.randn(1, 3, 5, 5),))
    assert report.changes == []
    assert {s.site: s.reason for s in report.skips} == {
        "1": "batch norm: the fused kernels normalize features, not over positions",
        "2": "group norm: the fused kernels normalize features, not over positions",
    }


class _NormWithExtraState(model_zoo.HandRMSNorm):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.register_buffer("calls", torch.zeros(()))


def test_module_with_state_beyond_the_norm_is_refused():
    _, report = FuseNorm()(nn.Sequential(_NormWithExtraState(8)), (torch.randn(2, 8),))
    assert report.skips[0].reason == (
        "holds state its norm does not use (calls): the fused module would drop it"
    )


def _site(module: nn.Module, **overrides) -> NormSite:
    fields = {
        "kind": "rms",
        "normalized_dims": (-1,),
        "normalized_shape": (8,),
        "eps": 1e-6,
        "affine": True,
        "weight_name": "scale",
        "casting": "none",
    }
    semantics = NormSemantics(**{**fields, **overrides})
    return NormSite(path="0", source="structural", semantics=semantics, module=module)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            {"casting": "fp8"},
            "casting mode 'fp8' is not one the kernels implement ('none', 'llama', 'gemma')",
        ),
        ({"eps": None}, "its normalized shape or eps could not be determined"),
        # Semantics read wrongly (here: a wrong eps) are caught by measuring the fused module.
        ({"eps": 10.0}, "the fused module differs from it by"),
    ],
)
def test_check_refuses_what_it_cannot_reproduce(overrides, reason):
    model = model_zoo.randomize_norms(nn.Sequential(model_zoo.HandRMSNorm(8)))
    ctx = build_context(model, (torch.randn(2, 8),))
    fuse = FuseNorm()
    assert fuse.check(_site(model[0], **overrides), ctx, fuse.prepare(ctx)).startswith(reason)


def test_without_inputs_the_site_is_measured_on_a_random_input():
    model = model_zoo.randomize_norms(nn.Sequential(nn.LayerNorm(16)))
    _, report = FuseNorm()(model)
    assert report.changes[0].details["measured_on"] == "a random input"


def test_a_converted_model_is_left_alone():
    model, args, kwargs = model_zoo.gpt2(layers=1)
    converted, _ = FuseNorm()(model, args, kwargs)
    _, again = FuseNorm()(converted, args, kwargs)
    assert again.changes == [] and {s.reason for s in again.skips} == {"already a fused module"}


class _ShapedChannelRMS(nn.Module):
    """A channel RMSNorm keeping its weight as (1, C, 1, 1)."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(1, channels, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * self.weight


class _ToChannelsLastNorm(nn.LayerNorm):
    """Normalizes the channels of NCHW and returns NHWC: no permute back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias)


def test_channel_norms_the_fused_module_cannot_reproduce_are_refused():
    x = torch.randn(2, 3, 5, 6)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), _ShapedChannelRMS(), _ToChannelsLastNorm(8)).eval()
    _, report = FuseNorm()(model, (x,))
    assert report.changes == []
    assert {s.site: s.reason for s in report.skips} == {
        "1": "normalizes dim -3 with affine tensors of shape (1, 8, 1, 1): the fused channel norm keeps them "
        "as vectors, which would change the checkpoint",
        "2": "the fused module does not give its output's shape on the example inputs: its semantics are "
        "not the ones read off it",
    }


def test_fused_channel_norms_are_found_over_their_channel_dim():
    import timm.layers

    from normswap.discover import find_norms
    from normswap.passes import swap_norm

    model = nn.Sequential(nn.Conv2d(3, 8, 1), timm.layers.LayerNorm2d(8)).eval()
    x = torch.randn(2, 3, 5, 8)  # W == C: a swap over the wrong dim would run, and be wrong
    fused, _ = FuseNorm()(model, (x,))
    assert find_norms(fused, (x,)).by_path("1").normalized_dims == (-3,)
    want = swap_norm(model, "rmsnorm", (x,))[0]
    got = swap_norm(fused, "rmsnorm", (x,))[0]
    torch.testing.assert_close(got(x), want(x))


def test_an_affine_reshaped_above_the_inputs_rank_is_not_the_norms():
    class UnbatchedChannelRMS(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.rand(8) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (C, H, W); the weight adds a batch dim
            return x * torch.rsqrt(x.pow(2).mean(-3, keepdim=True) + 1e-6) * self.weight.reshape(1, -1, 1, 1)

    model = nn.Sequential(nn.Identity(), UnbatchedChannelRMS()).eval()
    x = torch.randn(8, 5, 6)
    converted, report = FuseNorm()(model, (x,))
    assert report.changes == []
    # discovery left the multiply outside the norm, so the module is more than the norm
    assert report.skips[0].reason.startswith(
        "pattern norm computed inside 1's forward, not a module of its own"
    )
    assert converted(x).shape == model(x).shape == (1, 8, 5, 6)
