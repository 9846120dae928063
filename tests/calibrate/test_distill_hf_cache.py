"""Distillation of a model directory saved the normal way (issue 29, item 15): transformers' configs switch
the key/value cache on by default, ``convert`` turns it off for its capture (so the .pt2 it writes returns
no cache), and ``distill`` runs both models by that same rule (``capture_friendly``), so the cache is not
compared as an output."""

from __future__ import annotations

from pathlib import Path

import hf_dirs
import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.calibrate.distill import distill
from normswap.passes import SwapNorm


def _llama_with_cache(root: Path) -> Path:
    """A tiny LlamaForCausalLM saved by ``save_pretrained`` with ``use_cache`` at its default, true."""
    cls, config = hf_dirs.configs()["llama"]
    config.use_cache = True
    torch.manual_seed(0)
    model = cls(config).eval()
    hf_dirs.randomize_norms(model)
    path = root / "llama"
    model.save_pretrained(path)
    assert '"use_cache": true' in (path / "config.json").read_text()
    return path


def test_cli_distills_a_directory_saved_with_the_cache_on(tmp_path):
    original = _llama_with_cache(tmp_path)
    student, out = tmp_path / "student.pt2", tmp_path / "out.pt2"
    runner = CliRunner()
    converted = runner.invoke(app, ["convert", str(original), "--to", "dyt", "-o", str(student)])
    assert converted.exit_code == 0, converted.output
    data = tmp_path / "ids.pt"
    torch.save(torch.randint(0, 300, (12, 10), generator=torch.Generator().manual_seed(1)), data)
    result = runner.invoke(
        app,
        ["distill", str(original), str(student), "--data", str(data), "--batch-size", "4", "--steps", "2",
         "-o", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "mse loss on output.logits" in result.output
    assert "use_cache=False" in result.output  # said, as convert says it
    assert out.exists()


@pytest.mark.parametrize("given", [None, True])
def test_the_cache_is_off_unless_the_inputs_ask_for_it(given):
    """The same rule as convert's capture: off when the config turns it on, kept when the inputs set it;
    the teacher's config is left as it was."""
    teacher = hf_dirs.configs()["llama"][0](hf_dirs.configs()["llama"][1]).eval()
    teacher.config.use_cache = True
    ids = torch.randint(0, 300, (4, 10), generator=torch.Generator().manual_seed(1))
    student, _ = SwapNorm("dyt")(teacher, (ids,), {"use_cache": False})
    kwargs = {} if given is None else {"use_cache": given}
    batches = [{"input_ids": ids, **kwargs} for _ in range(3)]
    _, report = distill(teacher, student, batches, steps=2, lr=1e-3)
    assert teacher.config.use_cache is True and student.config.use_cache is True
    if given is None:
        assert any("use_cache=False" in note for note in report.notes), report.notes
        assert report.before is not None and report.after is not None
    else:
        assert not any("use_cache=False" in note for note in report.notes), report.notes
