"""Reading --data: image folders, .pt files, factories; every problem is one BadInputError."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision.io import encode_jpeg, write_png

from normswap.calibrate import NORMALIZATIONS, ModelInputs, load_calibration_data
from normswap.errors import BadInputError

EXAMPLE = (torch.zeros(1, 3, 16, 16),)


def _png(path: Path, image: torch.Tensor) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_png(image, str(path))
    return path


def _solid(value: int, h: int = 20, w: int = 24, channels: int = 3) -> torch.Tensor:
    return torch.full((channels, h, w), value, dtype=torch.uint8)


def _read(data) -> list[ModelInputs]:
    return list(data)


def test_image_folder_batches_scaled_and_cropped(tmp_path):
    for i, value in enumerate((0, 51, 102, 153, 204)):
        _png(tmp_path / "imgs" / ("a" if i < 3 else "b") / f"{i}.png", _solid(value, h=20 + i, w=30 - i))
    (tmp_path / "imgs" / ".DS_Store").write_bytes(b"junk")  # hidden files are not data
    data = load_calibration_data(tmp_path / "imgs", example_args=EXAMPLE, batch_size=2)
    assert data.num_batches == 3
    assert data.description.endswith("5 images at 3x16x16 in batches of 2")
    batches = _read(data)
    assert [b.args[0].shape for b in batches] == [(2, 3, 16, 16), (2, 3, 16, 16), (1, 3, 16, 16)]
    values = torch.cat([b.args[0] for b in batches]).amax((1, 2, 3))
    torch.testing.assert_close(values, torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8]), rtol=0, atol=1e-6)
    assert batches[0].args[0].dtype == torch.float32 and data.first is batches[0]


def test_image_is_resized_to_cover_then_centre_cropped(tmp_path):
    # 20 x 40 image: a white band in the middle half of the width, black on both sides
    image = torch.zeros(3, 20, 40, dtype=torch.uint8)
    image[:, :, 10:30] = 255
    _png(tmp_path / "imgs" / "band.png", image)
    (batch,) = _read(load_calibration_data(tmp_path / "imgs", example_args=EXAMPLE))
    x = batch.args[0][0]
    # resized to 16 x 32, the band spans columns 8..24, exactly the centre crop: white but for the blended
    # edge columns; a left or unscaled crop would show black
    assert x.shape == (3, 16, 16)
    assert float(x[:, :, 1:-1].min()) > 0.99 and float(x.min()) > 0.3


def test_imagenet_normalization_and_grayscale(tmp_path):
    _png(tmp_path / "imgs" / "x.png", _solid(51))
    (batch,) = _read(load_calibration_data(tmp_path / "imgs", example_args=EXAMPLE, normalize="imagenet"))
    mean, std = NORMALIZATIONS["imagenet"]
    expected = torch.tensor([(0.2 - m) / s for m, s in zip(mean, std, strict=True)])
    torch.testing.assert_close(batch.args[0][0, :, 5, 5], expected, rtol=0, atol=1e-6)

    (tmp_path / "jpg").mkdir()
    (tmp_path / "jpg" / "x.jpg").write_bytes(encode_jpeg(_solid(128)).numpy().tobytes())
    (batch,) = _read(load_calibration_data(tmp_path / "jpg", example_args=(torch.zeros(2, 1, 8, 8),)))
    assert batch.args[0].shape == (1, 1, 8, 8)
    assert abs(float(batch.args[0].mean()) - 128 / 255) < 0.02
    with pytest.raises(
        BadInputError, match="--normalize imagenet is for 3-channel images; the model takes 1"
    ):
        load_calibration_data(tmp_path / "jpg", example_args=(torch.zeros(2, 1, 8, 8),), normalize="imagenet")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "holds no files"),
        (lambda d: (d / "notes.txt").write_text("hello"), "notes.txt is not a JPEG, PNG, GIF or WEBP image"),
        (lambda d: (d / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40), "cannot decode image"),
    ],
)
def test_bad_image_folders(tmp_path, setup, message):
    folder = tmp_path / "imgs"
    folder.mkdir()
    setup(folder)
    with pytest.raises(BadInputError, match=message):
        _read(load_calibration_data(folder, example_args=EXAMPLE))


def test_image_folder_needs_the_input_size(tmp_path):
    _png(tmp_path / "imgs" / "x.png", _solid(3))
    with pytest.raises(BadInputError, match=r"the model has no example input; pass --input-shape 1,3,H,W"):
        load_calibration_data(tmp_path / "imgs")
    with pytest.raises(BadInputError, match=r"the model's example input is \(2, 16\)"):
        load_calibration_data(tmp_path / "imgs", example_args=(torch.zeros(2, 16),))


def test_pt_file_single_tensor_is_split(tmp_path):
    path = tmp_path / "calib.pt"
    torch.save(torch.arange(10.0).view(10, 1).expand(10, 3).clone(), path)
    data = load_calibration_data(path, batch_size=4)
    batches = _read(data)
    assert [b.args[0].shape[0] for b in batches] == [4, 4, 2] and data.num_batches == 3
    assert data.description == f"data file {path}: 10 samples of (3,) in batches of 4"
    assert float(batches[2].args[0][0, 0]) == 8.0


def test_pt_file_lists_of_batches(tmp_path):
    x = [torch.randn(3, 2) for _ in range(3)]
    torch.save(x, tmp_path / "tensors.pt")
    assert [b.args[0].shape for b in _read(load_calibration_data(tmp_path / "tensors.pt"))] == [(3, 2)] * 3
    torch.save([{"x": t} for t in x], tmp_path / "dicts.pt")
    assert [list(b.kwargs) for b in _read(load_calibration_data(tmp_path / "dicts.pt"))] == [["x"]] * 3
    # a DataLoader-like (inputs, labels) list: labels dropped when the model takes one input
    torch.save([(t, torch.zeros(3, dtype=torch.long)) for t in x], tmp_path / "pairs.pt")
    data = load_calibration_data(tmp_path / "pairs.pt", example_args=(torch.zeros(1, 2),))
    assert [len(b.args) for b in _read(data)] == [1, 1, 1]
    assert data.notes == [
        "batches hold 2 items and the model takes 1 input: only the first 1 are fed (the rest, e.g. labels, "
        "are ignored)"
    ]


@pytest.mark.parametrize(
    ("payload", "kwargs", "message"),
    [
        ([], {}, "holds an empty list: no batches"),
        ({"x": torch.zeros(2)}, {}, "holds a dict: expected a tensor"),
        ([torch.zeros(2, 2), (torch.zeros(2, 2),)], {}, "holds a list of Tensor, tuple"),
        (
            [torch.zeros(2, 2)] * 2,
            {"batch_size": 2},
            "--batch-size applies to an image folder or a single tensor",
        ),
        (torch.zeros(0, 3), {}, r"has shape \(0, 3\): it holds no values"),
    ],
)
def test_bad_pt_files(tmp_path, payload, kwargs, message):
    path = tmp_path / "data.pt"
    torch.save(payload, path)
    with pytest.raises(BadInputError, match=message):
        _read(load_calibration_data(path, **kwargs))


def test_batches_that_do_not_fit_are_named(tmp_path):
    torch.save([torch.zeros(4, 3, 8, 8), torch.zeros(4, 3, 8)], tmp_path / "mixed.pt")
    with pytest.raises(
        BadInputError,
        match=r"batch 1 \(args\[0\] \(4, 3, 8\)\) is laid out differently from batch 0 "
        r"\(args\[0\] \(4, 3, 8, 8\)\)",
    ):
        _read(load_calibration_data(tmp_path / "mixed.pt"))
    torch.save(torch.zeros(8, 3, 8), tmp_path / "rank3.pt")
    with pytest.raises(
        BadInputError, match=r"args\[0\] of shape \(8, 3, 8\) \(3-D\) where the model's example"
    ):
        _read(load_calibration_data(tmp_path / "rank3.pt", example_args=EXAMPLE))
    torch.save([torch.zeros(4, 2), torch.zeros(0, 2)], tmp_path / "empty.pt")
    with pytest.raises(BadInputError, match=r"batch 1, args\[0\] has shape \(0, 2\): it holds no values"):
        _read(load_calibration_data(tmp_path / "empty.pt"))


def test_pickled_object_is_refused_without_running_it(tmp_path):
    import pickle

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps(Path("x")))
    with pytest.raises(BadInputError, match="is a pickled Python object, not tensors"):
        load_calibration_data(path)


FACTORY = """
import torch

