"""Architectural swaps between channel-first and channel-last norms: what each target means per layout."""

from __future__ import annotations

import model_zoo
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normswap.modules.layout import (
    Derf,
    DyT,
    FeatureAffine,
    FeatureBatchNorm,
    FeatureGroupNorm,
    FeatureInstanceNorm,
    FeatureLayerNorm,
)
from normswap.passes import Pipeline, SwapNorm

torch.manual_seed(0)


def _randomize(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module


def test_feature_layernorm_on_nchw_is_layernorm_over_channels_at_each_pixel():
    x = torch.randn(2, 6, 5, 7)
    norm = _randomize(FeatureLayerNorm(6, eps=1e-6, dim=1))
    expected = F.layer_norm(x.permute(0, 2, 3, 1), (6,), norm.weight, norm.bias, 1e-6).permute(0, 3, 1, 2)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
    rms = _randomize(FeatureLayerNorm(6, eps=1e-6, dim=1, rms=True))
    expected = F.rms_norm(x.permute(0, 2, 3, 1), (6,), rms.weight, 1e-6).permute(0, 3, 1, 2)
    expected = expected + rms.bias[:, None, None]
    torch.testing.assert_close(rms(x), expected, rtol=1e-5, atol=1e-5)


def test_feature_batchnorm_on_tokens_normalizes_each_hidden_feature_over_batch_and_tokens():
    x = torch.randn(3, 9, 8) * 2 + 1
    norm = _randomize(FeatureBatchNorm(8, dim=-1)).train()
    y = norm(x)
    flat = y.reshape(-1, 8)
    w, b = norm.weight.detach(), norm.bias.detach()
    torch.testing.assert_close(flat.mean(0), b, rtol=0, atol=1e-5)
    torch.testing.assert_close(((flat - b) / w).var(0, unbiased=False), torch.ones(8), rtol=0, atol=1e-3)
    assert set(norm.state_dict()) == set(nn.BatchNorm1d(8).state_dict())
    norm.eval()
    expected = F.batch_norm(x.transpose(1, 2), norm.running_mean, norm.running_var, w, b, eps=norm.eps)
    torch.testing.assert_close(norm(x), expected.transpose(1, 2))


def test_feature_groupnorm_on_tokens_acts_per_token_and_on_nchw_is_torch_groupnorm():
    x = torch.randn(2, 5, 12)
    norm = _randomize(FeatureGroupNorm(3, 12, dim=-1))
    expected = F.group_norm(x.reshape(10, 12), 3, norm.weight, norm.bias, norm.eps).reshape(2, 5, 12)
    torch.testing.assert_close(norm(x), expected)
    image = torch.randn(2, 12, 4, 4)
    channel_first = _randomize(FeatureGroupNorm(3, 12, dim=1))
    expected = F.group_norm(image, 3, channel_first.weight, channel_first.bias, channel_first.eps)
    torch.testing.assert_close(channel_first(image), expected)


def test_feature_instancenorm_on_tokens_normalizes_each_feature_over_the_tokens_of_a_sample():
    x = torch.randn(2, 7, 4) * 3
    norm = FeatureInstanceNorm(4, dim=-1)
    y = norm(x)
    torch.testing.assert_close(y.mean(1), torch.zeros(2, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(y.var(1, unbiased=False), torch.ones(2, 4), rtol=0, atol=1e-3)
    with pytest.raises(ValueError, match="needs positions"):
        norm(torch.randn(2, 4))


def test_dyt_and_affine():
    x = torch.randn(2, 3, 4)
    dyt = _randomize(DyT(4, alpha=0.7, dim=-1))
    torch.testing.assert_close(dyt(x), torch.tanh(dyt.alpha * x) * dyt.weight + dyt.bias)
    affine = _randomize(FeatureAffine(3, dim=1))
    torch.testing.assert_close(affine(x), x * affine.weight[:, None] + affine.bias[:, None])


@pytest.mark.parametrize(
    ("to", "cls"),
    [
        ("layernorm", FeatureLayerNorm),
        ("rmsnorm", FeatureLayerNorm),
        ("groupnorm", FeatureGroupNorm),
        ("instancenorm", nn.InstanceNorm2d),
        ("dyt", DyT),
        ("derf", Derf),
        ("identity", FeatureAffine),
    ],
)
def test_resnet18_batchnorms_swap_to_every_kind_and_keep_their_affine(to, cls):
    model, args, kwargs = model_zoo.resnet18(size=64)  # layer4 keeps 2x2 positions for instance norm
    converted, report = Pipeline([SwapNorm(to, groups=8 if to == "groupnorm" else None)])(model, args, kwargs)
    swap = report.passes[0]
    assert len(swap.changes) == 20 and swap.skips == []
    new = converted.layer1[0].bn1
    assert isinstance(new, cls) and getattr(new, "dim", 1) == 1
    torch.testing.assert_close(new.weight, model.layer1[0].bn1.weight)
    torch.testing.assert_close(new.bias, model.layer1[0].bn1.bias)
    assert all(c.details["feature_dim"] == 1 and "site_sqnr_db" in c.details for c in swap.changes)
    assert converted(*args).shape == (2, 10)
    assert report.overall is not None and report.overall.worst_sqnr_db < 40  # architectural: it moved


def test_vit_layernorm_to_batchnorm_takes_statistics_from_the_example_inputs():
    model, args, kwargs = model_zoo.small_vit()
    converted, report = Pipeline([SwapNorm("batchnorm")])(model, args, kwargs)
    swap = report.passes[0]
    assert len(swap.changes) == 5
    new = converted.encoder.layers[0].ln_1
    assert isinstance(new, FeatureBatchNorm) and new.dim == -1 and not new.training
    assert swap.changes[0].details["statistics"] == "example inputs"
    # the statistics are those of the captured input of that site
    seen = {}
    hook = model.encoder.layers[0].ln_1.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    model(*args)
    hook.remove()
    flat = seen["x"].reshape(-1, 64).double()
    torch.testing.assert_close(new.running_mean.double(), flat.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new.running_var.double(), flat.var(0, unbiased=False), rtol=1e-4, atol=1e-5)


def test_bert_generic_rmsnorm_and_dyt_swaps_report_divergence():
    model, args, kwargs = model_zoo.bert()
    for to in ("rmsnorm", "dyt", "instancenorm"):
        converted, report = Pipeline([SwapNorm(to)])(model, args, kwargs)
        assert len(report.passes[0].changes) == 5, (to, report.passes[0].skips)
        assert -20 < report.overall.worst_sqnr_db < 60
        assert converted(*args, **kwargs).last_hidden_state.shape == (2, 12, 64)


def test_refusals_say_why():
    two_d = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)).eval()
    _, report = SwapNorm("instancenorm")(two_d, (torch.randn(3, 4),))
    assert report.skips[0].reason == (
        "input is 2-D: an instance norm needs positions (tokens) to normalize each feature over"
    )
    _, report = SwapNorm("groupnorm", groups=3)(two_d, (torch.randn(3, 4),))
    assert report.skips[0].reason == "8 features do not split into 3 groups"
    over_two = nn.Sequential(nn.Unflatten(-1, (2, 4)), nn.LayerNorm((2, 4))).eval()
    _, report = SwapNorm("batchnorm")(over_two, (torch.randn(3, 8),))
    assert report.skips[0].reason.startswith(
        "normalizes dims (-2, -1) of shape (2, 4): no single feature dim"
    )
    _, report = SwapNorm("instancenorm")(model_zoo.resnet18(size=32)[0], (torch.randn(2, 3, 32, 32),))
    reasons = {s.site: s.reason for s in report.skips}
    assert set(reasons) == {
        "layer4.0.bn1",
        "layer4.0.bn2",
        "layer4.0.downsample.1",
        "layer4.1.bn1",
        "layer4.1.bn2",
    }
    assert reasons["layer4.1.bn2"] == (
        "its input has one position per feature: an instance norm would output its bias alone"
    )
    with pytest.raises(ValueError, match="groupnorm needs the number of groups"):
        SwapNorm("groupnorm")
    with pytest.raises(ValueError, match="unknown norm target 'batchnorm2d'"):
        SwapNorm("batchnorm2d")


def test_from_kinds_limits_what_is_replaced():
    model, args, kwargs = model_zoo.convnext_tiny()
    _, report = SwapNorm("rmsnorm", from_kinds=("layer",))(model, args, kwargs)
    assert len(report.changes) == 23  # 18 per-block LayerNorms + 5 LayerNorm2d over channels
    layer2d = [c for c in report.changes if c.details["feature_dim"] == 1]
    assert len(layer2d) == 5 and layer2d[0].details["to_class"] == "FeatureLayerNorm"


def test_gpt2_layernorm_to_batchnorm_and_instancenorm_run_in_hf_code():
    # HF GPT-2's Conv1D .view()s what the norm returns: the per-layout norms must return contiguous tensors
    model, args, kwargs = model_zoo.gpt2()
    for to in ("batchnorm", "instancenorm"):
        converted, report = Pipeline([SwapNorm(to)])(model, args, kwargs)
        assert len(report.passes[0].changes) == 5
        assert converted(*args, **kwargs).logits.shape == (2, 12, 128)


def test_hand_written_norms_keep_their_affine_under_its_own_names():
    model = nn.Sequential(model_zoo.HandLayerNorm(16), nn.Linear(16, 4)).eval()
    x = torch.randn(2, 7, 16)  # (batch, tokens, hidden): a LayerNorm, not an instance norm
    converted, report = SwapNorm("dyt")(model, (x,))
    assert report.changes[0].details["feature_dim"] == -1
    torch.testing.assert_close(converted[0].weight, model[0].gain)
    torch.testing.assert_close(converted[0].bias, model[0].shift)


def test_timm_rmsnorm2d_keeps_its_reshaped_weight():
    import timm.layers

    model = nn.Sequential(nn.Conv2d(3, 8, 1), timm.layers.RmsNorm2d(8)).eval()
    with torch.no_grad():
        model[1].weight.copy_(torch.rand(8) + 0.5)
    # its forward multiplies by weight.reshape(1, -1, 1, 1): that is the norm's affine, not a later op
    converted, report = SwapNorm("layernorm")(model, (torch.randn(2, 3, 5, 5),))
    assert report.changes[0].details["feature_dim"] == 1
    torch.testing.assert_close(converted[1].weight, model[1].weight)


@pytest.mark.parametrize("to", ["identity", "rmsnorm", "groupnorm"])
def test_timm_batchnorm_act_keeps_its_activation(to):
    from timm.layers import BatchNormAct2d

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BatchNormAct2d(8, act_layer=nn.ReLU)).eval()
    x = torch.randn(2, 3, 8, 8)
    converted, report = SwapNorm(to, groups=2 if to == "groupnorm" else None)(model, (x,))
    assert report.changes[0].details["kept"] == ["drop", "act"]
    assert report.changes[0].description.endswith("then its drop and act as before")
    assert converted[1].act is not model[1].act and isinstance(converted[1].act, nn.ReLU)
    with torch.no_grad():
        assert float(converted(x).min()) >= 0  # the ReLU still runs after the swapped norm


def test_a_batchnorm_is_not_given_statistics_from_one_value_per_feature():
    """GPT-2 fed one token: each LayerNorm sees one value per feature, so the new BatchNorm's variance
    was 0 and it divided by sqrt(eps) (outputs 300x the original's, reported ok). Skipped with the reason."""
    model, _, kwargs = model_zoo.gpt2()
    one_token = torch.zeros(1, 1, dtype=torch.long)
    converted, report = Pipeline([SwapNorm("batchnorm")])(model, (one_token,), kwargs)
    swap = report.passes[0]
    assert swap.changes == [] and len(swap.skips) == 5
    assert {s.reason for s in swap.skips} == {
        "the example inputs give it one value per feature (shape (1, 1, 64)): a BatchNorm's statistics "
        "need several; give example inputs with more rows or tokens"
    }
    # two tokens are two values per feature: swapped, with a variance that is not 0
    converted, report = Pipeline([SwapNorm("batchnorm")])(model, (torch.tensor([[3, 7]]),), kwargs)
    assert len(report.passes[0].changes) == 5
    assert float(converted.transformer.h[0].ln_1.running_var.min()) > 0
