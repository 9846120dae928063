"""Data reaches a Hugging Face model as it takes it, on every command that reads data, whether the model
is a directory or a ``.pt2`` exported from one with keyword example inputs.

- An image folder feeds an HF vision model (ViT, ResNet) by its keyword, ``pixel_values``, sized from
  that keyword's example: ``recalibrate``, ``distill``, ``convert --calibrate`` and ``validate --data``
  refused it before ("the model has no example input"), since only a first positional input was read.
- Keyword batches (``input_ids``, ``attention_mask``, ``labels``) reach every model a command feeds them
  to as all of them take them (:func:`normswap.calibrate.feeding.fit_to_models`): a ``.pt2`` takes no
  ``labels`` and needs the ``use_cache=False`` it was exported with. ``distill`` and ``convert
  --calibrate`` exited 2 ("Got ... ['input_ids', 'attention_mask', 'labels'] but expected
  ['input_ids', 'use_cache']") where ``validate`` compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_dirs import make_directory, with_cache_on
from normswap_cli.app import app
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")
runner = CliRunner()


def _saved_pt2(directory: Path, path: Path) -> Path:
    """The model of ``directory`` exported as it is, with the keyword example inputs its config makes."""
    import normswap
    from normswap.load import load_model

    loaded = load_model(str(directory))
    assert loaded.example_kwargs and not loaded.example_args  # an HF model takes keywords
    normswap.save(loaded.model, path, loaded.example_args, loaded.example_kwargs)
    return path


def _cli(*args: str, report: Path | None = None) -> tuple[int, dict, str]:
    ran = runner.invoke(app, [*args, *(["--report", str(report)] if report is not None else [])])
    assert "Traceback" not in ran.output, ran.output
    data = json.loads(report.read_text()) if report is not None and report.exists() else {}
    return ran.exit_code, data, ran.output


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from torchvision.io import write_png

    root = tmp_path_factory.mktemp("vision")
    torch.manual_seed(0)
    vit = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=3,
    )  # fmt: skip
    transformers.ViTForImageClassification(vit).eval().save_pretrained(root / "vit")
    # HF's ResNet: BatchNorms to recalibrate; its config fixes no image size (made at 224)
    resnet = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    transformers.ResNetForImageClassification(resnet).eval().save_pretrained(root / "resnet")
    made = {name: root / name for name in ("vit", "resnet")}
    for name in ("vit", "resnet"):
        made[f"{name}.pt2"] = _saved_pt2(root / name, root / f"{name}.pt2")
    code, _, output = _cli("convert", str(root / "vit"), "--to", "dyt", "-o", str(root / "vit-dyt.pt2"))
    assert code == 0, output
    made["vit-dyt.pt2"] = root / "vit-dyt.pt2"
    images = root / "images"
    images.mkdir()
    generator = torch.Generator().manual_seed(0)
    for i in range(6):  # not the model's size: resized to cover it, centre-cropped
        write_png(
            torch.randint(0, 256, (3, 40, 36), dtype=torch.uint8, generator=generator),
            str(images / f"{i}.png"),
        )
    made["images"] = images
    return made


@pytest.mark.parametrize("model", ["resnet", "resnet.pt2"])
def test_recalibrate_an_hf_vision_model_on_an_image_folder(vision, model, tmp_path):
    out = tmp_path / "recalibrated.pt"
    code, report, output = _cli(
        "recalibrate", str(vision[model]), "--data", str(vision["images"]), "--batch-size", "2",
        "-o", str(out), report=tmp_path / "r.json",
    )  # fmt: skip
    assert code == 0, output
    assert report["data_description"].endswith("6 images at 3x224x224 in batches of 2, fed as pixel_values=")
    assert report["batches"] == 2 and report["samples"] == 4 and report["holdout_samples"] == 2
    assert report["layers"] and report["skips"] == []
    # the statistics moved from their initial values (mean 0) to the images'
    assert max(abs(layer["mean_shift"]) for layer in report["layers"]) > 1e-3
    assert out.is_file()


def test_recalibrate_a_directory_and_its_pt2_alike(vision, tmp_path):
    """The same images, the same statistics: a directory and its .pt2 are one model to the data."""
    reports = []
    for model in ("resnet", "resnet.pt2"):
        code, report, output = _cli(
            "recalibrate", str(vision[model]), "--data", str(vision["images"]), "--batch-size", "2",
            "-o", str(tmp_path / f"{model}-out.pt"), report=tmp_path / f"{model}.json",
        )  # fmt: skip
        assert code == 0, output
        reports.append({layer["path"]: layer["mean_shift"] for layer in report["layers"]})
    directory, program = reports
    assert len(directory) == 8  # the stem's, and two per basic block and one per shortcut
    assert program == pytest.approx(directory, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("teacher", ["vit", "vit.pt2"])
def test_distill_an_hf_vision_model_on_an_image_folder(vision, teacher, tmp_path):
    out = tmp_path / "student.pt"
    code, report, output = _cli(
        "distill", str(vision[teacher]), str(vision["vit-dyt.pt2"]), "--data", str(vision["images"]),
        "--batch-size", "2", "--steps", "3", "--lr", "1e-2", "-o", str(out), report=tmp_path / "d.json",
    )  # fmt: skip
    assert code == 0, output
    assert "fed as pixel_values=" in report["data_description"]
    assert report["batches"] == 2 and report["ok"] and out.is_file()
    # trained: the held-out outputs moved towards the teacher's
    assert report["holdout_loss_after"] < report["holdout_loss_before"]


@pytest.mark.parametrize("model", ["vit", "vit.pt2"])
def test_convert_calibrate_an_hf_vision_model_on_an_image_folder(vision, model, tmp_path):
    code, report, output = _cli(
        "convert", str(vision[model]), "--to", "dyt", "--calibrate", str(vision["images"]),
        "--batch-size", "2", "-o", str(tmp_path / "dyt.pt"), report=tmp_path / "c.json",
    )  # fmt: skip
    assert code == 0, output
    fit = report["calibration"]
    assert fit["batches"] == 3 and len(fit["sites"]) == 3
    # each DyT refitted on the images: its alpha moved from DyT's 0.5, its site much closer to the norm's
    assert all(site["alpha"] != 0.5 for site in fit["sites"])
    assert all(site["sqnr_after_db"] > site["sqnr_before_db"] + 6 for site in fit["sites"])


@pytest.mark.parametrize("converted", ["vit", "vit.pt2"])
def test_validate_an_hf_vision_model_on_an_image_folder(vision, converted, tmp_path):
    code, report, output = _cli(
        "validate", str(vision["vit"]), str(vision[converted]), "--data", str(vision["images"]),
        "--batch-size", "2", "--exact", report=tmp_path / "v.json",
    )  # fmt: skip
    assert code == 0, output
    assert report["passed"] and report["batches"] == 3 and report["exact"]


def test_images_for_a_model_whose_example_holds_two_image_tensors_are_refused(tmp_path):
    from normswap.calibrate.data_images import image_geometry
    from normswap.errors import BadInputError

    image = torch.zeros(1, 3, 8, 6)
    taken = image_geometry((), tmp_path, {"pixel_values": image, "interpolate_pos_encoding": False})
    assert (taken.keyword, taken.channels, taken.height, taken.width) == ("pixel_values", 3, 8, 6)
    assert image_geometry((image,), tmp_path, {"other": torch.zeros(1, 3, 4, 4)}).keyword is None
    mask = torch.ones(1, 1, 8, 6, dtype=torch.bool)  # four dims, no image: not a candidate
    assert image_geometry((), tmp_path, {"mask": mask, "pixel_values": image}).keyword == "pixel_values"
    with pytest.raises(BadInputError, match=r"several \(N, C, H, W\) tensors \(a, b\)"):
        image_geometry((), tmp_path, {"a": image, "b": image})
    with pytest.raises(BadInputError, match=r"the model's example input is \(1, 5, 8, 6\)"):
        image_geometry((), tmp_path, {"pixel_values": torch.zeros(1, 5, 8, 6)})


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt2")
    source = with_cache_on(make_directory(root, "gpt2"))
    made = {"gpt2": source, "gpt2.pt2": _saved_pt2(source, root / "gpt2.pt2")}
    code, _, output = _cli("convert", str(source), "--to", "dyt", "-o", str(root / "gpt2-dyt.pt2"))
    assert code == 0, output
    made["gpt2-dyt.pt2"] = root / "gpt2-dyt.pt2"
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    batches = [
        {"input_ids": ids.roll(i, 1), "attention_mask": torch.ones_like(ids), "labels": ids} for i in range(4)
    ]
    torch.save(batches, root / "tokens.pt")
    made["tokens"] = root / "tokens.pt"
    return made


NOT_FED = "the inputs' labels is not fed: the model's forward does not take it (GraphModule)"
CACHE_OFF = "the inputs run with use_cache=False, which the program takes (GraphModule)"


@pytest.mark.parametrize("teacher", ["gpt2", "gpt2.pt2"])
def test_distill_keyword_batches_into_a_causal_lm_pt2(gpt2, teacher, tmp_path):
    code, report, output = _cli(
        "distill", str(gpt2[teacher]), str(gpt2["gpt2-dyt.pt2"]), "--data", str(gpt2["tokens"]),
        "--steps", "3", "--lr", "1e-2", "-o", str(tmp_path / "student.pt"), report=tmp_path / "d.json",
    )  # fmt: skip
    assert code == 0, output
    assert NOT_FED in report["notes"] and CACHE_OFF in report["notes"]
    assert report["ok"] and report["holdout_loss_after"] < report["holdout_loss_before"]


@pytest.mark.parametrize("model", ["gpt2", "gpt2.pt2"])
def test_convert_calibrate_keyword_batches_into_a_causal_lm(gpt2, model, tmp_path):
    code, report, output = _cli(
        "convert", str(gpt2[model]), "--to", "dyt", "--calibrate", str(gpt2["tokens"]),
        "-o", str(tmp_path / "dyt.pt"), report=tmp_path / "c.json",
    )  # fmt: skip
    assert code == 0, output
    fit = report["calibration"]
    assert fit["batches"] == 4 and len(fit["sites"]) == 5  # two blocks' two LayerNorms and ln_f
    assert all(site["alpha"] != 0.5 for site in fit["sites"])
    assert all(site["sqnr_after_db"] > site["sqnr_before_db"] for site in fit["sites"])
    # how the batches were fed is said, in the report and the output, as recalibrate and distill say it
    if model == "gpt2.pt2":
        assert NOT_FED in fit["notes"] and CACHE_OFF in fit["notes"]
        assert f"note: {NOT_FED}" in " ".join(output.split())
    else:
        assert fit["notes"] == []


def test_a_batch_is_fitted_to_every_model_it_is_fed_to(gpt2):
    """The one rule (feeding.fit_to_models): a key one model does not take is fed to none, a setting one
    requires is passed to all; each change said once."""
    from normswap.calibrate.data import ModelInputs
    from normswap.calibrate.feeding import fed, fit_to_models
    from normswap.load import load_model

    directory = load_model(str(gpt2["gpt2"])).model
    program = load_model(str(gpt2["gpt2.pt2"])).model
    ids = torch.zeros(1, 4, dtype=torch.long)
    batch = ModelInputs((), {"input_ids": ids, "labels": ids})
    notes: list[str] = []
    both = fit_to_models((directory, program), batch, notes)
    assert set(both.kwargs) == {"input_ids", "use_cache"} and both.kwargs["use_cache"] is False
    assert notes == [NOT_FED, CACHE_OFF]
    assert fit_to_models((directory,), batch) is batch  # the directory takes them all
    assert set(fed(directory, batch, compared_with=(program,)).kwargs) == {"input_ids", "use_cache"}
