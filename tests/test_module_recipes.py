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


@pytest.mark.parametrize(
    ("make", "x"),
    [
        (
            lambda: nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 6, 3, padding=1, groups=2), dim=2),
            torch.randn(2, 4, 9),
        ),
        (lambda: nn.utils.parametrizations.weight_norm(nn.Linear(5, 3)), torch.randn(4, 5)),
        (
            lambda: nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 3, bias=False), dim=None),
            torch.randn(1, 3, 6, 6),
        ),
    ],
)
def test_a_weight_normed_layer_is_recorded_with_its_dim_and_built_back(make, x):
    torch.manual_seed(0)
    layer = make()
    recipe = module_recipe(layer)
    assert recipe is not None and recipe["weight_norm"] == {"dim": layer.parametrizations.weight[0].dim}
    built = build_from_recipe(recipe)
    assert built.state_dict().keys() == layer.state_dict().keys()
    built.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert torch.equal(built(x), layer(x))
    # a plain layer's recipe has no weight_norm; another parametrization stacked on it has no recipe at all
    assert "weight_norm" not in module_recipe(nn.Linear(5, 3))

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    nn.utils.parametrize.register_parametrization(layer, "weight", Double())
    assert module_recipe(layer) is None


@pytest.mark.parametrize(
    ("weight_norm", "reason"),
    [
        ({"dim": 2}, r"weight_norm dim must be an int in \[-1, 2\), got 2"),
        ({"dim": True}, r"weight_norm dim must be an int in \[-1, 2\), got True"),
        ({"dim": 0, "code": "x"}, r"weight_norm must be \{'dim': DIM\}"),
        ("all", r"weight_norm must be \{'dim': DIM\}"),
    ],
)
def test_a_weight_norm_recipe_from_a_file_is_checked(weight_norm, reason):
    recipe = {**module_recipe(nn.Linear(5, 3)), "weight_norm": weight_norm}
    with pytest.raises(ValueError, match=reason):
        build_from_recipe(recipe)
    with pytest.raises(ValueError, match="weight_norm is for Linear, Conv1d, Conv2d, Conv3d, not 'Identity'"):
        build_from_recipe({"class": "Identity", "kwargs": {}, "weight_norm": {"dim": 0}})
