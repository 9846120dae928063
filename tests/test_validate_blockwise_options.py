"""``validate --blockwise`` honours what it is asked as the whole-model comparison does, or refuses it.

Found by a tester: with two model directories ``--blockwise`` returned before any option was looked at,
so ``--min-sqnr`` was judged at the exact tolerance (a lossy ``--to layernorm`` Llama: PASS whole, FAIL
block by block), no threshold exited 1 where the whole model exits 0, ``--data``/``--batches``/
``--input-shape``/``--plot`` were ignored without a word, and ``--exact --min-sqnr`` or ``--plot x.txt``
were accepted. Now every option is checked first on every route, the verdict is the whole model's rule
(outputs decide; block by block, the converted model run through its own blocks), and an option the
route cannot honour is refused (exit 2) saying what to do instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_dirs import make_directory
from normswap_cli.app import app
from typer.testing import CliRunner

import normswap
from normswap.api import ComparisonVerdict
from normswap.errors import BadInputError
from normswap.verify import blockwise
from normswap.verify.block_verdict import blockwise_failure
from normswap.verify.metrics import PooledSqnr

runner = CliRunner()

# The lossy --to layernorm Llama's output SQNR on the whole model's example (1x16), whole or block by block
EXAMPLE_SQNR = 16.214


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small Llama directory, its lossy ``--to layernorm`` conversion as a directory and as a pickled
    ``.pt`` (one conversion), and 8x16 token ids."""
    from normswap import ConvertConfig, convert, save
    from normswap.load import load_model

    root = tmp_path_factory.mktemp("blockwise_options")
    source = make_directory(root, "llama")
    loaded = load_model(str(source))
    result = convert(loaded.model, ConvertConfig(to="layernorm"), loaded.example_args, loaded.example_kwargs)
    assert result.ok and result.changes == 5, result.refusal
    save(result, root / "ln", source=loaded.checkpoint)
    save(result, root / "ln.pt")
    torch.manual_seed(0)
    torch.save(torch.randint(0, 300, (8, 16)), root / "ids.pt")
    return {"source": source, "dir": root / "ln", "pt": root / "ln.pt", "ids": root / "ids.pt", "root": root}


def _cli(tmp_path: Path, *argv: str) -> tuple[int, str, dict]:
    report = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    shown = runner.invoke(app, ["validate", *argv, "--report", str(report)])
    return shown.exit_code, " ".join(shown.output.split()), json.loads(report.read_text())


@pytest.mark.parametrize(("threshold", "code"), [("5", 0), ("30", 1)])
def test_min_sqnr_gives_the_same_verdict_whole_and_block_by_block_on_two_directories(
    llama, tmp_path, threshold, code
):
    """The swap costs ~16-17 dB at the output: 5 dB passes on both routes, 30 dB fails on both (block by
    block it was judged at the exact tolerance: FAIL, exit 1, whatever --min-sqnr said)."""
    pair = (str(llama["source"]), str(llama["dir"]))
    whole_code, whole_text, whole = _cli(tmp_path, *pair, "--min-sqnr", threshold)
    block_code, block_text, block = _cli(tmp_path, *pair, "--blockwise", "--min-sqnr", threshold)
    assert (whole_code, block_code) == (code, code), (whole_text, block_text)
    assert (
        f"verdict (block by block, min SQNR {threshold} dB): {'PASS' if code == 0 else 'FAIL'}" in block_text
    )
    assert block["verdict"] == ("passed" if code == 0 else "failed") and block["min_sqnr_db"] == float(
        threshold
    )
    # the first input (1x16) is the whole model's example: the end-to-end output is the same number,
    # and the one judged (the second shape, 2x5, is reported, not judged)
    assert [s["stages"][0]["stage"] for s in block["blockwise"]] == ["embeddings", "embeddings"]
    sqnr = whole["outputs"][0]["sqnr_db"]
    assert block["blockwise"][0]["output"]["sqnr_db"] == pytest.approx(sqnr, rel=1e-9)
    assert block["output_sqnr_db"] == pytest.approx(sqnr, rel=1e-9) and 14 < sqnr < 20
    assert block["output_sqnr_inputs"] == ["1x16"] and block["blockwise"][1]["output"] is not None
    assert f"output SQNR judged on inputs 1x16 (as the whole-model comparison): {sqnr:.3g} dB" in block_text
    if code == 1:
        assert "outputs are not within the 30 dB: output.logits: SQNR" in whole_text
        assert "error: the output is not within 30 dB: SQNR" in block_text
        assert "dB end to end on inputs 1x16, below 30 dB; first stage below it: block 0" in block_text
        assert block["failure"].startswith("the output is not within 30 dB")
    else:
        assert block["failure"] is None and "error" not in block_text


