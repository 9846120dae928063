"""--fold-layerscale: every LayerScale of real models folded into the layer that writes what it scales,
exactly, on inputs beyond the example; the sites it must leave alone refused with the reason; a Hugging
Face directory (whose files transformers renames as it loads) converted and loaded back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import normswap
from normswap.passes.layerscale.fold import fold_scale_into_writer

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def _random_scales(model: nn.Module) -> nn.Module:
    """Scales far from their init (1e-5 .. 0.5 in real checkpoints' configs), so a fold that drops them shows."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gamma", "lambda1", "lambda2", "layer_scale_parameter")):
                param.copy_(torch.randn(param.shape, generator=generator))
    return model.eval()


def _vit() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, init_values=0.1, num_classes=10
    )


def _convnext(conv_mlp: bool) -> nn.Module:
    from timm.models.convnext import ConvNeXt

    return ConvNeXt(
        depths=(1, 1, 1, 1), dims=(16, 32, 48, 64), ls_init_value=0.5, num_classes=10, conv_mlp=conv_mlp
    )


def _dinov2() -> nn.Module:
    config = transformers.Dinov2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    return transformers.Dinov2Model(config)


def _hf_convnext() -> nn.Module:
    config = transformers.ConvNextConfig(
        hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], layer_scale_init_value=0.5
    )
    return transformers.ConvNextModel(config)


MODELS = {
    # name: (build, example, another input shape, how many scales, what a folded module becomes)
    "timm_vit": (_vit, (2, 3, 32, 32), (3, 3, 32, 32), 4, nn.Identity),
    "timm_convnext": (lambda: _convnext(False), (2, 3, 64, 64), (1, 3, 96, 96), 4, None),
    "timm_convnext_conv_mlp": (lambda: _convnext(True), (2, 3, 64, 64), (1, 3, 96, 96), 4, None),
    "hf_dinov2": (_dinov2, (2, 3, 32, 32), (3, 3, 32, 32), 4, None),
    "hf_convnext": (_hf_convnext, (2, 3, 64, 64), (1, 3, 96, 96), 4, None),
}


def _run(model: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(pixel_values=x) if isinstance(model, transformers.PreTrainedModel) else model(x)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


@pytest.mark.parametrize("name", list(MODELS))
def test_every_layerscale_is_folded_exactly(name):
    build, example, other, scales, replaced_by = MODELS[name]
    model = _random_scales(build())
    x = torch.randn(example, generator=torch.Generator().manual_seed(0))
    hf = isinstance(model, transformers.PreTrainedModel)
    result = normswap.convert(
        model,
        normswap.ConvertConfig(fold_layerscale=True),
        *(((), {"pixel_values": x}) if hf else ((x,), {})),
    )
    assert result.ok, result.refusal
    report = result.pass_report("fold_layerscale")
    assert len(report.changes) == scales and report.skips == []
    for change in report.changes:
        owner = change.site.rpartition(".")[0]
        if replaced_by is not None:
            assert isinstance(result.model.get_submodule(owner), replaced_by)
        else:  # kept as ones: the module structure (and an HF directory's keys) unchanged
            assert torch.equal(
                result.model.get_parameter(change.site), torch.ones_like(model.get_parameter(change.site))
            )
    # exact as a function: on another batch and image size than the example
    before, after = _run(model, other), _run(result.model, other)
    assert ((before - after).abs().max() / before.abs().max()).item() < 1e-5


@pytest.mark.parametrize("name", ["timm_vit", "timm_convnext"])
def test_a_pt2_folds_each_scale_as_its_module_does(name, tmp_path: Path):
    """The same models as .pt2 programs: the scales sit on bare holders that the program reads, so each
    is folded and left as ones (dropping its holder crashed the run), exact on new values."""
    build, example, _, scales, _ = MODELS[name]
    model = _random_scales(build())
    x = torch.randn(example, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    result = normswap.convert(
        normswap.load_model(str(path)).model, normswap.ConvertConfig(fold_layerscale=True), (x,)
    )
    assert result.ok, result.refusal
    report = result.pass_report("fold_layerscale")
    assert len(report.changes) == scales and report.skips == []
    for change in report.changes:
        assert torch.equal(
            result.model.get_parameter(change.site), torch.ones_like(model.get_parameter(change.site))
        )
    before, after = _run(model, example), _run(result.model, example)
    assert ((before - after).abs().max() / before.abs().max()).item() < 1e-5


def test_the_fold_is_the_scaled_layer_in_float64():
    weight, bias, scale = torch.randn(5, 3), torch.randn(5), torch.randn(5)
    new_weight, new_bias = fold_scale_into_writer(weight, bias, scale)
    x = torch.randn(4, 3)
    assert torch.allclose(x @ new_weight.T + new_bias, scale * (x @ weight.T + bias), atol=1e-6)
    conv = torch.randn(5, 2, 3, 3)
    assert torch.equal(
        fold_scale_into_writer(conv, None, scale)[0],
        (conv.double() * scale.double().reshape(5, 1, 1, 1)).float(),
    )


class _ScaleReadTwice(nn.Module):
    """A scaled branch whose layer output is also read before the scale: folding would change that read."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.gamma = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return x + self.gamma * y + y.relu()


class _SharedScale(nn.Module):
    """One scale vector used by two branches."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.gamma = nn.Linear(8, 8), nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.a(x) + self.gamma * self.b(x)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (_ScaleReadTwice(), "the scaled value is read by something else too"),
        (_SharedScale(), "the scale is read elsewhere too"),
    ],
)
def test_a_scale_that_cannot_move_is_refused_with_the_reason(model, reason):
    result = normswap.convert(
        model.eval(), normswap.ConvertConfig(fold_layerscale=True), (torch.randn(2, 8),)
    )
    report = result.pass_report("fold_layerscale")
    assert result.ok and report.changes == []
    assert report.skips and all(reason in skip.reason for skip in report.skips)
    assert torch.equal(result.model.gamma, model.gamma)


