"""Bad input to any command: one line on stderr, exit 2, nothing written, never a traceback."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.errors import BadInputError
from normswap.load import atomic_write, inputs, make_inputs, parse_input_shape
from normswap.load import save as save_module

CONV = str(Path(__file__).resolve().parents[1] / "examples" / "small_convnet.py") + ":build"
runner = CliRunner()

GREEDY = """\
import torch
from torch import nn


class Greedy(nn.Module):
    def forward(self, x):
        return x + x.new_empty(10**14).sum()  # 400 TB: more than any address space


def build():
    return Greedy()
"""

# --input-shape 1,5,8,8 on a 3-channel conv
WRONG_CHANNELS = (
    "the model does not run on the example inputs (float32[1, 5, 8, 8]): RuntimeError: Given groups=1, "
    "weight of size [16, 3, 3, 3], expected input[1, 5, 8, 8] to have 3 channels, but got 5 channels instead"
)


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    torch.save(torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)), tmp_path / "data.pt")
    torch.save({"y": torch.randn(1, 3, 8, 8)}, tmp_path / "kwargs.pt")
    (tmp_path / "greedy.py").write_text(GREEDY)
    return tmp_path


def _bad_input(argv: list[str], directory: Path, line: str, *, prefix: bool = False) -> str:
    """Exit 2 with exactly one line on stderr (``line``, or starting with it), and no new file."""
    before = sorted(p.name for p in directory.iterdir())
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {line}") if prefix else lines[0] == f"error: {line}", result.stderr
    assert sorted(p.name for p in directory.iterdir()) == before
    return lines[0]


@pytest.mark.parametrize(
    ("options", "line"),
    [
        (["--input-shape", "1,5,8,8"], WRONG_CHANNELS),
        (
            ["--input-shape", "int64:1,3,8,8"],
            "the model does not run on the example inputs (int64[1, 3, 8, 8]): RuntimeError: expected scalar "
            "type Long but found Float",
        ),
        (
            ["--inputs", "kwargs.pt"],
            "the model does not run on the example inputs (y=float32[1, 3, 8, 8]): TypeError: "
            "SmallConvNet.forward() got an unexpected keyword argument 'y'",
        ),
    ],
    ids=["channels", "dtype", "keyword"],
)
def test_convert_inputs_that_do_not_fit_the_model(work, options, line):
    _bad_input(["convert", CONV, "--fold-bn", "-o", "out.pt", *options], work, line)


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (["inspect", CONV, "--json", "sites.json"], WRONG_CHANNELS),
        (["export", CONV, "-o", "out.onnx", "--report", "r.json"], WRONG_CHANNELS),
        (["recalibrate", CONV, "--data", "data.pt", "--batch-size", "4", "-o", "out.pt"], WRONG_CHANNELS),
        (
            ["distill", CONV, CONV, "--data", "data.pt", "--batch-size", "4", "--steps", "1", "-o", "out.pt"],
            WRONG_CHANNELS.replace("the model", "ORIGINAL"),
        ),
    ],
    ids=["inspect", "export", "recalibrate", "distill"],
)
def test_every_command_checks_the_inputs_before_its_work(work, command, line):
    _bad_input([*command, "--input-shape", "1,5,8,8"], work, line)


HUGE = ["--input-shape", "100000000,3,224,224"]  # 60 TB of float32


@pytest.mark.parametrize(
    "command",
    [
        ["convert", CONV, "--fold-bn", "-o", "out.pt"],
        ["inspect", CONV, "--json", "sites.json"],
        ["export", CONV, "-o", "out.onnx"],
        ["validate", CONV, CONV, "--report", "r.json"],
        ["recalibrate", CONV, "--data", "data.pt", "--batch-size", "4", "-o", "out.pt"],
        ["distill", CONV, CONV, "--data", "data.pt", "--batch-size", "4", "--steps", "1", "-o", "out.pt"],
    ],
    ids=lambda argv: argv[0],
)
def test_inputs_larger_than_memory_are_refused_before_allocating(work, command):
    line = "input shape float32:100000000,3,224,224 needs 60.2 TB of memory, more than this machine's "
    _bad_input([*command, *HUGE], work, line, prefix=True)


def test_an_allocation_failure_while_making_inputs(monkeypatch):
    monkeypatch.setattr(inputs, "_machine_memory", lambda: None)  # as where the memory size is unknown
    with pytest.raises(BadInputError) as info:
        make_inputs([parse_input_shape("100000,1000,1000")])  # 400 TB: no address space holds it
    assert str(info.value).startswith(
        "cannot allocate an input of shape float32:100000,1000,1000: out of memory"
    )
    assert str(info.value).endswith("; give a smaller shape")


def test_a_model_that_runs_out_of_memory(work):
    argv = ["convert", "greedy.py:build", "--to", "fused", "--input-shape", "2,4", "-o", "out.pt"]
    line = _bad_input(
        argv, work, "the model runs out of memory on the example inputs (float32[2, 4]) (", prefix=True
    )
    assert "can't allocate memory" in line and line.endswith("): give smaller inputs")


def _read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refuse_temp_files(path, *args, **kwargs):
        if ".normswap-tmp-" in os.fspath(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_open(path, *args, **kwargs)

    # tests run as root, for whom chmod does not stop a write: fail the way a read-only mount does
    monkeypatch.setattr(save_module.os, "open", refuse_temp_files)


def test_atomic_write_to_a_read_only_file_system(tmp_path, monkeypatch):
    _read_only(monkeypatch)
    with pytest.raises(BadInputError) as info:
        atomic_write(tmp_path / "out.pt", lambda t: t.write_bytes(b"x"))
    assert str(info.value) == f"cannot write to output directory {tmp_path}: Read-only file system"
    assert list(tmp_path.iterdir()) == []


def test_inspect_json_to_a_read_only_file_system(work, monkeypatch):
    _read_only(monkeypatch)
    line = f"cannot write to output directory {work / 'out'}: Read-only file system"
    (work / "out").mkdir()
    _bad_input(["inspect", CONV, "--json", str(work / "out" / "sites.json")], work / "out", line)
