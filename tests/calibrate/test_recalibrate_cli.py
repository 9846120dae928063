"""``normswap recalibrate`` end to end: exit codes, messages, what is written and what is not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import model_zoo
import pytest
import torch
from normswap_cli.app import app
from torchvision.io import write_png
from typer.testing import CliRunner

from normswap.calibrate import recalibrate_batchnorm

ZOO = str(Path(model_zoo.__file__))
runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args))


def _calibration_file(path: Path, n: int = 32, size: int = 32, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))
    torch.save(x, path)
    return x


def _one_line_error(result, text: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], result.output


@pytest.mark.slow
def test_recalibrate_resnet18_factory_writes_model_and_report(tmp_path):
    data = tmp_path / "calib.pt"
    x = _calibration_file(data)
    out, report = tmp_path / "r18.pt", tmp_path / "report.json"
    result = _run(
        "recalibrate", f"{ZOO}:resnet18_factory", "--data", str(data), "--batch-size", "8", "-o", str(out),
        "--report", str(report),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"data file {data}: 32 samples of (3, 32, 32) in batches of 8" in result.output
    assert (
        "recalibrate_batchnorm (data-driven): 20 BatchNorm layers re-estimated on 3 batches (24 samples), 0 skipped"
        in result.output
    )
    assert (
        "held-out batch (8 samples, last batch of the data), outputs after vs before: SQNR" in result.output
    )
    assert f"wrote {out} (pickle)" in result.output

    # the written model carries exactly the statistics the library computes on the same batches
    model, _ = model_zoo.resnet18_factory()
    expected, lib_report = recalibrate_batchnorm(model, list(x.split(8)))
    state = torch.load(out, weights_only=False).state_dict()
    for key, value in expected.state_dict().items():
        if "running" in key:
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=key)

    data_json = json.loads(report.read_text())
    assert data_json["written"] and data_json["ok"] and data_json["kind"] == "data-driven"
    assert data_json["batches"] == 3 and data_json["samples"] == 24 and data_json["batch_sizes"] == [8, 8, 8]
    assert len(data_json["layers"]) == 20 and data_json["skips"] == []
    assert data_json["layers"][0]["path"] == "bn1"
    assert abs(data_json["layers"][0]["mean_shift"] - lib_report.layers[0].mean_shift) < 1e-9
    holdout = data_json["holdout"]["outputs"][0]
    assert abs(holdout["sqnr_db"] - lib_report.holdout.outputs[0].sqnr_db) < 1e-6
    assert data_json["holdout_samples"] == 8


def test_recalibrate_image_folder_with_batches_and_holdout(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        write_png(
            torch.randint(0, 256, (3, 40, 48), generator=g, dtype=torch.uint8), str(folder / f"{i}.png")
        )
    holdout = tmp_path / "holdout.pt"
    _calibration_file(holdout, n=4)
    out = tmp_path / "r18.pt"
    result = _run(
        "recalibrate", f"{ZOO}:resnet18_factory", "--data", str(folder), "--batch-size", "2", "--batches", "2",
        "--normalize", "imagenet", "--holdout", str(holdout), "-o", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "6 images at 3x32x32 in batches of 2, imagenet-normalized" in result.output
    assert "re-estimated on 2 batches (4 samples)" in result.output
    assert "held-out batch (2 samples, separate held-out batch)" in result.output
    # the holdout holds 2 batches of 2: one is compared, and that is said
    said = f"--holdout {holdout}: its first batch is compared; it holds more, which are not read"
    assert said in " ".join(result.output.split())
    model = torch.load(out, weights_only=False)
    assert int(model.bn1.num_batches_tracked) == 2 and model.bn1.momentum == 0.1
    assert not any(m.training for m in model.modules())


@pytest.mark.slow
def test_recalibrate_pt2_input(tmp_path):
    model, args, _ = model_zoo.resnet18(size=32)
    path = tmp_path / "r18.pt2"
    torch.export.save(torch.export.export(model, args, strict=False), path)
    data = tmp_path / "calib.pt"
    _calibration_file(data, n=8)
    out = tmp_path / "out.pt2"
    result = _run("recalibrate", str(path), "--data", str(data), "--batch-size", "2", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "20 BatchNorm layers re-estimated on 3 batches (6 samples)" in result.output and out.exists()

    # the same model written as .pt: a module that runs as the .pt2's program does (issue 26)
    pickled = tmp_path / "out.pt"
    result = _run("recalibrate", str(path), "--data", str(data), "--batch-size", "2", "-o", str(pickled))
    assert result.exit_code == 0, result.output
    assert f"wrote {pickled} (pickle)" in result.output
    with torch.no_grad():
        want = torch.export.load(out).module()(*args)
        got = torch.load(pickled, weights_only=False)(*args)
    assert want.shape == got.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)

    out.unlink()
    result = _run("recalibrate", str(path), "--data", str(data), "--batch-size", "4", "-o", str(out))
    _one_line_error(result, "a .pt2 model takes only the input shapes it was exported for")
    assert not out.exists()


NO_BN = """
import torch
from torch import nn

