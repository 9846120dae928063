"""An exact change holds for the function, not for one input: checked beyond the example inputs.

The pipeline checks every exact pass on the example inputs and on variants of them along the dims the
original model accepts freely (batch, sequence length, spatial size); every tensor output is compared,
integer and bool ones by equality; a check that compared nothing fails.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import model_zoo
import torch
import torch.nn.functional as F
from normswap_cli.app import app
from normswap_cli.render import print_pipeline as _print_pipeline
from torch import nn
from typer.testing import CliRunner

from normswap.passes import FoldBatchNorm, FoldNormAffine, FuseGraphNorm, Pipeline, RecenterLayerNorm
from normswap.passes.core.base import Change, Needs, Pass, PassContext, RewriteKind
from normswap.verify.variants import candidate_variants

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

# A model whose forward branches on the input size: at 16x16 it applies its BatchNorm, at 6x6 it does
# not. Folding the BN into the conv is right for the first branch and wrong for the second.
BRANCHY = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) if x.shape[-1] >= 8 else y


    def build():
        torch.manual_seed(0)
        model = Branchy()
        with torch.no_grad():
            model.bn.running_mean.uniform_(-1, 1)
            model.bn.running_var.uniform_(0.5, 2)
            model.bn.weight.uniform_(0.5, 2)
            model.bn.bias.uniform_(-1, 1)
        return model.eval(), (torch.randn(1, 3, 16, 16),)
    """
)


def _branchy(tmp_path: Path):
    path = tmp_path / "branchy.py"
    path.write_text(BRANCHY)
    namespace: dict = {}
    exec(compile(BRANCHY, str(path), "exec"), namespace)
    return path, namespace["build"]


def _verified(report, index: int = 0) -> list[list[list[int]]]:
    return [v["shapes"] for v in report.passes[index].validation["verified_inputs"]]


def test_a_fold_right_on_the_example_and_wrong_on_a_smaller_input_fails(tmp_path):
    _, build = _branchy(tmp_path)
    model, args = build()
    _, report = Pipeline([FoldBatchNorm()])(model, args)
    assert len(report.passes[0].changes) == 1
    validation = report.passes[0].validation
    assert validation["within_tolerance"]  # the example alone cannot tell
    assert not report.ok
    assert report.exact_failures[0].startswith("fold_batchnorm: output moved by")
    assert "on inputs 1x3x4x4" in report.exact_failures[0]
    assert [f["shapes"] for f in validation["failed_inputs"]] == [[[1, 3, 4, 4]]]
    assert [[1, 3, 16, 16]] in _verified(report) and [[2, 3, 16, 16]] in _verified(report)


def test_the_cli_refuses_to_write_a_fold_that_only_the_example_supports(tmp_path):
    path, _ = _branchy(tmp_path)
    out = tmp_path / "folded.pt"
    report = tmp_path / "report.json"
    result = CliRunner().invoke(
        app, ["convert", f"{path}:build", "--fold-bn", "-o", str(out), "--report", str(report)]
    )
    assert result.exit_code == 1, result.output
    assert "exact rewrite changed the outputs: fold_batchnorm" in result.output
    assert "1x3x4x4" in result.output and "nothing written" in result.output
    assert not out.exists()
    data = json.loads(report.read_text())
    assert data["written"] is False and not data["ok"]


def test_a_correct_fold_of_resnet18_is_verified_on_every_free_shape():
    model, args, kwargs = model_zoo.resnet18(size=32)
    _, report = Pipeline([FoldBatchNorm()])(model, (args[0][:1],), kwargs)
    assert report.ok, report.exact_failures
    validation = report.passes[0].validation
    assert validation["failed_inputs"] == [] and validation["limitations"] == []
    shapes = _verified(report)
    # the example first, then batch 2 and a 4x smaller and a ~2x larger image
    assert shapes == [[[1, 3, 32, 32]], [[2, 3, 32, 32]], [[1, 3, 8, 8]], [[1, 3, 45, 45]]]
    assert all(v["worst_rel"] <= 1e-5 for v in validation["verified_inputs"])
    # channels-last guesses change the channel dim: the original rejects them, so they are not free
    rejected = report.input_variants["rejected"]
    assert rejected and all("channels" in r["reason"] for r in rejected)
    assert json.dumps(report.to_dict(), default=str)


