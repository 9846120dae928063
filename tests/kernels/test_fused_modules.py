"""Fused modules: same constructor and state_dict as the reference modules, from_module, same function."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from normswap.modules import LayerNorm, RMSNorm
from normswap.modules.fused import FusedAddLayerNorm, FusedAddRMSNorm, FusedLayerNorm, FusedRMSNorm

PAIRS = [
    (RMSNorm, FusedRMSNorm),
    (LayerNorm, FusedLayerNorm),
    (RMSNorm, FusedAddRMSNorm),
    (LayerNorm, FusedAddLayerNorm),
]
CONFIGS = [
    {},
    {"bias": True, "casting": "llama"},
    {"elementwise_affine": False, "bias": False},
    {"casting": "gemma", "weight_offset": 1.0, "eps": 1e-6},
    {"normalized_shape": (4, 8), "casting": "none"},
]


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return module


@pytest.mark.parametrize(("ref_cls", "fused_cls"), PAIRS)
def test_same_constructor(ref_cls, fused_cls):
    assert inspect.signature(fused_cls.__init__) == inspect.signature(ref_cls.__init__)
    assert issubclass(fused_cls, ref_cls)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("ref_cls", "fused_cls"), PAIRS)
def test_state_dict_round_trip(ref_cls, fused_cls, config):
    config = {"normalized_shape": 32, **config}
    ref = _randomize(ref_cls(**config))
    fused = fused_cls(**config)
    assert list(fused.state_dict()) == list(ref.state_dict())
    fused.load_state_dict(ref.state_dict())
    back = ref_cls(**config)
    back.load_state_dict(fused.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("ref_cls", "fused_cls"), PAIRS[:2])
def test_from_module_computes_the_same(ref_cls, fused_cls, config):
    config = {"normalized_shape": 32, **config}
    ref = _randomize(ref_cls(**config, dtype=torch.bfloat16))
    fused = fused_cls.from_module(ref)
    assert type(fused) is fused_cls
    assert fused.extra_repr() == ref.extra_repr()
    shape = (3, 5, *ref.normalized_shape)
    x = torch.randn(shape).bfloat16()
    assert torch.equal(fused(x), ref(x))  # on CPU the op runs the reference math itself


@pytest.mark.parametrize(("ref_cls", "fused_cls"), PAIRS[2:])
def test_fused_add_modules(ref_cls, fused_cls):
    ref = _randomize(ref_cls(32, casting="llama"))
    fused = fused_cls.from_module(ref)
    x, r = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    y, h = fused(x, r)
    assert torch.equal(h, x + r)
    assert torch.equal(y, ref(x + r))


def test_from_module_copies_parameters_and_flags():
    ref = RMSNorm(16, bias=True, dtype=torch.bfloat16)
    ref.bias.data = ref.bias.data.float()  # weight and bias of different dtypes survive the copy
    ref.weight.requires_grad_(False)
    ref.eval()
    fused = FusedRMSNorm.from_module(ref)
    assert fused.weight.dtype == torch.bfloat16 and fused.bias.dtype == torch.float32
    assert not fused.weight.requires_grad and fused.bias.requires_grad
    assert not fused.training
    assert fused.weight.data_ptr() != ref.weight.data_ptr()
    with torch.no_grad():
        fused.weight.add_(1.0)
    assert torch.equal(ref.weight, torch.ones(16, dtype=torch.bfloat16))  # the source is untouched


def test_from_torch_modules():
    ln = _randomize(nn.LayerNorm(24, eps=1e-3))
    fused_ln = FusedLayerNorm.from_module(ln)
    x = torch.randn(4, 24)
    torch.testing.assert_close(fused_ln(x), ln(x))
    rms = _randomize(nn.RMSNorm(24, eps=1e-6))
    torch.testing.assert_close(FusedRMSNorm.from_module(rms)(x), rms(x))
    no_bias = FusedLayerNorm.from_module(nn.LayerNorm(24, bias=False))
    assert no_bias.bias is None


@pytest.mark.parametrize(
    ("fused_cls", "module", "error", "message"),
    [
        (FusedRMSNorm, LayerNorm(8), TypeError, "LayerNorm"),
        (FusedLayerNorm, RMSNorm(8), TypeError, "RMSNorm"),
        (FusedLayerNorm, nn.GroupNorm(2, 8), TypeError, "GroupNorm"),
    ],
)
def test_from_module_refuses(fused_cls, module, error, message):
    with pytest.raises(error, match=message):
        fused_cls.from_module(module)


def test_gradients_flow_to_parameters():
    ref = _randomize(LayerNorm(16, casting="gemma", weight_offset=1.0))
    fused = FusedLayerNorm.from_module(ref)
    x = torch.randn(4, 16)
    ref(x).pow(2).sum().backward()
    fused(x).pow(2).sum().backward()
    torch.testing.assert_close(fused.weight.grad, ref.weight.grad)
    torch.testing.assert_close(fused.bias.grad, ref.bias.grad)


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


@pytest.mark.parametrize("fused_cls", [FusedLayerNorm, FusedRMSNorm])
def test_a_parametrized_weight_is_the_one_the_forward_uses(fused_cls):
    """The forward reads weight and bias straight from ``_parameters`` (host time), except where a
    parametrization (torch.nn.utils.parametrize) moved the weight out of them: then the parametrized
    attribute, as the reference module's forward would read it."""
    from torch.nn.utils import parametrize

    fused = _randomize(fused_cls(16))
    reference = _randomize(fused_cls._reference(16))
    with torch.no_grad():
        reference.weight.mul_(2)
    parametrize.register_parametrization(fused, "weight", _Doubled())
    assert "weight" not in fused._parameters
    x = torch.randn(3, 16)
    torch.testing.assert_close(fused(x), reference(x))
    # a fused module keeping a hand-written norm's names (gain/shift), its gain parametrized
    renamed = _randomize(fused_cls(16))
    renamed._rename_parameters("gain", "shift")
    with torch.no_grad():
        renamed.gain.copy_(reference.weight / 2)
        if renamed.shift is not None and reference.bias is not None:
            renamed.shift.copy_(reference.bias)
    parametrize.register_parametrization(renamed, "gain", _Doubled())
    torch.testing.assert_close(renamed(x), reference(x))
