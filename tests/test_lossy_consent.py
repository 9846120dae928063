"""No lossy result without consent: --to rmsnorm is exact where the residual stream can be recentered;
when that route fails for a reason that is not the model's architecture (no graph captured, a form
normswap does not handle), the lossy swap is not written unless the user passes --allow-lossy.
Post-LN LayerNorms (no exact route by architecture) and the swaps asked for by kind are unchanged.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import model_zoo
import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.passes.recenter_layernorm import recenter_layernorm

pytest.importorskip("transformers")

runner = CliRunner()
ZOO = str(Path(model_zoo.__file__))

FACTORY = textwrap.dedent(
    '''
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel


    def _ids():
        return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


    def _gpt2():
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
        return GPT2LMHeadModel(config).eval()


    class Guarded(nn.Module):
        """A pre-LN GPT-2 behind a branch on a tensor's value: no graph of it can be captured, so the
        exact route cannot run, although the architecture allows it."""

        def __init__(self):
            super().__init__()
            self.lm = _gpt2()

        def forward(self, input_ids):
            if input_ids.max() >= 0:
                return self.lm(input_ids=input_ids).logits
            return self.lm(input_ids=input_ids.clamp(min=0)).logits


    def guarded():
        return Guarded().eval(), (_ids(),)


    def convnet():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
        return model, (torch.randn(2, 3, 8, 8),)
    '''
)


@pytest.fixture
def factory(tmp_path: Path) -> str:
    path = tmp_path / "consent_models.py"
    path.write_text(FACTORY)
    return str(path)


def _run(*args: str):
    return runner.invoke(app, list(args))


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_failed_exact_route_fails_the_command_and_writes_nothing(factory, tmp_path):
    out = tmp_path / "rms.pt"
    report = tmp_path / "report.json"
    result = _run("convert", f"{factory}:guarded", "--to", "rmsnorm", "-o", str(out), "--report", str(report))
    assert result.exit_code == 1, result.output
    said = _flat(result.output)
    assert (
        "error: --to rmsnorm: the exact route failed for 5 LayerNorm(s), not because of the model's " in said
    )
    assert "no graph captured (torch.export failed: GuardOnDataDependentSymNode" in said
    assert "pass --allow-lossy to accept the lossy swap; nothing written" in said
    assert not out.exists()
    data = json.loads(report.read_text())
    assert data["written"] is False
    assert {s["cause"] for s in data["passes"][0]["skips"]} == {"capture"}


def test_allow_lossy_accepts_the_lossy_swap(factory, tmp_path):
    out = tmp_path / "rms.pt"
    result = _run("convert", f"{factory}:guarded", "--to", "rmsnorm", "--allow-lossy", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "recenter_layernorm: 0 changed, 5 skipped" in result.output
    assert "swap_norm (architectural): 5 changed, 0 skipped; SQNR" in result.output
    assert "note: --allow-lossy: 5 LayerNorm(s) swapped lossily where the exact route failed" in result.output
    assert out.exists()


def test_a_post_ln_model_is_swapped_without_the_flag(tmp_path):
    """BERT's LayerNorms read a normalized stream: no exact route exists, the swap is architectural by
    architecture and needs no consent beyond --to rmsnorm."""
    out = tmp_path / "bert_rms.pt"
    report = tmp_path / "report.json"
    result = _run(
        "convert", f"{ZOO}:bert_factory", "--to", "rmsnorm", "-o", str(out), "--report", str(report)
    )
    assert result.exit_code == 0, result.output
    assert "recenter_layernorm (exact): 1 changed, 4 skipped" in result.output
    assert "swap_norm (architectural): 4 changed" in result.output and out.exists()
    skips = json.loads(report.read_text())["passes"][0]["skips"]
    assert [s["cause"] for s in skips] == ["architecture"] * 4


def test_skip_causes_tell_architecture_from_capture(factory):
    import importlib.util

    from normswap.passes.base import SkipCause

    model, args, kwargs = model_zoo.bert()
    _, report = recenter_layernorm(model, args, kwargs)
    assert {s.cause for s in report.skips} == {SkipCause.ARCHITECTURE}

    spec = importlib.util.spec_from_file_location("_consent_models", factory)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    guarded, guarded_args = module.guarded()
    _, report = recenter_layernorm(guarded, guarded_args)
    assert len(report.skips) == 5 and {s.cause for s in report.skips} == {SkipCause.CAPTURE}
    assert report.to_dict()["skips"][0]["cause"] == "capture"


def test_architectural_swaps_asked_by_kind_are_unchanged(factory, tmp_path):
    out = tmp_path / "gn.pt"
    result = _run("convert", f"{factory}:convnet", "--to", "groupnorm", "--groups", "2", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "swap_norm (architectural): 1 changed" in result.output and out.exists()
    converted = torch.load(out, weights_only=False)
    assert type(converted[1]).__name__ != "BatchNorm2d"


@pytest.mark.parametrize(
    ("options", "line"),
    [
        (["--to", "rmsnorm", "--exact", "--allow-lossy"], "--allow-lossy and --exact contradict each other"),
        (["--to", "groupnorm", "--groups", "2", "--allow-lossy"], "--allow-lossy applies to --to rmsnorm"),
    ],
)
def test_allow_lossy_where_it_means_nothing_is_a_usage_error(factory, tmp_path, options, line):
    out = tmp_path / "x.pt"
    result = _run("convert", f"{factory}:convnet", *options, "-o", str(out))
    assert result.exit_code == 2, result.output
    assert line in result.output and not out.exists()


def test_lossy_after_failure_counts_only_failures_that_a_lossy_pass_then_changed():
    from normswap.passes.base import Change, PassReport, RewriteKind, Skip, SkipCause
    from normswap.passes.recenter_layernorm import lossy_after_failure

    recenter = PassReport("recenter_layernorm", RewriteKind.EXACT)
    recenter.skips = [
        Skip("recenter_layernorm", "a", "post-LN", SkipCause.ARCHITECTURE),
        Skip("recenter_layernorm", "b", "no graph", SkipCause.CAPTURE),
        Skip("recenter_layernorm", "c", "functional", SkipCause.UNSUPPORTED),
    ]
    swap = PassReport("swap_norm", RewriteKind.ARCHITECTURAL)
    swap.changes = [Change("swap_norm", site, RewriteKind.ARCHITECTURAL, "") for site in ("a", "b")]
    assert [s.site for s in lossy_after_failure([recenter, swap])] == ["b"]
    assert lossy_after_failure([recenter]) == []
