"""Hugging Face models built the normal way: default configs (use_cache=True), no tricks from the user.

The models come from a factory file written here, as a user would write it: ``GPT2LMHeadModel(config)``
and ``LlamaForCausalLM(config)`` with small default configs, returning ``(model, {"input_ids": ids})``.
normswap turns the cache off for its captures only, says so, and the model it writes keeps its config.
Also here: reasons said once per cause, and outputs that cannot be written refused before the work.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

pytest.importorskip("transformers")

runner = CliRunner()

FACTORY = textwrap.dedent(
    '''
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


    def _ids(vocab):
        return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


    def _randomize_norms(model):
        # norm parameters far from (1, 0): exactness must not hide behind default weights
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "ln" in name or "norm" in name:
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        return model


    def gpt2():
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
        return _randomize_norms(GPT2LMHeadModel(config)).eval(), {"input_ids": _ids(64)}


    def llama():
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=64,
        )
        return _randomize_norms(LlamaForCausalLM(config)).eval(), {"input_ids": _ids(64)}


    def gpt2_cache_asked():
        model, inputs = gpt2()
        return model, {**inputs, "use_cache": True}


    class Guarded(nn.Module):
        """A GPT-2 behind a branch on a tensor's value: neither torch.export nor fx can capture it."""

        def __init__(self):
            super().__init__()
            self.lm = gpt2()[0]

        def forward(self, input_ids):
            if input_ids.max() >= 0:
                return self.lm(input_ids=input_ids).logits
            return self.lm(input_ids=input_ids.clamp(min=0)).logits


    def guarded():
        return Guarded().eval(), (_ids(64),)


    class WithLambda(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.act = lambda x: x.relu()

        def forward(self, x):
            return self.act(self.bn(self.conv(x)))


    def with_lambda():
        return WithLambda().eval(), (torch.randn(1, 3, 8, 8),)


    def convnet():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
        return model, (torch.randn(1, 3, 8, 8),)
    '''
)


@pytest.fixture
def factory(tmp_path: Path) -> str:
    path = tmp_path / "hf_models.py"
    path.write_text(FACTORY)
    return str(path)


def _run(*args: str):
    return runner.invoke(app, list(args))


def _build(factory: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_hf_models_{name}", factory)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()


def _logits(output):
    if isinstance(output, torch.Tensor):
        return output
    return output["logits"] if isinstance(output, dict) else output.logits


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fused_pt2_of_a_default_config_model(factory, tmp_path, name):
    import normswap.kernels.ops  # noqa: F401  (the program calls normswap's fused ops)

    out = tmp_path / f"{name}_fused.pt2"
    result = _run("convert", f"{factory}:{name}", "--to", "fused", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "fuse_norm (exact): 5 changed, 0 skipped" in result.output
    assert "graph captured (export) with use_cache=False" in result.output
    assert f"{out} exported with use_cache=False" in " ".join(result.output.split())
    model, inputs = _build(factory, name)
    expected = model(**inputs).logits
    got = _logits(torch.export.load(out).module()(**inputs))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_exact_rmsnorm_of_a_default_gpt2_keeps_its_config(factory, tmp_path):
    out = tmp_path / "gpt2_rms.pt"
    report = tmp_path / "report.json"
    result = _run(
        "convert",
        f"{factory}:gpt2",
        "--to",
        "rmsnorm",
        "--exact",
        "-o",
        str(out),
        "--report",
        str(report),
    )
    assert result.exit_code == 0, result.output
    assert "recenter_layernorm (exact): 5 changed, 0 skipped" in result.output
    data = json.loads(report.read_text())
    assert data["written"] and data["graph_notes"] == ["use_cache=False"]
    assert data["passes"][0]["graph_notes"] == ["use_cache=False"]
    converted = torch.load(out, weights_only=False)
    assert converted.config.use_cache is True  # the user's config, not the capture's
    model, inputs = _build(factory, "gpt2")
    expected = model(**inputs).logits
    got = converted(**inputs)
    assert got.past_key_values is not None  # it still returns its cache, as the user built it
    torch.testing.assert_close(got.logits, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_inspect_captures_a_default_config_model(factory, name):
    result = _run("inspect", f"{factory}:{name}")
    assert result.exit_code == 0, result.output
    assert "5 norm sites" in result.output and "graph captured with export" in result.output
    assert "use_cache=False" in result.output


def test_a_cache_the_user_asks_for_is_kept_and_the_reason_is_a_whole_sentence(factory, tmp_path):
    report = tmp_path / "sites.json"
    result = _run("inspect", f"{factory}:gpt2_cache_asked", "--json", str(report))
    assert result.exit_code == 0, result.output
    errors = json.loads(report.read_text())["graph_errors"]
    assert errors[0] == (
        "torch.export failed: RuntimeError: Found <class 'transformers.cache_utils.DynamicCache'> in "
        "output, which is not a known type"
    )


def test_a_pickled_hf_model_converts_with_trust_pickle(factory, tmp_path):
    model, inputs = _build(factory, "gpt2")
    pickled = tmp_path / "gpt2.pt"
    torch.save(model, pickled)
    out = tmp_path / "gpt2_rms.pt2"
    result = _run(
        "convert",
        str(pickled),
        "--trust-pickle",
        "--to",
        "rmsnorm",
        "--exact",
        "--input-shape",
        "int64:1,16",
        "-o",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert "recenter_layernorm (exact): 5 changed, 0 skipped" in result.output
    # --input-shape gives the ids positionally; the program takes them so, at other lengths too (a
    # batch of 1 stays static in the export)
    ids = inputs["input_ids"][:1]
    expected = model(input_ids=ids).logits
    got = _logits(torch.export.load(out).module()(ids))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_a_capture_failure_is_said_once_for_all_its_sites(factory, tmp_path):
    out = tmp_path / "lossy.pt"
    report = tmp_path / "report.json"
    result = _run(
        "convert",
        f"{factory}:guarded",
        "--to",
        "rmsnorm",
        "--allow-lossy",
        "-o",
        str(out),
        "--report",
        str(report),
    )
    assert result.exit_code == 0, result.output
    # one row for the five LayerNorms, not five rows; the JSON keeps every site
    assert result.output.count("GuardOnDataDependentSymNode") == 1, result.output
    assert "5 sites: lm.transformer.h.0.ln_1" in result.output
    skips = json.loads(report.read_text())["passes"][0]["skips"]
    assert len(skips) == 5 and len({s["reason"] for s in skips}) == 1
    reason = skips[0]["reason"]
    assert reason.startswith("no graph captured (torch.export failed: GuardOnDataDependentSymNode: ")
    assert (
        "fx tracing failed: TraceError: symbolically traced variables cannot be used as inputs to " in reason
    )
    assert reason.endswith(
        "make the forward traceable by torch.export on these inputs (e.g. no Python "
        "branch on a tensor's value)"
    )
    assert "def forward" not in result.output  # torch's partial graph dump stays out of the user's way


def test_a_pt2_of_a_model_export_cannot_capture_is_refused_before_the_work(factory, tmp_path):
    out = tmp_path / "x.pt2"
    result = _run("convert", f"{factory}:guarded", "--to", "fused", "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "a pt2 file is written from a torch.export capture, and the model cannot be captured" in (
        " ".join(result.output.split())
    )
    assert "save as .pt" in result.output
    assert "Changes" not in result.output and not out.exists()  # no conversion ran


def test_a_pickle_of_a_model_holding_a_lambda_is_refused_before_the_work(factory, tmp_path):
    out = tmp_path / "x.pt"
    result = _run("convert", f"{factory}:with_lambda", "--fold-bn", "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "the model cannot be pickled" in result.output and "save as .pt2" in result.output
    assert "Changes" not in result.output and not out.exists()


def test_onnx_without_its_packages_is_refused_before_the_work(factory, tmp_path, monkeypatch):
    import normswap.load.save as save

    monkeypatch.setattr(save, "_FORMAT_PACKAGES", {"onnx": ("normswap_no_such_package",)})
    out = tmp_path / "x.onnx"
    result = _run("convert", f"{factory}:convnet", "--fold-bn", "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "needs normswap_no_such_package, which is not installed" in result.output
    assert "Changes" not in result.output and not out.exists()


def test_a_graph_rewrite_written_as_a_program_runs_without_the_cache(factory, tmp_path):
    """--fuse-add returns a GraphModule, written as a program, which returns no cache (a .pt2 of an HF
    model is exported with use_cache=False): the example inputs run with use_cache=False and say so, so
    the rewrite is made on a model built with the default config (in the Python API without an output
    it skips instead, saying how: tests/test_route_parity.py)."""
    out = tmp_path / "fused.pt2"
    report = tmp_path / "report.json"
    result = _run(
        "convert", f"{factory}:gpt2", "--to", "fused", "--fuse-add", "-o", str(out), "--report", str(report)
    )
    assert result.exit_code == 0, result.output
    written = json.loads(report.read_text())
    passes = {p["pass_name"]: p for p in written["passes"]}
    assert len(passes["fuse_norm"]["changes"]) == 5
    assert len(passes["fuse_add_norm"]["changes"]) == 4, passes["fuse_add_norm"]["skips"]
    assert (
        "the example inputs run with use_cache=False: the written program returns no cache"
        in written["notes"]
    )
