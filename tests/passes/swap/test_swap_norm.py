"""swap_norm: architectural swaps that carry every parameter over and measure what they moved."""

from __future__ import annotations

import math

import model_zoo
import pytest
import torch
from torch import nn

from normswap.modules import LayerNorm, RMSNorm
from normswap.passes import Pipeline, SwapNorm
from normswap.verify import compare_models


def test_gpt2_layernorm_to_rmsnorm_runs_and_reports_divergence():
    model, args, kwargs = model_zoo.gpt2()
    swapped, report = Pipeline([SwapNorm("rmsnorm")])(model, args, kwargs)
    changes = report.passes[0].changes
    assert [c.site for c in changes] == [
        "transformer.h.0.ln_1",
        "transformer.h.0.ln_2",
        "transformer.h.1.ln_1",
        "transformer.h.1.ln_2",
        "transformer.ln_f",
    ]
    assert all(c.kind.value == "architectural" for c in changes)
    for change in changes:
        assert math.isfinite(change.details["site_sqnr_db"]) and change.details["site_sqnr_db"] > 0
    new, old = swapped.transformer.h[0].ln_1, model.transformer.h[0].ln_1
    assert isinstance(new, RMSNorm) and new.eps == old.eps
    torch.testing.assert_close(new.weight, old.weight, rtol=0, atol=0)
    torch.testing.assert_close(new.bias, old.bias, rtol=0, atol=0)  # LN bias kept as an RMSNorm bias
    overall = report.overall.outputs[0]
    assert overall.name == "output.logits"
    assert 0 < overall.sqnr_db < 80 and 0 < overall.cosine < 1  # it moved, measurably, and is reported
    assert report.ok  # architectural changes are measured, not failed
    # the swapped model is a working GPT-2 that still generates logits of the same shape
    assert swapped(*args, **kwargs).logits.shape == model(*args, **kwargs).logits.shape
    assert isinstance(model.transformer.h[0].ln_1, nn.LayerNorm)  # input not mutated


def test_swap_is_exact_for_centered_inputs_site_by_site():
    # RMSNorm(x) == LayerNorm(x) when x has zero mean over the normalized dim: the per-site figure
    # must then say the swap changed nothing there.
    class Centered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(16, eps=1e-6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ln(x - x.mean(-1, keepdim=True))

    model = model_zoo.randomize_norms(Centered())
    _, report = SwapNorm("rmsnorm")(model, (torch.randn(4, 16),))
    assert report.changes[0].details["site_sqnr_db"] > 100


def test_llama_rmsnorm_to_layernorm_keeps_casting_and_weights():
    model, args, kwargs = model_zoo.llama()
    swapped, report = SwapNorm("layernorm")(model, args, kwargs)
    assert len(report.changes) == 5 and report.skips == []
    new = swapped.model.layers[0].input_layernorm
    assert isinstance(new, LayerNorm) and new.bias is None and new.casting == "llama"
    torch.testing.assert_close(new.weight, model.model.layers[0].input_layernorm.weight, rtol=0, atol=0)
    assert compare_models(model, swapped, args, kwargs).worst_sqnr_db < 80


def test_gemma_offset_weights_keep_their_meaning():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    norm = GemmaRMSNorm(16)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(3, 16)
    swapped, _ = SwapNorm("layernorm")(nn.Sequential(norm), (x,))
    new = swapped[0]
    assert (new.casting, new.weight_offset) == ("gemma", 1.0)
    # LayerNorm of centered input == RMSNorm of it: the offset weight must give Gemma's output
    xc = x - x.mean(-1, keepdim=True)
    torch.testing.assert_close(new(xc), norm(xc), rtol=1e-5, atol=1e-5)


def test_layernorm2d_and_batchnorm_map_to_a_norm_over_the_channels():
    model, args, _ = model_zoo.convnext_tiny()
    swapped, report = SwapNorm("rmsnorm")(model, args)
    assert report.skips == [] and len(report.changes) == 23
    stem = swapped.get_submodule("stem.1")
    assert type(stem).__name__ == "FeatureLayerNorm" and stem.dim == 1 and stem.rms
    bn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    swapped, report = SwapNorm("layernorm")(bn, (torch.randn(1, 3, 5, 5),))
    assert report.changes[0].description == "BatchNorm2d -> FeatureLayerNorm"
    assert swapped[1].dim == 1 and not swapped[1].rms


def test_inline_norms_are_skipped_not_silently_ignored():
    _, report = SwapNorm("rmsnorm")(model_zoo.HandWrittenNet(), (torch.randn(2, 16),))
    reasons = {s.site: s.reason for s in report.skips}
    assert reasons["<root>::layer_norm"].startswith("functional norm computed inside a forward")
    assert {c.site for c in report.changes} == {"ln"}


def test_unknown_target_is_a_value_error():
    with pytest.raises(ValueError, match="unknown norm target 'batchnorm2d'"):
        SwapNorm("batchnorm2d")
