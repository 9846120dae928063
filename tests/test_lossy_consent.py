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

from normswap.passes.recenter.layernorm import RecenterLayerNorm

pytest.importorskip("transformers")

runner = CliRunner()
ZOO = str(Path(model_zoo.__file__))

FACTORY = textwrap.dedent(
    '''
    import torch
    import torch.nn.functional as F
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


    class ShiftedBlock(nn.Module):
        """A pre-LN block whose attention works on a cyclically shifted sequence, as Swin's shifted
        windows do: the branch rolls its input and rolls its output back (torch.roll over the tokens)
        before the residual add. With ``gelu_writer`` the MLP writes its activation straight into the
        stream, without a projection after it."""

        def __init__(self, dim, heads=2, shift=3, gelu_writer=False):
            super().__init__()
            self.heads, self.shift, self.gelu_writer = heads, shift, gelu_writer
            self.norm1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, dim if gelu_writer else 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, c = x.shape
            h = self.norm1(x)
            if self.shift:
                h = torch.roll(h, -self.shift, dims=1)
            q, k, v = self.qkv(h).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = self.proj(h.transpose(1, 2).reshape(b, t, c))
            if self.shift:
                h = torch.roll(h, self.shift, dims=1)
            x = x + h
            h = F.gelu(self.fc1(self.norm2(x)))
            return x + (h if self.gelu_writer else self.fc2(h))


    class TinyLM(nn.Module):
        def __init__(self, dim=32, layers=2, **block):
            super().__init__()
            self.embed = nn.Embedding(64, dim)
            self.blocks = nn.ModuleList(ShiftedBlock(dim, **block) for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, 64)

        def forward(self, input_ids):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))


    def shifted():
        """Pre-LN, exact route open in principle, but torch.roll is an op the stream analysis does not
        model: an analysis limit, not the architecture."""
        torch.manual_seed(0)
        return TinyLM().eval(), (_ids(),)


    def gelu_writer():
        """Pre-LN, but a GELU writes into the residual stream: no centering of parameters makes the
        stream zero-mean, so the swap is lossy by architecture."""
        torch.manual_seed(0)
        return TinyLM(shift=0, gelu_writer=True).eval(), (_ids(),)
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


def _refused_without_consent(factory: str, name: str, out: Path, detail: str, cause: str) -> None:
    """`convert NAME --to rmsnorm` exits 1 naming the failed exact route and ``detail``, writes nothing,
    and reports every skip with ``cause``."""
    report = out.with_name("report.json")
    result = _run("convert", f"{factory}:{name}", "--to", "rmsnorm", "-o", str(out), "--report", str(report))
    assert result.exit_code == 1, result.output
    said = _flat(result.output)
    assert (
        "error: --to rmsnorm: the exact route failed for 5 LayerNorm(s), not because of the model's" in said
    )
    assert detail in said
    assert "pass --allow-lossy to accept the lossy swap; nothing written" in said
    assert not out.exists()
    data = json.loads(report.read_text())
    assert data["written"] is False
    assert {s["cause"] for s in data["passes"][0]["skips"]} == {cause}


def test_a_failed_exact_route_fails_the_command_and_writes_nothing(factory, tmp_path):
    detail = "no graph captured (torch.export failed: GuardOnDataDependentSymNode"
    _refused_without_consent(factory, "guarded", tmp_path / "rms.pt", detail, "capture")


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

    from normswap.passes.core.base import SkipCause

    model, args, kwargs = model_zoo.bert()
    _, report = RecenterLayerNorm()(model, args, kwargs)
    assert {s.cause for s in report.skips} == {SkipCause.ARCHITECTURE}

    spec = importlib.util.spec_from_file_location("_consent_models", factory)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    guarded, guarded_args = module.guarded()
    _, report = RecenterLayerNorm()(guarded, guarded_args)
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
    from normswap.passes.core.base import Change, PassReport, RewriteKind, Skip, SkipCause
    from normswap.passes.recenter.layernorm import lossy_after_failure

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


def _factory_model(factory: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_consent_models", factory)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()


def test_stream_analysis_limits_are_unsupported_and_what_the_graph_shows_is_architecture(factory):
    """A residual-stream refusal says whether the graph rules recentering out (a nonlinearity written
    into the stream) or the analysis could not tell (torch.roll, an op it does not model)."""
    from normswap.passes.core.base import SkipCause

    model, args = _factory_model(factory, "shifted")
    _, report = RecenterLayerNorm()(model, args)
    assert report.changes == [] and len(report.skips) == 5
    assert {s.cause for s in report.skips} == {SkipCause.UNSUPPORTED}
    assert "(roll) writes into the residual stream, and normswap does not know" in report.skips[0].reason

    model, args = _factory_model(factory, "gelu_writer")
    _, report = RecenterLayerNorm()(model, args)
    assert report.changes == [] and len(report.skips) == 5
    assert {s.cause for s in report.skips} == {SkipCause.ARCHITECTURE}
    assert "(gelu) writes into the residual stream and is not a linear map" in report.skips[0].reason


def test_an_analysis_limit_on_a_pre_ln_model_needs_consent(factory, tmp_path):
    out = tmp_path / "rms.pt"
    detail = "(roll) writes into the residual stream, and normswap does not know"
    _refused_without_consent(factory, "shifted", out, detail, "unsupported")

    result = _run("convert", f"{factory}:shifted", "--to", "rmsnorm", "--allow-lossy", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "note: --allow-lossy: 5 LayerNorm(s) swapped lossily where the exact route failed" in result.output
    assert out.exists()


def test_a_stream_the_architecture_rules_out_is_swapped_without_the_flag(factory, tmp_path):
    out = tmp_path / "rms.pt"
    result = _run("convert", f"{factory}:gelu_writer", "--to", "rmsnorm", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "recenter_layernorm: 0 changed, 5 skipped" in result.output
    assert "swap_norm (architectural): 5 changed" in result.output and out.exists()