def test_the_cli_lists_the_shapes_an_exact_change_was_verified_on(tmp_path):
    out = tmp_path / "folded.pt"
    report = tmp_path / "report.json"
    result = CliRunner().invoke(
        app,
        [
            "convert",
            f"{EXAMPLES / 'small_convnet.py'}:build",
            "--fold-bn",
            "-o",
            str(out),
            "--report",
            str(report),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "verified on 5 input shapes: 2x3x32x32, 3x3x32x32, 1x3x32x32, 2x3x8x8, 2x3x45x45" in result.output
    assert out.exists()
    fold = json.loads(report.read_text())["passes"][0]
    assert [v["shapes"] for v in fold["validation"]["verified_inputs"]][3] == [[2, 3, 8, 8]]


def _gpt2(n_positions: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=n_positions, bos_token_id=0, eos_token_id=0
    )
    model = model_zoo.randomize_norms(GPT2LMHeadModel(config)).eval()
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    return model, (ids,), {"attention_mask": mask, "use_cache": False}


def _llama():
    model, args, kwargs = model_zoo.llama()
    return model, args, {**kwargs, "attention_mask": torch.ones_like(args[0])}


def test_an_hf_transformer_is_verified_on_other_lengths_and_batches_with_its_mask():
    model, args, kwargs = _gpt2(n_positions=64)
    _, report = Pipeline([RecenterLayerNorm()])(model, args, kwargs)
    assert report.ok, report.exact_failures
    assert len(report.passes[0].changes) == 5
    # input_ids and attention_mask change together: batch 3 and 1, length 3 and 24
    assert _verified(report) == [
        [[2, 12], [2, 12]],
        [[3, 12], [3, 12]],
        [[1, 12], [1, 12]],
        [[2, 3], [2, 3]],
        [[2, 24], [2, 24]],
    ]


def test_llama_norm_affine_fold_is_verified_on_other_lengths():
    model, args, kwargs = _llama()
    _, report = Pipeline([FoldNormAffine()])(model, args, kwargs)
    assert report.ok, report.exact_failures
    assert report.passes[0].changes
    assert [[2, 3], [2, 3]] in _verified(report) and [[2, 24], [2, 24]] in _verified(report)


def test_a_length_past_the_position_table_is_not_a_free_size():
    model, args, kwargs = _gpt2(n_positions=16)
    _, report = Pipeline([RecenterLayerNorm()])(model, args, kwargs)
    assert report.ok, report.exact_failures
    assert [[2, 24], [2, 24]] not in _verified(report)
    rejected = report.input_variants["rejected"]
    assert [r["shapes"] for r in rejected] == [[[2, 24], [2, 24]]] and "IndexError" in rejected[0]["reason"]


def test_variants_keep_ids_in_range_and_masks_consistent():
    ids = torch.tensor([[5, 9, 7, 6], [8, 5, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    variants = candidate_variants((ids,), {"attention_mask": mask})
    assert [v.label for v in variants] == ["batch 3", "batch 1", "length 1", "length 8"]
    for v in variants:
        new_ids, new_mask = v.args[0], v.kwargs["attention_mask"]
        assert new_ids.shape == new_mask.shape and new_ids.dtype == ids.dtype
        assert int(new_ids.min()) >= 5 and int(new_ids.max()) <= 9
        assert set(new_mask.unique().tolist()) <= {0, 1}
    longer = variants[3].kwargs["attention_mask"]
    assert longer[:, :4].equal(mask) and longer[0, 4:].eq(0).all() and longer[1, 4:].eq(1).all()
    assert candidate_variants((ids,), {"attention_mask": mask})[3].args[0].equal(variants[3].args[0])


class _ArgmaxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).mean((2, 3))).argmax(-1)


@dataclass(frozen=True)
class _Head:
    path: str


class _NudgeHead(Pass[_Head, _Head, None]):
    """An "exact" pass that is not: it moves one class's bias just enough to flip one prediction (the
    example row and class with the smallest margin)."""

    name = "nudge_head"
    kind = RewriteKind.EXACT
    needs = Needs.PARAMETERS

    def candidates(self, ctx: PassContext, state: None) -> list[_Head]:
        return [_Head("head")]

    def check(self, site: _Head, ctx: PassContext, state: None) -> _Head:
        return site

    def apply(self, plan: _Head, ctx: PassContext, state: None) -> Change:
        model, args = ctx.model, ctx.example_args
        with torch.no_grad():
            logits = model.head(model.bn(model.conv(args[0])).mean((2, 3)))
            gaps = logits.max(-1, keepdim=True).values - logits
            gaps[gaps == 0] = float("inf")
            row, cls = divmod(int(gaps.argmin()), gaps.shape[1])
            model.head.bias[cls] += float(gaps[row, cls]) * 1.0001
        return Change(self.name, plan.path, self.kind, "moved a bias")


def _argmax_net() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = model_zoo.randomize_norms(_ArgmaxNet()).eval()
    return model, (torch.randn(4, 3, 8, 8),)


def test_integer_outputs_are_compared_for_equality():
    model, args = _argmax_net()
    _, report = Pipeline([FoldBatchNorm()])(model, args)
    assert report.ok, report.exact_failures
    outputs = report.passes[0].validation["outputs"]
    assert [(o["dtype"], o["mismatched"], o["within_tolerance"]) for o in outputs] == [("int64", 0, True)]
    assert len(report.passes[0].validation["verified_inputs"]) >= 3


def test_an_exact_change_that_flips_one_id_fails():
    model, args = _argmax_net()
    _, report = Pipeline([_NudgeHead()])(model, args)
    assert not report.ok
    assert report.exact_failures[0].startswith(
        "nudge_head: output (int64, compared for equality) differs in 1 of 4 values on the example inputs"
    )


class _Returns(nn.Module):
    def __init__(self, value: object) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.value = value

    def forward(self, x: torch.Tensor) -> object:
        self.bn(self.conv(x))
        return self.value


def test_a_check_that_compared_nothing_fails_and_prints(capsys):
    for value, returned in ((None, "None"), ("done", "str")):
        model = model_zoo.randomize_norms(_Returns(value)).eval()
        _, report = Pipeline([FoldBatchNorm()])(model, (torch.randn(1, 3, 8, 8),))
        assert len(report.passes[0].changes) == 1
        assert not report.ok
        assert report.exact_failures == [
            f"fold_batchnorm: the model returns no tensor to compare (returned {returned}) on the example "
            "inputs 1x3x8x8: an exact change cannot be verified"
        ]
        _print_pipeline(report)
        printed = capsys.readouterr().out
        assert "the model returns no tensor to compare FAIL" in printed


class _ChannelsLastNorm(nn.Module):
    """A functional LayerNorm over channels: FuseGraphNorm rewrites it on a graph exported at one shape."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.w = nn.Parameter(1 + 0.3 * torch.randn(8))
        self.b = nn.Parameter(0.3 * torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).permute(0, 2, 3, 1)
        return F.layer_norm(y, (8,), self.w, self.b).permute(0, 3, 1, 2)


class _SizeBranchNorm(_ChannelsLastNorm):
    """The same, with a branch on the image width: export keeps only the branch the example takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] >= 16:
            x = x * 2
        return super().forward(x)


def test_a_graph_rewrite_keeps_the_batch_and_image_size_free():
    torch.manual_seed(0)
    _, report = Pipeline([FuseGraphNorm()])(_ChannelsLastNorm().eval(), (torch.randn(1, 3, 16, 16),))
    assert report.ok, report.exact_failures
    validation = report.passes[0].validation
    # exported from the example grown to batch 2, its height and width free
    assert _verified(report) == [[[1, 3, 16, 16]], [[2, 3, 16, 16]], [[1, 3, 4, 4]], [[1, 3, 22, 22]]]
    assert not validation["not_accepted"] and not validation.get("limitations")


def test_a_graph_rewrite_specialized_to_the_example_shape_is_a_stated_limitation(capsys):
    torch.manual_seed(0)
    _, report = Pipeline([FuseGraphNorm()])(_SizeBranchNorm().eval(), (torch.randn(1, 3, 16, 16),))
    assert report.ok, report.exact_failures
    validation = report.passes[0].validation
    # the width the example's branch needs stays: a narrower image is refused by the graph's guard
    assert _verified(report) == [[[1, 3, 16, 16]], [[2, 3, 16, 16]], [[1, 3, 22, 22]]]
    refused = {str(v["shapes"]) for v in validation["not_accepted"]}
    assert refused == {str([[1, 3, 4, 4]])}
    assert validation["limitations"][0].startswith(
        "verified on shapes 1x3x16x16, 2x3x16x16, 1x3x22x22; the converted model does not accept 1x3x4x4, "
        "which the original does (AssertionError: Guard failed:"
    )
    _print_pipeline(report)
    printed = capsys.readouterr().out
    assert "verified on 3 input shapes: 1x3x16x16, 2x3x16x16, 1x3x22x22" in printed
    assert "limited: verified on shapes" in printed


def test_a_forward_that_adapts_itself_to_a_small_input_does_not_keep_the_change():
    """HF Swin sets each layer's window_size to the input's resolution when that is smaller, and keeps
    it: probing a small variant used to leave the model unable to run its own example (a crash in
    convert), and would have saved the converted model so changed."""
    from transformers import SwinConfig, SwinForImageClassification

    from normswap.passes.fuse.modules import FuseNorm

    torch.manual_seed(0)
    config = SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
    )
    model = model_zoo.randomize_norms(SwinForImageClassification(config)).eval()
    windows = [layer.window_size for layer in model.modules() if hasattr(layer, "shift_size")]
    x = torch.randn(1, 3, 32, 32)
    converted, report = Pipeline([FuseNorm()])(model, (x,), {})
    assert report.ok, report.exact_failures
    assert len(_verified(report)) >= 2
    assert [layer.window_size for layer in model.modules() if hasattr(layer, "shift_size")] == windows
    assert [layer.window_size for layer in converted.modules() if hasattr(layer, "shift_size")] == windows
    want = model(x).logits
    torch.testing.assert_close(converted(x).logits, want, rtol=0, atol=1e-5 * float(want.abs().max()))
