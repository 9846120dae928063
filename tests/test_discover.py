"""find_norms on real third-party models and on norms nobody registered anywhere."""

from __future__ import annotations

import model_zoo
import pytest
import torch
from torch import nn

from normswap.discover import find_norms


def _kinds(inventory) -> dict[str, int]:
    return inventory.counts()


def test_resnet18_batchnorms_with_producers_and_consumers():
    model, args, kwargs = model_zoo.resnet18()
    inv = find_norms(model, args, kwargs)
    assert inv.graph_method == "export"
    assert _kinds(inv) == {"batch": 20}
    bn1 = inv.by_path("bn1")
    assert (bn1.producer, bn1.consumers) == ("conv1", ["relu"])
    assert bn1.normalized_shape == (64,) and bn1.eps == 1e-5 and bn1.running_stats
    down = inv.by_path("layer2.0.downsample.1")
    assert down.producer == "layer2.0.downsample.0"
    # the second BN of a basic block feeds the residual add
    assert inv.by_path("layer1.0.bn2").consumers == ["add@layer1.0"]


def test_vit_b_16_layernorms():
    model, args, kwargs = model_zoo.vit_b_16()
    inv = find_norms(model, args, kwargs)
    assert _kinds(inv) == {"layer": 25}
    assert all(s.normalized_shape == (768,) and s.eps == 1e-6 for s in inv)
    assert inv.by_path("encoder.layers.encoder_layer_0.ln_2").consumers == [
        "encoder.layers.encoder_layer_0.mlp.0"
    ]


def test_timm_convnext_layernorm2d_normalizes_channels():
    model, args, kwargs = model_zoo.convnext_tiny()
    inv = find_norms(model, args, kwargs)
    assert _kinds(inv) == {"layer": 23}
    stem = inv.by_path("stem.1")
    assert stem.class_name.endswith("LayerNorm2d")
    assert stem.normalized_dims == (-3,)  # channels of NCHW, found through the permute around the op
    assert inv.by_path("stages.0.blocks.0.norm").normalized_dims == (-1,)


@pytest.mark.parametrize(
    ("builder", "expected", "eps"),
    [(model_zoo.gpt2, {"layer": 5}, 1e-5), (model_zoo.bert, {"layer": 5}, 1e-12)],
)
def test_hf_layernorm_models(builder, expected, eps):
    model, args, kwargs = builder()
    inv = find_norms(model, args, kwargs)
    assert _kinds(inv) == expected
    assert all(s.source == "module" and s.eps == eps and s.affine and s.bias for s in inv)


def test_hf_llama_rmsnorm_recognized_by_structure():
    model, args, kwargs = model_zoo.llama()
    inv = find_norms(model, args, kwargs)
    assert _kinds(inv) == {"rms": 5}
    for site in inv:
        assert site.source == "structural"
        assert site.class_name.endswith("LlamaRMSNorm")
        assert (site.eps, site.casting, site.weight_offset, site.normalized_shape) == (
            1e-6,
            "llama",
            0.0,
            (64,),
        )
        assert site.affine and not site.bias
    assert inv.by_path("model.layers.0.input_layernorm").consumers == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ]


def test_gemma_and_t5_norm_semantics():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    model = nn.Sequential(GemmaRMSNorm(32, eps=1e-6), nn.Linear(32, 32), T5LayerNorm(32, eps=1e-6))
    inv = find_norms(model, (torch.randn(2, 5, 32),))
    gemma, t5 = inv.by_path("0"), inv.by_path("2")
    assert (gemma.kind, gemma.casting, gemma.weight_offset) == ("rms", "gemma", 1.0)
    # T5 casts back to the weight dtype only for half weights: in fp32 its math is plain
    assert (t5.kind, t5.casting, t5.weight_offset) == ("rms", "none", 0.0)
    inv16 = find_norms(model.bfloat16(), (torch.randn(2, 5, 32, dtype=torch.bfloat16),))
    assert inv16.by_path("2").casting == "llama"
    assert (inv16.by_path("0").casting, inv16.by_path("0").dtype) == ("gemma", "bfloat16")


