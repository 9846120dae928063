"""fold_norm_affine: exact on real transformers, and a stated reason wherever folding would be wrong."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import model_zoo
import pytest
import torch
from torch import nn

from normswap.modules import RMSNorm
from normswap.passes import FoldNormAffine, Pipeline
from normswap.passes.affine.arithmetic import fold_affine_into_linear
from normswap.util.tolerance import EXACT_TOLERANCE
from normswap.verify import compare_models


def _reasons(report) -> dict[str, str]:
    return {s.site: s.reason for s in report.skips}


def _assert_exact(original: nn.Module, folded: nn.Module, args: tuple, kwargs: dict | None = None) -> float:
    cmp = compare_models(original, folded, args, kwargs)
    worst = max(cmp.outputs, key=lambda o: o.max_rel)
    # DESIGN.md: fp32 exact rewrites within 1e-5 x max|reference output|
    assert worst.max_rel <= EXACT_TOLERANCE[torch.float32], worst
    return worst.max_rel


def _affine_norms(model: nn.Module) -> int:
    return sum(
        isinstance(getattr(m, "weight", None), torch.Tensor)
        for m in model.modules()
        if "norm" in type(m).__name__.lower()
    )


# --- the math alone ---------------------------------------------------------------------------------


@pytest.mark.parametrize("in_dim", [1, 0], ids=["linear", "hf_conv1d"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fold_math_matches_the_unfolded_composition(in_dim, with_bias, dtype):
    g = torch.Generator().manual_seed(0)
    features, out = 13, 7
    x = torch.randn(5, 3, features, generator=g, dtype=torch.float64)
    gain, shift = 1 + torch.randn(features, generator=g), torch.randn(features, generator=g)
    weight = torch.randn((out, features) if in_dim == 1 else (features, out), generator=g).to(dtype)
    bias = torch.randn(out, generator=g).to(dtype) if with_bias else None
    new_w, new_b = fold_affine_into_linear(weight, bias, gain.to(dtype), shift.to(dtype), in_dim)
    assert new_w.dtype == dtype and new_b is not None and new_b.dtype == dtype

    def apply(w: torch.Tensor, b: torch.Tensor | None, inp: torch.Tensor) -> torch.Tensor:
        w = w.double() if in_dim == 1 else w.double().T
        return inp @ w.T + (b.double() if b is not None else 0)

    ref = apply(weight, bias, x * gain.to(dtype).double() + shift.to(dtype).double())
    tol = EXACT_TOLERANCE[dtype] * ref.abs().max()
    torch.testing.assert_close(apply(new_w, new_b, x), ref, rtol=0, atol=tol.item())


def test_fold_math_without_shift_adds_no_bias():
    w, b = fold_affine_into_linear(torch.ones(3, 4), None, torch.full((4,), 2.0), None)
    assert b is None and torch.equal(w, torch.full((3, 4), 2.0))


# --- real models ------------------------------------------------------------------------------------


def test_llama_rmsnorms_fold_into_the_projections():
    model, args, kwargs = model_zoo.llama()
    folded, report = FoldNormAffine()(model, args, kwargs)
    assert report.skips == []
    by_site = {c.site: c.details["into"] for c in report.changes}
    assert by_site["model.layers.0.input_layernorm"] == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    assert by_site["model.layers.1.post_attention_layernorm"] == [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    # the final norm is read through logits_to_keep's slice over tokens, which keeps the hidden dim
    assert by_site["model.norm"] == ["lm_head"]
    norm = folded.model.layers[0].input_layernorm
    assert isinstance(norm, RMSNorm) and norm.weight is None and norm.casting == "llama"
    assert norm.eps == model.model.layers[0].input_layernorm.variance_epsilon
    assert folded.model.layers[0].self_attn.q_proj.bias is None  # RMSNorm has no bias: none is added
    assert "model.layers.0.input_layernorm.weight" not in folded.state_dict()
    assert _affine_norms(model) == 5  # the input model is untouched
    _assert_exact(model, folded, args, kwargs)


def test_folded_llama_state_dict_loads_into_the_original_class():
    # The removed norm weights are missing keys, and a freshly built Llama initializes them to 1: the
    # folded checkpoint loaded with strict=False into the stock class computes the folded function.
    from transformers import LlamaForCausalLM

    model, args, kwargs = model_zoo.llama()
    folded, report = FoldNormAffine()(model, args, kwargs)
    stock = LlamaForCausalLM(model.config).eval()
    result = stock.load_state_dict(folded.state_dict(), strict=False)
    assert sorted(result.missing_keys) == sorted(
        k for c in report.changes for k in c.details["removed_parameters"]
    )
    assert result.unexpected_keys == []
    _assert_exact(model, stock, args, kwargs)


def test_gpt2_folds_into_conv1d_and_refuses_the_tied_head():
    model, args, kwargs = model_zoo.gpt2()
    folded, report = FoldNormAffine()(model, args, kwargs)
    assert [c.site for c in report.changes] == [
        "transformer.h.0.ln_1",
        "transformer.h.0.ln_2",
        "transformer.h.1.ln_1",
        "transformer.h.1.ln_2",
    ]
    assert report.changes[0].details["into"] == ["transformer.h.0.attn.c_attn"]
    assert report.changes[0].details["reader_classes"] == ["Conv1D"]
    assert _reasons(report) == {
        "transformer.ln_f": "lm_head.weight is tied to transformer.wte.weight: folding would change that use too"
    }
    assert folded.transformer.h[0].ln_1.weight is None and folded.transformer.h[0].ln_1.bias is None
    _assert_exact(model, folded, args, kwargs)


def _torchvision_vit() -> tuple[nn.Module, tuple]:
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    nn.init.normal_(model.heads.head.weight)  # torchvision zero-inits the head: logits would not see the fold
    return model_zoo.randomize_norms(model).eval(), (torch.randn(2, 3, 32, 32),)


def _timm_vit() -> tuple[nn.Module, tuple]:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)
    return model_zoo.randomize_norms(model).eval(), (torch.randn(2, 3, 32, 32),)


def test_torchvision_vit_folds_into_multihead_attention_and_the_head():
    model, args = _torchvision_vit()
    folded, report = FoldNormAffine()(model, args)
    assert report.skips == [] and len(report.changes) == 5
    into = {c.site: c.details["into"] for c in report.changes}
    assert into["encoder.layers.encoder_layer_0.ln_1"] == ["encoder.layers.encoder_layer_0.self_attention"]
    assert into["encoder.layers.encoder_layer_0.ln_2"] == ["encoder.layers.encoder_layer_0.mlp.0"]
    assert into["encoder.ln"] == ["heads.head"]  # through the class-token select
    _assert_exact(model, folded, args)


def test_timm_vit_folds_into_qkv_fc1_and_the_head():
    model, args = _timm_vit()
    folded, report = FoldNormAffine()(model, args)
    assert report.skips == []
    into = {c.site: c.details["into"] for c in report.changes}
    assert into == {
        "blocks.0.norm1": ["blocks.0.attn.qkv"],
        "blocks.0.norm2": ["blocks.0.mlp.fc1"],
        "blocks.1.norm1": ["blocks.1.attn.qkv"],
        "blocks.1.norm2": ["blocks.1.mlp.fc1"],
        "norm": ["head"],  # through the token select and the eval-mode head dropout
    }
    assert isinstance(folded.blocks[0].norm1, nn.LayerNorm) and folded.blocks[0].norm1.weight is None
    _assert_exact(model, folded, args)


def _gemma() -> tuple[nn.Module, tuple, dict]:
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    config = GemmaConfig(
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = GemmaForCausalLM(config).eval()
    with torch.no_grad():  # Gemma stores w with y = x * (1 + w); w = 0 is neutral, so move it off 0
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape))
    return model, (model_zoo._token_ids(128),), {"use_cache": False}


def test_gemma_offset_weight_folds_as_one_plus_w():
    model, args, kwargs = _gemma()
    folded, report = FoldNormAffine()(model, args, kwargs)
    assert report.skips == [] and len(report.changes) == 3
    assert {c.details["weight_offset"] for c in report.changes} == {1.0}
    norm = folded.model.layers[0].input_layernorm
    assert isinstance(norm, RMSNorm) and norm.weight is None and norm.casting == "gemma"
    _assert_exact(model, folded, args, kwargs)


def test_t5_folds_inside_and_refuses_the_returned_final_norm():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    model = model_zoo.randomize_norms(T5EncoderModel(config)).eval()
    args = (model_zoo._token_ids(128),)
    folded, report = FoldNormAffine()(model, args)
    assert len(report.changes) == 4
    assert _reasons(report) == {
        "encoder.final_layer_norm": "output is returned by the model, not only read by Linear layers"
    }
    _assert_exact(model, folded, args)


@pytest.mark.parametrize("build", ["llama", "gpt2"])
def test_bf16_fold_stays_within_bf16_rounding(build):
    # In bf16 the folded model rounds W diag(g) where the original rounded g * n(x): not bit-equal, so
    # it is held to the bf16 row of the tolerance table, and it must be no further from the fp32
    # model than the unfolded bf16 model is (within 1.5 dB of SQNR).
    model, args, kwargs = getattr(model_zoo, build)()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    folded, report = FoldNormAffine()(bf16, args, kwargs)
    assert report.changes
    to_original = compare_models(bf16, folded, args, kwargs)
    assert to_original.within_tolerance and to_original.worst_rel <= EXACT_TOLERANCE[torch.bfloat16]
    folded_vs_fp32 = compare_models(model, folded, args, kwargs).worst_sqnr_db
    bf16_vs_fp32 = compare_models(model, bf16, args, kwargs).worst_sqnr_db
    assert folded_vs_fp32 >= bf16_vs_fp32 - 1.5
    assert folded.lm_head.weight.dtype == torch.bfloat16


def test_pipeline_validates_the_fold_as_exact():
    model, args, kwargs = model_zoo.llama(layers=1)
    _, report = Pipeline([FoldNormAffine()])(model, args, kwargs)
    assert report.ok and report.passes[0].validation["within_tolerance"]
    assert report.passes[0].changes[0].kind.value == "exact"


def test_hand_written_norm_folds_and_functional_ones_are_refused():
    torch.manual_seed(0)
    model = model_zoo.HandWrittenNet().eval()
    args = (torch.randn(3, 16),)
    folded, report = FoldNormAffine()(model, args)
    assert [c.site for c in report.changes] == ["ln"]
    # its parameters are called gain and shift: found on the graph, not by name
    assert report.changes[0].details["removed_parameters"] == ["ln.gain", "ln.shift"]
    reasons = _reasons(report)
    assert reasons["rms"] == "output is also read by layer_norm, which is not a Linear"
    assert reasons["<root>::layer_norm"] == (
        "functional norm inside a forward, not a module: folding it needs a graph rewrite"
    )
    _assert_exact(model, folded, args)


def test_without_example_inputs_the_fx_graph_is_used():
    torch.manual_seed(0)
    model = model_zoo.HandWrittenNet().eval()
    folded, report = FoldNormAffine()(model)
    assert report.graph_method == "fx" and [c.site for c in report.changes] == ["ln"]
    _assert_exact(model, folded, (torch.randn(3, 16),))


# --- refusals ---------------------------------------------------------------------------------------


def test_bert_post_ln_norms_feed_residuals_and_are_refused():
    model, args, kwargs = model_zoo.bert()
    _, report = FoldNormAffine()(model, args, kwargs)
    assert report.changes == []
    reasons = _reasons(report)
    assert reasons["embeddings.LayerNorm"] == (
        "output is also read by add@encoder.layer.0.attention.output (BertSelfOutput), which is not a Linear"
    )
    assert reasons["encoder.layer.1.output.LayerNorm"] == (
        "output is returned by the model, not only read by Linear layers"
    )


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x)) + self.fc(x)


class _Partial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x)[..., :4])


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        return self.fc(y) + y


class _ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class _TwoNormShapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm((4, 8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x))


class _CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.ln(x)) + self.fc2(self.ln(x * 2))


class _CrossAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.ln(x)
        return self.attn(q, x, x, need_weights=False)[0]


class _Channels(nn.Module):
    """timm's LayerNorm2d over the channels of NCHW, and a BatchNorm."""

    def __init__(self) -> None:
        from timm.layers import LayerNorm2d

        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.ln2d = LayerNorm2d(8)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.ln2d(self.conv(x))))


