"""Module recipes: what normswap records of the modules it puts into a model directory, built back the
same, and nothing else built from a file's say-so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normswap.modules import LayerNorm, RMSNorm
from normswap.modules.fused import FusedChannelLayerNorm, FusedLayerNorm, FusedRMSNorm
from normswap.modules.recipes import build_from_recipe, module_recipe


def _channel_norm() -> nn.Module:
    norm = FusedChannelLayerNorm(8, eps=1e-6)
    norm.channel_dim = -3
    return norm


@pytest.mark.parametrize(
    "make",
    [
        lambda: RMSNorm(8, eps=1e-6, casting="llama"),
        lambda: RMSNorm(8, eps=1e-6, casting="gemma", weight_offset=1.0),
        lambda: LayerNorm(8, eps=1e-5, bias=False),
        lambda: LayerNorm((4, 8), eps=1e-5, elementwise_affine=False, bias=False),
        lambda: FusedRMSNorm(8, eps=1e-6),
        lambda: FusedLayerNorm(8, eps=1e-5),
        _channel_norm,
        nn.Identity,
    ],
)
def test_a_recipe_builds_a_module_computing_the_same(make):
    original = make()
    with torch.no_grad():
        for param in original.parameters():
            param.uniform_(-1, 1)
    recipe = module_recipe(original)
    assert recipe is not None
    rebuilt = build_from_recipe(recipe, dtype=torch.float32)
    assert type(rebuilt) is type(original)
    rebuilt.load_state_dict(original.state_dict())
    x = torch.randn(2, 8, 5, 5) if isinstance(original, FusedChannelLayerNorm) else torch.randn(3, 4, 8)
    torch.testing.assert_close(rebuilt(x), original(x), rtol=0, atol=0)


def test_modules_normswap_does_not_put_into_a_model_have_no_recipe():
    assert module_recipe(nn.LayerNorm(8)) is None  # the config builds torch's own: nothing to record
    assert module_recipe(nn.GELU()) is None

    class Sneaky(RMSNorm):  # a subclass is not the class the recipe would build
        pass

    assert module_recipe(Sneaky(8)) is None


@pytest.mark.parametrize(
    ("recipe", "reason"),
    [
        ({"class": "os.system", "kwargs": {}}, "unknown module class"),
        ({"class": "RMSNorm"}, "a module recipe is"),
        ({"class": "RMSNorm", "kwargs": {"normalized_shape": [8]}}, "arguments must be exactly"),
        (
            {
                "class": "RMSNorm",
                "kwargs": {
                    "normalized_shape": [8],
                    "eps": "1e-6",
                    "elementwise_affine": True,
                    "bias": False,
                    "casting": "none",
                    "weight_offset": 0.0,
                },
            },
            "eps must be a finite number",
        ),
        (
            {
                "class": "LayerNorm",
                "kwargs": {
                    "normalized_shape": [8, -1],
                    "eps": 1e-5,
                    "elementwise_affine": True,
                    "bias": True,
                    "casting": "none",
                    "weight_offset": 0.0,
                },
            },
            "normalized_shape must be a list of positive ints",
        ),
        (
            {
                "class": "LayerNorm",
                "kwargs": {
                    "normalized_shape": [8],
                    "eps": 1e-5,
                    "elementwise_affine": 1,
                    "bias": True,
                    "casting": "none",
                    "weight_offset": 0.0,
                },
            },
            "elementwise_affine must be true or false",
        ),
        ({"class": "Identity", "kwargs": {"x": 1}}, "Identity takes no arguments"),
    ],
)
def test_a_recipe_from_a_file_is_checked_before_anything_is_built(recipe, reason):
    with pytest.raises(ValueError, match=reason):
        build_from_recipe(recipe)


@pytest.mark.parametrize(
    ("layer", "x"),
    [
        (nn.Linear(6, 5, bias=False), torch.randn(2, 6)),
        (nn.Conv1d(4, 6, 3, padding="same", padding_mode="reflect"), torch.randn(2, 4, 9)),
        (nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2, bias=True), torch.randn(2, 4, 9, 9)),
        (nn.Conv3d(2, 3, (1, 3, 3), dilation=(1, 2, 2)), torch.randn(1, 2, 3, 9, 9)),
    ],
)
def test_a_layer_recipe_builds_the_same_layer(layer, x):
    recipe = module_recipe(layer)
    rebuilt = build_from_recipe(recipe)
    assert type(rebuilt) is type(layer) and repr(rebuilt) == repr(layer)
    rebuilt.load_state_dict(layer.state_dict())
    torch.testing.assert_close(rebuilt(x), layer(x), rtol=0, atol=0)


def test_a_layer_recipe_with_bad_arguments_is_refused():
    good = module_recipe(nn.Conv2d(4, 8, 3))
    for key, value, reason in [
        ("kernel_size", [3], "kernel_size must be a list of 2 ints"),
        ("groups", 0, "groups must be an int >= 1"),
        ("padding", "sometimes", "padding must be 'same', 'valid' or a list of ints"),
        ("padding_mode", "mirror", "padding_mode must be one of"),
    ]:
        bad = {"class": "Conv2d", "kwargs": {**good["kwargs"], key: value}}
        with pytest.raises(ValueError, match=reason):
            build_from_recipe(bad)
