"""A converted model directory that transformers' stock ``from_pretrained`` would read as another model
keeps its weights where stock loaders do not look (``normswap-*`` files), on every route that writes
one; a directory it reads right keeps the stock names; normswap's loader reads both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from hf_dirs import convert_in_memory, logits, make_directory, rel, stream, token_ids

from normswap.errors import BadInputError
from normswap.load import load_model
from normswap.load.checkpoint_dir import read_checkpoint_directory
from normswap.load.stock_reading import stock_on_meta, stock_reading_problem
from normswap.modules.fused import FusedRMSNorm
from normswap.modules.norms import RMSNorm
from normswap.modules.recipes import module_recipe


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stock")
    return {name: make_directory(root, name) for name in ("gpt2", "llama")}


def _weight_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.endswith((".safetensors", ".index.json")))


def _stock_refuses(path: Path) -> None:
    with pytest.raises(OSError, match=r"no file named model\.safetensors"):
        transformers.AutoModelForCausalLM.from_pretrained(path)


def _hidden(path: Path) -> str:
    """The directory's weights are all under normswap's names; returns what normswap.json says of it."""
    files = _weight_files(path)
    assert files and all(name.startswith("normswap-model") for name in files), files
    _stock_refuses(path)
    return json.loads((path / "normswap.json").read_text())["stock_loading"]


def test_in_memory_a_lossy_rmsnorm_is_kept_from_stock_loaders(dirs, tmp_path):
    # the silent case: RMSNorm written where the config builds LayerNorm, with the same tensor names
    result = convert_in_memory(dirs["gpt2"], {"to": "rmsnorm"}, tmp_path / "out")
    why = _hidden(tmp_path / "out")
    assert "is a RMSNorm; the config builds a LayerNorm, which computes another function" in why
    assert result.model is not None
    reloaded = load_model(str(tmp_path / "out")).model
    assert rel(logits(result.model, token_ids()), logits(reloaded, token_ids())) <= 1e-6


def test_streamed_exact_rmsnorm_is_kept_from_stock_loaders_and_reads_back(dirs, tmp_path):
    written = stream(dirs["gpt2"], tmp_path / "out", to="rmsnorm", exact=True)
    assert written.stock_refused is not None and "RMSNorm" in written.stock_refused
    assert written.shards == [n for n in _weight_files(tmp_path / "out") if n.endswith(".safetensors")]
    _hidden(tmp_path / "out")
    original = transformers.AutoModelForCausalLM.from_pretrained(dirs["gpt2"]).eval()
    reloaded = load_model(str(tmp_path / "out")).model
    assert rel(logits(original, token_ids()), logits(reloaded, token_ids())) <= 1e-5


def test_a_hidden_directory_converted_again_stays_hidden(dirs, tmp_path):
    stream(dirs["gpt2"], tmp_path / "exact", to="rmsnorm", exact=True)
    written = stream(tmp_path / "exact", tmp_path / "folded", fold_norm_affine=True)
    assert written.stock_refused is not None  # the input's recorded modules are still there
    _hidden(tmp_path / "folded")
    original = transformers.AutoModelForCausalLM.from_pretrained(dirs["gpt2"]).eval()
    reloaded = load_model(str(tmp_path / "folded")).model
    assert rel(logits(original, token_ids()), logits(reloaded, token_ids())) <= 1e-5


def test_fused_norms_keep_the_stock_names_and_stock_reads_the_same_model(dirs, tmp_path):
    result = convert_in_memory(dirs["llama"], {"to": "fused"}, tmp_path / "out")
    record = json.loads((tmp_path / "out" / "normswap.json").read_text())
    assert record["modules"] and "compute the same function" in record["stock_loading"]
    assert not any(n.startswith("normswap-") for n in _weight_files(tmp_path / "out"))
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert rel(logits(result.model, token_ids()), logits(stock, token_ids())) <= 1e-5


def test_the_judgement_is_the_function_not_the_names():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    stock = stock_on_meta(transformers.LlamaForCausalLM, config)
    norm = stock.get_submodule("model.norm")
    fused = module_recipe(FusedRMSNorm(32, eps=norm.variance_epsilon))
    assert stock_reading_problem(stock, {"model.norm": fused}) is None
    # another eps is another function, with the same tensor names
    other_eps = module_recipe(RMSNorm(32, eps=0.25))
    assert "computes another function" in stock_reading_problem(stock, {"model.norm": other_eps})
    gone = {"model.norm": {"class": "Identity", "kwargs": {}}}
    assert "Identity holding no tensors; the config builds a LlamaRMSNorm holding weight" in (
        stock_reading_problem(stock, gone)
    )


def test_weights_under_normswap_names_need_the_record(dirs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dirs["gpt2"], copy)
    for name in _weight_files(copy):
        (copy / name).rename(copy / f"normswap-{name}")
    index = json.loads((copy / "normswap-model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f"normswap-{v}" for k, v in index["weight_map"].items()}
    (copy / "normswap-model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BadInputError, match=r"under normswap.s names .* but has no normswap\.json"):
        read_checkpoint_directory(copy)


def test_weights_under_both_names_are_refused(dirs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dirs["gpt2"], copy)
    first = next(n for n in _weight_files(copy) if n.endswith(".safetensors"))
    shutil.copy(copy / first, copy / "normswap-model.safetensors")
    with pytest.raises(BadInputError, match=r"under both the stock names .* which of them is the model"):
        read_checkpoint_directory(copy)


def test_every_writer_says_how_it_loads(dirs, tmp_path):
    """The CLI's line and --report for a directory written streamed and one written in memory."""
    from normswap_cli.app import app
    from typer.testing import CliRunner

    runner = CliRunner()
    for options, route in ((["--exact"], "streamed"), ([], "directory")):
        out, report = tmp_path / f"out-{route}", tmp_path / f"{route}.json"
        args = [
            "convert",
            str(dirs["gpt2"]),
            "--to",
            "rmsnorm",
            *options,
            "-o",
            str(out),
            "--report",
            str(report),
        ]
        done = runner.invoke(app, args)
        assert done.exit_code == 0, done.output
        said = " ".join(done.output.split())
        assert "load it with normswap.load_model. Its weights are stored as normswap-* files" in said
        assert "the config builds a LayerNorm, which computes another function" in said
        written = json.loads(report.read_text())["directory"]  # one key whichever route wrote it
        assert "LayerNorm" in written["stock_refused"]
        _hidden(out)


