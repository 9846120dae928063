"""A large model's .onnx: its weights in an external data file OUT.onnx.data beside it (ONNX's own answer
to protobuf's 2 GiB limit), checked in onnxruntime from the path, published with the .onnx, covered by
the output rule. The threshold is lowered so that a tiny model takes that route."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

import normswap.load.onnx_file as onnx_file
from normswap.export.onnx import export_onnx, run_onnx

FACTORY = """\
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)).eval()
    return model, (torch.randn(2, 16),)
"""


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    return model.eval(), torch.randn(2, 16)


def _external_initializers(path: Path) -> list[str]:
    proto = onnx.load(str(path), load_external_data=False)
    return [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


@pytest.mark.parametrize("target", ["standard", "onnxruntime"])
def test_a_large_model_is_written_with_its_data_file_and_checked_from_the_path(tmp_path, target):
    model, x = _model()
    out = tmp_path / "out.onnx"
    result = export_onnx(model, out, (x,), external_data_bytes=0, target=target)
    assert result.external_data == "out.onnx.data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "out.onnx.data"]
    assert {"0.weight", "2.weight"} <= set(_external_initializers(out))  # (tiny tensors stay inline)
    # the onnxruntime check ran (on the file with its data file) and agreed with PyTorch
    assert result.outputs and result.within_tolerance
    (got,) = run_onnx(out, (x,), {})
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)


def test_a_small_model_keeps_its_weights_inside(tmp_path):
    model, x = _model()
    result = export_onnx(model, tmp_path / "out.onnx", (x,))
    assert result.external_data is None and _external_initializers(tmp_path / "out.onnx") == []
    assert [p.name for p in tmp_path.iterdir()] == ["out.onnx"]


def test_the_cli_writes_the_data_file_says_so_and_replaces_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.py").write_text(FACTORY)
    runner = CliRunner()
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    monkeypatch.setattr(onnx_file, "EXTERNAL_DATA_BYTES", 0)
    argv = ["export", "small.py:build", "-o", str(out), "--report", str(report)]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["onnx"]["external_data"] == "out.onnx.data"
    assert "weights in out.onnx.data beside the .onnx" in result.output
    assert (tmp_path / "out.onnx.data").is_file()
    # again without --overwrite: both files are outputs, refused before any work
    again = runner.invoke(app, argv)
    assert again.exit_code == 2 and f"-o {out} exists: pass --overwrite to replace it" in again.stderr
    # replaced by a small export: the data file of the old output goes with it
    monkeypatch.setattr(onnx_file, "EXTERNAL_DATA_BYTES", 1 << 30)
    replaced = runner.invoke(app, [*argv, "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert not (tmp_path / "out.onnx.data").exists() and _external_initializers(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "report.json", "small.py"]