def test_a_norms_weight_is_no_candidate():
    """A Llama's RMSNorm multiplies by its weight: not a LayerScale, not listed as a skip either."""
    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=64,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    result = normswap.convert(
        model, normswap.ConvertConfig(fold_layerscale=True), (), {"input_ids": torch.randint(0, 64, (1, 8))}
    )
    report = result.pass_report("fold_layerscale")
    assert report.changes == [] and report.skips == []
    assert any("nothing to change: no site to rewrite" in note for note in result.notes)


def test_a_directory_whose_keys_transformers_renames_is_folded_and_loads_back(tmp_path: Path):
    """Dinov2's files store attention.attention.key where the module has k_proj: the directory is read,
    converted in memory (a stream edits stored tensors by the model's names) and loads back as saved."""
    model = _random_scales(_dinov2())
    model.save_pretrained(tmp_path / "dinov2")
    out = tmp_path / "folded"
    result = normswap.convert(tmp_path / "dinov2", normswap.ConvertConfig(fold_layerscale=True, output=out))
    assert result.ok and result.route == "in memory" and result.changes == 4
    assert any("store tensors under other names than the model's" in note for note in result.notes)
    normswap.save(result)
    back = transformers.Dinov2Model.from_pretrained(out).eval()
    before, after = _run(model, (1, 3, 32, 32)), _run(back, (1, 3, 32, 32))
    assert ((before - after).abs().max() / before.abs().max()).item() < 1e-5
    # a rewrite that streams goes in memory for these files too, and says why
    folded = normswap.convert(
        tmp_path / "dinov2", normswap.ConvertConfig(fold_norm_affine=True, output=tmp_path / "affine")
    )
    assert folded.ok and folded.route == "in memory"
    assert any("store tensors under other names than the model's" in note for note in folded.notes)


def _convnext_directory(root: Path) -> tuple[Path, nn.Module]:
    config = transformers.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 2], num_stages=2, image_size=64)
    model = _random_scales(transformers.ConvNextModel(config)).eval()
    model.save_pretrained(root / "convnext", max_shard_size="50KB")
    return root / "convnext", model


def test_a_directory_streams_each_scale_folded_and_verified_and_loads_back(tmp_path: Path):
    source, model = _convnext_directory(tmp_path)
    out = tmp_path / "folded"
    result = normswap.convert(source, normswap.ConvertConfig(fold_layerscale=True, output=out))
    assert result.ok and result.route == "streamed" and result.changes == 3  # one scale per block
    back = transformers.ConvNextModel.from_pretrained(out).eval()
    scales = {k: v for k, v in back.state_dict().items() if k.endswith("layer_scale_parameter")}
    assert len(scales) == 3 and all(torch.equal(v, torch.ones_like(v)) for v in scales.values())
    for shape in ((1, 3, 64, 64), (2, 3, 48, 80)):  # the checked size and another
        before, after = _run(model, shape), _run(back, shape)
        assert ((before - after).abs().max() / before.abs().max()).item() < 1e-5


def test_a_wrong_streamed_fold_is_caught_by_its_check_and_nothing_is_written(tmp_path: Path, monkeypatch):
    import normswap.passes.layerscale.fold as layerscale_fold

    source, _ = _convnext_directory(tmp_path)

    def off_by_a_little(weight, bias, scale):
        return fold_scale_into_writer(weight, bias, scale * (1 + 1e-3))

    monkeypatch.setattr(layerscale_fold, "fold_scale_into_writer", off_by_a_little)
    result = normswap.convert(source, normswap.ConvertConfig(fold_layerscale=True, output=tmp_path / "out"))
    assert not result.ok and result.verdict is normswap.Verdict.EXACT_FAILURE
    assert result.refusal.startswith(
        "verification: encoder.stages.0.layers.0.layer_scale_parameter -> encoder.stages.0.layers.0.pwconv2 "
        "as written is outside the exact tolerance"
    )
    assert result.refusal.endswith("nothing written")
    assert [p.name for p in tmp_path.iterdir()] == ["convnext"]  # no output, no temporary sibling