def test_no_threshold_reports_and_passes_and_exact_judges_every_block(llama, monkeypatch):
    """Without --exact/--min-sqnr both routes report and pass (block by block exited 1 on the exact
    tolerance); the exact tolerance is applied when asked, naming the first block outside it. Only
    --min-sqnr reads the output run end to end, so only it runs each converted block a second time."""
    asked: list[bool] = []
    real = blockwise.verify_blockwise

    def verify(*args: object, **kwargs: object) -> list:
        asked.append(bool(kwargs.get("end_to_end")))
        return real(*args, **kwargs)

    monkeypatch.setattr(blockwise, "verify_blockwise", verify)
    pair = (str(llama["source"]), str(llama["dir"]))
    whole = normswap.validate(*pair)
    block = normswap.validate(*pair, blockwise=True)
    assert asked == [False]  # the converted model was not run end to end
    assert (
        whole.verdict is block.verdict is ComparisonVerdict.NOT_JUDGED and block.ok and block.refusal is None
    )
    assert [r.output for r in block.blockwise] == [None, None]  # not run: no figure, not a made-up one
    shown = block.to_dict()
    assert shown["output_sqnr_db"] is None and shown["output_sqnr_inputs"] is None
    assert [r["output"] for r in shown["blockwise"]] == [None, None]
    assert block.blockwise_shapes == ["1x16", "2x5"] and [len(r.stages) for r in block.blockwise] == [4, 4]
    # the rule validate applies to these reports, for what else could be asked
    failed = blockwise_failure(block.blockwise, exact=True, min_sqnr_db=None)
    assert failed is not None and failed.startswith("outside the exact tolerance: block 0: ")
    assert blockwise_failure(block.blockwise, exact=False, min_sqnr_db=None) is None
    with pytest.raises(ValueError, match=r"needs the reports of an end-to-end comparison"):
        blockwise_failure(block.blockwise, exact=False, min_sqnr_db=5.0)


def test_a_threshold_between_the_example_and_the_pooled_figure_gives_one_verdict_on_both_routes(llama):
    """Block by block compares two directories on 1x16 (the whole model's example) and 2x5; it judged
    the output SQNR pooled over both, so a threshold between that figure and the example's passed block
    by block and failed whole (a Llama at --min-sqnr 13.3: 13.1 dB whole, 13.38 dB pooled). It is now
    judged on the whole model's inputs, both shapes still reported."""
    pair, threshold = (str(llama["source"]), str(llama["dir"])), 16.6
    whole = normswap.validate(*pair, min_sqnr=threshold)
    block = normswap.validate(*pair, blockwise=True, min_sqnr=threshold)
    example = whole.layerwise.outputs[0].comparison.sqnr_db
    pooled = PooledSqnr.of(r.output_sqnr for r in block.blockwise).db
    assert example == pytest.approx(EXAMPLE_SQNR, abs=1e-3) and pooled == pytest.approx(17.029, abs=1e-3)
    assert example < threshold < pooled  # pooled, block by block passed where the whole model failed
    assert whole.verdict is block.verdict is ComparisonVerdict.FAILED, (whole.refusal, block.refusal)
    shown = block.to_dict()
    assert shown["output_sqnr_db"] == pytest.approx(example, rel=1e-9)
    assert shown["output_sqnr_inputs"] == ["1x16"] and block.blockwise_shapes == ["1x16", "2x5"]
    # both shapes still reported: 1x16 the whole model's figure, 2x5 above it (~18.7 dB)
    assert [r["output"]["sqnr_db"] for r in shown["blockwise"]] == [
        pytest.approx(example, rel=1e-9),
        pytest.approx(18.730, abs=1e-3),
    ]
    assert block.refusal == (
        f"the output is not within {threshold:g} dB: SQNR {example:.3g} dB end to end on inputs 1x16, "
        f"below {threshold:g} dB"
    )


