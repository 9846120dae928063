"""convert --to cosine: Linear/Conv layers become cosine layers (normswap.passes.swap.cosine_layers), on models
nobody here wrote (HF Wav2Vec2 and BERT from small configs, torchvision resnet18 and mobilenet_v3_small)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normswap
from normswap.modules.cosine import CosineConv, CosineLinear, feature_rows, fit_cosine_scale
from normswap.passes import CosineLayers
from normswap.verify.metrics import sqnr_db

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")


def _wav2vec2() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), feat_extract_norm="layer",
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    model = transformers.Wav2Vec2Model(config).eval()
    return model, (torch.randn(2, 400),)


def _resnet18() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    with torch.no_grad():  # trained-like statistics, so BatchNorm is not near the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 32, 32),)


def _ln_outputs(model: nn.Module, args: tuple) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    lns = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    handles = [m.register_forward_hook(lambda _m, _a, out: seen.append(out.detach())) for m in lns]
    with torch.no_grad():
        model(*args)
    for h in handles:
        h.remove()
    return seen


def test_cosine_identity_reproduces_the_layer():
    """y = ||x~|| ||w~_j|| cos_j exactly, with and without bias, Linear and Conv2d (padding, stride)."""
    torch.manual_seed(0)
    x, img = torch.randn(7, 13, dtype=torch.float64), torch.randn(2, 3, 9, 9, dtype=torch.float64)
    for bias in (True, False):
        lin = nn.Linear(13, 5, bias=bias).double()
        cos = CosineLinear(13, 5, bias=bias).double()
        conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=bias).double()
        ccos = CosineConv(3, 4, (3, 3), (2, 2), (1, 1), (1, 1), bias=bias).double()
        with torch.no_grad():
            for old, new in ((lin, cos), (conv, ccos)):
                new.weight.copy_(old.weight)
                if bias:
                    new.bias.copy_(old.bias)
                new.scale.copy_(new.weight_norms())
            torch.testing.assert_close(cos(x) * cos.input_norms(x), lin(x), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ccos(img) * ccos.input_norms(img), conv(img), rtol=1e-12, atol=1e-12)


def test_wav2vec2_conv_feeding_layernorm_is_lossless_up_to_eps():
    """Wav2Vec2's feature encoder (feat_extract_norm="layer"): conv (no bias) -> LayerNorm over channels.
    The per-position factor cancels in the LayerNorm: its outputs within 2e-5 x max of the original."""
    model, args = _wav2vec2()
    converted, report = CosineLayers()(model, args)
    changed = {c.site: c for c in report.changes}
    convs = [f"feature_extractor.conv_layers.{i}.conv" for i in range(2)]
    assert set(changed) == set(convs)
    for site in convs:
        assert changed[site].details["fit"] == "shared factor"
        assert changed[site].details["reader_sqnr_db"] > 80
    for ref, got in zip(_ln_outputs(model, args)[:2], _ln_outputs(converted, args)[:2], strict=True):
        assert float((ref - got).abs().max()) <= 2e-5 * float(ref.abs().max())
    reasons = {s.site: s.reason for s in report.skips}
    assert "reaches add, not only norms" in reasons["encoder.layers.0.attention.out_proj"]
    assert "parametrization" in reasons["encoder.pos_conv_embed.conv"]


def test_least_squares_scale_is_the_optimum_on_resnet18_and_whole_model_sqnr_is_reported():
    """BatchNorm in eval is a per-channel affine: the per-position factor survives, the fit is per output,
    and perturbing any fitted scale increases the error; the reported whole-model SQNR is the one
    computed here."""
    model, args = _resnet18()
    result = normswap.convert(model, normswap.ConvertConfig(to="cosine"), args)
    report = result.pass_report("cosine_layers")
    assert len(report.changes) == 20  # every conv reads into a BatchNorm; fc is the model's output
    assert all(c.details["fit"] == "per output" for c in report.changes)
    assert [s.site for s in report.skips] == ["fc"]
    with torch.no_grad():
        expected = sqnr_db(model(*args), result.model(*args))
    assert result.report.overall.worst_sqnr_db == pytest.approx(expected, abs=1e-6)
    # the fit at conv1, on conv1's input
    layer, new = model.conv1, result.model.conv1
    x = args[0]
    with torch.no_grad():
        cos, want = feature_rows(new.cosine(x), True).double(), feature_rows(layer(x), True).double()
    scale = new.scale.detach().double()

    def error(s: torch.Tensor) -> float:
        return float(((cos * s - want) ** 2).sum())

    best = error(scale)
    torch.manual_seed(1)
    for j in torch.randperm(scale.numel())[:8].tolist():
        for step in (1e-3, -1e-3):
            moved = scale.clone()
            moved[j] *= 1 + step
            assert error(moved) > best
    assert error(scale * 1.001) > best and error(scale * 0.999) > best


def test_shared_factor_is_the_least_squares_optimum_within_its_family():
    torch.manual_seed(0)
    cos, base = torch.randn(200, 6, dtype=torch.float64), torch.rand(6, dtype=torch.float64) + 0.5
    want = cos * base * (2 + 0.3 * torch.randn(200, 1, dtype=torch.float64))
    shared = fit_cosine_scale(cos, want, base)
    k = float(shared[0] / base[0])
    torch.testing.assert_close(shared, k * base)

    def error(factor: float) -> float:
        return float(((cos * base * factor - want) ** 2).sum())

    assert error(k) < error(k * 1.001) and error(k) < error(k * 0.999)


def test_refusals_say_why():
    model, args = _wav2vec2()
    _, report = CosineLayers(["nothing.*", "feature_projection.projection"])(model, args)
    reasons = {s.site: s.reason for s in report.skips}
    assert reasons["nothing.*"] == "--layers pattern 'nothing.*' matches no Linear or Conv1d/2d/3d module"
    assert [c.site for c in report.changes] == ["feature_projection.projection"]  # named: taken anyway
    torch.manual_seed(0)
    mobile = torchvision.models.mobilenet_v3_small(num_classes=10).eval()
    _, report = CosineLayers(["features.1.block.0.0"])(mobile, (torch.randn(1, 3, 32, 32),))
    assert report.skips[0].reason.startswith("grouped conv (groups=16)")
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37
        )
    ).eval()
    _, report = CosineLayers()(bert, (torch.randint(0, 50, (2, 7)),))
    reasons = {s.site: s.reason for s in report.skips}
    # the prediction head's dense -> GELU -> LayerNorm: GELU does not commute with a positive factor
    assert "reaches gelu, not only norms" in reasons["cls.predictions.transform.dense"]
    assert "reaches add, not only norms" in reasons["bert.encoder.layer.0.output.dense"]
    assert not report.changes


def test_config_refusals():
    with pytest.raises(normswap.errors.BadInputError, match="--layers picks the layers --to cosine converts"):
        normswap.ConvertConfig(to="dyt", layers=["a"]).validate()
    with pytest.raises(normswap.errors.CheckFailedError, match="cosine_layers is architectural"):
        normswap.ConvertConfig(to="cosine", exact=True).validate()


def test_calibration_refits_the_scales_and_onnx_export(tmp_path):
    model, args = _wav2vec2()
    torch.manual_seed(2)
    batches = [(torch.randn(2, 400),) for _ in range(3)]
    config = normswap.ConvertConfig(
        to="cosine", layers="feature_projection.projection", calibration_data=batches
    )
    result = normswap.convert(model, config, args)
    fit = result.calibration.fit
    assert [s.site for s in fit.sites] == ["feature_projection.projection"]
    assert fit.sites[0].sqnr_after_db >= fit.sites[0].sqnr_before_db - 1e-9  # least squares on that data
    from normswap.export.onnx import export_onnx

    pytest.importorskip("onnxruntime")
    export_onnx(result.model, tmp_path / "w.onnx", args, opset=18)  # raises unless onnxruntime agrees


def test_distill_repairs_a_cosine_model():
    """The scales and every other parameter train like any other: distillation moves the cosine resnet18
    back towards the original on held-out data."""
    from normswap.calibrate.distill import distill

    model, args = _resnet18()
    student = normswap.convert(model, normswap.ConvertConfig(to="cosine"), args).model
    g = torch.Generator().manual_seed(4)
    data = [torch.randn(8, 3, 32, 32, generator=g) for _ in range(4)]
    distilled, report = distill(model, student, data, steps=15, lr=1e-4)
    # measured: held-out SQNR 8.7 dB -> 14.0 dB
    assert report.ok and report.sqnr_after_db > report.sqnr_before_db + 3.0, report.to_dict()
    scales = [m.scale for m in distilled.modules() if isinstance(m, CosineConv)]
    originals = [m.scale for m in student.modules() if isinstance(m, CosineConv)]
    assert len(scales) == 20 and any(not torch.equal(a, b) for a, b in zip(scales, originals, strict=True))


class _LinearNorm(nn.Module):
    """Linear -> LayerNorm over its features (``swap``: over the tokens instead, after a transpose)."""

    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.swap = swap
        self.fc, self.norm, self.unused = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.norm(h.transpose(1, 2) if self.swap else h)


def _norm_output_rel(model: nn.Module, converted: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        want, got = model(x).float(), converted(x).float()
    return float((want - got).abs().max() / want.abs().max())


def test_calibration_keeps_the_shared_factor_in_half_precision():
    """A Linear -> LayerNorm is lossless with one factor times the weight norms; calibration must refit
    that form, also in bf16, where a stored scale no longer shows the form exactly."""
    torch.manual_seed(0)
    model = _LinearNorm().to(torch.bfloat16).eval()
    x = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    batches = [(torch.randn(2, 16, 16, dtype=torch.bfloat16),) for _ in range(3)]
    plain = normswap.convert(model, normswap.ConvertConfig(to="cosine", layers="fc"), (x,))
    calibrated = normswap.convert(
        model, normswap.ConvertConfig(to="cosine", layers="fc", calibration_data=batches), (x,)
    )
    assert plain.model.fc.shared_scale and calibrated.model.fc.shared_scale
    assert calibrated.calibration.fit.sites[0].note == "shared factor"
    # bf16's own rounding, not a per-output misfit (measured before the fix: 3.8e-2 after calibration)
    assert _norm_output_rel(model, calibrated.model, x) < 2e-2
    assert _norm_output_rel(model, calibrated.model, x) <= 1.5 * _norm_output_rel(model, plain.model, x)


def test_a_norm_over_another_dim_gets_the_per_output_fit_and_unrun_layers_are_left():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 16)
    _, report = CosineLayers()(_LinearNorm(swap=True).eval(), (x,))
    change = {c.site: c for c in report.changes}["fc"]
    assert change.details["fit"] == "per output" and not change.details["scale_invariant_readers"]
    _, report = CosineLayers()(_LinearNorm().eval(), (x,))
    assert {c.site: c for c in report.changes}["fc"].details["fit"] == "shared factor"
    reasons = {s.site: s.reason for s in report.skips}
    assert reasons["unused"].startswith("it does not run on the example inputs, so what reads it is unknown")


def test_half_precision_norms_do_not_overflow():
    layer = CosineLinear(4096, 8).to(torch.float16)
    x = torch.randn(2, 4096, dtype=torch.float16) * 5  # sum of squares ~1e5: beyond fp16's 65504
    reference = CosineLinear(4096, 8)
    reference.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    got = layer(x)
    assert got.dtype == torch.float16 and torch.isfinite(layer.input_norms(x)).all()
    torch.testing.assert_close(got.float(), reference(x.float()), rtol=2e-2, atol=2e-3)
