"""A padded batch of sentences exports and is checked at its tokens, on HF's GPT-2.

In a left-padded batch, causal attention at a padding position sees no token: what it returns there is
read by nothing, and PyTorch and onnxruntime return different values (`normswap export` of GPT-2 with a
left-padded ``attention_mask`` exited 1, "onnxruntime disagrees with PyTorch", on a correct file). The
check compares every output per token at the tokens only, and says how many positions it left out; a
disagreement at a token still fails. The shorter variant of a left-padded batch keeps its last tokens,
so that no sentence of it is padding alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

import normswap.export.onnx as onnx_export
from normswap.errors import CheckFailedError
from normswap.export.onnx import export_onnx
from normswap.verify.variants import candidate_variants

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _left_padded() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_a_left_padded_gpt2_exports_and_is_checked_at_its_tokens(tmp_path):
    model = _gpt2()
    directory, inputs = tmp_path / "gpt2", tmp_path / "padded.pt"
    model.save_pretrained(directory)
    torch.save(_left_padded(), inputs)
    out, report = tmp_path / "gpt2.onnx", tmp_path / "report.json"
    result = CliRunner().invoke(
        app, ["export", str(directory), "--inputs", str(inputs), "-o", str(out), "--report", str(report)]
    )
    assert result.exit_code == 0, result.output
    outputs = json.loads(report.read_text())["onnx"]["outputs"]
    # the example and its batch-3 variant hold padding; the shorter variant kept the last tokens: none
    left_out = [o["name"] for o in outputs if "padding positions left out" in o["name"]]
    assert any("at 2x8 + 2x8 (its 3 padding positions left out)" in name for name in left_out), left_out
    assert all(o["max_rel"] <= 1e-4 for o in outputs)
    # the file computes the model's logits at every token of the padded batch
    session_out = onnx_export.run_onnx(out, (), {**_left_padded(), "use_cache": False})[0]
    with torch.no_grad():
        expected = model(**_left_padded(), use_cache=False).logits
    tokens = _left_padded()["attention_mask"].bool()
    torch.testing.assert_close(session_out[tokens], expected[tokens], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("where", "fails"), [("token", True), ("padding", False)])
def test_a_disagreement_at_a_token_fails_and_one_at_padding_is_left_out(tmp_path, monkeypatch, where, fails):
    real = onnx_export._ort_run
    position = 5 if where == "token" else 1  # row 1 is padding at positions 0..2

    def moved(path):
        def run(args, kwargs):
            outputs = real(path)(args, kwargs)
            mask = kwargs.get("attention_mask")
            if mask is not None and mask.shape[1] > position and mask[1, position] == (where == "token"):
                outputs[0] = outputs[0].clone()
                outputs[0][1, position] += 1.0
            return outputs

        return run

    monkeypatch.setattr(onnx_export, "_ort_run", moved)
    kwargs = {**_left_padded(), "use_cache": False}
    if fails:
        with pytest.raises(CheckFailedError, match=r"onnxruntime disagrees with PyTorch: output\[0\]"):
            export_onnx(_gpt2(), tmp_path / "x.onnx", (), kwargs)
        assert not (tmp_path / "x.onnx").exists()
    else:
        export_onnx(_gpt2(), tmp_path / "x.onnx", (), kwargs)
        assert (tmp_path / "x.onnx").exists()


def test_the_shorter_variant_of_a_left_padded_batch_keeps_its_last_tokens():
    ids = torch.arange(16).reshape(2, 8)
    left = torch.tensor([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]])
    right = torch.tensor([[1] * 8, [1, 1, 1, 1, 1, 0, 0, 0]])
    kpm_left = torch.tensor([[False] * 8, [True, True, True] + [False] * 5])  # torch's: True = padding

    def shorter(mask: torch.Tensor) -> dict[str, torch.Tensor]:
        (variant,) = [
            v for v in candidate_variants((), {"input_ids": ids, "mask": mask}) if v.label == "length 2"
        ]
        return variant.kwargs

    assert shorter(left)["input_ids"].tolist() == [[6, 7], [14, 15]]
    assert shorter(left)["mask"].tolist() == [[1, 1], [1, 1]]
    assert shorter(kpm_left)["mask"].tolist() == [[False, False], [False, False]]
    assert shorter(right)["input_ids"].tolist() == [[0, 1], [8, 9]]  # right padding: the first tokens
    # no unpadded row to tell the token value by: the first tokens, as for any batch
    both_padded = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]])
    assert shorter(both_padded)["input_ids"].tolist() == [[0, 1], [8, 9]]
