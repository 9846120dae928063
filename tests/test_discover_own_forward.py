"""A norm class whose own forward computes more than its norm is read as a norm call inside that forward.

Replacing such a module (a swap, a folded affine's weightless norm) would drop what else its forward
computes, and reading every op of its call as the norm let the LayerNorm -> RMSNorm recentring believe
that nothing but norms read the stream (it then moved ``tanh(x)``: `--to rmsnorm` exited 1 on the
in-memory route and on the ``.pt2``). One rule in discovery (:mod:`normswap.discover.own_forward`) and the
same list of ops in the ``.pt2`` lift: every route sees the same sites, every pass the same refusal.
Classes whose forward is only the norm (a cast around it, the channels-first moves) stay module sites.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_dirs import randomize_norms
from torch import nn

from normswap import ConvertConfig, Verdict, convert, find_norms
from normswap.load import load_model

transformers = pytest.importorskip("transformers")


class ScaledLayerNorm(nn.LayerNorm):
    """More than the norm: a branch that reads the norm's input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5 + torch.tanh(x)


class Fp32LayerNorm(nn.LayerNorm):
    """Only the norm, computed in fp32 (open_clip's LayerNormFp32 is written this way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(dtype)


class Block(nn.Module):
    def __init__(self, norm: type[nn.LayerNorm]) -> None:
        super().__init__()
        self.up, self.norm, self.head = nn.Linear(16, 16), norm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.up(x)))


def _block(norm: type[nn.LayerNorm]) -> nn.Module:
    torch.manual_seed(0)
    model = Block(norm).eval()
    with torch.no_grad():  # a mean in the stream and a non-trivial affine
        model.up.bias.normal_(2.0, 1.0)
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    return model


ARGS = (torch.randn(2, 8, 16),)


def _routes(model: nn.Module, tmp_path: Path) -> dict[str, nn.Module]:
    """The model in memory and as its ``.pt2`` loads (lifted back into modules)."""
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, ARGS), path)
    return {"memory": model, "pt2": load_model(path).model}


def test_a_norm_subclass_that_computes_more_is_a_call_inside_its_forward(tmp_path):
    for route, model in _routes(_block(ScaledLayerNorm), tmp_path).items():
        sites = find_norms(model, ARGS).sites
        assert [(s.source, s.path.split("::")[0]) for s in sites] == [("functional", "norm")], route
        before = model(*ARGS)
        exact = convert(model, ConvertConfig(to="rmsnorm", exact=True), ARGS)
        assert exact.verdict is Verdict.NOT_EXACT_UNDER_POLICY, route
        assert "norm::" in (exact.refusal or "") and "not a module" in (exact.refusal or ""), exact.refusal
        result = convert(model, ConvertConfig(to="rmsnorm"), ARGS)
        # skipped by both passes, not half-done: the stream's mean reaches tanh, so nothing is recentred
        assert result.verdict is Verdict.OK, route
        assert not [c for r in result.report.passes for c in r.changes], route
        skips = [s.reason for r in result.report.passes for s in r.skips]
        # a .pt2 holds no class: its norm is "inside a forward"; in memory the class is named
        inside = (
            "ScaledLayerNorm.forward, which computes more than the norm" if route == "memory" else "a forward"
        )
        assert any(f"inside {inside}, not a module" in reason for reason in skips), (route, skips)
        torch.testing.assert_close(result.model(*ARGS), before, rtol=0, atol=0)


def test_a_subclass_that_is_only_the_norm_stays_a_module_and_converts_exactly(tmp_path):
    for route, model in _routes(_block(Fp32LayerNorm), tmp_path).items():
        sites = find_norms(model, ARGS).sites
        assert [(s.source, s.path) for s in sites] == [("module", "norm")], route
        before = model(*ARGS)
        result = convert(model, ConvertConfig(to="rmsnorm", exact=True), ARGS)
        assert result.verdict is Verdict.OK, route
        assert "rms" in type(result.model.get_submodule("norm")).__name__.lower(), route
        changed = [c.site for r in result.report.passes for c in r.changes]
        assert "norm" in changed, (route, changed)
        torch.testing.assert_close(result.model(*ARGS), before, rtol=1e-5, atol=1e-5)


def _nemotron() -> nn.Module:
    config = transformers.NemotronConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.NemotronForCausalLM(config).eval()
    randomize_norms(model)
    return model


def test_nemotrons_layernorm1p_normalizes_with_weight_plus_one_and_is_not_read_as_its_weight():
    """HF Nemotron's ``LayerNorm1P(nn.LayerNorm)`` calls ``F.layer_norm(x, ..., self.weight + 1, ...)``:
    read as a LayerNorm module its gain would be ``weight``, and `--to rmsnorm` exited 1 (the exact
    check caught the recentred stream). Its norms are calls inside its forward: nothing is rewritten,
    the outputs are the original's."""
    model = _nemotron()
    ids = torch.randint(0, 64, (2, 12))
    sites = find_norms(model, (ids,)).sites
    assert len(sites) == 5 and {s.source for s in sites} == {"functional"}
    assert {s.path.split("::")[0].rsplit(".", 1)[-1] for s in sites} == {
        "input_layernorm",
        "post_attention_layernorm",
        "norm",
    }
    before = model(ids).logits
    for config in (ConvertConfig(to="rmsnorm"), ConvertConfig(fold_norm_affine=True)):
        result = convert(model, config, (ids,))
        assert result.verdict is Verdict.OK and not [c for r in result.report.passes for c in r.changes]
        torch.testing.assert_close(result.model(ids).logits, before, rtol=0, atol=0)


