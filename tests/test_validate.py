"""normswap validate: per-output figures, per-layer divergence, the first divergent layer, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import model_zoo
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.passes import FoldBatchNorm, Pipeline, RecenterLayerNorm, SwapNorm
from normswap.verify.layerwise import validate_models

ZOO = str(Path(model_zoo.__file__))


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_first_divergent_layer_is_the_first_swapped_norm():
    model, args, kwargs = model_zoo.small_vit()
    converted, _ = Pipeline([SwapNorm("batchnorm")])(model, args, kwargs)
    norms = [p for p, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    report = validate_models(model, converted, [(args, kwargs)], norm_paths=norms)
    assert report.first_divergent == "encoder.layers.encoder_layer_0.ln_1"
    before = report.layers[: [x.path for x in report.layers].index(report.first_divergent)]
    assert before and all(x.sqnr_db == float("inf") for x in before)  # conv_proj, dropout...: untouched
    assert [x.path for x in report.norm_sites] == norms  # execution order of the ViT
    assert report.norm_sites[0].converted_class == "FeatureBatchNorm"
    assert all(x.sqnr_db < 40 for x in report.norm_sites)
    out = report.outputs[0]
    assert out.comparison.shape == (2, 10) and out.top5_agreement is not None
    assert not report.passed  # below the default 40 dB


def test_an_exact_fold_passes_and_a_recentered_stream_is_exact_at_the_output_only():
    model, args, kwargs = model_zoo.resnet18(size=32)
    folded, _ = FoldBatchNorm()(model, args, kwargs)
    report = validate_models(model, folded, [(args, kwargs)], exact=True)
    assert report.passed and report.outputs[0].comparison.max_rel <= 1e-5
    assert report.first_divergent is None or report.first_divergent.startswith(("conv1", "bn1"))
    # recentering changes the residual stream itself; only the LayerNorm outputs and logits must agree
    model, args, kwargs = model_zoo.gpt2()
    converted, _ = RecenterLayerNorm()(model, args, kwargs)
    report = validate_models(model, converted, [(args, kwargs)], exact=True)
    assert report.passed
    assert report.first_divergent == "transformer.wte"
    ln_f = next(x for x in report.layers if x.path == "transformer.ln_f")
    assert ln_f.max_rel <= 1e-5 and ln_f.converted_class == "RMSNorm"


def test_cli_reports_plots_and_fails_an_exact_check_with_the_layer(tmp_path):
    converted = tmp_path / "bert_dyt.pt"
    assert _run("convert", f"{ZOO}:bert_factory", "--to", "dyt", "-o", str(converted)).exit_code == 0
    plot, report = tmp_path / "div.png", tmp_path / "v.json"
    result = _run(
        "validate", f"{ZOO}:bert_factory", str(converted), "--trust-pickle", "--plot", str(plot), "--report",
        str(report),
    )  # fmt: skip
    assert result.exit_code == 0, result.output  # a report, not a check
    assert "first divergent past 40 dB: embeddings.LayerNorm (LayerNorm -> DyT" in result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(report.read_text())
    assert data["first_divergent"] == "embeddings.LayerNorm" and len(data["layers"]) >= 40
    result = _run("validate", f"{ZOO}:bert_factory", str(converted), "--trust-pickle", "--exact")
    assert result.exit_code == 1
    # the reason of the one exact rule (normswap.verify.exact), then where the layers part ways
    assert "outputs are not within the exact tolerance: output" in result.output
    assert "x max|ref|, tolerance 1e-05) on the inputs; against the model in fp64" in result.output
    assert "; first divergent layer: embeddings.LayerNorm" in result.output
    result = _run("validate", f"{ZOO}:bert_factory", str(converted), "--trust-pickle", "--min-sqnr", "0.1")
    assert result.exit_code == 0, result.output


def test_cli_batches_from_data_and_usage_errors(tmp_path):
    data = tmp_path / "x.pt"
    torch.save(torch.randn(12, 3, 32, 32), data)
    folded = tmp_path / "folded.pt2"
    assert _run("convert", f"{ZOO}:resnet18_factory", "--fold-bn", "-o", str(folded)).exit_code == 0
    result = _run(
        "validate",
        f"{ZOO}:resnet18_factory",
        str(folded),
        "--data",
        str(data),
        "--batch-size",
        "2",
        "--exact",
    )
    assert result.exit_code == 0, result.output
    assert "Outputs (6 batches)" in result.output and "PASS" in result.output
    # more batches asked for than the data holds: all compared, and said
    result = _run(
        "validate", f"{ZOO}:resnet18_factory", str(folded), "--data", str(data), "--batch-size", "4",
        "--batches", "5", "--exact",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Outputs (3 batches)" in result.output
    assert f"5 batches were asked for (--batches); --data {data} holds 3, and all of them were compared" in (
        " ".join(result.output.split())
    )
    result = _run("validate", f"{ZOO}:resnet18_factory", str(folded), "--plot", str(tmp_path / "x.svg"))
    assert result.exit_code == 2 and "the plot is a PNG file" in result.output
    result = _run("validate", f"{ZOO}:resnet18_factory", f"{ZOO}:gpt2_factory")
    assert result.exit_code == 2
    assert "cannot compare: the converted model fails on these inputs: RuntimeError" in result.output


def test_a_pt2_of_channel_norms_compares_in_its_layout(tmp_path):
    import math

    from normswap.load import save_model
    from normswap.load.model_file import load_model

    model, args, kwargs = model_zoo.convnext_tiny()
    save_model(model, tmp_path / "c.pt2", args, kwargs)
    loaded = load_model(str(tmp_path / "c.pt2")).model
    report = validate_models(model, loaded, [(args, kwargs)], norm_paths=["stem.1"])
    stem = next(layer for layer in report.layers if layer.path == "stem.1")
    # the .pt2's LayerNorm2d (permute, layer_norm, permute back) is lifted whole: NCHW in and out as the
    # model's, compared as it is
    assert stem.converted_class == "ChannelLayerNorm" and stem.sqnr_db > 100
    # its plain containers (stem, stages.0, ...) are never called by the flat graph: not compared
    assert all(not math.isnan(layer.sqnr_db) for layer in report.layers)
    assert report.first_divergent is None
