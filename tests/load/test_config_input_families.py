"""Inputs from the config for the families whose forward wants more than token ids or images (issue 30):
encoder-decoders get decoder token ids (T5, BART, Whisper), speech models their log-mel features
(Whisper's fixed frame count), and a directory whose config says too little takes the user's inputs by
the forward's own keywords instead of refusing them with the sentence that asks for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from normswap_cli.app import app
from typer.testing import CliRunner


def _whisper() -> torch.nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=96, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> torch.nn.Module:
    config = transformers.BartConfig(
        vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


FAMILIES = {"whisper": _whisper, "t5": _t5, "bart": _bart}


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    made = {}
    for name, build in FAMILIES.items():
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():  # norms away from their init, so that a fold has something to move
            for module_name, p in model.named_parameters():
                if "norm" in module_name.lower() and p.ndim == 1:
                    p.uniform_(0.75, 1.25)
        model.save_pretrained(root / name)
        made[name] = root / name
    return made


def _run(args: list[str], report: Path | None = None) -> tuple[int, str, dict]:
    ran = CliRunner().invoke(app, [*args, *(["--report", str(report)] if report else [])])
    assert ran.exit_code != 3, ran.output  # an internal error: a bug, whatever the input
    data = json.loads(report.read_text()) if report is not None and report.exists() else {}
    return ran.exit_code, " ".join(ran.output.split()), data


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_encoder_decoders_go_through_inspect_convert_and_export(tmp_path: Path, directories, name):
    source = str(directories[name])
    code, text, _ = _run(["inspect", source])
    assert code == 0, text
    code, text, report = _run(
        ["convert", source, "--fold-norm-affine", "-o", str(tmp_path / "c.pt2")], tmp_path / "c.json"
    )
    assert code == 0, text
    changed = sum(len(p["changes"]) for p in report["passes"])
    # BART is post-LN: its norms feed residual sums, not a linear, and the run says so
    assert report["verdict"] == "ok" and (
        changed > 0 if name != "bart" else any(n.startswith("nothing to change") for n in report["notes"])
    )
    # the example the config made: the main input and the decoder's ids, and the file takes other lengths
    shapes = report["written_shapes"]
    assert not [r for r in shapes["rejected"] if r["label"].startswith(("batch", "length"))], shapes
    code, text, report = _run(["export", source, "-o", str(tmp_path / "e.onnx")], tmp_path / "e.json")
    assert code == 0, text
    assert report["onnx"]["within_tolerance"] and "decoder_input_ids" in report["onnx"]["dynamic_axes"]


def test_whisper_features_have_the_frames_its_encoder_takes(directories):
    from normswap.load import load_model

    loaded = load_model(str(directories["whisper"]))
    features, decoder = loaded.example_kwargs["input_features"], loaded.example_kwargs["decoder_input_ids"]
    assert features.shape == (1, 16, 32) and features.dtype == torch.float32  # 2 x max_source_positions
    assert decoder.shape == (1, 8) and int(decoder.max()) < 96


def test_a_config_that_says_too_little_takes_the_users_inputs_by_keyword(tmp_path: Path):
    """An Audio Spectrogram Transformer's config names no frame layout normswap knows: without inputs the
    refusal says how to give them; with a file keyed by the forward's parameter, every command runs."""
    config = transformers.ASTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, max_length=32,
        num_mel_bins=16, patch_size=8, frequency_stride=8, time_stride=8, num_labels=3,
    )  # fmt: skip
    transformers.ASTForAudioClassification(config).eval().save_pretrained(tmp_path / "ast")
    source = str(tmp_path / "ast")
    code, text, _ = _run(["convert", source, "--fold-norm-affine", "-o", str(tmp_path / "a.pt2")])
    assert code == 2 and "main input is 'input_values'" in text and "--inputs FILE" in text
    torch.save({"input_values": torch.randn(2, 32, 16)}, tmp_path / "inputs.pt")
    code, text, report = _run(
        [
            "convert",
            source,
            "--fold-norm-affine",
            "--inputs",
            str(tmp_path / "inputs.pt"),
            "-o",
            str(tmp_path / "a.pt2"),
        ],
        tmp_path / "r.json",
    )
    assert code == 0, text
    assert report["verdict"] == "ok" and sum(len(p["changes"]) for p in report["passes"]) > 0


@pytest.mark.parametrize(
    ("family", "options", "rewrite", "changed"),
    [("gpt2", {"to": "crmsnorm"}, "compress_stream", 5), ("llama", {"defer_rms": True}, "defer_rms", 4),
     ("llama", {"to": "fused", "fuse_add": True}, "fuse_add_norm", 4)],
    ids=["gpt2-crmsnorm", "llama-defer-rms", "llama-fuse-add"],
)  # fmt: skip
def test_a_stock_decoder_directory_reaches_the_graph_rewrites(
    tmp_path: Path, family, options, rewrite, changed
):
    """transformers' configs turn the key/value cache on (use_cache=True): a directory saved with the
    defaults returned a DynamicCache on its example, which no capture carries, and the graph rewrites
    changed nothing (exit 0, "0 changed") while its .pt2 was rewritten. The example a directory gets from
    its config runs without the cache, as every file normswap writes is exported."""
    import normswap

    small = {"vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0}
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, **small)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, **small,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    assert config.use_cache  # the library's default, kept as a user's saved model has it
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
    model.eval().save_pretrained(tmp_path / family)
    if family == "gpt2":  # a config.json without the key (as the Hub's gpt2 has): the class's default, on
        saved = json.loads((tmp_path / family / "config.json").read_text())
        del saved["use_cache"]
        (tmp_path / family / "config.json").write_text(json.dumps(saved))
    result = normswap.convert(tmp_path / family, normswap.ConvertConfig(exact=True, **options))
    assert result.ok and result.example_kwargs.get("use_cache") is False
    assert any(
        note.startswith("the example inputs made from the config run with use_cache=False")
        for note in result.notes
    )
    report = next(r for r in result.report.passes if r.pass_name == rewrite)
    assert len(report.changes) == changed, [s.reason for s in report.skips]
    assert result.report.overall is not None and result.report.overall.worst_rel <= 1e-5