def test_a_norm_without_tensors_and_integer_buffers_are_judged_by_their_function():
    # OLMo's LayerNorm has no affine: its width comes from its shape; a BatchNorm's count is an integer
    from torch import nn

    from normswap.modules.fused import FusedLayerNorm

    weightless = module_recipe(FusedLayerNorm(8, elementwise_affine=False, bias=False))
    assert (
        stock_reading_problem(
            nn.Sequential(nn.LayerNorm(8, elementwise_affine=False)).to("meta"), {"0": weightless}
        )
        is None
    )
    other = module_recipe(FusedLayerNorm(8, eps=0.5, elementwise_affine=False, bias=False))
    assert "computes another function" in stock_reading_problem(
        nn.Sequential(nn.LayerNorm(8, elementwise_affine=False)).to("meta"), {"0": other}
    )


def test_layers_recorded_as_the_class_the_config_builds_are_judged_on_their_own_inputs(tmp_path):
    """A ResNet given weight norm and then stripped of it records its layers as the Conv2d/Linear the
    config builds: stock loading reads it (it hid the weights, 'could not be run on a probe input', where
    only norm-shaped inputs were tried; the classifier's Linear is 32 -> 5)."""
    from normswap_cli.app import app
    from typer.testing import CliRunner

    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5)
    source = tmp_path / "resnet"
    transformers.ResNetForImageClassification(config).eval().save_pretrained(source)
    runner = CliRunner()
    for argv in (
        [str(source), "--add-weight-norm", "all", "-o", str(tmp_path / "wn")],
        [str(tmp_path / "wn"), "--remove-weight-norm", "-o", str(tmp_path / "plain")],
    ):
        result = runner.invoke(app, ["convert", *argv])
        assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "plain" / "normswap.json").read_text())
    assert "classifier.1" in record["modules"] and record["modules"]["classifier.1"]["class"] == "Linear"
    assert record["stock_loading"].startswith("transformers' from_pretrained builds the original classes")
    stock = stock_on_meta(transformers.ResNetForImageClassification, config)
    assert stock_reading_problem(stock, record["modules"]) is None
    # transformers reads it back as the model it was
    reloaded = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "plain").eval()
    original = transformers.ResNetForImageClassification.from_pretrained(source).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want, got = original(images).logits, reloaded(images).logits
    assert (want - got).abs().max() <= 1e-5 * want.abs().max()
