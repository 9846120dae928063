"""The normswap command end to end: exit codes, messages, files written or not."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import model_zoo
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

ZOO = str(Path(model_zoo.__file__))
runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args))


def test_help_does_not_import_torch_triton_or_onnx():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from normswap_cli.app import app\n"
        "for argv in (['--help'], ['inspect', '--help'], ['convert', '--help']):\n"
        "    assert CliRunner().invoke(app, argv).exit_code == 0\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'onnx', 'onnxruntime') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_torchrun_worker_leaves_without_finalization_and_keeps_its_exit_status(tmp_path):
    """Under torchrun (WORLD_SIZE > 1) a finished command exits with os._exit after flushing its output:
    gloo's threads touching Python during the interpreter's finalization abort a finished run now and
    then. Alone, or failed, it finalizes as usual. The exit status and the printed lines survive."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('finalized'))\n"
        "from normswap_cli.app import main\n"
        "sys.argv = ['normswap', *sys.argv[1:]]\n"
        "main()\n"
    )
    missing = str(tmp_path / "missing.pt2")
    for world_size, finalized in (("2", False), ("1", True)):
        env = {**os.environ, "WORLD_SIZE": world_size}
        shown = subprocess.run(
            [sys.executable, "-c", code, "--version"], capture_output=True, text=True, env=env
        )
        assert shown.returncode == 0 and shown.stdout.startswith("normswap "), shown
        assert ("finalized" in shown.stdout) is finalized
        refused = subprocess.run(
            [sys.executable, "-c", code, "inspect", missing], capture_output=True, text=True, env=env
        )
        assert refused.returncode == 2, refused
        # a failed run finalizes: another process must have the time to say its own reason
        assert "missing.pt2" in refused.stderr and "finalized" in refused.stdout


def test_convert_fold_bn_resnet18_leaves_no_batchnorm(tmp_path):
    out = tmp_path / "folded.pt2"
    report = tmp_path / "report.json"
    result = _run("convert", f"{ZOO}:resnet18_factory", "--fold-bn", "-o", str(out), "--report", str(report))
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and out.exists()
    data = json.loads(report.read_text())
    fold = data["passes"][0]
    assert data["written"] and len(fold["changes"]) == 20 and fold["skips"] == []
    assert fold["validation"]["outputs"][0]["max_rel"] <= 1e-5
    program = torch.export.load(out)
    assert not [n for n in program.graph.nodes if "batch_norm" in str(n.target)]
    model, args = model_zoo.resnet18_factory()
    expected = model(*args)
    torch.testing.assert_close(
        program.module()(*args), expected, rtol=0, atol=1e-5 * expected.abs().max().item()
    )


