"""What is written is what was verified: a saved program is run on every input shape its conversion was
verified on before it takes its name, says which it takes, and an exact conversion refuses one that would
not take them (issue 31). No fallback from a dynamic to a static export is silent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import normswap
from normswap.errors import CheckFailedError


def _gpt2(positions: int = 1024) -> tuple[torch.nn.Module, tuple, dict]:
    """HF GPT-2 from a config with its default position table, as a user builds it; batch 1 x 32 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=positions)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.75, 1.25)
                module.bias.uniform_(-0.5, 0.5)
    return model, (torch.randint(0, 128, (1, 32)),), {"use_cache": False}


def _llama() -> tuple[torch.nn.Module, tuple, dict]:
    """HF Llama from a config (positions for 1024 tokens), random norm weights; batch 1 x 32 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.75, 1.25)
    return model, (torch.randint(0, 128, (1, 32)),), {"use_cache": False}


@pytest.mark.parametrize(
    ("build", "options"),
    [
        (_gpt2, {"to": "crmsnorm", "exact": True}),
        (_gpt2, {"to": "fused", "fuse_add": True, "exact": True}),
        (_llama, {"defer_rms": True}),
    ],
    ids=["gpt2-crmsnorm", "gpt2-fuse-add", "llama-defer-rms"],
)
def test_graph_rewrite_programs_take_every_length_and_batch_in_a_fresh_process(
    tmp_path: Path, build, options
):
    """The issue's case first: --to crmsnorm --exact of GPT-2 from a batch-1 example wrote a program fixed
    at 1 x 32 (the graph rewrite's export specialized the batch, so the saving export fell back to
    static). Every rewrite that makes a graph, its .pt2 loaded where neither model nor normswap's state is."""
    model, args, kwargs = build()
    result = normswap.convert(model, normswap.ConvertConfig(**options), args, kwargs)
    assert result.ok and result.changes > 0, result.refusal
    assert isinstance(result.model, torch.fx.GraphModule)
    saved = normswap.save(result, tmp_path / "g.pt2")
    assert saved.shapes is not None and not saved.shapes.rejected, saved.shapes
    assert "2x32" in saved.shapes.accepted and "1x32" in saved.shapes.accepted
    assert not [m for m in saved.messages if "fixed at" in m]
    assert saved.to_dict()["written_shapes"]["accepted"] == saved.shapes.accepted
    # the shapes a user runs, well beyond the verified ones, against the original model
    shapes = [(1, 32), (1, 512), (4, 32), (3, 300), (4, 512)]
    inputs = {
        f"{b}x{s}": torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(b * s))
        for b, s in shapes
    }
    with torch.no_grad():
        want = {k: model(ids, use_cache=False).logits for k, ids in inputs.items()}
    torch.save({"inputs": inputs, "want": want}, tmp_path / "cases.pt")
    script = textwrap.dedent(
        f"""
        import torch, transformers.modeling_outputs, normswap.kernels
        cases = torch.load({str(tmp_path / "cases.pt")!r})
        program = torch.export.load({str(tmp_path / "g.pt2")!r}).module()
        for key, ids in cases["inputs"].items():
            got = program(ids, use_cache=False)["logits"]
            want = cases["want"][key]
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel < 1e-4, (key, rel)
            print(key, "ok", f"{{rel:.1e}}")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count(" ok ") == len(shapes), run.stdout


def _static_export_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every export with free dims fail, as a model with data-dependent shapes makes it fail."""
    real = torch.export.export

    def export(*a, dynamic_shapes=None, **kw):
        if dynamic_shapes is not None:
            raise RuntimeError("Could not guard on data-dependent expression u0 < 32")
        return real(*a, **kw)

    monkeypatch.setattr(torch.export, "export", export)


def test_exact_conversion_refuses_a_program_fixed_at_the_example(tmp_path: Path, monkeypatch):
    model, args, kwargs = _gpt2(positions=64)
    result = normswap.convert(model, normswap.ConvertConfig(to="rmsnorm", exact=True), args, kwargs)
    assert result.ok, result.refusal
    _static_export_only(monkeypatch)
    for name in ("g.pt2", "g.pt"):
        if name == "g.pt" and not isinstance(result.model, torch.fx.GraphModule):
            continue  # a module pickles whole: no program, no fixed shapes
        with pytest.raises(CheckFailedError) as refusal:
            normswap.save(result, tmp_path / name)
        text = str(refusal.value)
        assert "would not take every input shape the conversion was verified on" in text
        assert "rejects 2x32 (AssertionError: Guard failed" in text  # the batch variant, with its guard
        assert "fixed at the example's shapes 1x32" in text and "data-dependent" in text
        assert "nothing written" in text
        assert not (tmp_path / name).exists() and not list(tmp_path.glob(f"*{name}*"))


def test_without_exact_the_file_is_written_and_says_which_shapes_it_takes(tmp_path: Path, monkeypatch):
    model, args, kwargs = _gpt2(positions=64)
    result = normswap.convert(model, normswap.ConvertConfig(fold_norm_affine=True), args, kwargs)
    assert result.ok and result.changes > 0, result.refusal
    _static_export_only(monkeypatch)
    saved = normswap.save(result, tmp_path / "g.pt2")
    assert (tmp_path / "g.pt2").exists()
    assert saved.shapes is not None and saved.shapes.accepted == ["1x32"]
    rejected = [r["shapes"] for r in saved.shapes.rejected]
    assert "2x32" in rejected and len(rejected) >= 2, rejected  # the batch and a length variant
    said = " ".join(saved.messages)
    assert "fixed at the example's shapes 1x32" in said and "data-dependent" in said
    assert "takes 1x32 of the shapes it was verified on, and rejects 2x32" in said
    report = saved.to_dict()
    assert report["written_shapes"]["rejected"] == saved.shapes.rejected
    assert any("fixed at" in m for m in report["output_messages"])


def test_the_command_says_which_shapes_the_file_takes_and_refuses_under_exact(tmp_path: Path, monkeypatch):
    """The same rule on the command line: the shapes the written program takes are printed and in
    --report; an exact conversion whose program would be fixed at the example exits 1, nothing written."""
    import json

    from normswap_cli.app import app
    from typer.testing import CliRunner

    zoo = Path(__file__).resolve().parents[1] / "model_zoo.py"
    out, report = tmp_path / "g.pt2", tmp_path / "r.json"
    args = ["convert", f"{zoo}:gpt2_factory", "--to", "crmsnorm", "--exact", "-o", str(out)]
    ran = CliRunner().invoke(app, [*args, "--report", str(report)])
    assert ran.exit_code == 0, ran.output
    # the zoo's example is 2 x 12 tokens; batch 1 and 3, lengths 3 and 24 are its variants
    assert f"{out} takes every shape it was verified on: 2x12, 3x12, 1x12" in " ".join(ran.output.split())
    written = json.loads(report.read_text())["written_shapes"]
    assert written["rejected"] == [] and {"1x12", "3x12", "2x24"} <= set(written["accepted"])

    _static_export_only(monkeypatch)
    again = tmp_path / "h.pt2"
    ran = CliRunner().invoke(
        app, ["convert", f"{zoo}:gpt2_factory", "--to", "rmsnorm", "--exact", "-o", str(again)]
    )
    assert ran.exit_code == 1, ran.output
    text = " ".join(ran.output.split())
    assert "would not take every input shape the conversion was verified on" in text
    assert "rejects 3x12" in text and "fixed at the example's shapes 2x12" in text and not again.exists()
    # the user fixing the shape is consent: written, and the note says what it takes
    ran = CliRunner().invoke(
        app,
        ["convert", f"{zoo}:gpt2_factory", "--to", "rmsnorm", "--exact", "-o", str(again), "--static-shapes"],
    )
    assert ran.exit_code == 0, ran.output
    assert again.exists() and "takes 2x12 of the shapes it was verified on" in " ".join(ran.output.split())


def test_exact_conversion_refuses_an_onnx_file_fixed_at_the_example(tmp_path: Path, monkeypatch):
    """The same rule for ONNX: the file is run in onnxruntime on every verified shape, and an exact
    conversion whose file would be fixed at the example is refused, with the export's reason."""
    model, args, kwargs = _gpt2(positions=64)
    result = normswap.convert(model, normswap.ConvertConfig(to="rmsnorm", exact=True), args, kwargs)
    assert result.ok, result.refusal
    _static_export_only(monkeypatch)
    with pytest.raises(CheckFailedError) as refusal:
        normswap.save(result, tmp_path / "g.onnx")
    text = str(refusal.value)
    assert "g.onnx would not take every input shape the conversion was verified on" in text
    assert "rejects 2x32 (InvalidArgument" in text and "fixed at the example's shapes 1x32" in text
    assert "--static-shapes" in text and "nothing written" in text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".pt2", ".onnx"])