def test_hand_written_norms_found_whatever_they_are_called():
    torch.manual_seed(0)
    inv = find_norms(model_zoo.HandWrittenNet(), (torch.randn(3, 16),))
    got = {(s.path, s.kind, s.source) for s in inv}
    assert got == {
        ("ln", "layer", "structural"),
        ("rms", "rms", "structural"),
        ("<root>::layer_norm", "layer", "functional"),
        ("<root>::mul_3", "layer", "pattern"),
    }
    ln = inv.by_path("ln")
    assert (ln.eps, ln.affine, ln.bias, ln.normalized_shape) == (1e-5, True, True, (16,))
    assert inv.by_path("rms").producer == "fc"


class _InlineChannelRMSNorm(nn.Module):
    """RMSNorm over the C of NCHW with its weight reshaped to (1, C, 1, 1), or to a wrong dim."""

    def __init__(self, channels: int, weight_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(channels) + 0.5)
        self.weight_shape = weight_shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)
        return y * self.weight.reshape(self.weight_shape)


def test_a_weight_reshaped_along_the_normalized_dim_is_the_norms_affine():
    x = torch.randn(2, 6, 6, 6)
    site = find_norms(nn.Sequential(_InlineChannelRMSNorm(6, (1, -1, 1, 1))), (x,)).by_path("0")
    assert (site.source, site.normalized_dims, site.affine, site.weight_name) == (
        "structural",
        (-3,),
        True,
        "weight",
    )
    # The same weight broadcast along W instead of C scales another dim: it is not this norm's affine,
    # so the site is a norm without one and the multiply stays outside it.
    inv = find_norms(nn.Sequential(_InlineChannelRMSNorm(6, (1, 1, 1, -1))), (x,))
    assert [(s.kind, s.normalized_dims, s.affine) for s in inv] == [("rms", (-3,), False)]


def test_norm_kinds_from_torch_nn_and_third_party_classes():
    from timm.layers import BatchNormAct2d
    from torchvision.ops.misc import FrozenBatchNorm2d

    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.GroupNorm(2, 8),
        nn.InstanceNorm2d(8, affine=True),
        FrozenBatchNorm2d(8),
        BatchNormAct2d(8),
        nn.Flatten(2),
        nn.RMSNorm(36),
    )
    inv = find_norms(model.eval(), (torch.randn(2, 3, 8, 8),))
    by = {s.path: s for s in inv}
    assert (by["1"].kind, by["1"].num_groups) == ("group", 2)
    assert (by["2"].kind, by["2"].normalized_dims) == ("instance", (-2, -1))
    assert (by["3"].kind, by["3"].running_stats) == ("batch", True)
    assert by["4"].kind == "batch" and by["4"].class_name.endswith("BatchNormAct2d")
    assert by["6"].kind == "rms"
    assert len(inv) == 5  # BatchNormAct2d's activation is not a separate norm


class _DataDependent(nn.Module):
    """Neither export (data-dependent branch) nor fx (Python bool of a tensor) can capture this."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = model_zoo.HandRMSNorm(8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.norm(x)
        return self.bn(x)


def test_without_a_graph_modules_are_still_found_and_the_reason_is_kept():
    inv = find_norms(_DataDependent(), (torch.randn(4, 8),))
    assert inv.graph_method is None
    assert "torch.export failed" in inv.capture.reason and "fx tracing failed" in inv.capture.reason
    assert {(s.path, s.kind, s.source) for s in inv} == {
        ("norm", "rms", "structural"),
        ("bn", "batch", "module"),
    }


def test_layernorm2d_dims_without_example_inputs():
    import timm.layers

    # fx tracing records Tensor.permute(x, 0, 2, 3, 1) with the dims as varargs
    site = find_norms(nn.Sequential(nn.Conv2d(3, 8, 1), timm.layers.LayerNorm2d(8))).by_path("1")
    assert site.normalized_dims == (-3,)