def test_convert_gpt2_to_rmsnorm_is_exact_by_recentering(tmp_path):
    out = tmp_path / "gpt2_rms.pt2"
    report = tmp_path / "report.json"
    result = _run(
        "convert",
        f"{ZOO}:gpt2_factory",
        "--to",
        "rmsnorm",
        "--exact",
        "-o",
        str(out),
        "--report",
        str(report),
    )
    assert result.exit_code == 0, result.output
    assert "recenter_layernorm (exact): 5 changed, 0 skipped" in result.output and "PASS" in result.output
    data = json.loads(report.read_text())
    assert data["written"] and data["overall"]["within_tolerance"]
    assert max(o["max_rel"] for o in data["overall"]["outputs"]) <= 1e-5
    program = torch.export.load(out)
    assert not [n for n in program.graph.nodes if "layer_norm" in str(n.target)]
    model, args, kwargs = model_zoo.gpt2()
    expected = model(*args, **kwargs).logits
    got = program.module()(*args, **kwargs)
    got = got["logits"] if isinstance(got, dict) else got.logits if hasattr(got, "logits") else got[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_convert_bert_to_rmsnorm_is_exact_where_it_can_and_reports_the_rest(tmp_path):
    out = tmp_path / "bert_rms.pt"
    report = tmp_path / "report.json"
    result = _run(
        "convert", f"{ZOO}:bert_factory", "--to", "rmsnorm", "-o", str(out), "--report", str(report)
    )
    assert result.exit_code == 0, result.output
    assert "recenter_layernorm (exact): 1 changed, 4 skipped" in result.output
    assert "swap_norm (architectural): 4 changed" in result.output and "SQNR" in result.output
    data = json.loads(report.read_text())
    assert 0 < data["overall"]["worst_sqnr_db"] < 80
    converted = torch.load(out, weights_only=False)
    _, args, kwargs = model_zoo.bert()
    assert converted(*args, **kwargs).last_hidden_state.shape == (2, 12, 64)


def test_exact_fails_on_a_post_ln_model_and_writes_nothing(tmp_path):
    out = tmp_path / "x.pt2"
    report = tmp_path / "r.json"
    result = _run(
        "convert",
        f"{ZOO}:bert_factory",
        "--to",
        "rmsnorm",
        "--exact",
        "-o",
        str(out),
        "--report",
        str(report),
    )
    assert result.exit_code == 1
    assert (
        "--exact: 4 LayerNorm(s) cannot become RMSNorm exactly (encoder.layer.0.attention.output.LayerNorm"
        in (result.output)
    )
    assert "nothing written" in result.output and not out.exists()
    assert json.loads(report.read_text())["written"] is False


def test_exact_refuses_an_architectural_swap_and_writes_nothing(tmp_path):
    out = tmp_path / "x.pt2"
    result = _run("convert", f"{ZOO}:gpt2_factory", "--to", "layernorm", "--exact", "-o", str(out))
    assert result.exit_code == 1
    assert "--exact: swap_norm is architectural, not exact; nothing written" in result.output
    assert not out.exists()


def test_a_broken_exact_rewrite_fails_the_check_and_writes_nothing(tmp_path, monkeypatch):
    # the package re-exports a function of the same name, so fetch the module itself
    fold = importlib.import_module("normswap.passes.batchnorm.group")

    def wrong(weight, bias, scale, shift, out_channel_dim=0):
        w, b = real(weight, bias, scale, shift, out_channel_dim)
        return w * 1.01, b

    real = fold.fold_bn_into_conv_weights
    monkeypatch.setattr(fold, "fold_bn_into_conv_weights", wrong)
    out = tmp_path / "bad.pt2"
    result = _run("convert", f"{ZOO}:resnet18_factory", "--fold-bn", "-o", str(out))
    assert result.exit_code == 1
    assert "FAIL" in result.output and "exact rewrite changed the outputs: fold_batchnorm" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_inspect_lists_sites_and_writes_json(tmp_path):
    js = tmp_path / "sites.json"
    result = _run("inspect", f"{ZOO}:gpt2_factory", "--json", str(js))
    assert result.exit_code == 0, result.output
    assert "5 norm sites: layer 5; graph captured with export" in result.output
    data = json.loads(js.read_text())
    assert data["counts"] == {"layer": 5}
    assert data["sites"][0]["path"] == "transformer.h.0.ln_1"
    assert data["sites"][0]["consumers"] == ["transformer.h.0.attn.c_attn"]


def test_inspect_pt2_with_its_recorded_inputs(tmp_path):
    model, args, _ = model_zoo.resnet18(size=32)
    path = tmp_path / "r18.pt2"
    torch.export.save(torch.export.export(model, args, strict=False), path)
    result = _run("inspect", str(path))
    assert result.exit_code == 0, result.output
    assert "20 norm sites: batch 20; graph captured with export" in result.output


def test_usage_errors_exit_2_with_one_line(tmp_path):
    out = str(tmp_path / "o.pt2")
    cases = [
        (("convert", f"{ZOO}:gpt2_factory", "-o", out), "nothing to do: give --to KIND, --fold-bn"),
        (("convert", f"{ZOO}:gpt2_factory", "--to", "tanh", "-o", out), "--to 'tanh' is not a norm kind"),
        (("inspect", str(tmp_path / "missing.pt2")), "missing.pt2"),
        (
            ("inspect", "no_such_package.models:build"),
            "cannot import factory module 'no_such_package.models'",
        ),
        (
            ("convert", f"{ZOO}:conv_bn_without_inputs", "--fold-bn", "-o", out),
            "this command needs example inputs",
        ),
        (("inspect", f"{ZOO}:HandRMSNorm"), "raised TypeError: HandRMSNorm.__init__() missing 1 required"),
        (("convert", f"{ZOO}:resnet18_factory", "--fold-bn", "-o", str(tmp_path / "o.txt")), ".txt"),
    ]
    for argv, message in cases:
        result = _run(*argv)
        assert result.exit_code == 2, (argv, result.output)
        assert message in result.output, (argv, result.output)
        assert "Traceback" not in result.output


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_malicious_pickle_is_not_executed_without_trust_pickle(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    with open(path, "wb") as f:
        pickle.dump(_Payload(marker), f)
    result = _run("inspect", str(path))
    assert result.exit_code == 2
    assert "--trust-pickle" in result.output and "arbitrary code" in result.output
    assert not marker.exists()


def test_convert_groupnorm_with_calibration_reports_the_gain(tmp_path):
    data = tmp_path / "calib.pt"
    torch.save(torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0)), data)
    out, report = tmp_path / "gn.pt2", tmp_path / "r.json"
    result = _run(
        "convert", f"{ZOO}:resnet18_factory", "--to", "groupnorm", "--groups", "8", "--calibrate", str(data),
        "--batch-size", "8", "-o", str(out), "--report", str(report),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Calibration on 2 batches" in result.output and out.exists()
    data_out = json.loads(report.read_text())
    fit = data_out["calibration"]
    assert len(fit["sites"]) == 20
    assert fit["model_sqnr_after_db"] > fit["model_sqnr_before_db"] + 15
    after = data_out["overall_after_calibration"]["worst_sqnr_db"]
    assert after > data_out["overall"]["worst_sqnr_db"] + 15  # on the example inputs, held out


def test_convert_option_mistakes_are_usage_errors(tmp_path):
    out = tmp_path / "x.pt2"
    cases = [
        (["--to", "groupnorm"], "--to groupnorm needs --groups N"),
        (["--to", "layernorm", "--groups", "4"], "--groups applies to --to groupnorm only"),
        (
            ["--fold-bn", "--calibrate", "x.pt"],
            "--calibrate fits swapped norms: give an architectural --to KIND",
        ),
        (["--to", "dyt", "--from", "conv"], "--from 'conv': choose from batch, layer"),
        (["--from", "batch"], "--from picks which norms --to replaces: give --to KIND"),
        ([], "nothing to do: give --to KIND, --fold-bn"),
    ]
    for extra, message in cases:
        result = _run("convert", f"{ZOO}:resnet18_factory", "-o", str(out), *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.output.replace("\n", " "), (extra, result.output)
    assert not out.exists()


def test_convert_fused_with_residual_adds_fused_too(tmp_path):
    out, report = tmp_path / "g.pt2", tmp_path / "r.json"
    result = _run(
        "convert", f"{ZOO}:gpt2_factory", "--to", "fused", "--fuse-add", "--exact", "-o", str(out), "--report",
        str(report),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "fuse_add_norm (exact): 4 changed, 1 skipped" in result.output and out.exists()
    passes = {p["pass_name"]: p for p in json.loads(report.read_text())["passes"]}
    assert passes["fuse_add_norm"]["skips"][0]["reason"] == "its input comes from dropout, not a residual add"
    result = _run("convert", f"{ZOO}:gpt2_factory", "--fuse-add", "-o", str(tmp_path / "x.pt2"))
    assert (
        result.exit_code == 2
        and "--fuse-add fuses residual adds into fused norms: give --to fused" in result.output
    )


def test_convert_fused_with_inline_norms_fused_too(tmp_path):
    out, report = tmp_path / "h.pt2", tmp_path / "r.json"
    result = _run(
        "convert", f"{ZOO}:HandWrittenNet", "--input-shape", "3,16", "--to", "fused", "--fuse-inline",
        "--exact", "-o", str(out), "--report", str(report),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "fuse_graph_norm (exact): 2 changed, 0 skipped" in result.output and out.exists()
    passes = {p["pass_name"]: p for p in json.loads(report.read_text())["passes"]}
    assert [c["details"]["source"] for c in passes["fuse_graph_norm"]["changes"]] == ["functional", "pattern"]
    result = _run(
        "convert", f"{ZOO}:HandWrittenNet", "--input-shape", "3,16", "--fuse-inline", "-o", str(out),
        "--overwrite",
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--fuse-inline fuses norms inside other forwards: give --to fused" in result.output
    pickled = tmp_path / "h.pt"
    result = _run(
        "convert", f"{ZOO}:HandWrittenNet", "--input-shape", "3,16", "--to", "fused", "--fuse-inline", "-o",
        str(pickled),
    )  # fmt: skip
    # a .pt holds the program (normswap.load.exported_module), which loads back and runs (its numbers
    # against the original: tests/load/test_portable_outputs.py)
    assert result.exit_code == 0, result.output
    loaded = torch.load(pickled, weights_only=False)
    assert type(loaded).__name__ == "ExportedModule"
    with torch.no_grad():
        assert loaded(torch.randn(3, 16)).shape == torch.export.load(out).module()(torch.randn(3, 16)).shape


def test_pt2_outputs_take_other_input_shapes(tmp_path):
    # every input dim the model leaves free is exported dynamic: other batch sizes and lengths run
    model, (ids,), kwargs = model_zoo.gpt2()
    out = tmp_path / "g.pt2"
    result = _run("convert", f"{ZOO}:gpt2_factory", "--to", "fused", "--fuse-add", "-o", str(out))
    assert result.exit_code == 0, result.output
    loaded = torch.export.load(out).module()
    other = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(2))
    assert ids.shape == (2, 12)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(other, **kwargs).logits, model(other, **kwargs).logits, atol=1e-4, rtol=1e-5
        )

    out = tmp_path / "r.pt2"
    assert _run("convert", f"{ZOO}:resnet18_factory", "--fold-bn", "-o", str(out)).exit_code == 0
    model, (x,) = model_zoo.resnet18_factory()
    batch = torch.randn(x.shape[0] + 2, *x.shape[1:])
    with torch.no_grad():
        want = model(batch)
        torch.testing.assert_close(
            torch.export.load(out).module()(batch), want, atol=1e-4 * float(want.abs().max()), rtol=0
        )


_WEIGHT_NORM_FACTORY = """
import warnings

import torch
from torch import nn


def _net():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv1d(4, 4, 3, padding=1))
    nn.utils.parametrizations.weight_norm(model[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        nn.utils.weight_norm(model[2])
    return model.eval()


def both_forms():
    return _net(), (torch.randn(2, 2, 8),)


def with_a_lambda():
    model = _net()
    model.scale = lambda x: x  # does not pickle, weight norm or not
    return model, (torch.randn(2, 2, 8),)
"""


def test_convert_remove_weight_norm_writes_a_pickle(tmp_path):
    """Both weight-norm forms removed, and the plain model written to .pt; the model is still checked
    for pickling before the work (judged as it will be written, without its weight norms)."""
    factory = tmp_path / "weight_norm_models.py"
    factory.write_text(_WEIGHT_NORM_FACTORY)
    out = tmp_path / "plain.pt"
    result = _run("convert", f"{factory}:both_forms", "--remove-weight-norm", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "remove_weight_norm (exact): 2 changed, 0 skipped" in result.output and out.exists()
    loaded = torch.load(out, weights_only=False)
    assert [type(m) for m in loaded] == [torch.nn.Conv1d, torch.nn.Tanh, torch.nn.Conv1d]

    bad = tmp_path / "bad.pt"
    result = _run("convert", f"{factory}:with_a_lambda", "--remove-weight-norm", "-o", str(bad))
    assert result.exit_code == 2, result.output
    assert "the model cannot be pickled" in result.output and "lambda" in result.output
    assert "Changes" not in result.output and not bad.exists()  # refused before the work


def test_a_crash_is_a_bug_with_its_own_exit_code_and_a_pointer_to_debug(tmp_path, monkeypatch):
    """Exit codes: 0 done, 1 a check failed, 2 bad input; anything else that escapes is a bug: exit 3 and
    one line saying so, the traceback only with --debug."""
    import normswap.api

    def broken(*args, **kwargs):
        raise KeyError("layer3.0.bn1")

    monkeypatch.setattr(normswap.api, "inspect", broken)
    monkeypatch.delenv("NORMSWAP_DEBUG", raising=False)
    ran = CliRunner().invoke(app, ["inspect", f"{ZOO}:resnet18_factory"])
    assert ran.exit_code == 3, ran.output
    text = " ".join(ran.output.split())
    assert "internal error (KeyError: 'layer3.0.bn1')" in text and "--debug" in text
    assert "Traceback" not in ran.output
    monkeypatch.setenv("NORMSWAP_DEBUG", "0")  # --debug sets it for the process; put back by monkeypatch
    debugged = CliRunner().invoke(app, ["--debug", "inspect", f"{ZOO}:resnet18_factory"])
    assert isinstance(debugged.exception, KeyError)  # the traceback is the user's to see


def test_quiet_prints_only_what_was_written(tmp_path):
    example = str(Path(__file__).resolve().parents[1] / "examples" / "small_convnet.py") + ":build"
    out = tmp_path / "r.pt2"
    ran = CliRunner().invoke(app, ["--quiet", "convert", example, "--fold-bn", "-o", str(out)])
    assert ran.exit_code == 0, ran.output
    assert ran.output.strip().splitlines() == [f"wrote {out} (pt2)"]
    loud = CliRunner().invoke(app, ["convert", example, "--fold-bn", "-o", str(tmp_path / "y.pt2")])
    assert len(loud.output.splitlines()) > 10  # quiet is for the run that asked for it
