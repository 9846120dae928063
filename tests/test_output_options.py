"""One rule for the options that say how an output is written (normswap.load.output_options): an option
the chosen output does not use is refused, exit 2, naming the option and the outputs it applies to, on
every command that takes it and from Python. ``--opset 18 -o m.pt2`` and ``--static-shapes -o DIR`` were
accepted and dropped, where ``--portable -o m.onnx`` was refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_dirs import make_directory
from normswap_cli.app import app
from typer.testing import CliRunner

import normswap
from normswap.errors import BadInputError

CONV = str(Path(__file__).resolve().parents[1] / "examples" / "small_convnet.py") + ":build"
SHAPE = ["--input-shape", "1,3,8,8"]
OPSET = "--opset is for an .onnx output, not"
STATIC = "--static-shapes is for a written program: a .pt2, .onnx or .pt output, not"


@pytest.mark.parametrize(
    ("options", "output", "said"),
    [
        ({"opset": 18}, "m.pt2", OPSET),
        ({"opset": 18}, "m.pt", OPSET),
        ({"opset": 18}, "m", OPSET),
        ({"static_shapes": True}, "m", STATIC),
        ({"portable": True}, "m.onnx", "--portable is for a .pt2 output, not"),
    ],
)
def test_the_config_refuses_an_option_its_output_does_not_use(tmp_path, options, output, said):
    config = normswap.ConvertConfig(fold_bn=True, output=tmp_path / output, **options)
    with pytest.raises(BadInputError, match=said.replace(".", r"\.")):
        config.validate()


def test_options_the_output_uses_are_accepted(tmp_path):
    for options, output in [
        ({"opset": 18, "static_shapes": True}, "m.onnx"),
        ({"static_shapes": True}, "m.pt2"),
    ]:
        normswap.ConvertConfig(fold_bn=True, output=tmp_path / output, **options).validate()
    # a .pt holds a program when the model is an exported graph, which --static-shapes fixes; whether
    # it is one is known only after the work, so the path alone decides, on every route
    normswap.ConvertConfig(to="fused", fuse_add=True, output=tmp_path / "m.pt", static_shapes=True).validate()
    normswap.ConvertConfig(fold_bn=True, output=tmp_path / "m.pt", static_shapes=True).validate()


def _refused(argv: list[str], said: str, tmp_path: Path) -> None:
    before = set(tmp_path.iterdir())
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split()), result.output
    assert set(tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize(
    ("argv", "output", "said"),
    [
        (["convert", CONV, *SHAPE, "--fold-bn", "--opset", "18"], "m.pt2", OPSET),
        (["recalibrate", CONV, *SHAPE, "--data", "DATA", "--opset", "18"], "m.pt", OPSET),
        (["distill", CONV, CONV, *SHAPE, "--data", "DATA", "--steps", "1", "--opset", "17"], "m.pt2", OPSET),
    ],
    ids=["convert-opset", "recalibrate-opset", "distill-opset"],
)
def test_every_command_refuses_an_output_option_its_output_does_not_use(tmp_path, argv, output, said):
    data = tmp_path.parent / f"{tmp_path.name}-data.pt"
    torch.save(torch.randn(8, 3, 8, 8), data)
    argv = [str(data) if a == "DATA" else a for a in argv]
    _refused(
        [*argv, "--batch-size", "4", "-o", str(tmp_path / output)]
        if "--data" in argv
        else [*argv, "-o", str(tmp_path / output)],
        said,
        tmp_path,
    )


def test_the_directory_routes_refuse_them_too(tmp_path):
    source = make_directory(tmp_path, "llama")
    data = tmp_path / "ids.pt"
    torch.save(torch.randint(0, 300, (4, 6)), data)
    out = str(tmp_path / "out")
    sequential = ["--to", "layernorm", "--calibrate", str(data), "--batch-size", "4", "--sequential"]
    _refused(["convert", str(source), *sequential, "--opset", "18", "-o", out], OPSET, tmp_path)
    _refused(["convert", str(source), "--fold-norm-affine", "--static-shapes", "-o", out], STATIC, tmp_path)


def test_save_holds_a_module_to_the_same_rule(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    with pytest.raises(BadInputError, match=OPSET):
        normswap.save(model, tmp_path / "m.pt2", (torch.randn(2, 4),), opset=18)
    with pytest.raises(BadInputError, match=STATIC.replace(".", r"\.")):
        normswap.save(model, tmp_path / "m", (torch.randn(2, 4),), static_shapes=True)
    assert list(tmp_path.iterdir()) == []


def test_a_result_saved_to_another_path_takes_no_option_of_the_configs_output(tmp_path):
    """save(result, other) inherited --opset from a config whose output was an .onnx, and refused the
    .pt2 the caller asked for with an option the caller never gave it."""
    from normswap.load import load_model

    loaded = load_model(CONV)
    config = normswap.ConvertConfig(fold_bn=True, output=tmp_path / "m.onnx", opset=18, static_shapes=True)
    result = normswap.convert(loaded.model, config, loaded.example_args)
    saved = normswap.save(result, tmp_path / "other.pt")
    assert saved.path == tmp_path / "other.pt" and saved.path.is_file()
    with pytest.raises(BadInputError, match=OPSET):  # the config's own output keeps the config's rule
        normswap.save(result, tmp_path / "again.pt2", opset=18)
