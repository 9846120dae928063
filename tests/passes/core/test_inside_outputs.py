""" "Exact" keeps the outputs of the example; what it changes inside the model is said, on every route.

Recentring GPT-2's residual stream (``--to rmsnorm --exact``) keeps the logits but changes the hidden
states a caller gets with ``output_hidden_states=True``: the conversion names them, both routes (in
memory and streamed) print what the pass changes inside the model, and an example that asks for the
hidden states is refused under ``--exact``. A fold that keeps the hidden states names none, so the
check is a measurement, not a label.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from hf_dirs import configs, make_directory, randomize_norms  # noqa: E402

import normswap  # noqa: E402
from normswap.verify.inside_outputs import summarize_names  # noqa: E402

RECENTRED = "the residual stream is recentred"


def _gpt2() -> torch.nn.Module:
    cls, config = configs()["gpt2"]
    torch.manual_seed(0)
    model = cls(config).eval()
    randomize_norms(model)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))


def test_exact_recentring_names_the_hidden_states_it_changes():
    model, ids = _gpt2(), _ids()
    result = normswap.convert(
        model, normswap.ConvertConfig(to="rmsnorm", exact=True), example_kwargs={"input_ids": ids}
    )
    assert result.ok
    # asking for the hidden states leaves nothing on either model (transformers keeps hooks it installs)
    for checked in (model, result.model):
        assert not any(m._forward_hooks for m in checked.modules())
    pickle.dumps(result.model)
    layers = model.config.n_layer
    # every hidden state before the final norm moved; the last one (after ln_f) and the logits did not
    assert result.outputs_not_preserved == [f"output.hidden_states[{i}]" for i in range(layers)]
    with torch.no_grad():
        before = model(input_ids=ids, output_hidden_states=True)
        after = result.model(input_ids=ids, output_hidden_states=True)
    moved = (before.hidden_states[0] - after.hidden_states[0]).abs().max() / before.hidden_states[
        0
    ].abs().max()
    assert moved > 1e-2  # the names are real: these states did move
    assert torch.allclose(before.hidden_states[-1], after.hidden_states[-1], atol=1e-5)
    assert any(f"output.hidden_states[0..{layers - 1}]" in note for note in result.notes)
    report = result.to_dict()
    assert report["outputs_not_preserved"] == result.outputs_not_preserved
    assert RECENTRED in report["passes"][0]["inside_changes"]


def test_a_fold_that_keeps_the_hidden_states_names_none():
    model, ids = _gpt2(), _ids()
    result = normswap.convert(
        model, normswap.ConvertConfig(fold_norm_affine=True), example_kwargs={"input_ids": ids}
    )
    assert result.ok and result.changes > 0
    assert result.outputs_not_preserved == []


def test_exact_refuses_an_example_that_asks_for_the_hidden_states():
    model, ids = _gpt2(), _ids()
    result = normswap.convert(
        model,
        normswap.ConvertConfig(to="rmsnorm", exact=True),
        example_kwargs={"input_ids": ids, "output_hidden_states": True},
    )
    assert not result.ok
    assert "is an output of the model, which would see its mean" in result.refusal


def test_both_routes_say_what_the_rewrite_changes_inside(tmp_path: Path):
    source = make_directory(tmp_path, "gpt2")
    runner = CliRunner()
    streamed = runner.invoke(
        app, ["convert", str(source), "--to", "rmsnorm", "--exact", "-o", str(tmp_path / "out")]
    )
    in_memory = runner.invoke(
        app, ["convert", str(source), "--to", "rmsnorm", "--exact", "-o", str(tmp_path / "out.pt2")]
    )
    for run in (streamed, in_memory):
        assert run.exit_code == 0, run.output
        flat = " ".join(run.output.split())
        assert f"note: recenter_layernorm: {RECENTRED}" in flat
    # only the in-memory route can ask the whole model for its hidden states
    assert "output_hidden_states=True: output.hidden_states[0..1]" in " ".join(in_memory.output.split())


def test_summarize_names_folds_runs_of_indices():
    names = ["output.a[0]", "output.a[1]", "output.a[2]", "output.a[4]", "output.b"]
    assert summarize_names(names) == "output.b, output.a[0..2], output.a[4]"