def stream():
    for i in range(3):
        yield torch.full((2, 3), float(i))

def broken():
    yield torch.zeros(2, 3)
    raise RuntimeError("disk went away")

def tensor():
    return torch.zeros(6, 3)

def number():
    return 3
"""


def test_factories(tmp_path):
    source = tmp_path / "calib_data.py"
    source.write_text(FACTORY)
    data = load_calibration_data(f"{source}:stream")
    assert data.num_batches is None
    assert [float(b.args[0][0, 0]) for b in _read(data)] == [0.0, 1.0, 2.0]
    assert [b.args[0].shape[0] for b in _read(load_calibration_data(f"{source}:tensor", batch_size=4))] == [
        4,
        2,
    ]
    with pytest.raises(
        BadInputError, match=r"data factory '.*:broken' raised while producing batch 1: RuntimeError"
    ):
        _read(load_calibration_data(f"{source}:broken"))
    with pytest.raises(BadInputError, match="returned a value of type int: expected an iterable of batches"):
        load_calibration_data(f"{source}:number")
    with pytest.raises(BadInputError, match="--batch-size applies to an image folder or a single tensor"):
        load_calibration_data(f"{source}:stream", batch_size=2)
    with pytest.raises(BadInputError, match="has no attribute 'missing'"):
        load_calibration_data(f"{source}:missing")


def test_missing_data_and_misplaced_options(tmp_path):
    with pytest.raises(BadInputError, match=r"^data not found: .*nope\.pt \(give a folder of images"):
        load_calibration_data(tmp_path / "nope.pt")
    torch.save(torch.zeros(4, 3), tmp_path / "x.pt")
    with pytest.raises(BadInputError, match="--normalize applies to an image folder"):
        load_calibration_data(tmp_path / "x.pt", normalize="imagenet")
    with pytest.raises(BadInputError, match="--normalize 'cifar': choose from imagenet"):
        load_calibration_data(tmp_path / "x.pt", normalize="cifar")


def test_options_for_another_source_are_dropped_where_they_do_not_apply(tmp_path):
    torch.save([torch.zeros(3, 2)] * 2, tmp_path / "batches.pt")
    data = load_calibration_data(
        tmp_path / "batches.pt", batch_size=8, normalize="imagenet", ignore_inapplicable=True
    )
    assert [b.args[0].shape for b in _read(data)] == [(3, 2), (3, 2)]
    with pytest.raises(BadInputError, match="--normalize 'cifar'"):
        load_calibration_data(tmp_path / "batches.pt", normalize="cifar", ignore_inapplicable=True)


def test_a_tensor_is_fed_by_name_to_a_model_that_takes_one_keyword_tensor(tmp_path):
    """HF models and their .pt2 (exported with input_ids=, which takes it by name only)."""
    path = tmp_path / "ids.pt"
    torch.save(torch.arange(30).view(6, 5), path)
    example = {"input_ids": torch.zeros(1, 5, dtype=torch.long), "use_cache": False}
    data = load_calibration_data(path, batch_size=4, example_kwargs=example)
    batches = _read(data)
    assert [sorted(b.kwargs) for b in batches] == [["input_ids", "use_cache"]] * 2 and not batches[0].args
    assert torch.equal(batches[1].kwargs["input_ids"], torch.arange(20, 30).view(2, 5))
    assert batches[0].kwargs["use_cache"] is False
    assert data.notes == ["batches are fed as input_ids=, the model's one tensor input"]
    # two keyword tensors: which one a positional tensor is cannot be told, so it stays positional
    both = {"input_ids": torch.zeros(1, 5, dtype=torch.long), "attention_mask": torch.ones(1, 5)}
    (first, _) = _read(load_calibration_data(path, batch_size=4, example_kwargs=both))
    assert first.args and not first.kwargs
