"""defer_rms (FlashNorm): an RMSNorm's scale applied after the linear layers that read it, on HF models."""

from __future__ import annotations

from pathlib import Path

import model_zoo
import pytest
import torch
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

from normswap.export.onnx import export_onnx
from normswap.graph.ops import op_name
from normswap.passes import DeferRMS, FoldNormAffine, Pipeline

ZOO = str(Path(__file__).resolve().parents[2] / "model_zoo.py")


def _llama(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple, dict]:
    model, args, kwargs = model_zoo.llama()  # HF Llama from a config, norm weights drawn around 1
    return model.to(dtype), args, kwargs


def test_llama_norms_scale_after_their_projections():
    model, args, kwargs = _llama()
    deferred, report = Pipeline([FoldNormAffine(), DeferRMS()])(model, args, kwargs)
    assert report.ok, report.exact_failures
    result = report.passes[1]
    readers = {c.site: c.details["readers"] for c in result.changes}
    assert readers["model.layers.0.input_layernorm"] == [
        f"model.layers.0.self_attn.{p}_proj" for p in ("q", "k", "v")
    ]
    assert readers["model.layers.1.post_attention_layernorm"] == [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    assert len(readers) == 4
    # the final norm reaches lm_head through the logits_to_keep slice: not only linear layers
    assert {s.site: s.reason for s in result.skips} == {
        "model.norm": "its output reaches slice, not only linear layers"
    }
    # every deferred linear reads the raw stream, and one statistic per norm is shared by its readers
    graph = deferred.graph
    rsqrts = [n for n in graph.nodes if op_name(n) == "rsqrt"]
    assert len(rsqrts) == 5
    shared = sorted(len(n.users) for n in rsqrts)
    assert shared == [1, 2, 2, 3, 3]
    for rsqrt in rsqrts:
        for mul in rsqrt.users:
            other = next(a for a in mul.args if a is not rsqrt)
            assert op_name(other) in ("linear", "to")  # the product of a raw-input linear, or model.norm's x
    # the function, not the example: other batch sizes and lengths
    for shape in ((3, 13), (1, 1)):
        ids = torch.randint(0, 128, shape)
        with torch.no_grad():
            got, want = deferred(ids, use_cache=False).logits, model(ids, use_cache=False).logits
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_bf16_llama_is_refused_with_the_rounding_it_would_skip():
    model, args, kwargs = _llama(torch.bfloat16)
    _, report = Pipeline([FoldNormAffine(), DeferRMS()])(model, args, kwargs)
    reasons = {s.site: s.reason for s in report.passes[1].skips}
    assert not report.passes[1].changes
    assert reasons["model.layers.0.input_layernorm"] == (
        "the normalized value is rounded to torch.bfloat16 before the matmuls: deferring the scale would "
        "skip that rounding (not exact)"
    )


class _Block(nn.Module):
    def __init__(self, residual_reads_norm: bool = False, affine: bool = True) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16, eps=1e-6, elementwise_affine=affine)
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 16, bias=False)
        self.residual_reads_norm = residual_reads_norm
        if affine:
            with torch.no_grad():
                self.norm.weight.normal_(1.0, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        out = self.b(n) + self.a(n).sum(-1, keepdim=True)
        return out + n if self.residual_reads_norm else out + x


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        (_Block(), "it multiplies by its weight: fold that into the readers first (--fold-norm-affine)"),
        (_Block(residual_reads_norm=True, affine=False), "its output reaches add, not only linear layers"),
    ],
    ids=["weight", "residual"],
)
def test_what_deferring_cannot_express_is_refused(block, reason):
    out, report = Pipeline([DeferRMS()])(block.eval(), (torch.randn(2, 5, 16),), {})
    result = report.passes[-1]
    assert not result.changes and [s.reason for s in result.skips] == [reason]
    assert out is not None


def test_deferred_block_is_exact_with_and_without_bias_and_exports_to_onnx(tmp_path):
    model = _Block().eval()
    x = torch.randn(2, 5, 16) * 3 + 1
    deferred, report = Pipeline([FoldNormAffine(), DeferRMS()])(model, (x,), {})
    assert [c.details["readers"] for c in report.passes[1].changes] == [["b", "a"]] or [
        c.details["readers"] for c in report.passes[1].changes
    ] == [["a", "b"]]
    y = torch.randn(2, 5, 16) * 2 - 1  # the graph was captured with static shapes: another input
    torch.testing.assert_close(deferred(y), model(y).detach(), atol=1e-5, rtol=1e-5)
    exported = export_onnx(deferred, tmp_path / "d.onnx", (x,))
    assert exported.within_tolerance and exported.op_counts["ReduceMean"] == 1


def test_cli_writes_the_graph_as_pt_and_pt2(tmp_path):
    runner = CliRunner()
    for name in ("l.pt", "l.pt2"):
        out = tmp_path / name
        result = runner.invoke(app, ["convert", f"{ZOO}:llama", "--defer-rms", "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert "defer_rms (exact): 4 changed, 1 skipped" in result.output and out.exists()