def test_hf_convnext_channels_first_layernorm_stays_a_module_over_the_channel_dim():
    """HF's ``ConvNextLayerNorm(nn.LayerNorm)`` permutes around ``super().forward``: only the norm."""
    config = transformers.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32)
    model = transformers.ConvNextModel(config).eval()
    sites = find_norms(model, (torch.randn(1, 3, 32, 32),)).sites
    first = [s for s in sites if "ConvNextLayerNorm" in (s.class_name or "")]
    assert first and all(s.source == "module" for s in first)
    assert any(s.normalized_dims == (-3,) for s in first)


class BatchNormPlusGate(nn.BatchNorm2d):
    """More than the norm: a gate that reads the norm's input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(x)


class ConvBlock(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, padding=1), norm, nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)))


def _conv_block(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model = ConvBlock(norm).eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.normal_()
        model.bn.bias.normal_()
    return model


IMAGES = (torch.randn(2, 3, 16, 16),)


def test_a_batchnorm_subclass_that_computes_more_is_not_swapped_away():
    """`--to layernorm` replaced the whole module and dropped its gate (an architectural swap reported
    as moving the model by 5.8 dB, of which the gate was the most)."""
    model = _conv_block(BatchNormPlusGate(8))
    sites = find_norms(model, IMAGES).sites
    assert [(s.source, s.path.split("::")[0]) for s in sites] == [("functional", "bn")]
    before = model(*IMAGES)
    for config in (ConvertConfig(to="layernorm"), ConvertConfig(fold_bn=True)):
        result = convert(model, config, IMAGES)
        assert result.verdict is Verdict.OK and not [c for r in result.report.passes for c in r.changes]
        assert isinstance(result.model.get_submodule("bn"), BatchNormPlusGate)
        torch.testing.assert_close(result.model(*IMAGES), before, rtol=0, atol=0)


def test_timms_batchnorm_with_its_activation_stays_a_module_whose_activation_every_swap_keeps():
    timm_layers = pytest.importorskip("timm.layers")
    model = _conv_block(timm_layers.BatchNormAct2d(8, act_layer=nn.ReLU))
    sites = find_norms(model, IMAGES).sites
    assert [(s.source, s.path) for s in sites] == [("module", "bn")]
    result = convert(model, ConvertConfig(to="layernorm"), IMAGES)
    assert [c.site for r in result.report.passes for c in r.changes] == ["bn"]
    assert isinstance(result.model.get_submodule("bn.act"), nn.ReLU)
    with torch.no_grad():  # the swapped norm's output still goes through the ReLU
        assert float(result.model.bn(result.model.conv(IMAGES[0])).amin()) >= 0.0


def test_timms_fast_norm_inside_an_autocast_region_stays_a_module():
    """timm's fast norms run ``F.layer_norm`` inside ``torch.autocast(enabled=False)``: export holds it in
    one ``wrap_with_autocast`` region, which the graph sweep does not look into. A norm read as more than
    itself must be found again as a call, or it stays the module it was: it vanished (0 sites) instead."""
    timm_layers = pytest.importorskip("timm.layers")
    timm_layers.set_fast_norm(True)
    try:
        model = _block(timm_layers.LayerNorm)
    finally:
        timm_layers.set_fast_norm(False)
    assert model.norm._fast_norm
    sites = find_norms(model, ARGS).sites
    assert [(s.source, s.path) for s in sites] == [("module", "norm")]
    result = convert(model, ConvertConfig(to="rmsnorm", exact=True), ARGS)
    assert (
        result.verdict is Verdict.OK
        and [c.site for r in result.report.passes for c in r.changes][-1] == "norm"
    )
    torch.testing.assert_close(result.model(*ARGS), model(*ARGS), rtol=1e-5, atol=1e-5)
