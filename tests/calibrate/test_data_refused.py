"""Data that no command may calibrate, fit or distil on is refused by the one data loader, on every
command that reads data, with one line naming the file, the batch and where: NaN/Inf values, tensors
that are not plain dense data (a Parameter, sparse, meta, empty), and expanded views that declare far
more rows than the file holds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from hf_dirs import make_directory
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.calibrate import load_calibration_data
from normswap.errors import BadInputError

CONV = str(Path(__file__).resolve().parents[2] / "examples" / "small_convnet.py") + ":build"
SHAPE = ["--input-shape", "1,3,8,8"]
runner = CliRunner()


def _images(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    torch.save(_images(), root / "good.pt")
    bad = _images(1)
    bad[5, 1, 2, 3] = float("nan")  # batch 1 (of 4 rows), its row 1
    torch.save(bad, root / "nan.pt")
    ids = torch.randint(0, 300, (8, 6), generator=torch.Generator().manual_seed(0)).double()
    ids[6, 4] = float("inf")
    torch.save(ids, root / "ids_inf.pt")
    torch.save(torch.randint(0, 300, (8, 6), generator=torch.Generator().manual_seed(0)), root / "ids.pt")
    make_directory(root, "llama")
    return root


def _refused(argv: list[str], cwd: Path, *parts: str) -> str:
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    assert not (cwd / "out.pt").exists() and not (cwd / "out").exists()
    return lines[0]


NAN_AT = "holds 1 NaN/Inf value(s), the first (nan) at index [5, 1, 2, 3] (batch 1): clean the data"


@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (["convert", CONV, *SHAPE, "--to", "dyt", "--calibrate", "nan.pt"], NAN_AT),
        (["recalibrate", CONV, *SHAPE, "--data", "nan.pt"], NAN_AT),
        # the held-out file's NaN is in its batch 1, which the command never feeds: refused all the same
        (["recalibrate", CONV, *SHAPE, "--data", "good.pt", "--holdout", "nan.pt"], NAN_AT),
        (["distill", CONV, CONV, *SHAPE, "--data", "nan.pt", "--steps", "1"], NAN_AT),
        (["distill", CONV, CONV, *SHAPE, "--data", "good.pt", "--holdout", "nan.pt", "--steps", "1"], NAN_AT),
        (
            ["convert", "llama-float32", "--to", "layernorm", "--calibrate", "ids_inf.pt", "--sequential"],
            "holds 1 NaN/Inf value(s), the first (inf) at index [6, 4] (batch 1)",
        ),
    ],
    ids=[
        "convert-calibrate",
        "recalibrate-data",
        "recalibrate-holdout",
        "distill-data",
        "distill-holdout",
        "sequential",
    ],
)
def test_nan_or_inf_data_is_refused_by_every_command(files, tmp_path, monkeypatch, argv, where):
    monkeypatch.chdir(files)
    data = next(a for a in argv if a.endswith(".pt") and a != "good.pt")
    out = ["-o", str(tmp_path / ("out" if "--sequential" in argv else "out.pt"))]
    _refused([*argv, "--batch-size", "4", *out], tmp_path, f"error: data file {data} {where}")


def test_a_nan_in_a_list_of_batches_is_named_by_its_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = [_images()[:4], _images(1)[:4]]
    bad[1][2, 0, 0, 1] = float("inf")
    bad[1][3, 0, 0, 0] = float("-inf")  # an image's -Inf is no mask's: counted as well
    torch.save(bad, tmp_path / "batches.pt")
    line = "error: data file batches.pt: batch 1, args[0] holds 2 NaN/Inf value(s), the first (inf) at "
    _refused(
        ["recalibrate", CONV, *SHAPE, "--data", "batches.pt", "-o", "out.pt"],
        tmp_path,
        line + "index [2, 0, 0, 1]",
    )


def _expanded() -> torch.Tensor:
    return torch.randn(1, 3, 8, 8).expand(10**7, 3, 8, 8)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (
            torch.nn.Parameter(torch.randn(8, 3, 8, 8)),
            "is a torch.nn.Parameter (a model's weight), not plain data",
        ),
        (
            torch.randn(8, 3, 8, 8).to_sparse(),
            "is a sparse_coo tensor of shape (8, 3, 8, 8): give dense tensors",
        ),
        (
            torch.empty(8, 3, 8, 8, device="meta"),
            "is on the meta device (a shape of (8, 3, 8, 8) without values)",
        ),
        (
            [torch.zeros(4, 3, 0, 8)],
            "batch 0, args[0] has shape (4, 3, 0, 8): it holds no values",
        ),
        (torch.zeros(8, 3, 0, 8), "data file bad.pt has shape (8, 3, 0, 8): it holds no values"),
        (_expanded(), "is an expanded view of shape (10000000, 3, 8, 8) over 768 bytes"),
        ([_expanded()[:64]], "batch 0, args[0] is an expanded view of shape (64, 3, 8, 8)"),
    ],
    ids=["parameter", "sparse", "meta", "empty-batch", "empty", "stride0", "stride0-batch"],
)
def test_tensors_that_are_not_plain_data_are_refused_quickly(files, tmp_path, monkeypatch, payload, reason):
    torch.save(payload, tmp_path / "bad.pt")
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    _refused(
        ["recalibrate", CONV, *SHAPE, "--data", "bad.pt", "-o", "out.pt"],
        tmp_path,
        "data file bad.pt",
        reason,
    )
    # a 1 kB file declaring 10^7 rows is refused before any row is read (it ran past 300 s)
    assert time.perf_counter() - start < 30


def test_token_ids_of_length_zero_are_refused(files, tmp_path, monkeypatch):
    monkeypatch.chdir(files)
    torch.save(torch.zeros(4, 0, dtype=torch.long), tmp_path / "ids_empty.pt")
    _refused(
        [
            "convert",
            "llama-float32",
            "--to",
            "layernorm",
            "--calibrate",
            str(tmp_path / "ids_empty.pt"),
            "-o",
            str(tmp_path / "out"),
        ],
        tmp_path,
        f"error: data file {tmp_path / 'ids_empty.pt'} has shape (4, 0): it holds no values",
    )


def test_the_rule_is_the_loaders_whatever_the_source(tmp_path):
    # a factory's batches pass the same check as a file's
    bad = [torch.ones(2, 3), torch.tensor([[1.0, float("inf"), 0.0]])]
    path = tmp_path / "batches.pt"
    torch.save(bad, path)
    with pytest.raises(
        BadInputError,
        match=r"batch 1, args\[0\] holds 1 NaN/Inf value\(s\), the first \(inf\) at index \[0, 1\]",
    ):
        list(load_calibration_data(path))
    # an additive mask's -Inf (0 and -Inf only, as an example input may hold) is read as it is on every
    # route; a -Inf among other values is the data's fault, as a +Inf is
    torch.save([torch.zeros(2, 3), torch.tensor([[0.0, float("-inf"), 0.0]])], path)
    assert len(list(load_calibration_data(path))) == 2
    torch.save([torch.ones(2, 3), torch.tensor([[1.0, float("-inf"), 0.0]])], path)
    with pytest.raises(
        BadInputError, match=r"holds 1 NaN/Inf value\(s\), the first \(-inf\) at index \[0, 1\]"
    ):
        list(load_calibration_data(path))
    # integer data cannot hold NaN: read as it is
    assert len(list(load_calibration_data(files_ids(tmp_path)))) == 1


def files_ids(root: Path) -> Path:
    torch.save(torch.arange(12).reshape(3, 4), root / "ids.pt")
    return root / "ids.pt"


@pytest.mark.parametrize("route", [[], ["--sequential"]], ids=["in-memory", "sequential"])
@pytest.mark.parametrize(
    ("value", "reason"),
    [(300, "holds token id 300 at index [1, 2]"), (-1, "holds token id -1 at index [1, 2]")],
    ids=["past-vocab", "negative"],
)
def test_token_ids_outside_the_vocabulary_are_refused_on_both_routes(files, tmp_path, route, value, reason):
    ids = torch.randint(0, 300, (8, 6), generator=torch.Generator().manual_seed(0))
    ids[5, 2] = value  # batch 1, its row 1
    torch.save(ids, tmp_path / "ids.pt")
    argv = [
        "convert",
        str(files / "llama-float32"),
        "--to",
        "layernorm",
        "--calibrate",
        str(tmp_path / "ids.pt"),
    ]
    _refused(
        [*argv, "--batch-size", "4", *route, "-o", str(tmp_path / "out")],
        tmp_path,
        f"batch 1, kwargs['input_ids'] {reason}, outside the model's vocabulary [0, 300)",
    )


def test_batches_given_to_the_library_are_held_to_the_same_rule():
    """``ConvertConfig(calibration_data=[...])``: batches handed over as objects, not a file, are checked
    by the same rule before any fit runs."""
    import normswap
    from normswap.load import load_model

    model = load_model(CONV).model.eval()
    good, bad = _images(0)[:4], _images(1)[:4].clone()
    bad[2, 0, 1, 1] = float("inf")
    config = normswap.ConvertConfig(to="groupnorm", groups=1, calibration_data=[good, bad])
    with pytest.raises(BadInputError, match=r"calibration_data: batch 1, args\[0\] holds 1 NaN/Inf"):
        normswap.convert(model, config, (good,))


@pytest.mark.parametrize("command", ["distill", "distill-holdout", "validate"])
def test_token_ids_outside_the_vocabulary_are_refused_by_every_command(files, tmp_path, command):
    """The check runs in the data loader for every command that hands it the model, not per command."""
    ids = torch.randint(0, 300, (8, 6), generator=torch.Generator().manual_seed(0))
    # batch 1, its row 1; a held-out file gives its first batch only
    ids[1 if command == "distill-holdout" else 5, 2] = 300
    torch.save(ids, tmp_path / "bad_ids.pt")
    model, bad, good = str(files / "llama-float32"), str(tmp_path / "bad_ids.pt"), str(files / "ids.pt")
    argv = {
        "distill": ["distill", model, model, "--data", bad, "--steps", "1", "-o", str(tmp_path / "out.pt")],
        "distill-holdout": [
            "distill",
            model,
            model,
            "--data",
            good,
            "--holdout",
            bad,
            "--steps",
            "1",
            "-o",
            str(tmp_path / "out.pt"),
        ],
        "validate": ["validate", model, model, "--data", bad],
    }[command]
    _refused(
        [*argv, "--batch-size", "4"],
        tmp_path,
        "kwargs['input_ids'] holds token id 300 at index [1, 2], outside the model's vocabulary [0, 300)",
    )


def test_batches_given_as_objects_with_a_model_file_and_an_output(tmp_path):
    """The library route checks its paths before the work (a model file and an output); batches given as
    objects are no path to check (they crashed that check: os.fspath of a list)."""
    import normswap

    good, bad = _images(0)[:4], _images(1)[:4].clone()
    bad[0, 0, 0, 0] = float("nan")
    config = normswap.ConvertConfig(
        to="groupnorm", groups=1, calibration_data=[good, bad], output=tmp_path / "out.pt2"
    )
    with pytest.raises(BadInputError, match=r"calibration_data: batch 1, args\[0\] holds 1 NaN"):
        normswap.convert(CONV, config)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["recalibrate", CONV, *SHAPE, "--data", "good.pt", "--holdout", "rank3.pt", "-o", "out.pt"],
        ["validate", CONV, CONV, *SHAPE, "--data", "rank3.pt"],
    ],
    ids=["holdout", "validate-data"],
)
def test_a_file_that_is_not_calibration_data_is_not_called_so(files, monkeypatch, argv):
    """A held-out file and validate's --data are named as what they are: the batch of that file, not a
    "calibration batch"."""
    torch.save(torch.zeros(8, 3, 8), files / "rank3.pt")
    monkeypatch.chdir(files)
    line = _refused(argv, files, "data file rank3.pt: batch 0 has args[0] of shape (8, 3, 8) (3-D)")
    assert "calibration" not in line
