"""``export --target onnxruntime``: the norms written as ONNX Runtime's fused ops, on models nobody here wrote."""

from __future__ import annotations

from pathlib import Path

import model_zoo
import pytest
import torch
import transformers
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

from normswap.export.onnx import export_onnx, run_onnx
from normswap.verify.variants import InputVariant, candidate_variants

ZOO = str(Path(__file__).resolve().parents[1] / "model_zoo.py")
RMS_OPS = {"Pow", "ReduceMean", "Sqrt", "Reciprocal"}


def _llama() -> tuple[nn.Module, dict]:
    model, (ids,), kwargs = model_zoo.llama()  # HF Llama from a config, norm weights drawn around 1
    return model, {"input_ids": ids, **kwargs}


def _unoptimized(path: Path, kwargs: dict) -> torch.Tensor:
    """The file run with onnxruntime's graph optimizations off: the file itself, not ORT's re-fusion."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    return torch.from_numpy(session.run(None, {name: kwargs["input_ids"].numpy()})[0])


def test_llama_rms_norms_become_simplified_layer_norms_with_their_residual_adds(tmp_path):
    model, kwargs = _llama()
    variants = [InputVariant("example", (), kwargs), *candidate_variants((), kwargs)]
    standard = export_onnx(model, tmp_path / "s.onnx", (), kwargs, check_shapes=variants)
    fused = export_onnx(model, tmp_path / "o.onnx", (), kwargs, target="onnxruntime", check_shapes=variants)
    # 5 norms: the first reads the embedding, the other 4 a residual sum (which keeps its name)
    assert fused.onnxruntime_fusion == {
        "fused": {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 4},
        "left": [],
    }
    assert fused.op_counts["SkipSimplifiedLayerNormalization"] == 4
    assert not RMS_OPS & set(fused.op_counts) and set(standard.op_counts) >= RMS_OPS
    # each norm: 7 nodes (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, the weight Mul) become 1; each
    # residual Add joins its norm
    assert sum(fused.op_counts.values()) == sum(standard.op_counts.values()) - 5 * 6 - 4
    assert fused.within_tolerance and not fused.shapes.rejected
    assert fused.shapes.accepted == [v.describe() for v in variants]
    want = model(**kwargs).logits.detach()
    got = _unoptimized(tmp_path / "o.onnx", kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_gpt2_residual_layer_norms_become_skip_layer_norms(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    kwargs = {"input_ids": torch.randint(0, 128, (2, 8))}
    fused = export_onnx(model, tmp_path / "g.onnx", (), kwargs, target="onnxruntime")
    # ln_1 of the first block reads token + position embeddings, a broadcast add: no residual sum
    assert fused.onnxruntime_fusion == {"fused": {"SkipLayerNormalization": 4}, "left": []}
    assert fused.op_counts["LayerNormalization"] == 1 and fused.within_tolerance
    torch.testing.assert_close(
        _unoptimized(tmp_path / "g.onnx", kwargs), model(**kwargs).logits.detach(), atol=1e-5, rtol=1e-4
    )


class _Block(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.inner, self.norm, self.out = nn.Linear(16, 16), norm, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x) + x
        return self.out(self.norm(h)) + h


def test_a_weightless_rms_norm_gets_a_scale_of_ones(tmp_path):
    model = _Block(nn.RMSNorm(16, eps=1e-6, elementwise_affine=False)).eval()
    x = torch.randn(2, 3, 16) * 3 + 1
    result = export_onnx(model, tmp_path / "w.onnx", (x,), target="onnxruntime")
    assert result.onnxruntime_fusion["fused"] == {"SkipSimplifiedLayerNormalization": 1}
    (got,) = run_onnx(tmp_path / "w.onnx", (x,), {})
    torch.testing.assert_close(got, model(x).detach(), atol=1e-5, rtol=1e-5)


def test_an_eps_onnxruntime_does_not_fuse_is_left_with_the_reason(tmp_path):
    model = _Block(nn.RMSNorm(16, eps=1e-3)).eval()
    result = export_onnx(model, tmp_path / "e.onnx", (torch.randn(2, 3, 16),), target="onnxruntime")
    assert result.onnxruntime_fusion["fused"] == {}
    (reason,) = result.onnxruntime_fusion["left"]
    assert "eps 0.001 is outside (0, 0.0001]" in reason
    assert result.op_counts["ReduceMean"] == 1 and result.within_tolerance


def test_cli_writes_the_fused_ops_and_refuses_an_unknown_target(tmp_path):
    runner = CliRunner()
    out = tmp_path / "l.onnx"
    result = runner.invoke(app, ["export", f"{ZOO}:llama", "-o", str(out), "--target", "onnxruntime"])
    assert result.exit_code == 0, result.output
    assert (
        "onnxruntime's fused norm ops: SimplifiedLayerNormalization 1, SkipSimplifiedLayerNormalization 4"
        in (" ".join(result.output.split()))
    )
    bad = runner.invoke(
        app, ["export", f"{ZOO}:llama", "-o", str(tmp_path / "b.onnx"), "--target", "tensorrt"]
    )
    assert bad.exit_code == 2 and "--target must be standard or onnxruntime, got 'tensorrt'" in bad.output
    assert not (tmp_path / "b.onnx").exists()


@pytest.mark.parametrize("target", ["standard", "onnxruntime"])
def test_the_target_is_in_the_report(tmp_path, target):
    result = export_onnx(
        _Block(nn.LayerNorm(16)).eval(), tmp_path / "r.onnx", (torch.randn(2, 3, 16),), target=target
    )
    assert result.to_dict()["target"] == target
    assert ("SkipLayerNormalization" in result.op_counts) == (target == "onnxruntime")


def test_the_other_written_form_fuses_too(tmp_path):
    # normswap's own fused RMSNorm exports as Mul(x, x) ... Div(x, sqrt), where HF's LlamaRMSNorm gives
    # Pow(x, 2) ... Reciprocal + Mul: both become the same fused ops
    from normswap.passes import FuseNorm, Pipeline

    model, kwargs = _llama()
    fused_model, _ = Pipeline([FuseNorm()])(model, (), kwargs)
    result = export_onnx(fused_model, tmp_path / "f.onnx", (), kwargs, target="onnxruntime")
    assert result.onnxruntime_fusion["fused"] == {
        "SimplifiedLayerNormalization": 1,
        "SkipSimplifiedLayerNormalization": 4,
    }
    standard = export_onnx(fused_model, tmp_path / "s.onnx", (), kwargs)
    assert standard.op_counts.get("Div", 0) - result.op_counts.get("Div", 0) == 5  # one per norm
    torch.testing.assert_close(
        _unoptimized(tmp_path / "f.onnx", kwargs), model(**kwargs).logits.detach(), atol=1e-5, rtol=1e-4
    )
