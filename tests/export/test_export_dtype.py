"""--dtype: a bf16 checkpoint exports to ONNX as float32 and is checked; bf16 itself, which onnxruntime's
CPU build cannot run, is refused before the export with the way out (issue 30). The same rule on
`export` and on `convert -o x.onnx`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

import normswap.export.onnx as onnx_export


@pytest.fixture(scope="module")
def bf16_gpt2(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A GPT-2 model directory stored in bf16, as most checkpoints on the hub are."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.75, 1.25)
                module.bias.uniform_(-0.5, 0.5)
    path = tmp_path_factory.mktemp("bf16") / "gpt2"
    model.to(torch.bfloat16).save_pretrained(path)
    return path, model


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("command", ["export", "convert"])
def test_a_bf16_onnx_is_refused_before_the_export_with_the_way_out(tmp_path, bf16_gpt2, monkeypatch, command):
    def never(*a, **k):
        raise AssertionError("the export ran")

    monkeypatch.setattr(onnx_export, "_onnx_program", never)
    directory, _ = bf16_gpt2
    out = tmp_path / "g.onnx"
    extra = ["--fold-norm-affine"] if command == "convert" else []
    ran = _run(command, str(directory), *extra, "-o", str(out))
    assert ran.exit_code == 2, ran.output
    text = " ".join(ran.output.split())
    assert "onnxruntime's CPU build has no bf16 kernels" in text and "--dtype float32" in text
    asked = _run(command, str(directory), *extra, "-o", str(out), "--dtype", "bf16")
    assert asked.exit_code == 2 and "no bf16 kernels" in " ".join(asked.output.split())
    assert list(tmp_path.iterdir()) == []


def test_a_bf16_checkpoint_exports_as_float32_and_is_checked(tmp_path, bf16_gpt2):
    import onnx

    directory, model = bf16_gpt2
    out, report = tmp_path / "g.onnx", tmp_path / "r.json"
    ran = _run("export", str(directory), "-o", str(out), "--dtype", "float32", "--report", str(report))
    assert ran.exit_code == 0, ran.output
    data = json.loads(report.read_text())["onnx"]
    assert data["within_tolerance"] and {o["dtype"] for o in data["outputs"]} == {"float32"}
    assert len(data["shapes"]["accepted"]) >= 3 and not data["shapes"]["rejected"]
    proto = onnx.load(str(out))
    assert {i.data_type for i in proto.graph.initializer if i.data_type in (1, 10, 16)} == {1}  # fp32 only
    # the file computes what the bf16 checkpoint's weights compute, widened: exactly, in float32
    ids = torch.randint(0, 128, (3, 20))
    (got,) = onnx_export.run_onnx(out, (), {"input_ids": ids})
    widened = type(model).from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        want = widened(input_ids=ids, use_cache=False).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_convert_writes_its_onnx_in_the_dtype_asked(tmp_path, bf16_gpt2):
    directory, _ = bf16_gpt2
    out, report = tmp_path / "g.onnx", tmp_path / "r.json"
    ran = _run(
        "convert",
        str(directory),
        "--fold-norm-affine",
        "-o",
        str(out),
        "--dtype",
        "fp32",
        "--report",
        str(report),
    )
    assert ran.exit_code == 0, ran.output
    data = json.loads(report.read_text())
    assert data["verdict"] == "ok" and data["onnx"]["within_tolerance"]
    assert {o["dtype"] for o in data["onnx"]["outputs"]} == {"float32"}
    bad = _run(
        "convert", str(directory), "--fold-norm-affine", "-o", str(tmp_path / "h.onnx"), "--dtype", "fp8"
    )
    assert bad.exit_code == 2 and "--dtype must be one of float32, float16, bfloat16" in " ".join(
        bad.output.split()
    )


def test_save_casts_a_copy_and_leaves_the_conversion_as_it_was(tmp_path, bf16_gpt2):
    import normswap

    _, model = bf16_gpt2  # bf16 in memory
    ids = torch.randint(0, 128, (1, 16))
    result = normswap.convert(
        model, normswap.ConvertConfig(fold_norm_affine=True), (ids,), {"use_cache": False}
    )
    assert result.ok, result.refusal
    saved = normswap.save(result, tmp_path / "g.pt2", dtype=torch.float32)
    assert {p.dtype for p in result.model.parameters()} == {torch.bfloat16}
    program = torch.export.load(saved.path).module()
    assert {p.dtype for p in program.parameters()} == {torch.float32}
    assert saved.shapes is not None and "1x16" in saved.shapes.accepted


@pytest.mark.parametrize("suffix", [".pt2", ".pt", ".onnx"])
def test_a_cast_copy_past_the_dtypes_range_is_refused_by_every_output_kind(tmp_path, suffix):
    """A weight of 1e5 is finite in float32 and Inf in float16: the .onnx compared its way to a refusal,
    while the .pt2 and .pt were written full of Inf with exit 0. The cast copy is checked once, for every
    output kind, and nothing is written."""
    import normswap
    from normswap.errors import CheckFailedError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    with torch.no_grad():
        model[2].weight[0, 0] = 1e5
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    assert torch.isfinite(model(x)).all()
    out = tmp_path / f"out{suffix}"
    with pytest.raises(
        CheckFailedError, match=r"^--dtype float16: the model cast to float16 computes \d+ NaN/Inf"
    ):
        normswap.save(model, out, (x,), dtype=torch.float16)
    assert list(tmp_path.iterdir()) == []
    assert model[2].weight.dtype == torch.float32  # the user's model is left as it was


@pytest.mark.parametrize("command", ["export", "convert", "recalibrate"])
def test_every_command_refuses_an_overflowing_cast_as_its_own_failed_check(tmp_path, command):
    """The same cast past float16's range is a failed check of what normswap cast (exit 1) on every
    command; export called the user's float32 model broken (exit 2)."""
    from normswap_cli.app import app
    from typer.testing import CliRunner

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)
    )
    with torch.no_grad():
        model[3].weight[0, 0] = 1e5
    program = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model.eval(), (torch.randn(2, 3, 8, 8),)), program)
    data = tmp_path / "data.pt"
    torch.save(torch.randn(8, 3, 8, 8), data)
    argv = {
        "export": ["export", str(program)],
        "convert": ["convert", str(program), "--fold-bn"],
        "recalibrate": ["recalibrate", str(program), "--data", str(data), "--batch-size", "2"],
    }[command]
    result = CliRunner().invoke(app, [*argv, "--dtype", "float16", "-o", str(tmp_path / "out.onnx")])
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert "--dtype float16: the model cast to float16 computes" in said and "is broken" not in said
    assert not (tmp_path / "out.onnx").exists()
