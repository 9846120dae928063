"""``--to derf``: Dynamic erf (``erf(alpha x + s) * w + b`` per feature) in place of the norms of models
nobody here wrote, calibrated back with its scalars fitted, and exported to ONNX as the standard Erf op."""

from __future__ import annotations

import torch
import torchvision
import transformers
from torch import nn

import normswap
from normswap.api import ConvertConfig
from normswap.export.onnx import export_onnx
from normswap.modules.layout import Derf


def _gpt2() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model, {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))}


def test_derf_computes_erf_of_an_affine_scalar_map_per_feature_in_both_layouts():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 4)
    last = Derf(4, alpha=0.7, shift=0.2, dim=-1)
    first = Derf(3, alpha=1.3, shift=-0.4, dim=1)
    with torch.no_grad():
        for norm in (last, first):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-1, 1)
        torch.testing.assert_close(last(x), torch.erf(0.7 * x + 0.2) * last.weight + last.bias)
        want = torch.erf(1.3 * x - 0.4) * first.weight[:, None, None] + first.bias[:, None, None]
        torch.testing.assert_close(first(x), want)


def test_gpt2_layernorms_become_derf_keep_their_affine_and_calibration_fits_alpha_and_shift():
    model, kwargs = _gpt2()
    data = [
        {"input_ids": torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(s))}
        for s in (2, 3)
    ]
    plain = normswap.convert(model, ConvertConfig(to="derf"), None, kwargs)
    result = normswap.convert(model, ConvertConfig(to="derf", calibration_data=data), None, kwargs)
    layernorms = [p for p, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    derfs = {p: m for p, m in plain.model.named_modules() if isinstance(m, Derf)}
    assert sorted(derfs) == sorted(layernorms) == sorted(c.site for c in plain.report.passes[0].changes)
    ln = model.transformer.h[0].ln_1
    assert torch.equal(derfs["transformer.h.0.ln_1"].weight, ln.weight)
    assert torch.equal(derfs["transformer.h.0.ln_1"].bias, ln.bias)
    # the calibration fits every Derf's alpha and shift (no shift stays at its start) and moves the model
    # closer to the original at every site and as a whole
    fits = result.calibration.fit.sites
    assert len(fits) == len(layernorms) and all(f.shift is not None and f.shift != 0.0 for f in fits)
    assert all(f.sqnr_after_db > f.sqnr_before_db for f in fits)
    report = result.calibration.fit
    assert report.model_sqnr_after_db > report.model_sqnr_before_db + 3
    fitted = result.model.get_submodule(fits[0].site)
    assert (float(fitted.alpha), float(fitted.shift)) == (fits[0].alpha, fits[0].shift)


def test_resnet18_batchnorms_become_derf_per_channel():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    x = torch.rand(2, 3, 64, 64)
    result = normswap.convert(model, ConvertConfig(to="derf"), (x,))
    new = result.model.layer1[0].bn1
    assert isinstance(new, Derf) and new.dim == 1
    assert torch.equal(new.weight, model.layer1[0].bn1.weight)
    assert len(result.report.passes[0].changes) == 20 and result.model(x).shape == (2, 10)


def test_a_derf_model_exports_to_onnx_as_erf_and_runs_in_onnxruntime(tmp_path):
    model, kwargs = _gpt2()
    result = normswap.convert(model, ConvertConfig(to="derf"), None, kwargs)
    with torch.no_grad():
        for module in result.model.modules():
            if isinstance(module, Derf):  # scalars off their defaults, as a calibrated model has them
                module.alpha.fill_(0.9)
                module.shift.fill_(0.15)
    exported = export_onnx(result.model, tmp_path / "derf.onnx", (), kwargs)
    derfs = sum(isinstance(m, Derf) for m in result.model.modules())
    assert exported.op_counts.get("Erf", 0) >= derfs == 5
    assert "LayerNormalization" not in exported.op_counts
    assert exported.within_tolerance and exported.outputs