def test_static_shapes_writes_an_exact_conversion_for_the_example_and_says_so(tmp_path: Path, suffix):
    """--static-shapes is the user fixing the shape: the exact conversion is written, fixed at the
    example, and the report names the verified shapes it rejects (no fallback: nothing failed)."""
    model, args, kwargs = _gpt2(positions=64)
    config = normswap.ConvertConfig(to="rmsnorm", exact=True, static_shapes=True)
    result = normswap.convert(model, config, args, kwargs)
    saved = normswap.save(result, tmp_path / f"g{suffix}")
    assert saved.shapes is not None and saved.shapes.accepted == ["1x32"]
    assert {r["shapes"] for r in saved.shapes.rejected} >= {"2x32", "1x8"}
    said = " ".join(saved.messages)
    assert "takes 1x32 of the shapes it was verified on, and rejects 2x32" in said
    assert "export with free batch and sequence dims failed" not in said  # asked for, not a fallback
    if suffix == ".onnx":
        assert saved.onnx is not None and saved.onnx.dynamic_axes == {}


def test_an_llm_onnx_from_a_model_directory_runs_at_any_batch_and_length(tmp_path: Path):
    """The newcomer's case (issue 30): a model directory's example is 1 x 16 tokens, and its ONNX took
    that shape only. Now the file names its inputs, outputs and axes as optimum does and runs in a
    plain onnxruntime session, where normswap is not imported, at batches and lengths never exported."""
    import json

    from normswap_cli.app import app
    from typer.testing import CliRunner

    model, _, _ = _gpt2(positions=256)
    model.save_pretrained(tmp_path / "gpt2")
    out, report = tmp_path / "g.onnx", tmp_path / "r.json"
    ran = CliRunner().invoke(app, ["export", str(tmp_path / "gpt2"), "-o", str(out), "--report", str(report)])
    assert ran.exit_code == 0, ran.output
    data = json.loads(report.read_text())["onnx"]
    assert data["output_names"] == ["logits"] and not data["shapes"]["rejected"]
    assert {"1x16", "2x16"} <= set(data["shapes"]["accepted"])
    assert set(data["dynamic_axes"]) >= {"input_ids"}
    assert all(axes == {"0": "batch", "1": "sequence"} for axes in data["dynamic_axes"].values())
    cases = {f"{b}x{t}": torch.randint(0, 128, (b, t)) for b, t in [(2, 24), (4, 100), (1, 3)]}
    with torch.no_grad():
        want = {k: model(ids, use_cache=False).logits for k, ids in cases.items()}
    torch.save({"inputs": cases, "want": want}, tmp_path / "cases.pt")
    script = textwrap.dedent(
        f"""
        import sys, numpy, onnxruntime, torch
        session = onnxruntime.InferenceSession({str(out)!r}, providers=["CPUExecutionProvider"])
        inputs = {{i.name: i.shape for i in session.get_inputs()}}
        assert inputs["input_ids"] == ["batch", "sequence"], inputs
        assert [o.name for o in session.get_outputs()] == ["logits"]
        assert session.get_outputs()[0].shape[:2] == ["batch", "sequence"]
        cases = torch.load({str(tmp_path / "cases.pt")!r})
        for key, ids in cases["inputs"].items():
            feeds = {{"input_ids": ids.numpy()}}
            if "attention_mask" in inputs:
                feeds["attention_mask"] = numpy.ones_like(feeds["input_ids"])
            (got,) = session.run(None, feeds)
            want = cases["want"][key]
            rel = (numpy.abs(got - want.numpy()).max() / want.abs().max()).item()
            assert rel < 1e-4, (key, rel)
            print(key, "ok")
        assert "normswap" not in sys.modules
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count(" ok") == len(cases), run.stdout


def test_a_graph_rewrite_whose_export_is_fixed_at_the_example_says_so(monkeypatch):
    """No silent fallback inside a conversion either: a graph rewrite works on an export of the model,
    and when that export cannot keep the batch and length free, the conversion's notes say why."""
    model, args, kwargs = _gpt2(positions=64)
    _static_export_only(monkeypatch)
    result = normswap.convert(model, normswap.ConvertConfig(to="crmsnorm", exact=True), args, kwargs)
    assert result.ok, result.refusal
    fixed = [n for n in result.notes if "fixed at the example's shapes 1x32" in n]
    assert len(fixed) == 1 and "data-dependent" in fixed[0], result.notes
    assert result.to_dict()["notes"] == result.notes
    (done,) = [p for p in result.report.passes if p.graph_fallbacks]
    assert fixed[0].startswith(f"{done.pass_name}: the export with free batch and sequence dims failed")


def test_an_onnx_translation_that_cannot_keep_the_dims_free_is_fixed_and_says_why(
    tmp_path: Path, monkeypatch
):
    """torch.onnx may fail to translate a symbolic shape where the static one translates: the file is
    then written for the example's shapes, the reason said, and an exact conversion refuses it."""
    real = torch.onnx.export
    failing = {"free dims": True}

    def export(model, *a, **kw):
        # the program with free dims fails, also with torch.export's decompositions; the static one not
        if failing["free dims"] and isinstance(model, torch.export.ExportedProgram):
            free = any(not isinstance(d, int) for n in model.graph.nodes if n.op == "placeholder"
                       and isinstance(n.meta.get("val"), torch.Tensor) for d in n.meta["val"].shape)  # fmt: skip
            if free or model.range_constraints:
                raise ValueError(
                    "Cannot view a tensor with shape torch.Size([s11, s70, 2, 8]) as (s11, s70, 16)"
                )
        return real(model, *a, **kw)

    monkeypatch.setattr(torch.onnx, "export", export)
    model, args, kwargs = _gpt2(positions=64)
    result = normswap.convert(model, normswap.ConvertConfig(fold_norm_affine=True), args, kwargs)
    saved = normswap.save(result, tmp_path / "g.onnx")
    assert saved.shapes is not None and saved.shapes.accepted == ["1x32"]
    said = " ".join(saved.messages)
    assert "the ONNX translation with free batch and sequence dims failed" in said, said
    assert "Cannot view a tensor" in said, said
    assert "fixed at the example's shapes 1x32" in said
    exact = normswap.convert(model, normswap.ConvertConfig(to="rmsnorm", exact=True), args, kwargs)
    with pytest.raises(CheckFailedError, match="would not take every input shape"):
        normswap.save(exact, tmp_path / "h.onnx")


def test_a_refusal_without_a_fallback_says_the_model_fixes_the_dims():
    """Mamba's export succeeds with free dims and still fixes the length (its code ties it to the
    example's): the refusal says so, where it said nothing of why (directory sweep)."""
    from normswap.verify.written import WrittenShapes, refuse_untaken

    shapes = WrittenShapes(
        accepted=["1x16"], rejected=[{"shapes": "1x4", "label": "length 4", "error": "Guard failed"}]
    )
    with pytest.raises(CheckFailedError) as refusal:
        refuse_untaken("m.pt2", shapes, [])
    assert "torch.export kept these dims fixed: the model's code ties them to the example's sizes" in str(
        refusal.value
    )
    with pytest.raises(CheckFailedError) as told:
        refuse_untaken("m.pt2", shapes, ["the export with free batch and sequence dims failed (x)"])
    assert "(the export with free batch and sequence dims failed (x))" in str(told.value)