def build():
    return nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), (torch.zeros(2, 3),)

def frozen():
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, track_running_stats=False)), (torch.zeros(2, 3),)

def bn():
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).eval(), (torch.zeros(2, 3),)

def conv():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval(), (torch.zeros(2, 3, 8, 8),)
"""


def test_failures_exit_2_with_one_line_and_write_nothing(tmp_path):
    factory = tmp_path / "models.py"
    factory.write_text(NO_BN)
    good = tmp_path / "good.pt"
    torch.save(torch.randn(8, 3), good)
    (tmp_path / "empty").mkdir()
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "readme.txt").write_text("not an image")
    torch.save(torch.randn(8, 3, 5), tmp_path / "rank3.pt")
    torch.save(torch.randn(2, 3), tmp_path / "one_batch.pt")
    torch.save(torch.randn(8, 3, 8, 8), tmp_path / "conv.pt")
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    report = tmp_path / "out" / "report.json"
    cases = [
        (f"{factory}:build", good, [], "nothing to recalibrate: the model has no BatchNorm layers"),
        (f"{factory}:frozen", good, [], "BatchNorm1d has track_running_stats=False"),
        (f"{factory}:conv", tmp_path / "empty", [], "holds no files"),
        (f"{factory}:conv", tmp_path / "text", [], "readme.txt is not a JPEG, PNG, GIF or WEBP image"),
        (f"{factory}:bn", tmp_path / "text", [], "images need the model's input size"),
        (
            f"{factory}:bn",
            tmp_path / "rank3.pt",
            ["--batch-size", "4"],
            "(3-D) where the model's example input",
        ),
        (f"{factory}:bn", tmp_path / "one_batch.pt", [], "the data yields a single batch, which is held out"),
        (f"{factory}:bn", good, ["--normalize", "imagenet"], "--normalize applies to an image folder"),
        (f"{factory}:bn", tmp_path / "missing.pt", [], "data not found"),
        (f"{factory}:conv", tmp_path / "conv.pt", ["--holdout", str(tmp_path / "empty")], "holds no files"),
    ]
    for model, data, extra, message in cases:
        result = _run(
            "recalibrate", model, "--data", str(data), "-o", str(out), "--report", str(report), *extra
        )
        _one_line_error(result, message)
        assert list(out.parent.iterdir()) == [], (message, list(out.parent.iterdir()))

    result = _run("recalibrate", f"{factory}:bn", "--data", str(good), "-o", str(out), "--batches", "0")
    assert result.exit_code == 2 and "Invalid value for '--batches'" in result.output
    result = _run("recalibrate", f"{factory}:bn", "--data", str(good), "-o", str(tmp_path / "x.txt"))
    _one_line_error(result, "unknown output format")


def test_non_finite_statistics_fail_the_check_and_write_no_model(tmp_path):
    factory = tmp_path / "models.py"
    factory.write_text(NO_BN)
    x = torch.randn(8, 3)
    x[0, 0] = 3e38  # finite data (NaN data is refused as data) whose variance overflows
    data = tmp_path / "nan.pt"
    torch.save(x, data)
    out, report = tmp_path / "model.pt", tmp_path / "report.json"
    result = _run(
        "recalibrate", f"{factory}:bn", "--data", str(data), "--batch-size", "4", "-o", str(out),
        "--report", str(report),
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "recalibration produced non-finite values in 1; nothing written" in result.output
    assert not out.exists()
    assert json.loads(report.read_text())["written"] is False


def test_recalibrate_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from normswap_cli.app import app\n"
        "assert CliRunner().invoke(app, ['recalibrate', '--help']).exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'triton', 'onnx') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_recalibrate_writes_onnx_as_convert_does(tmp_path):
    """--opset, --static-shapes and --dtype on recalibrate, as on convert (one writer, normswap.save)."""
    data = tmp_path / "calib.pt"
    _calibration_file(data, n=8)
    out, report = tmp_path / "r.onnx", tmp_path / "r.json"
    zoo = str(Path(model_zoo.__file__))
    ran = _run(
        "recalibrate", f"{zoo}:resnet18_factory", "--data", str(data), "--batch-size", "4", "-o", str(out),
        "--opset", "18", "--dtype", "float16", "--report", str(report),
    )  # fmt: skip
    assert ran.exit_code == 0, ran.output
    written = json.loads(report.read_text())["onnx"]
    assert written["opset"] == 18 and written["dynamic_axes"] == {
        "x": {"0": "batch", "2": "height", "3": "width"}
    }
    assert {o["dtype"] for o in written["outputs"]} == {"float16"} and written["within_tolerance"]


def test_recalibrate_a_model_directory_into_a_model_directory(tmp_path):
    """A Hugging Face directory in, a directory out (-o without a suffix), as convert writes one: stock
    classes kept, so transformers' from_pretrained loads the re-estimated statistics."""
    import transformers

    config = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=5
    )
    torch.manual_seed(0)
    transformers.ResNetForImageClassification(config).eval().save_pretrained(tmp_path / "resnet")
    (tmp_path / "resnet" / "preprocessor_config.json").write_text("{}")
    data = tmp_path / "images.pt"
    torch.save(torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 + 1, data)
    out, report = tmp_path / "out", tmp_path / "r.json"
    ran = _run(
        "recalibrate", str(tmp_path / "resnet"), "--data", str(data), "--batch-size", "4", "-o", str(out),
        "--report", str(report),
    )  # fmt: skip
    assert ran.exit_code == 0, ran.output
    assert json.loads(report.read_text())["directory"]["stock_from_pretrained"] is True
    assert (out / "preprocessor_config.json").is_file()  # the input's side files come along
    reloaded = transformers.ResNetForImageClassification.from_pretrained(out).eval()
    norm = "resnet.embedder.embedder.normalization"
    before = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "resnet").get_submodule(
        norm
    )
    after = reloaded.get_submodule(norm)
    # the statistics moved to the data's, and are what the same run writes into a .pt
    assert not torch.allclose(before.running_mean, after.running_mean)
    ran = _run(
        "recalibrate",
        str(tmp_path / "resnet"),
        "--data",
        str(data),
        "--batch-size",
        "4",
        "-o",
        str(tmp_path / "m.pt"),
    )
    assert ran.exit_code == 0, ran.output
    pickled = torch.load(tmp_path / "m.pt", weights_only=False).get_submodule(norm)
    for name in ("running_mean", "running_var", "weight", "bias"):
        assert torch.equal(getattr(pickled, name), getattr(after, name)), name
