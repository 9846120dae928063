"""The one rule of feeding data to a model (normswap.calibrate.feeding), on every command that takes data:
batches go in the model's floating dtype, and data the model cannot take is refused in one sentence
(exit 2) before any work: convert --calibrate once crashed (exit 3) after converting."""

from __future__ import annotations

import json
from pathlib import Path

import model_zoo
import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

runner = CliRunner()
ZOO = str(Path(model_zoo.__file__))
RESNET = f"{ZOO}:resnet18_factory"  # torchvision's, 3 channels, float32


def _images(tmp_path: Path, name: str, channels: int, dtype: torch.dtype) -> str:
    path = tmp_path / name
    torch.save(torch.randn(8, channels, 32, 32, generator=torch.Generator().manual_seed(0)).to(dtype), path)
    return str(path)


def test_data_a_model_cannot_take_is_refused_before_the_work_on_every_command(tmp_path):
    one_channel = _images(tmp_path, "gray.pt", 1, torch.float32)
    out = tmp_path / "out.pt2"
    common = ["--batch-size", "4"]
    convert = runner.invoke(
        app,
        [
            "convert",
            RESNET,
            "--to",
            "groupnorm",
            "--groups",
            "1",
            "--calibrate",
            one_channel,
            *common,
            "-o",
            str(out),
        ],
    )
    recalibrate = runner.invoke(app, ["recalibrate", RESNET, "--data", one_channel, *common, "-o", str(out)])
    reason = "calibration batch 0 (args[0] (4, 1, 32, 32)) does not fit the model: RuntimeError"
    for result in (convert, recalibrate):
        assert result.exit_code == 2, result.output
        assert reason in " ".join(result.output.split())
    assert "swap_norm" not in convert.output  # refused before any pass ran
    validate = runner.invoke(app, ["validate", RESNET, RESNET, "--data", one_channel, *common])
    assert validate.exit_code == 2 and "the original model fails on these inputs" in validate.output
    assert not out.exists()

    # token ids past GPT-2's 64 positions: the same sentence, not an internal error
    tokens = tmp_path / "long.pt"
    torch.save(torch.randint(0, 128, (8, 200), generator=torch.Generator().manual_seed(0)), tokens)
    gpt2 = runner.invoke(
        app,
        [
            "convert",
            f"{ZOO}:gpt2_factory",
            "--to",
            "dyt",
            "--calibrate",
            str(tokens),
            *common,
            "-o",
            str(out),
        ],
    )
    assert gpt2.exit_code == 2, gpt2.output
    assert "calibration batch 0 (args[0] (4, 200)) does not fit the model: IndexError" in " ".join(
        gpt2.output.split()
    )
    assert not out.exists()


def test_float64_data_feeds_a_float32_model_on_every_command(tmp_path):
    doubles = _images(tmp_path, "doubles.pt", 3, torch.float64)
    common = ["--batch-size", "4"]
    report = tmp_path / "convert.json"
    convert = runner.invoke(
        app,
        ["convert", RESNET, "--to", "groupnorm", "--groups", "1", "--calibrate", doubles, *common,
         "-o", str(tmp_path / "c.pt2"), "--report", str(report)],
    )  # fmt: skip
    assert convert.exit_code == 0, convert.output
    calibration = json.loads(report.read_text())["calibration"]
    assert calibration["batches"] == 2  # the 8 float64 images, fed as float32, calibrated the swap
    assert calibration["model_sqnr_after_db"] > calibration["model_sqnr_before_db"] + 20
    recalibrate = runner.invoke(
        app, ["recalibrate", RESNET, "--data", doubles, *common, "-o", str(tmp_path / "r.pt2")]
    )
    assert recalibrate.exit_code == 0, recalibrate.output
    validate = runner.invoke(app, ["validate", RESNET, RESNET, "--data", doubles, *common])
    assert validate.exit_code == 0 and "FAIL" not in validate.output, validate.output
    # nothing asked: figures only, and the verdict line says so (it said FAIL against 40 dB, exit 0)
    assert "verdict (figures only: give --exact or --min-sqnr for a verdict): not judged" in validate.output