def test_blockwise_in_memory_compares_on_the_batches_of_data_with_the_whole_models_verdict(llama):
    """A directory against a pickled model is compared block by block in memory: --data's batches are
    fed there too (they were ignored for the example inputs), pooled as the whole model pools them."""
    common = {"trust_pickle": True, "data": str(llama["ids"]), "batch_size": 4, "min_sqnr": 30.0}
    pair = (str(llama["source"]), str(llama["pt"]))
    whole = normswap.validate(*pair, **common)
    block = normswap.validate(*pair, **common, blockwise=True)
    assert whole.verdict is block.verdict is ComparisonVerdict.FAILED, (whole.refusal, block.refusal)
    assert block.blockwise_shapes == ["4x16", "4x16"] and whole.layerwise.batches == 2
    sqnr = whole.layerwise.outputs[0].comparison.sqnr_db
    assert block.to_dict()["output_sqnr_db"] == pytest.approx(sqnr, rel=1e-9) and 14 < sqnr < 20
    assert block.refusal.startswith(f"the output is not within 30 dB: SQNR {sqnr:.3g} dB end to end")
    first = normswap.validate(*pair, **{**common, "min_sqnr": 5.0}, batches=1, blockwise=True)
    assert first.blockwise_shapes == ["4x16"] and first.verdict is ComparisonVerdict.PASSED


# (the CLI's options, the library's arguments, the refusal's words); FILE: a file under tmp_path
REFUSALS = [
    (["--data", "FILE"], {"data": "FILE"}, "--data: two model directories are compared block by block on"),
    (["--inputs", "FILE"], {"inputs": "FILE"}, "--inputs: two model directories are compared block by"),
    (
        ["--input-shape", "int64:3,7"],
        {"input_shapes": ["int64:3,7"]},
        "drop --input-shape, or compare without",
    ),
    (["--weights", "FILE"], {"weights": "FILE"}, "--weights only applies to a factory; ORIGINAL"),
    (["--plot", "x.png"], {"plot": "x.png"}, "--plot draws the per-layer SQNR of a whole-model comparison"),
    (["--plot", "x.txt"], {"plot": "x.txt"}, "--plot draws the per-layer SQNR"),
    (["--exact", "--min-sqnr", "5"], {"exact": True, "min_sqnr": 5.0}, "--exact and --min-sqnr are two"),
    (["--batches", "1"], {"batches": 1}, "--batches applies to --data"),
]


@pytest.mark.parametrize(("options", "arguments", "words"), REFUSALS)
def test_options_block_by_block_cannot_honour_are_refused_before_any_model_is_read(
    tmp_path, options, arguments, words
):
    """Checked first, on every route: the two folders are empty, and never read."""
    original, converted = tmp_path / "a", tmp_path / "b"
    original.mkdir(), converted.mkdir()
    (tmp_path / "FILE").write_bytes(b"")

    def where(value: object) -> object:  # a file or plot named in the case, under tmp_path
        return str(tmp_path / value) if value in ("FILE", "x.png", "x.txt") else value

    shown = runner.invoke(
        app, ["validate", str(original), str(converted), "--blockwise", *map(where, options)]
    )
    assert shown.exit_code == 2, shown.output
    assert words in " ".join(shown.output.split())
    arguments = {k: Path(where(v)) if k == "plot" else where(v) for k, v in arguments.items()}
    with pytest.raises(BadInputError) as refused:
        normswap.validate(str(original), str(converted), blockwise=True, **arguments)
    assert words in str(refused.value)
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.txt").exists()


def test_plot_is_refused_block_by_block_in_memory_too(llama, tmp_path):
    """A directory against a pickled model: no per-layer figures to draw either; refused before loading."""
    plot = tmp_path / "x.png"
    argv = [str(llama["source"]), str(llama["pt"]), "--trust-pickle", "--blockwise", "--plot", str(plot)]
    shown = runner.invoke(app, ["validate", *argv])
    assert shown.exit_code == 2 and "drop --plot (--report FILE holds every block's SQNR)" in " ".join(
        shown.output.split()
    )
    assert not plot.exists()


def test_the_whole_models_example_is_compared_first_if_the_fixed_shapes_lack_it(llama, monkeypatch):
    """The SQNR verdict needs the whole model's inputs: were the first fixed shape not its example
    (1x16), the example would be compared first and judged; the fixed shapes are still reported."""
    from normswap.api import checkpoint_checks

    monkeypatch.setattr(checkpoint_checks, "VERIFY_SHAPES", ((2, 5),))
    block = normswap.validate(str(llama["source"]), str(llama["dir"]), blockwise=True, min_sqnr=16.6)
    assert block.verdict is ComparisonVerdict.FAILED  # 2x5 alone (18.7 dB) would pass
    assert block.blockwise_shapes == ["1x16", "2x5"] and block.to_dict()["output_sqnr_inputs"] == ["1x16"]
    assert block.to_dict()["output_sqnr_db"] == pytest.approx(EXAMPLE_SQNR, abs=1e-3)
