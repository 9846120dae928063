"""Weight norm added or removed, streamed from a Hugging Face model directory (wav2vec2, whose config
builds its positional conv with weight norm): the same tensors as the in-memory route, each layer checked
against the original, and nothing written when a layer's values refuse it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_dirs import convert_in_memory, stream, wav2vec2_config
from hf_dirs import stored_tensors as _tensors
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.api import ConvertConfig, convert
from normswap.errors import CheckFailedError
from normswap.load import load_model

runner = CliRunner()
POS_CONV = "wav2vec2.encoder.pos_conv_embed.conv"


def _wav2vec2(tmp_path: Path, zero_row: str | None = None) -> tuple[Path, torch.nn.Module]:
    config = wav2vec2_config(vocab_size=20)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config).eval()
    if zero_row is not None:
        with torch.no_grad():
            model.get_submodule(zero_row).weight[3].zero_()
    model.save_pretrained(tmp_path / "w2v", max_shard_size="30KB")
    return tmp_path / "w2v", model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    audio = torch.randn(2, 800, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_values=audio).logits.double()


@pytest.mark.parametrize(
    "options",
    [
        {"remove_weight_norm": True},
        {"add_weight_norm": "all"},
        {
            "add_weight_norm": "lm_head,wav2vec2.feature_extractor.conv_layers.1.conv",
            "weight_norm_dim": "none",
        },
    ],
    ids=["remove", "add-all", "add-two-whole-tensor"],
)
def test_the_streamed_weight_norm_writes_what_the_in_memory_route_writes(tmp_path, options):
    source, model = _wav2vec2(tmp_path)
    assert len(list(source.glob("*.safetensors"))) > 1
    streamed = stream(source, tmp_path / "streamed", **options)
    result = convert_in_memory(source, options, tmp_path / "memory")

    ours, theirs = _tensors(tmp_path / "streamed"), _tensors(tmp_path / "memory")
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    memory_report = result.report.passes[0]
    assert [c.site for c in streamed.report.changes] == [c.site for c in memory_report.changes]
    assert [(s.site, s.reason) for s in streamed.report.skips] == [
        (s.site, s.reason) for s in memory_report.skips
    ]
    record = json.loads((tmp_path / "streamed" / "normswap.json").read_text())["modules"]
    assert record == json.loads((tmp_path / "memory" / "normswap.json").read_text())["modules"]
    # every rewritten layer was run against the original, within fp32's exact tolerance
    assert len(streamed.fold_checks) == len(streamed.report.changes) >= 1
    assert all(c.within_tolerance for c in streamed.fold_checks)
    back = load_model(str(tmp_path / "streamed")).model
    want, got = _logits(model), _logits(back)
    assert float((want - got).abs().max() / want.abs().max()) <= 1e-5
    if "remove_weight_norm" in options:
        assert f"{POS_CONV}.weight" in ours and not any("parametrizations" in k for k in ours)
        assert type(back.get_submodule(POS_CONV)) is torch.nn.Conv1d
    else:
        assert "lm_head.parametrizations.weight.original0" in ours and "lm_head.weight" not in ours
        assert type(back.lm_head).__name__ == "ParametrizedLinear"


def test_an_all_zero_slice_stops_the_stream_and_nothing_is_written(tmp_path):
    source, _ = _wav2vec2(tmp_path, zero_row="lm_head")
    with pytest.raises(
        CheckFailedError,
        match=r"--add-weight-norm: lm_head: 1 of 20 slices along dim 0 are all zeros: v / \|\|v\|\| would divide "
        r"by zero; nothing written",
    ):
        stream(source, tmp_path / "out", add_weight_norm="lm_head")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w2v"]
    # in memory the same layer is skipped with the same reason
    loaded = load_model(str(source))
    result = convert(
        loaded.model, ConvertConfig(add_weight_norm="lm_head"), loaded.example_args, loaded.example_kwargs
    )
    assert [s.reason for s in result.report.passes[0].skips] == [
        "1 of 20 slices along dim 0 are all zeros: v / ||v|| would divide by zero"
    ]


def test_the_cli_streams_weight_norm_removal(tmp_path):
    source, model = _wav2vec2(tmp_path)
    result = runner.invoke(app, ["convert", str(source), "--remove-weight-norm", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "remove_weight_norm (exact, streamed): 1 changed, 0 skipped" in result.output
    assert "verified 1 rewritten layers against the originals" in result.output
    assert "converting in memory" not in result.output
    back = load_model(str(tmp_path / "out")).model
    want, got = _logits(model), _logits(back)
    assert float((want - got).abs().max() / want.abs().max()) <= 1e-5
