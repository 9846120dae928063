"""Integer and bool outputs are compared in the ONNX check as everywhere else: equal, element for element
(they were left out, so a model returning only argmax ids was refused with "no output was compared")."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

HERE = str(Path(__file__))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))
        return {"label": logits.argmax(-1), "confident": logits.max(-1).values > 0}


def argmax_factory() -> tuple[nn.Module, tuple]:
    model = Classifier()
    model.train()
    model(torch.randn(8, 3, 12, 12))
    return model.eval(), (torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1)),)


def test_an_integer_only_model_exports_and_its_outputs_are_compared(tmp_path):
    for argv in (
        ["export", f"{HERE}:argmax_factory", "-o", str(tmp_path / "e.onnx")],
        ["convert", f"{HERE}:argmax_factory", "--fold-bn", "-o", str(tmp_path / "c.onnx")],
    ):
        report = tmp_path / "report.json"
        result = CliRunner().invoke(app, [*argv, "--report", str(report)])
        assert result.exit_code == 0, result.output
        data = json.loads(report.read_text())
        onnx = data.get("onnx") or data.get("output", {}).get("onnx") or data
        text = json.dumps(onnx)
        assert '"dtype": "int64"' in text and '"dtype": "bool"' in text, text[:2000]
        report.unlink()


def test_an_integer_output_that_differs_fails_the_check():
    """The rule the ONNX check applies per output: a float within onnxruntime's tolerance agrees; an
    integer or bool output agrees only when equal, element for element."""
    from normswap.export.onnx import _agrees
    from normswap.verify.metrics import compare_tensors

    ids = torch.tensor([3, 1, 4, 1, 5])
    assert _agrees(compare_tensors("ids", ids, ids.clone()))
    assert not _agrees(compare_tensors("ids", ids, torch.tensor([3, 1, 4, 1, 6])))
    mask = torch.tensor([True, False, True])
    assert not _agrees(compare_tensors("mask", mask, ~mask))
    x = torch.randn(64)
    assert _agrees(compare_tensors("x", x, x * (1 + 1e-6)))
    assert not _agrees(compare_tensors("x", x, x * 1.01))
