"""validate compares a model directory with its conversion the same way whichever form the conversion takes.

A keyword batch (``{"input_ids": ...}``, with ``labels``) or keyword example inputs (``input_ids`` and
``attention_mask``) reach both models as both take them (:func:`normswap.calibrate.feeding.fit_keywords`):
a key a ``.pt2`` does not take is not fed, a ``use_cache`` a ``.pt2`` requires is passed as it was
exported, and a config that turns the cache on runs with it off. Before, the ``.pt2`` exited 2 ("Got
['input_ids'] but expected ['input_ids', 'use_cache']") where its directory compared, and a directory
compared its key/value caches (top-1 agreement of a cache) where the ``.pt2`` returns none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_dirs import make_directory, with_cache_on
from normswap_cli.app import app
from typer.testing import CliRunner

pytest.importorskip("transformers")
runner = CliRunner()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kw")
    source = with_cache_on(make_directory(root, "llama"))
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    files = {
        "ids": [{"input_ids": ids}] * 2,
        "labels": [{"input_ids": ids, "labels": ids}] * 2,
        "masked": {"input_ids": ids[:1], "attention_mask": torch.ones_like(ids[:1])},
    }
    made = {"source": source}
    for name, value in files.items():
        torch.save(value, root / f"{name}.pt")
        made[name] = root / f"{name}.pt"
    for out in ("swapped", "swapped.pt2"):
        result = runner.invoke(app, ["convert", str(source), "--to", "layernorm", "-o", str(root / out)])
        assert result.exit_code == 0, result.output
        made[out] = root / out
    # exported with the user's keyword example: the program takes input_ids and attention_mask only
    result = runner.invoke(
        app,
        [
            "convert",
            str(source),
            "--fold-norm-affine",
            "--inputs",
            str(made["masked"]),
            "-o",
            str(root / "folded.pt2"),
        ],
    )
    assert result.exit_code == 0, result.output
    made["folded.pt2"] = root / "folded.pt2"
    return made


def _validate(llama: dict[str, Path], converted: str, *options: str, tmp: Path) -> tuple[int, dict, str]:
    report = tmp / f"{converted}-{len(options)}.json"
    result = runner.invoke(
        app, ["validate", str(llama["source"]), str(llama[converted]), *options, "--report", str(report)]
    )
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(report.read_text()) if report.exists() else {}, result.output


@pytest.mark.parametrize("batches", ["ids", "labels"])
def test_keyword_batches_compare_a_directory_and_its_pt2_alike(llama, tmp_path, batches):
    options = ("--data", str(llama[batches]), "--min-sqnr", "5")
    code_dir, dir_report, _ = _validate(llama, "swapped", *options, tmp=tmp_path)
    code_pt2, pt2_report, output = _validate(llama, "swapped.pt2", *options, tmp=tmp_path)
    assert code_dir == code_pt2 == 0, output
    # the same logits compared, alike, no cache among the outputs
    figures = [{o["name"]: o["sqnr_db"] for o in r["outputs"]} for r in (dir_report, pt2_report)]
    assert figures[0]["output.logits"] == pytest.approx(figures[1]["output.logits"], rel=1e-4)
    assert not [name for f in figures for name in f if "cache" in name]
    assert "the inputs run with use_cache=False, which the program takes (GraphModule)" in pt2_report["notes"]
    if batches == "labels":  # the directory's forward takes them (and returns a loss); the .pt2 does not
        assert (
            "the inputs' labels is not fed: the model's forward does not take it (GraphModule)"
            in (pt2_report["notes"])
        )
        assert set(figures[0]) == {"output.loss", "output.logits"} and set(figures[1]) == {"output.logits"}


def test_a_config_that_turns_the_cache_on_compares_without_it(llama, tmp_path):
    code, report, output = _validate(llama, "swapped", "--data", str(llama["ids"]), tmp=tmp_path)
    assert code == 0, output
    assert [o["name"] for o in report["outputs"]] == ["output.logits"]
    assert any(n.startswith("compared with use_cache=False") for n in report["notes"])
    assert json.loads((llama["source"] / "config.json").read_text())["use_cache"] is True  # as it was


def test_a_pt2_exported_with_an_attention_mask_validates_against_its_directory(llama, tmp_path):
    code, report, output = _validate(
        llama, "folded.pt2", "--inputs", str(llama["masked"]), "--exact", tmp=tmp_path
    )
    assert code == 0, output
    assert [o["name"] for o in report["outputs"]] == ["output.logits"]
    # without the mask the program was exported with, it cannot run: said, exit 2
    code, _, output = _validate(llama, "folded.pt2", tmp=tmp_path)
    assert code == 2 and "expected ['input_ids', 'attention_mask']" in output


def test_a_graph_rewrites_pt_is_the_same_model_as_its_pt2(llama, tmp_path):
    """`--fuse-add -o x.pt` pickles the program (ExportedModule). It held it under a `graph_module`
    submodule with a `(*args, **kwargs)` forward: the original's state_dict did not load into it, its
    keyword batches were not fitted (validate and distill exited 2 on `labels`), and validate compared 0
    layers where the `.pt2` compares 18. Loaded by normswap it is now read as its `.pt2` is; loaded by
    torch it keeps the program's names and signature."""
    for out in ("fused.pt", "fused.pt2"):
        result = runner.invoke(
            app, ["convert", str(llama["source"]), "--to", "fused", "--fuse-add", "-o", str(tmp_path / out)]
        )
        assert result.exit_code == 0, result.output
    llama = {**llama, "fused.pt": tmp_path / "fused.pt", "fused.pt2": tmp_path / "fused.pt2"}
    options = ("--data", str(llama["labels"]))
    code_pt, pt_report, output = _validate(llama, "fused.pt", *options, "--trust-pickle", tmp=tmp_path)
    code_pt2, pt2_report, _ = _validate(llama, "fused.pt2", *options, tmp=tmp_path)
    assert code_pt == code_pt2 == 0, output
    assert len(pt_report["layers"]) == len(pt2_report["layers"]) > 10
    assert pt_report["notes"] == pt2_report["notes"]
    assert (
        "the inputs' labels is not fed: the model's forward does not take it (GraphModule)"
        in pt_report["notes"]
    )
    distilled = runner.invoke(
        app,
        ["distill", str(llama["source"]), str(llama["fused.pt"]), "--trust-pickle", "--data",
         str(llama["labels"]), "--steps", "1", "-o", str(tmp_path / "d.pt2")],
    )  # fmt: skip
    assert distilled.exit_code == 0, distilled.output

    from normswap.load import load_model

    pickled = torch.load(llama["fused.pt"], weights_only=False)
    original = load_model(str(llama["source"])).model
    assert list(pickled.state_dict()) == list(original.state_dict())
    missing, unexpected = pickled.load_state_dict(original.state_dict())
    assert not missing and not unexpected
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(4))
    params = {name: p * 1.0 for name, p in original.named_parameters()}
    with torch.no_grad():
        via_functional = torch.func.functional_call(
            pickled, params, (), {"input_ids": ids, "use_cache": False}
        )
        torch.testing.assert_close(
            via_functional.logits, original(ids, use_cache=False).logits, atol=1e-5, rtol=1e-5
        )
