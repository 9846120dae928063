"""normswap export / convert -o x.onnx: the file is checked in onnxruntime before it is written."""

from __future__ import annotations

import json
from pathlib import Path

import model_zoo
import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

import normswap.export.onnx as onnx_export
from normswap.errors import BadInputError, CheckFailedError
from normswap.export.onnx import export_onnx
from normswap.verify.variants import InputVariant, candidate_variants

ZOO = str(Path(model_zoo.__file__))


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_export_resnet18_takes_any_batch_and_any_image_size(tmp_path):
    out, report = tmp_path / "r18.onnx", tmp_path / "r.json"
    result = _run("export", f"{ZOO}:resnet18_factory", "-o", str(out), "--report", str(report))
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())["onnx"]
    # the example is 2 x 3 x 32 x 32: its batch and image-size variants run and agree
    assert data["within_tolerance"] and data["dynamic_axes"] == {
        "x": {"0": "batch", "2": "height", "3": "width"}
    }
    assert data["shapes"]["accepted"] == ["2x3x32x32", "3x3x32x32", "1x3x32x32", "2x3x8x8", "2x3x45x45"]
    assert data["shapes"]["rejected"] == []
    assert {o["name"].split(" at ")[1] for o in data["outputs"]} == set(data["shapes"]["accepted"])
    assert max(o["max_rel"] for o in data["outputs"]) <= 1e-4
    assert "takes every shape it was verified on" in " ".join(result.output.split())
    assert data["op_counts"]["Conv"] == 20 and "BatchNormalization" not in data["op_counts"]
    # a plain onnxruntime session at a shape nobody verified: not square, another batch
    import onnxruntime

    model, _, _ = model_zoo.resnet18(size=32)
    x = torch.randn(3, 3, 40, 56, generator=torch.Generator().manual_seed(0))
    (got,) = onnxruntime.InferenceSession(str(out)).run(None, {"x": x.numpy()})
    with torch.no_grad():
        want = model.eval()(x)
    assert (torch.from_numpy(got) - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize(("opset", "rms_ops"), [(18, 0), (23, 5)])
def test_recentered_gpt2_exports_rmsnorm_as_the_standard_op_at_opset_23(tmp_path, opset, rms_ops):
    out, report = tmp_path / "g.onnx", tmp_path / "r.json"
    result = _run(
        "convert", f"{ZOO}:gpt2_factory", "--to", "rmsnorm", "--exact", "-o", str(out), "--opset", str(opset),
        "--report", str(report),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    ops = data["onnx"]["op_counts"]
    assert data["onnx"]["opset"] == opset and ops.get("RMSNormalization", 0) == rms_ops
    assert "LayerNormalization" not in ops
    assert data["onnx"]["within_tolerance"]


def test_folded_and_swapped_vit_exports_and_matches(tmp_path):
    model, args, kwargs = model_zoo.small_vit()
    from normswap.passes import Pipeline, SwapNorm

    converted, _ = Pipeline([SwapNorm("batchnorm")])(model, args, kwargs)
    result = export_onnx(converted, tmp_path / "vit.onnx", args, kwargs, opset=18)
    assert result.within_tolerance and result.outputs[0].shape == (2, 10)
    assert result.op_counts.get("LayerNormalization", 0) == 0  # every LayerNorm became a BatchNorm


def test_an_untranslatable_op_is_named_and_nothing_is_written(tmp_path):
    @torch.library.custom_op("nstest::mystery", mutates_args=())
    def mystery(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @mystery.register_fake
    def _(x):
        return torch.empty_like(x)

    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.ops.nstest.mystery(x) + 1

    out = tmp_path / "m.onnx"
    with pytest.raises(BadInputError, match=r"no ONNX translation for op nstest\.mystery\.default"):
        export_onnx(Model(), out, (torch.randn(2, 3),))
    assert list(tmp_path.iterdir()) == []


def test_onnxruntime_disagreement_fails_the_check_and_writes_nothing(tmp_path, monkeypatch):
    real = onnx_export._ort_run
    monkeypatch.setattr(onnx_export, "_ort_run", lambda path: lambda *a: [t * 1.01 for t in real(path)(*a)])
    model, args, _ = model_zoo.resnet18(size=32)
    with pytest.raises(CheckFailedError, match="onnxruntime disagrees with PyTorch: output"):
        export_onnx(model, tmp_path / "x.onnx", args)
    assert list(tmp_path.iterdir()) == []
    result = _run("export", f"{ZOO}:resnet18_factory", "-o", str(tmp_path / "y.pt2"))
    assert result.exit_code == 2 and "an ONNX export is written to a .onnx file" in result.output


def test_gpt2_is_written_at_opset_17_with_its_splits_given_sizes(tmp_path):
    """torch.onnx builds opset 18; asked for 17, its conversion of GPT-2's qkv Split keeps opset 18's
    num_outputs (an invalid file) and onnx's converter has no Split adapter. normswap gives each Split its
    sizes and converts the rest: a valid file, checked in onnxruntime on other batches and lengths."""
    import onnx
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = {"input_ids": torch.randint(0, 128, (2, 8))}
    out = tmp_path / "g17.onnx"
    variants = [InputVariant("example", (), ids), *candidate_variants((), ids)]
    result = export_onnx(model, out, (), ids, opset=17, check_shapes=variants)
    assert result.opset == 17 and result.within_tolerance and not result.shapes.rejected
    assert result.shapes.accepted == ["2x8", "3x8", "1x8", "2x2", "2x16"]
    assert result.note == "converted down from opset 18; 2 Split nodes given their sizes as inputs"
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto, full_check=True)
    splits = [n for n in proto.graph.node if n.op_type == "Split"]
    sizes = {i.name: onnx.numpy_helper.to_array(i).tolist() for i in proto.graph.initializer}
    assert len(splits) == 2 and all(not [a for a in n.attribute if a.name == "num_outputs"] for n in splits)
    assert all(sizes[n.input[1]] == [64, 64, 64] for n in splits)
    assert all(o.domain != "normswap.parked" for o in proto.opset_import)


def test_an_opset_onnx_cannot_convert_to_is_refused_with_the_op(tmp_path):
    # LayerNormalization exists from opset 17: a GPT-2 at 14 cannot be converted down, and says why
    out = tmp_path / "g.onnx"
    result = _run("export", f"{ZOO}:gpt2_factory", "-o", str(out), "--opset", "14")
    assert result.exit_code == 2
    assert (
        "onnx cannot convert the export down to opset 14 (No Previous Version of LayerNormalization exists)"
        in (" ".join(result.output.split()))
    )
    assert not out.exists()


def test_an_opset_newer_than_onnx_knows_is_refused_before_the_export(tmp_path):
    """It said "choose --opset 18 or higher" for 30 after a page of the exporter's traceback."""
    from onnx.defs import onnx_opset_version

    newest, out = onnx_opset_version(), tmp_path / "g.onnx"
    result = _run("export", f"{ZOO}:gpt2_factory", "-o", str(out), "--opset", str(newest + 5))
    assert result.exit_code == 2, result.output
    assert (
        f"--opset {newest + 5}: the installed onnx knows opsets up to {newest}; choose --opset {newest} or"
        in (" ".join(result.output.split()))
    )
    assert "Traceback" not in result.output and not out.exists()


def test_free_dims_with_keyword_inputs_and_modes_restored(tmp_path):
    model, args, kwargs = model_zoo.gpt2()  # input_ids positional, use_cache keyword
    model.train()
    variants = [InputVariant("example", args, kwargs), *candidate_variants(args, kwargs)]
    result = export_onnx(model, tmp_path / "g.onnx", args, kwargs, check_shapes=variants)
    assert result.within_tolerance and not result.shapes.rejected and len(result.shapes.accepted) == 5
    assert result.dynamic_axes == {"input_ids": {0: "batch", 1: "sequence"}}
    assert model.training and all(m.training for m in model.modules())  # exporting changed nothing


def test_a_translation_that_fails_is_told_from_a_missing_one():
    """torch.onnx's report names the node and, at its end, the exception its translation raised: that
    exception is the cause to show, not "no translation"."""
    from normswap.export.onnx import _describe

    class ConversionError(RuntimeError):
        pass

    failed = ConversionError(
        "Failed to convert the exported program to an ONNX model.\n"
        "While executing %view_4 : call_function[target=torch.ops.aten.view.default](args = (%x, [1, 16, 64]))\n"
        "## Exception summary\n\n<class 'ValueError'>: Cannot view a tensor with shape torch.Size([1, 16, 4, 16]) "
        "and strides (1024, 16, 256, 1) as a tensor with shape (1, 16, 64)!\n"
    )
    assert _describe(failed).startswith(
        "translating op aten.view.default failed (ValueError: Cannot view a tensor"
    )
    missing = ConversionError(
        "Failed to convert.\nWhile executing %m : call_function[target=torch.ops.mylib.mystery.default]\n"
        "## Exception summary\n\n<class 'torch.onnx._internal.exporter._errors.DispatchError'>: No ONNX "
        "function found for <OpOverload(op='mylib.mystery', overload='default')>\n"
    )
    assert _describe(missing) == "no ONNX translation for op mylib.mystery.default (ConversionError)"


def test_a_program_whose_image_sizes_stay_fixed_takes_the_example_with_a_unit_height(tmp_path, monkeypatch):
    """Freeing image sizes can make export reason for minutes (Swin's padding): past a budget relative to
    the export with them fixed, that program is kept, its batch still free, and the reason noted. With a
    1-pixel-high input (a 1-d signal as N x C x 1 x T) its height is the example's 1, not the 2 the
    attempt to free it traced with."""
    import normswap.graph.capture as capture

    monkeypatch.setattr(capture, "IMAGE_SIZE_BUDGET", (0.001, 0.0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, (1, 3)), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 1, 8)
    program = capture.export_program(model, (x,), {}, grow_unit_dims=True, fallbacks=(notes := []))
    torch.testing.assert_close(program.module()(x), model(x))
    torch.testing.assert_close(program.module()(torch.randn(3, 3, 1, 8)).shape, torch.Size([3, 4, 1, 6]))
    assert any("free image sizes took over" in n for n in notes), notes


def test_a_file_declares_free_only_the_dims_a_verified_shape_varied(tmp_path):
    """A user's GPT-2 .pt2 exported at fixed shapes (plain torch.export) runs on its example only, and an
    HF ViT takes other batches but not other image sizes: the ONNX file used to declare batch and sequence
    (and the ViT's height for both image dims) free, and onnxruntime failed inside the graph on any other
    shape. Each free dim of the file is now one a verified shape varies; the others are declared at the
    example's size, so a runtime refuses another size at the input, by name."""
    import numpy as np
    import onnxruntime
    import transformers

    from normswap.api import export_onnx as export_file

    model, args, kwargs = model_zoo.gpt2(layers=1)
    ids = args[0][:2]  # batch 2: no size-1 dim for export to grow
    pt2 = tmp_path / "gpt2.pt2"
    torch.export.save(torch.export.export(model, (ids,), kwargs, strict=False), pt2)
    saved = export_file(str(pt2), tmp_path / "gpt2.onnx")
    assert saved.onnx.dynamic_axes == {}
    session = onnxruntime.InferenceSession(str(tmp_path / "gpt2.onnx"))
    assert [d.dim_value for d in _declared(tmp_path / "gpt2.onnx")[0]] == list(ids.shape)
    with pytest.raises(Exception, match=r"(?i)invalid dimensions|got: 7 expected: \d+"):
        session.run(None, {session.get_inputs()[0].name: np.zeros((ids.shape[0], 7), dtype=np.int64)})

    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.ViTModel(config).eval().save_pretrained(tmp_path / "vit")
    saved = export_file(str(tmp_path / "vit"), tmp_path / "vit.onnx")
    assert saved.onnx.dynamic_axes == {"pixel_values": {0: "batch"}}
    dims = _declared(tmp_path / "vit.onnx")[0]
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [3, 32, 32]
    session = onnxruntime.InferenceSession(str(tmp_path / "vit.onnx"))
    session.run(None, {"pixel_values": np.zeros((3, 3, 32, 32), dtype=np.float32)})  # a free batch runs


def test_a_dim_along_which_one_verified_size_failed_is_declared_fixed(tmp_path):
    """timm's mobilenetv3 exported at 32 x 32 runs at 8 x 8 in onnxruntime and fails inside the graph at
    45 x 45 (torch.export bounded the image size): the file declared height and width free, so a runtime
    would feed it any size. A dim along which a verified size failed is declared at the example's size,
    and the 8 x 8 it took is reported rejected with the reason; the batch stays free."""
    import numpy as np
    import onnxruntime
    import timm

    from normswap.api import export_onnx as export_file

    factory = tmp_path / "mnv3.py"
    factory.write_text(
        "import timm, torch\n"
        "def model():\n"
        "    torch.manual_seed(0)\n"
        "    return timm.create_model('mobilenetv3_small_050', pretrained=False).eval()\n"
    )
    assert timm.__version__  # the model is timm's own
    saved = export_file(f"{factory}:model", tmp_path / "m.onnx", input_shapes=["1,3,32,32"])
    assert saved.onnx.dynamic_axes == {"x": {0: "batch"}}
    assert [d.dim_value for d in _declared(tmp_path / "m.onnx")[0][1:]] == [3, 32, 32]
    rejected = {r["shapes"]: r["error"] for r in saved.onnx.shapes.rejected}
    assert set(rejected) == {"1x3x45x45", "1x3x8x8"}
    assert rejected["1x3x8x8"] == "declared at the example's size: a verified size along the same dims failed"
    assert saved.onnx.shapes.accepted == ["1x3x32x32", "2x3x32x32"]
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"))
    assert session.run(None, {"x": np.zeros((3, 3, 32, 32), dtype=np.float32)})[0].shape == (3, 1000)


def _declared(path: Path) -> list:
    import onnx

    return [
        list(i.type.tensor_type.shape.dim) for i in onnx.load(str(path), load_external_data=False).graph.input
    ]


def test_an_architectural_swap_written_as_onnx_takes_the_shapes_its_pt2_takes(tmp_path):
    """A swap checked on its example only recorded no variants, so its ONNX file declared every dim at
    the example's while its .pt2 kept free dims unchecked. Both are now run on the shapes the converted
    module accepts, and take the same ones."""
    import normswap

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 2),
    )  # fmt: skip
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, 16, 16) * 2 + 1)
    model.eval()
    x = torch.randn(2, 3, 16, 16)
    result = normswap.convert(model, normswap.ConvertConfig(to="groupnorm", groups=4), (x,))
    onnx_file = normswap.save(result, tmp_path / "gn.onnx")
    program = normswap.save(result, tmp_path / "gn.pt2")
    assert onnx_file.onnx.dynamic_axes == {"input": {0: "batch", 2: "height", 3: "width"}}
    assert len(onnx_file.shapes.accepted) > 1 and not onnx_file.shapes.rejected
    assert onnx_file.shapes.accepted == program.shapes.accepted
