"""A 3-d floating input's length is free in a written program wherever the conversion verified it.

A Conv1d network's input is ``N x C x L``; a sequence of embeddings is ``N x T x D``. The conversion
verifies both kinds on other lengths (normswap.verify.variants: "channels-first size" changes dim 2,
"channels-last size" dim 1, and the model rejects the one that is its channels or hidden size). The
written ``.pt2`` and ``.onnx`` used to keep every dim but the batch at the example's size, so a Conv1d
program took one length only, and the note blamed torch.export for fixing "the image size". Now the dim
the model runs with at other sizes is freed (:func:`normswap.graph.capture._length_dims`), the other one
stays fixed, and a length that stays fixed is explained by what fixed it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

import normswap
from normswap.graph import capture

pytest.importorskip("onnxruntime")


def _conv1d_net() -> nn.Module:
    """The tester's network, its BatchNorm's statistics warmed on random data, then in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), nn.Conv1d(8, 8, 3, padding=1)
    )
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 4, 32) * 2 + 1)
    return model.eval()


class _Embeddings(nn.Module):
    """``N x T x D`` embeddings through a pre-LN attention block: T is a length, D a hidden size."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2, self.heads = nn.LayerNorm(d), nn.LayerNorm(d), heads
        self.qkv, self.proj, self.mlp = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class _BranchOnLength(nn.Module):
    """A Conv1d network whose code branches on the length: torch.export keeps the length within the
    example's branch (``L >= 21``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return y * 2 if x.shape[-1] > 20 else y


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def _onnx_input_dims(path: Path) -> list[list[str | int]]:
    import onnx

    graph = onnx.load(str(path)).graph
    return [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input]


@pytest.mark.parametrize("suffix", ["pt2", "onnx"])
def test_the_cli_writes_a_conv1d_program_that_takes_every_verified_length(tmp_path, suffix):
    """The tester's command on a pickled whole module: the .pt2 loads back with torch.export.load and
    runs at lengths 8, 64 and 77 (it took 32 only), the .onnx declares the length free (it was 32), both
    compute what the model computes there, and the note says every verified shape is taken."""
    model = _conv1d_net()
    torch.save(model, tmp_path / "model.pt")
    out, report = tmp_path / f"out.{suffix}", tmp_path / "report.json"
    argv = ["convert", str(tmp_path / "model.pt"), "--trust-pickle", "--fold-bn", "--input-shape", "2,4,32"]
    result = CliRunner().invoke(app, [*argv, "-o", str(out), "--report", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    verified = ["2x4x32", "3x4x32", "1x4x32", "2x4x8", "2x4x64"]
    assert data["written_shapes"] == {"verified": verified, "accepted": verified, "rejected": []}
    assert data["output_messages"] == [f"{out} takes every shape it was verified on: {', '.join(verified)}"]
    assert "torch.export fixed" not in result.output and "image size" not in result.output
    inputs = [torch.randn(2, 4, 8), torch.randn(3, 4, 64), torch.randn(1, 4, 77)]
    if suffix == "pt2":
        program = torch.export.load(out).module()
        for x in inputs:
            _close(program(x), model(x))
        with pytest.raises(Exception, match="Guard failed"):  # the channels stay the weight's 4
            program(torch.randn(2, 5, 32))
    else:
        from normswap.export.onnx import run_onnx

        ((batch, channels, length),) = _onnx_input_dims(out)
        assert (batch, channels) == ("batch", 4) and isinstance(length, str) and length, length
        for x in inputs:
            _close(run_onnx(out, (x,), {})[0], model(x))


def test_a_pt2_input_converted_keeps_its_free_length(tmp_path):
    """A .pt2 the user exported with a free length, converted with --fold-bn: the written program keeps
    the length free (it was fixed at the example's 32)."""
    model = _conv1d_net()
    dims = {0: torch.export.Dim("batch"), 2: torch.export.Dim("length", min=2, max=4096)}
    exported = torch.export.export(model, (torch.randn(2, 4, 32),), dynamic_shapes=(dims,))
    torch.export.save(exported, tmp_path / "model.pt2")
    out = tmp_path / "out.pt2"
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "model.pt2"), "--fold-bn", "-o", str(out)])
    assert result.exit_code == 0, result.output
    program = torch.export.load(out).module()
    for x in (torch.randn(2, 4, 8), torch.randn(5, 4, 100)):
        _close(program(x), model(x))


