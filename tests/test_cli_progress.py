"""What a user sees while normswap works: --version, flags that look like flags in --help, and progress
on a terminal that stays out of pipes and --report runs."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
from normswap_cli import app as cli
from normswap_cli import render
from rich.console import Console
from typer.testing import CliRunner

runner = CliRunner()

FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn


    def convnet():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
        return model, (torch.randn(2, 3, 8, 8),)
    """
)

# What the spinner says during a --fold-bn run (each long phase names itself).
PHASES = ("capturing a graph of the model", "fold_batchnorm: rewriting", "fold_batchnorm: validating")


@pytest.fixture
def factory(tmp_path: Path) -> str:
    path = tmp_path / "progress_models.py"
    path.write_text(FACTORY)
    return f"{path}:convnet"


def test_version_is_printed_without_importing_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from normswap_cli.app import app\n"
        "result = CliRunner().invoke(app, ['--version'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(result.output.strip())\n"
        "print(sorted(m for m in ('torch', 'triton', 'onnx') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    printed, heavy = out.stdout.strip().splitlines()
    assert printed == f"normswap {version('normswap')}" == "normswap 0.1.0"
    assert heavy == "[]"


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (
            "convert",
            [
                "--trust-pickle",
                "--fold-bn",
                "--fuse-add",
                "--fuse-inline",
                "--fold-norm-affine",
                "--remove-weight-norm",
                "--exact",
                "--allow-lossy",
            ],
        ),
        ("export", ["--trust-pickle", "--static-shapes"]),
        ("validate", ["--trust-pickle", "--exact"]),
        ("inspect", ["--trust-pickle"]),
    ],
)
def test_boolean_options_look_like_flags_in_help(command, flags):
    result = runner.invoke(cli.app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for flag in flags:
        line = next(ln for ln in result.output.splitlines() if re.search(rf"{flag}(\s|$)", ln))
        assert not re.search(rf"{flag}\s+<bool>", line), line


def test_no_progress_in_a_pipe(factory, tmp_path):
    result = runner.invoke(cli.app, ["convert", factory, "--fold-bn", "-o", str(tmp_path / "f.pt2")])
    assert result.exit_code == 0, result.output
    assert not any(phase in result.output for phase in PHASES)


def _terminal(monkeypatch) -> io.StringIO:
    buffer = io.StringIO()
    # wide enough that no status line wraps, whatever the length of the temp path in it
    monkeypatch.setattr(render, "err", Console(file=buffer, force_terminal=True, width=1000))
    return buffer


def test_progress_on_a_terminal(factory, tmp_path, monkeypatch):
    buffer = _terminal(monkeypatch)
    result = runner.invoke(cli.app, ["convert", factory, "--fold-bn", "-o", str(tmp_path / "f.pt2")])
    assert result.exit_code == 0, result.output
    shown = buffer.getvalue()
    assert all(phase in shown for phase in PHASES), shown
    assert f"exporting {tmp_path / 'f.pt2'}" in shown
    assert not any(phase in result.output for phase in PHASES)  # stdout keeps the report only


def test_progress_of_inspect_and_export_on_a_terminal(factory, tmp_path, monkeypatch):
    buffer = _terminal(monkeypatch)
    assert runner.invoke(cli.app, ["inspect", factory]).exit_code == 0
    assert "capturing a graph of the model" in buffer.getvalue()
    onnx = tmp_path / "m.onnx"
    result = runner.invoke(cli.app, ["export", factory, "-o", str(onnx)])
    assert result.exit_code == 0, result.output
    assert "to ONNX and checking it in onnxruntime" in buffer.getvalue()


def test_no_progress_in_a_report_run_even_on_a_terminal(factory, tmp_path, monkeypatch):
    buffer = _terminal(monkeypatch)
    report = tmp_path / "r.json"
    result = runner.invoke(
        cli.app, ["convert", factory, "--fold-bn", "-o", str(tmp_path / "f.pt2"), "--report", str(report)]
    )
    assert result.exit_code == 0, result.output
    assert not any(phase in buffer.getvalue() for phase in PHASES)