def _weight_normed_reader() -> nn.Module:
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    nn.utils.parametrizations.weight_norm(model[1])
    return model


_CASES = [
    (_Shared, (2, 3, 8), "ln", "fc is called at 2 sites; folding would change the others"),
    (
        _Partial,
        (2, 3, 8),
        "ln",
        "output is read only in part: slice is a slice on the normalized (last) dim",
    ),
    (_Residual, (2, 3, 8), "ln", "output is also read by add, which is not a Linear"),
    (
        lambda: nn.Sequential(nn.LayerNorm(8), _ScaledLinear(8, 4)),
        (2, 8),
        "0",
        "output is read by 1 (_ScaledLinear), which overrides forward; its output is not a plain Linear of its input",
    ),
    (
        _TwoNormShapes,
        (2, 4, 8),
        "ln",
        "normalizes the trailing dims (4, 8): a Linear can absorb a gain over the last dim only",
    ),
    (_CalledTwice, (2, 8), "ln", "norm is called at 2 sites; folding needs exactly one"),
    (
        _CrossAttention,
        (2, 3, 8),
        "ln",
        "attn (MultiheadAttention) also reads input:x",
    ),
    (
        lambda: nn.Sequential(nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 4)),
        (2, 8),
        "0",
        "norm has no elementwise affine: nothing to fold",
    ),
    (
        _weight_normed_reader,
        (2, 8),
        "0",
        "1.weight is parametrized (e.g. weight norm): remove that first",
    ),
]