@pytest.mark.parametrize(
    ("build", "example", "free", "other"),
    [
        # embeddings: the length T (dim 1) is free, the hidden size D (dim 2) stays the weights' 16
        (_Embeddings, (2, 12, 16), 1, [(3, 3, 16), (2, 24, 16), (1, 7, 16)]),
        # mono audio N x 1 x L: the length is free, the one channel stays 1 (never grown to 2 to trace)
        (
            lambda: nn.Sequential(nn.Conv1d(1, 4, 5, padding=2), nn.BatchNorm1d(4)),
            (2, 1, 32),
            2,
            [(3, 1, 8), (1, 1, 100)],
        ),
    ],
    ids=["N x T x D", "N x 1 x L"],
)
def test_the_dim_the_model_varies_is_free_and_the_other_is_not(tmp_path, build, example, free, other):
    """The verified dim is chosen from what the model runs with, not from the input's rank: the .pt2
    and the .onnx take other lengths along it and nothing else."""
    torch.manual_seed(0)
    x = torch.randn(*example)
    for suffix in ("pt2", "onnx"):
        config = normswap.ConvertConfig(output=tmp_path / f"m.{suffix}", to="rmsnorm", fold_bn=True)
        result = normswap.convert(build().eval(), config, example_args=(x,))
        model, saved = result.model, normswap.save(result)
        assert saved.shapes is not None and not saved.shapes.rejected, saved.shapes
        assert len(saved.shapes.accepted) == 5, saved.shapes  # the example, 2 batches, 2 lengths
        fixed = 3 - free  # the channel or hidden dim
        if suffix == "onnx":
            (dims,) = _onnx_input_dims(saved.path)
            assert isinstance(dims[free], str) and dims[fixed] == example[fixed], dims
            continue
        program = torch.export.load(saved.path).module()
        for shape in other:
            y = torch.randn(*shape)
            with torch.no_grad():
                _close(program(y), model(y))
        wrong = list(example)
        wrong[fixed] += 1
        with pytest.raises(Exception, match="Guard failed"):
            program(torch.randn(*wrong))


def test_a_length_torch_export_fixes_is_named_as_a_length(tmp_path):
    """A model that branches on its length: the program takes the verified length on the example's
    branch (64), rejects the other (8) with torch.export's guard, and the note says torch.export fixed
    the length, not an image size."""
    torch.manual_seed(0)
    model = _BranchOnLength().eval()
    x = torch.randn(2, 4, 32)
    config = normswap.ConvertConfig(output=tmp_path / "m.pt2", fold_bn=True)
    saved = normswap.save(normswap.convert(model, config, example_args=(x,)))
    assert saved.shapes is not None
    assert saved.shapes.accepted == ["2x4x32", "3x4x32", "1x4x32", "2x4x64"]
    assert [r["shapes"] for r in saved.shapes.rejected] == ["2x4x8"]
    assert "x.size()[2] >= 21" in saved.shapes.rejected[0]["error"]
    (message,) = saved.messages
    assert message.endswith(
        "(torch.export bounded or fixed the length where the model's code ties it to the example's)"
    )
    assert "image size" not in message


def test_a_length_normswap_fixes_says_so_and_does_not_blame_torch_export(tmp_path, monkeypatch):
    """Past the time budget for freeing the length, the program keeps the example's length (its batch
    free): the note says normswap's export with free lengths took too long, and names the lengths the
    program rejects without claiming torch.export fixed them."""
    monkeypatch.setattr(capture, "IMAGE_SIZE_BUDGET", (0.001, 0.0))
    model = _conv1d_net()
    config = normswap.ConvertConfig(output=tmp_path / "m.pt2", fold_bn=True)
    saved = normswap.save(normswap.convert(model, config, example_args=(torch.randn(2, 4, 32),)))
    assert saved.shapes is not None and saved.shapes.accepted == ["2x4x32", "3x4x32", "1x4x32"]
    assert [r["shapes"] for r in saved.shapes.rejected] == ["2x4x8", "2x4x64"]
    fallback, taken = saved.messages
    assert "the export with free lengths took over 0 s" in fallback
    assert fallback.endswith("so they are fixed at the example's")
    assert "rejects 2x4x8" in taken and "torch.export fixed" not in taken


def test_finding_the_length_leaves_the_model_as_it_was():
    """The model is run on other lengths to find which dim of a 3-d input is free: dim 2 of a Conv1d's
    input, not its channels; a model in training mode keeps its mode and its BatchNorm statistics, and
    what its forward rebinds (as HF Swin shrinks its windows to a small input) is put back."""

    class Remembers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.last = nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x.shape[-1]
            return self.bn(self.conv(x))

    torch.manual_seed(0)
    model = Remembers().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 4, 32)
    free = capture._length_dims(model, (x,), {})
    assert [free(x, d) for d in range(3)] == [
        torch.export.Dim.AUTO,
        torch.export.Dim.STATIC,
        torch.export.Dim.AUTO,
    ]
    assert model.training and model.bn.training and model.last is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_finding_the_length_leaves_the_inputs_as_they_were():
    """A forward that writes into an input it is given (a mask scaled in place) is run on copies: the
    example the conversion goes on with is the user's."""

    class ScalesItsMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(4, 8, 3, padding=1)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            mask.mul_(2)
            return self.conv(x) * mask

    x, mask = torch.randn(2, 4, 32), torch.ones(2, 1, 1)
    free = capture._length_dims(ScalesItsMask(), (x,), {"mask": mask})
    assert free(x, 2) == torch.export.Dim.AUTO  # the probe ran (and would have doubled the mask twice)
    assert torch.equal(mask, torch.ones(2, 1, 1))
