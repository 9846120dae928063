"""normswap.convert: what `normswap convert` does, as a library call with a typed result.

Real outside models (torchvision's resnet18, Hugging Face GPT-2 and BERT built from small configs); the
numbers are the ones the CLI tests hold the command to, and the CLI's JSON report is the result's
``to_dict()``.
"""

from __future__ import annotations

import json
from pathlib import Path

import model_zoo
import pytest
import torch
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

import normswap
from normswap import BadInputError, CheckFailedError, ConversionResult, ConvertConfig
from normswap.api import Verdict, jsonable

pytest.importorskip("torchvision")
pytest.importorskip("transformers")

ZOO = str(Path(model_zoo.__file__))


def _count(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def _json(data: dict) -> dict:
    """What a --report file holds for ``data``: strict JSON, read back."""
    return json.loads(json.dumps(jsonable(data), allow_nan=False))


def test_fold_bn_on_torchvision_resnet18_leaves_the_input_alone(tmp_path):
    model, args, _ = model_zoo.resnet18(size=32)
    expected = model(*args)
    model.train()  # the caller's flags: conversion runs in inference mode and gives them back
    result = normswap.convert(model, ConvertConfig(fold_bn=True), args)

    assert isinstance(result, ConversionResult) and result.ok and result.verdict is Verdict.OK
    # folding BNs reads module-level facts, which resnet18's fx graph has: no torch.export for the analysis
    assert result.refusal is None and result.graph_method == "fx"
    fold = result.pass_report("fold_batchnorm")
    assert result.changes == len(fold.changes) == 20 and fold.skips == []
    assert fold.validation["outputs"][0]["max_rel"] <= 1e-5
    assert result.report.overall.within_tolerance and result.report.overall.worst_rel <= 1e-5
    assert _count(result.model, nn.BatchNorm2d) == 0 and not result.model.training
    torch.testing.assert_close(result.model(*args), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    # the input model: still 20 BatchNorms, still in training mode
    assert _count(model, nn.BatchNorm2d) == 20 and model.training

    saved = normswap.save(result, tmp_path / "folded.pt")
    assert saved.format == "pickle" and result.saved is saved
    loaded = torch.load(tmp_path / "folded.pt", weights_only=False)
    torch.testing.assert_close(loaded(*args), result.model(*args))


def test_gpt2_to_rmsnorm_under_the_exact_policy(tmp_path):
    model, args, kwargs = model_zoo.gpt2()
    out = tmp_path / "gpt2_rms.pt2"
    config = ConvertConfig(to="rmsnorm", exact=True, output=out)
    result = normswap.convert(model, config, args, kwargs)

    assert result.ok, result.refusal
    assert [p.pass_name for p in result.report.passes] == ["recenter_layernorm"]  # no lossy pass queued
    recenter = result.pass_report("recenter_layernorm")
    assert len(recenter.changes) == 5 and recenter.skips == []  # ln_1, ln_2 of 2 blocks, and ln_f
    assert recenter.validation["within_tolerance"] and not recenter.validation["failed_inputs"]
    assert result.report.overall.worst_rel <= 1e-5
    assert _count(result.model, nn.LayerNorm) == 0 and _count(model, nn.LayerNorm) == 5

    saved = normswap.save(result)  # to config.output
    assert saved.path == out and saved.format == "pt2" and out.exists()
    expected = model(*args, **kwargs).logits
    got = torch.export.load(out).module()(*args, **kwargs)
    got = got["logits"] if isinstance(got, dict) else got.logits if hasattr(got, "logits") else got[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    data = result.to_dict()
    assert data["written"] and data["output"] == str(out) and data["verdict"] == "ok"


def test_exact_policy_refuses_a_post_ln_model_with_its_reason(tmp_path):
    model, args, kwargs = model_zoo.bert()
    out = tmp_path / "bert.pt2"
    result = normswap.convert(model, ConvertConfig(to="rmsnorm", exact=True, output=out), args, kwargs)

    assert not result.ok and result.verdict is Verdict.NOT_EXACT_UNDER_POLICY
    assert result.refusal.startswith(
        "--exact: 4 LayerNorm(s) cannot become RMSNorm exactly (encoder.layer.0.attention.output.LayerNorm: "
    )
    assert result.refusal.endswith("; nothing written")
    recenter = result.pass_report("recenter_layernorm")
    assert len(recenter.changes) == 1 and len(recenter.skips) == 4
    assert {s.cause.value for s in recenter.skips} == {"architecture"}
    with pytest.raises(CheckFailedError, match="cannot become RMSNorm exactly"):
        normswap.save(result)
    assert not out.exists()
    data = result.to_dict()
    assert data["written"] is False and data["verdict"] == "not_exact_under_policy"
    assert data["ok"] is False  # the report's "ok" is the verdict's (it said True: the exact checks passed)


def test_exact_policy_refuses_an_architectural_swap_before_any_work():
    with pytest.raises(CheckFailedError, match=r"^--exact: swap_norm is architectural, not exact; nothing"):
        ConvertConfig(to="layernorm", exact=True).validate()


class Guarded(nn.Module):
    """A pre-LN GPT-2 behind a branch on a tensor's value: no graph can be captured, so the exact route
    cannot run, although the architecture allows it."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = model_zoo.gpt2()[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.max() >= 0:
            return self.lm(input_ids=input_ids, use_cache=False).logits
        return self.lm(input_ids=input_ids.clamp(min=0), use_cache=False).logits


def test_a_lossy_fallback_needs_consent():
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    guarded = Guarded().eval()
    refused = normswap.convert(guarded, ConvertConfig(to="rmsnorm"), (ids,))

    assert refused.verdict is Verdict.LOSSY_WITHOUT_CONSENT and not refused.ok
    assert refused.graph_method is None
    assert refused.refusal.startswith(
        "--to rmsnorm: the exact route failed for 5 LayerNorm(s), not because of the model's architecture: "
        "no graph captured"
    )
    assert refused.refusal.endswith("pass --allow-lossy to accept the lossy swap; nothing written")
    assert len(refused.pass_report("swap_norm").changes) == 5
    assert refused.lossy_by_consent is None

    consented = normswap.convert(guarded, ConvertConfig(to="rmsnorm", allow_lossy=True), (ids,))
    assert consented.ok and len(consented.lossy_by_consent) == 5
    assert consented.notes == [
        "--allow-lossy: 5 LayerNorm(s) swapped lossily where the exact route failed (see Skipped)"
    ]
    swap = consented.pass_report("swap_norm")
    assert 0 < swap.validation["worst_sqnr_db"] < 80  # lossy, and measured
    assert _count(consented.model, nn.LayerNorm) == 0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ConvertConfig(), "nothing to do: give --to KIND, --fold-bn"),
        (ConvertConfig(to="groupnorm"), "--to groupnorm needs --groups N"),
        (ConvertConfig(to="nope"), "--to 'nope' is not a norm kind normswap can swap to"),
        (ConvertConfig(to="dyt", from_kinds=["conv"]), "--from 'conv': choose from batch, layer"),
        (ConvertConfig(fold_bn=True, calibration_data="x.pt"), "--calibrate fits swapped norms"),
        # the fit reads modules that a graph rewrite has made one exported program by then
        (
            ConvertConfig(to="layernorm", defer_rms=True, calibration_data="x.pt"),
            "--calibrate fits swapped norms as modules, and defer_rms makes the model an exported program",
        ),
        (ConvertConfig(to="rmsnorm", exact=True, allow_lossy=True), "--allow-lossy and --exact contradict"),
        (ConvertConfig(fold_bn=True, output="m.bin"), "-o m.bin: unknown output format"),
        (ConvertConfig(to="fused", fuse_add=True, output="m"), "--fuse-add makes the model an exported"),
        (ConvertConfig(to="rmsnorm", exact=True, output="m.pt", portable=True), "--portable is for a .pt2"),
        (ConvertConfig(add_weight_norm="all", weight_norm_dim="x"), "--weight-norm-dim 'x': give output"),
        # torch reads dim -1 as the whole weight, not the last dim: refused as an option, not a crash
        (ConvertConfig(add_weight_norm="all", weight_norm_dim="-1"), "--weight-norm-dim '-1': dim must be"),
        (ConvertConfig(add_weight_norm="all", weight_norm_dim=-1), "--weight-norm-dim -1: dim must be"),
        # accepted and ignored, where --layers without --to cosine is refused
        (ConvertConfig(fold_bn=True, calibration_batches=2), "--calibrate-batches read the --calibrate data"),
        (ConvertConfig(fold_bn=True, batch_size=4), "--batch-size read the --calibrate data: give"),
    ],
)
def test_config_mistakes_are_bad_input(config, message):
    with pytest.raises(BadInputError) as raised:
        config.validate()
    assert message in str(raised.value)
    assert raised.value.exit_code == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"to": "dyt", "calibration_data": "x.pt", "calibration_batches": 0},
            "--calibrate-batches must be a",
        ),
        ({"to": "dyt", "calibration_data": "x.pt", "calibration_batches": -2}, "got -2"),
        ({"to": "dyt", "calibration_data": "x.pt", "batch_size": 0}, "--batch-size must be a whole number"),
        ({"to": "groupnorm", "groups": 0}, "--groups must be a whole number of at least 1, got 0"),
        ({"to": "groupnorm", "groups": "4"}, "--groups must be a whole number of at least 1, got '4'"),
        ({"to": "groupnorm", "groups": True}, "got True"),
        ({"fold_bn": True, "output": 5}, "-o must be a path (a str or a Path), got a int"),
    ],
)
def test_counts_and_paths_of_a_config_built_in_python_are_checked(options, message):
    """What the command line's own types check, checked where a library caller builds the config: 0 or
    -2 calibration batches calibrated on nothing or raised ValueError inside islice, a str of groups raised
    TypeError, an int output TypeError (a user hunt)."""
    with pytest.raises(BadInputError) as raised:
        ConvertConfig(**options)
    assert message in str(raised.value) and raised.value.exit_code == 2


def test_a_kind_given_as_a_str_and_a_config_given_as_a_dict():
    """from_kinds="layer" was read letter by letter ("--from 'l'"); a dict as the config raised
    AttributeError; a module given to inspect raised TypeError where validate says what to pass."""
    assert ConvertConfig(to="dyt", from_kinds="layer").from_kinds == ("layer",)
    assert ConvertConfig(to="dyt", from_kinds="layer, rms").from_kinds == ("layer", "rms")
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(BadInputError, match=r"config must be a normswap\.ConvertConfig, not a dict"):
        normswap.convert(model, {"to": "rmsnorm"}, (torch.randn(2, 4),))  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match=r"not a Sequential object; normswap\.convert takes a module"):
        normswap.inspect(model)  # type: ignore[arg-type]


def test_the_cli_report_is_the_results_to_dict(tmp_path):
    cli_out, cli_report = tmp_path / "cli" / "folded.pt2", tmp_path / "cli" / "report.json"
    cli_out.parent.mkdir()
    argv = [
        "convert",
        f"{ZOO}:resnet18_factory",
        "--fold-bn",
        "-o",
        str(cli_out),
        "--report",
        str(cli_report),
    ]
    ran = CliRunner().invoke(app, argv)
    assert ran.exit_code == 0, ran.output
    from_cli = json.loads(cli_report.read_text())

    model, args = model_zoo.resnet18_factory()
    out = tmp_path / "folded.pt2"
    result = normswap.convert(model, ConvertConfig(fold_bn=True, output=out), args)
    normswap.save(result)
    from_library = _json(result.to_dict())

    assert from_cli.pop("model") == f"{ZOO}:resnet18_factory"
    assert from_cli.pop("output") == str(cli_out) and from_library.pop("output") == str(out)
    # sentences about the written file name it: the same sentences, each with its own path
    cli_said = [m.replace(str(cli_out), "OUT") for m in from_cli.pop("output_messages")]
    assert cli_said == [m.replace(str(out), "OUT") for m in from_library.pop("output_messages")]
    assert from_cli == from_library
    assert from_cli["written"] and from_cli["verdict"] == "ok" and from_cli["refusal"] is None


def test_the_cli_report_of_a_refusal_is_the_results_to_dict(tmp_path):
    cli_out, cli_report = tmp_path / "x.pt2", tmp_path / "r.json"
    argv = ["convert", f"{ZOO}:bert_factory", "--to", "rmsnorm", "--exact", "-o", str(cli_out)]
    ran = CliRunner().invoke(app, [*argv, "--report", str(cli_report)])
    assert ran.exit_code == 1 and not cli_out.exists()
    from_cli = json.loads(cli_report.read_text())

    model, args, kwargs = model_zoo.bert()
    result = normswap.convert(model, ConvertConfig(to="rmsnorm", exact=True, output=cli_out), args, kwargs)
    from_library = _json(result.to_dict())
    assert from_cli.pop("model") == f"{ZOO}:bert_factory"
    assert from_cli == from_library
    assert from_cli["refusal"] in " ".join(ran.output.split())


def test_the_api_says_what_it_takes_where_it_raised_type_errors(tmp_path):
    """A bare tensor as example inputs ('Boolean value of Tensor ... is ambiguous'), a module given where a
    spec is read ('expected str ... not MobileNetV3'), a str output for recalibrate ('no attribute
    suffix'): each a BadInputError that says what to pass, or taken as ConvertConfig takes it."""
    import torchvision

    from normswap.errors import BadInputError

    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(BadInputError, match=r"pass \(x,\), not x"):
        normswap.convert(model, normswap.ConvertConfig(fold_bn=True), x)
    with pytest.raises(BadInputError, match=r"not a ResNet object; normswap\.convert takes a module"):
        normswap.validate(model, model)
    data = tmp_path / "data.pt"
    torch.save(torch.randn(8, 3, 32, 32), data)
    spec = f"{tmp_path / 'factory.py'}:build"
    (tmp_path / "factory.py").write_text(
        "import torch, torchvision\n"
        "def build():\n    torch.manual_seed(0)\n    return torchvision.models.resnet18(num_classes=10).eval()\n"
    )
    out = str(tmp_path / "out.pt2")
    run = normswap.recalibrate(spec, str(data), out, batch_size=4, input_shapes=["1,3,32,32"])
    assert run.ok and (tmp_path / "out.pt2").is_file()


def test_python_spellings_of_a_dtype_and_a_path_are_taken(tmp_path):
    """ConvertConfig(dtype=torch.bfloat16) raised AttributeError ('torch.dtype' has no 'lower'), and
    export_onnx / validate(plot=) raised it for a str path that convert and recalibrate take."""
    assert normswap.ConvertConfig(
        fold_bn=True, output=tmp_path / "m.pt2", dtype=torch.bfloat16
    ).output_dtype == (torch.bfloat16)
    with pytest.raises(normswap.BadInputError, match=r"--dtype must be one of float32, float16, bfloat16"):
        normswap.ConvertConfig(fold_bn=True, output=tmp_path / "m.pt2", dtype=torch.int8).validate()
    (tmp_path / "taken.onnx").write_bytes(b"the user's")
    with pytest.raises(normswap.OutputExistsError):  # a str path reaches the output rule, not .suffix
        normswap.export_onnx("no/such/model.pt2", str(tmp_path / "taken.onnx"))
    (tmp_path / "taken.png").write_bytes(b"the user's")
    with pytest.raises(normswap.OutputExistsError):
        normswap.validate("no/such/a.pt2", "no/such/b.pt2", plot=str(tmp_path / "taken.png"))


def test_a_compiled_or_data_parallel_model_is_converted_as_the_module_inside():
    """Through torch.compile's wrapper every check recompiled per shape (minutes for a ResNet-18) and
    every site carried "_orig_mod."; DataParallel's "module.". The module inside is converted, said."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4)
    )
    args = (torch.randn(2, 3, 8, 8),)
    plain = normswap.convert(model.eval(), normswap.ConvertConfig(fold_bn=True), args)
    assert len(plain.report.passes[0].changes) == 2
    for wrapper, name in ((torch.compile, "torch.compile's wrapper"), (nn.DataParallel, "DataParallel")):
        result = normswap.convert(wrapper(model), normswap.ConvertConfig(fold_bn=True), args)
        assert result.ok and [c.site for c in result.report.passes[0].changes] == [
            c.site for c in plain.report.passes[0].changes
        ]
        assert not any(c.site.startswith(("_orig_mod.", "module.")) for c in result.report.passes[0].changes)
        assert any(name in note for note in result.notes), result.notes
        assert result.model.state_dict().keys() == plain.model.state_dict().keys()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"fold_bn": "False"}, "fold_bn is True or False, got 'False'"),  # a str switched it on
        ({"opset": "17"}, "opset is a whole number (an ONNX opset), got '17'"),  # TypeError after the work
        ({"from_kinds": 3}, "from_kinds is a name or a list of names, got 3"),
        ({"layers": 3}, "layers is a name or a list of names, got 3"),
    ],
)
def test_a_config_option_of_the_wrong_type_is_refused_by_name(options, said):
    with pytest.raises(normswap.BadInputError) as refused:
        normswap.ConvertConfig(**options)
    assert str(refused.value) == said


def test_a_model_on_the_meta_device_is_refused_in_one_sentence():
    """Weights on the meta device failed deep inside a check (Tensor.item() on meta, copy out of meta)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).eval()
    with pytest.raises(
        normswap.BadInputError, match=r"^the model's weights are on the meta device \(0\.weight"
    ):
        normswap.convert(model, normswap.ConvertConfig(fold_bn=True), (torch.randn(1, 3, 8, 8),))