@pytest.mark.parametrize(("build", "shape", "site", "reason"), _CASES)
def test_illegal_folds_are_refused_with_the_reason(build, shape, site, reason):
    torch.manual_seed(0)
    model = model_zoo.randomize_norms(build()).eval()
    folded, report = FoldNormAffine()(model, (torch.randn(*shape),))
    assert report.changes == []
    assert _reasons(report)[site] == reason
    _assert_exact(model, folded, (torch.randn(*shape),))


def test_channel_norms_are_refused_with_the_reason():
    torch.manual_seed(0)
    model = model_zoo.randomize_norms(_Channels()).eval()
    _, report = FoldNormAffine()(model, (torch.randn(2, 3, 4, 5),))
    reasons = _reasons(report)
    assert reasons["ln2d"] == "normalizes dims (-3,), not the last dim (e.g. a channels-first LayerNorm2d)"
    assert reasons["bn"] == (
        "batch norm normalizes channels, not the last dim a Linear reads; "
        "BatchNorm folds into the layer before it (fold_batchnorm)"
    )


def test_training_mode_is_refused():
    model = model_zoo.randomize_norms(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4)))  # still training
    _, report = FoldNormAffine()(model, (torch.randn(2, 8),))
    assert report.changes == []
    assert _reasons(report)["0"].startswith("norm is in training mode")


def test_no_graph_means_no_fold():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it, and no inputs for export
                x = -x
            return self.fc(self.ln(x))

    model = Branchy().eval()
    _, report = FoldNormAffine()(model)
    assert report.changes == []
    assert _reasons(report)["ln"].startswith(
        "no graph captured, so the readers of the norm output are unknown"
    )


@pytest.mark.slow
def test_example_script_runs_and_is_exact():
    script = Path(__file__).resolve().parents[3] / "examples" / "fold_norm_affine.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "model.norm: gain folded into lm_head; now RMSNorm without affine" in out
    assert "loads the folded state_dict (5 norm weights left at 1): same logits" in out
    assert out.rstrip().endswith("; exact")