def test_data_beyond_the_models_dtype_is_refused_not_fed_as_inf():
    """fp32 data past float16's range would be Inf in a float16 model: the data's fault, said so."""
    import pytest

    from normswap.calibrate.data import ModelInputs
    from normswap.calibrate.feeding import to_model
    from normswap.errors import BadInputError

    batch = ModelInputs((torch.tensor([[1.0, 7.0e4]]),))
    with pytest.raises(
        BadInputError, match=r"beyond float16's range, the model's dtype: largest magnitude 70000"
    ):
        to_model(batch, torch.device("cpu"), torch.float16)
    (cast,) = to_model(ModelInputs((torch.tensor([[1.0, 6.0e4]]),)), torch.device("cpu"), torch.float16).args
    assert cast.dtype == torch.float16 and float(cast[0, 1]) == 6.0e4


def test_a_holdout_of_several_batches_is_said_to_be_compared_on_its_first(tmp_path):
    """recalibrate and distill compare on the first batch of --holdout (read_data, their one reader):
    a source that holds more says so, whether it knows its length (a file) or not (a generator, read
    one batch ahead); one batch says nothing."""
    from normswap.api.sources import read_data

    data, one, two = tmp_path / "data.pt", tmp_path / "one.pt", tmp_path / "two.pt"
    for path, n in ((data, 8), (one, 4), (two, 8)):
        torch.save(torch.randn(n, 3, 8, 8), path)
    example = (torch.randn(1, 3, 8, 8),)
    source, held = read_data(str(data), str(two), example, {}, 4, None)
    assert held is not None and source.notes == [
        f"--holdout {two}: its first batch is compared; it holds more, which are not read"
    ]
    source, _ = read_data(str(data), str(one), example, {}, 4, None)
    assert source.notes == []
    factory = tmp_path / "gen.py"
    factory.write_text(
        "import torch\ndef batches():\n    return (torch.randn(2, 3, 8, 8) for _ in range(3))\n"
    )
    source, _ = read_data(str(data), f"{factory}:batches", example, {}, None, None)
    assert source.notes == [
        f"--holdout {factory}:batches: its first batch is compared; it holds more, which are not read"
    ]


def test_data_for_a_bf16_model_directory_is_fed_in_bf16(tmp_path):
    """A bf16 HF model keeps its rotary inverse frequencies in a float32 buffer: "one floating dtype" over
    parameters and buffers found two and cast nothing, so float64 data met bf16 weights ("double !=
    BFloat16") on every route. The parameters' dtype is the model's."""
    from hf_dirs import make_directory

    from normswap.calibrate.data import ModelInputs
    from normswap.calibrate.feeding import device_and_dtype, fed
    from normswap.load import load_model

    model = load_model(str(make_directory(tmp_path, "llama", torch.bfloat16))).model
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} >= {torch.float32}  # the premise
    assert device_and_dtype(model)[1] == torch.bfloat16
    embeds = torch.randn(2, 5, model.config.hidden_size, dtype=torch.float64)
    batch = fed(model, ModelInputs((), {"inputs_embeds": embeds}))
    assert batch.kwargs["inputs_embeds"].dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(**batch.kwargs).logits
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


def test_calibration_data_with_no_batch_is_refused_not_fitted_on_nothing():
    """calibration_data=[] (or a generator that yields nothing) fitted nothing and the conversion was
    reported ok; the data's one reader refuses it on every route (CalibrationData.take)."""
    from normswap import ConvertConfig, convert
    from normswap.errors import BadInputError

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    args = (torch.randn(2, 3, 8, 8),)
    for empty in ([], (b for b in ())):
        config = ConvertConfig(to="groupnorm", groups=2, calibration_data=empty)
        with pytest.raises(BadInputError, match=r"^calibration_data: no batches to calibrate on$"):
            convert(model, config, args)
