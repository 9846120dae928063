"""Hugging Face model directories in and out: read as ``from_pretrained`` reads them (offline, stored
dtype, nothing from the directory run), written as ``save_pretrained`` writes them (sharded safetensors
with an index), loaded back with the stock ``from_pretrained`` where the classes are kept, and with
normswap's loader where a conversion changed them.

The directories are made here by transformers' own ``save_pretrained`` from small configs of GPT-2
(tied embeddings), Llama (untied), OPT and Gemma, random weights with norm parameters far from (1, 0),
sharded into several files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from hf_dirs import configs, logits, make_directory, rel, token_ids  # noqa: E402

from normswap import ConvertConfig, convert, save  # noqa: E402
from normswap.errors import BadInputError, CheckFailedError  # noqa: E402
from normswap.load import load_model  # noqa: E402
from normswap.load.checkpoint_dir import read_checkpoint_directory  # noqa: E402
from normswap.load.model_file import load_model_structure  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    made = {name: make_directory(root, name) for name in configs()}
    made["gpt2-bf16"] = make_directory(root, "gpt2", torch.bfloat16)
    return made


# --- reading ---------------------------------------------------------------------------------------


def test_a_sharded_directory_loads_with_its_weights_in_the_stored_dtype(dirs):
    path = dirs["gpt2-bf16"]
    checkpoint = read_checkpoint_directory(path)
    assert len(checkpoint.shards) >= 3 and checkpoint.architecture == "GPT2LMHeadModel"
    loaded = load_model(str(path))
    assert loaded.format == "directory" and loaded.model.dtype == torch.bfloat16
    reference = transformers.GPT2LMHeadModel.from_pretrained(path)
    ours, theirs = loaded.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert loaded.example_kwargs["input_ids"].shape == (1, 16)
    assert int(loaded.example_kwargs["input_ids"].max()) < 300


def test_inspect_builds_the_model_on_meta_and_reads_no_weight(dirs, monkeypatch, tmp_path):
    import safetensors

    import normswap.load.checkpoint_dir as checkpoint_dir
    import normswap.load.model_file as model_file

    def no_weights(*args, **kwargs):
        raise AssertionError("inspect read the weights")

    for module in (checkpoint_dir, model_file):
        monkeypatch.setattr(module, "load_checkpoint_directory", no_weights)
    monkeypatch.setattr(safetensors.safe_open, "get_tensor", no_weights, raising=False)
    structure = load_model_structure(str(dirs["llama"]))
    assert all(p.is_meta for p in structure.model.parameters())
    out = tmp_path / "sites.json"
    result = runner.invoke(app, ["inspect", str(dirs["llama"]), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["graph_method"] == "export"
    assert report["counts"] == {"rms": 5}  # 2 blocks x 2 + the final norm


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p, c: c.update(auto_map={"AutoModelForCausalLM": "modeling.Model"}), "own Python code"),
        (lambda p, c: c.update(architectures=["os.system"]), "not a model class of transformers"),
        (lambda p, c: c.update(architectures=["PreTrainedTokenizer"]), "not a model class of transformers"),
    ],
)
def test_a_config_that_would_run_or_name_other_code_is_refused(dirs, tmp_path, damage, reason):
    path = tmp_path / "model"
    shutil.copytree(dirs["gpt2"], path)
    config = json.loads((path / "config.json").read_text())
    damage(path, config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError, match=reason):
        load_model(str(path))


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_an_index_pointing_outside_the_directory_is_refused(dirs, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(dirs["gpt2"], path)
    index = _index(path)
    first = next(iter(index["weight_map"]))
    shutil.copy(path / index["weight_map"][first], tmp_path / "outside.safetensors")
    index["weight_map"][first] = "../outside.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BadInputError, match="not a safetensors file name in the directory itself"):
        load_model(str(path))


def test_a_tensor_the_index_names_but_its_shard_lacks_is_refused(dirs, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(dirs["gpt2"], path)
    index = _index(path)
    index["weight_map"]["transformer.h.0.ln_1.scale"] = index["weight_map"]["transformer.h.0.ln_1.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BadInputError, match=r"lacks 1 tensors .*transformer\.h\.0\.ln_1\.scale"):
        load_model(str(path))


def test_weights_that_do_not_cover_the_model_are_refused_not_left_random(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model"
    shutil.copytree(dirs["llama"], path)
    index = _index(path)
    shard = index["weight_map"].pop("model.layers.1.mlp.down_proj.weight")
    tensors = load_file(path / shard)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / shard, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        BadInputError, match=r"do not match the model: 1 missing \(e\.g\. model\.layers\.1\.mlp"
    ):
        load_model(str(path))


def test_pickled_weights_and_a_corrupt_shard_are_refused(dirs, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(dirs["gpt2"] / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(BadInputError, match="pickled weights"):
        load_model(str(pickled))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(dirs["gpt2"], corrupt)
    shard = sorted(corrupt.glob("*.safetensors"))[0]
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(BadInputError, match="not a readable safetensors file"):
        load_model(str(corrupt))
    folder = tmp_path / "plain"
    folder.mkdir()
    with pytest.raises(BadInputError, match=r"directory without a config\.json"):
        load_model(str(folder))


# --- writing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "phi", "gemma"])
def test_fold_norm_affine_writes_a_directory_the_stock_loader_reads(dirs, tmp_path, name):
    source = dirs[name]
    (source / "original").mkdir(exist_ok=True)  # a folder of other-format weights: not carried over
    loaded = load_model(str(source))
    result = convert(
        loaded.model, ConvertConfig(fold_norm_affine=True), loaded.example_args, loaded.example_kwargs
    )
    assert result.ok and len(result.report.passes[0].changes) >= 3
    out = tmp_path / "folded"
    saved = save(result, out, source=loaded.checkpoint)
    written = saved.directory
    assert written.stock and not (out / "normswap.json").exists()
    assert written.copied_files == ["tokenizer.json"] and written.not_copied == ["original"]
    assert written.reload_max_rel is not None and written.reload_max_rel <= 1e-5
    assert len(written.shards) >= 2 and (out / "model.safetensors.index.json").is_file()
    from safetensors import safe_open

    with safe_open(str(out / written.shards[0]), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    stock = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(stock) is type(loaded.model)
    ids = token_ids()
    assert rel(logits(loaded.model, ids), logits(stock, ids)) <= 1e-5
    # each folded norm is stored with neutral weights (its affine moved into the readers); the rest as it was
    folded = {change.site for change in result.report.passes[0].changes}
    neutral = 0.0 if name == "gemma" else 1.0
    original = loaded.model.state_dict()
    for key, value in stock.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if owner in folded:
            assert torch.all(value == (neutral if leaf == "weight" else 0.0)), key
    assert len(folded) >= 3 and all(f"{site}.weight" in original for site in folded)


def test_rmsnorm_exact_records_the_new_modules_and_normswap_loads_them(dirs, tmp_path):
    loaded = load_model(str(dirs["gpt2"]))
    config = ConvertConfig(to="rmsnorm", exact=True)
    result = convert(loaded.model, config, loaded.example_args, loaded.example_kwargs)
    assert result.ok
    out = tmp_path / "rms"
    written = save(result, out, source=loaded.checkpoint).directory
    assert not written.stock and len(written.recorded_modules) == 6
    record = json.loads((out / "normswap.json").read_text())
    assert {r["class"] for r in record["modules"].values()} == {"RMSNorm", "CenteredEmbedding"}
    # GPT-2's LM head reads the token embedding: it stays one tensor, tied, and the embedding centres
    # the rows it looks up; the files hold the matrix once
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in _stored_names(out)
    back = load_model(str(out))
    from normswap.modules import RMSNorm
    from normswap.modules.centered import CenteredEmbedding

    assert isinstance(back.model.transformer.h[1].ln_2, RMSNorm)
    assert isinstance(back.model.transformer.wte, CenteredEmbedding)
    assert back.model.lm_head.weight is back.model.transformer.wte.weight
    ids = token_ids()
    assert rel(logits(loaded.model, ids), logits(back.model, ids)) <= 1e-5


def test_the_cli_writes_a_directory_and_refuses_an_existing_one(dirs, tmp_path):
    out = tmp_path / "out"
    # --to fused does not stream: the in-memory route, its directory loaded back before the rename
    argv = ["convert", str(dirs["llama"]), "--to", "fused", "-o", str(out)]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert (
        "5 modules recorded in normswap.json" in result.output and "loaded back and compared" in result.output
    )
    before = sorted(p.name for p in out.iterdir())
    again = runner.invoke(app, argv)
    assert again.exit_code == 2
    assert f"-o {out} exists: pass --overwrite to replace it" in again.output
    assert sorted(p.name for p in out.iterdir()) == before
    into_input = runner.invoke(
        app, ["convert", str(dirs["llama"]), "--fold-norm-affine", "-o", str(dirs["llama"])]
    )
    assert into_input.exit_code == 2


def test_a_directory_that_does_not_reload_into_the_model_is_not_kept(dirs, tmp_path, monkeypatch):
    import normswap.load.checkpoint_dir as checkpoint_dir

    loaded = load_model(str(dirs["gpt2"]))
    result = convert(
        loaded.model, ConvertConfig(fold_norm_affine=True), loaded.example_args, loaded.example_kwargs
    )
    real = checkpoint_dir.load_checkpoint_directory

    def perturbed(checkpoint):
        model = real(checkpoint)
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.mul_(1.01)
        return model

    monkeypatch.setattr(checkpoint_dir, "load_checkpoint_directory", perturbed)
    out = tmp_path / "bad"
    with pytest.raises(CheckFailedError, match="reloads into another model"):
        save(result, out, source=loaded.checkpoint)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_model_that_is_not_a_transformers_model_cannot_go_to_a_directory(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    config = ConvertConfig(fold_norm_affine=True, output=tmp_path / "out")
    with pytest.raises(BadInputError, match="a model directory is written for a transformers model"):
        convert(model, config, (torch.randn(2, 4),))
    with pytest.raises(BadInputError, match="a model directory cannot hold"):
        ConvertConfig(to="fused", fuse_add=True, output=tmp_path / "out").validate()


def test_a_record_naming_an_unknown_class_is_refused(dirs, tmp_path):
    loaded = load_model(str(dirs["gpt2"]))
    result = convert(
        loaded.model, ConvertConfig(to="rmsnorm", exact=True), loaded.example_args, loaded.example_kwargs
    )
    out = tmp_path / "rms"
    save(result, out, source=loaded.checkpoint)
    record = json.loads((out / "normswap.json").read_text())
    record["modules"]["transformer.ln_f"] = {"class": "builtins.eval", "kwargs": {}}
    (out / "normswap.json").write_text(json.dumps(record))
    with pytest.raises(BadInputError, match=r"transformer\.ln_f: unknown module class 'builtins\.eval'"):
        load_model(str(out))


def test_folded_batchnorms_of_a_hf_resnet_go_to_a_directory_and_load_back(tmp_path):
    config = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, image_size=64
    )
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path / "resnet")
    result = runner.invoke(
        app, ["convert", str(tmp_path / "resnet"), "--fold-bn", "-o", str(tmp_path / "out")]
    )
    assert result.exit_code == 0, result.output
    # each BatchNorm became an Identity and its conv gained a bias: recorded, and rebuilt by normswap
    modules = json.loads((tmp_path / "out" / "normswap.json").read_text())["modules"]
    assert {r["class"] for r in modules.values()} == {"Identity", "Conv2d"}
    back = load_model(str(tmp_path / "out")).model
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in back.modules())
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(pixel_values=pixels).logits, back(pixel_values=pixels).logits
    assert rel(want.double(), got.double()) <= 1e-5


def _stored_names(directory: Path) -> set[str]:
    from normswap.load.weight_files import find_weights

    return set(find_weights(directory).weight_map)


def test_a_recorded_module_under_a_name_transformers_renames_loads(tmp_path):
    """GPT-NeoX stores its head as embed_out and transformers loads it as lm_head. Folding the final
    LayerNorm's affine gives the head a bias (a recorded module), which save_pretrained writes as
    embed_out.bias: the directory must load under the loader's names, not be refused as not matching
    (found by benchmarks/sweep_directories.py)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "neox")
    out = tmp_path / "neox-folded"
    ran = CliRunner().invoke(app, ["convert", str(tmp_path / "neox"), "--fold-norm-affine", "-o", str(out)])
    assert ran.exit_code == 0, ran.output
    reloaded = load_model(str(out)).model
    assert reloaded.lm_head.bias is not None  # the folded bias, read from embed_out.bias
    ids = torch.randint(0, 128, (2, 10))
    assert rel(logits(reloaded, ids), logits(model, ids)) < 1e-5


def test_a_conversion_a_directory_could_not_be_read_back_as_is_refused_before_writing(tmp_path):
    """Dinov2's loading merges or splits tensors, and a directory with recorded modules is read tensor by
    tensor: `--to fused -o DIR` was refused only after converting and writing, naming the temporary
    folder. Now the writer asks the reader's rule first: exit 2, one sentence, nothing written; a .pt2
    takes the same conversion."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
        patch_size=8,
    )  # fmt: skip
    transformers.Dinov2Model(config).eval().save_pretrained(tmp_path / "dino")
    out = tmp_path / "out"
    ran = CliRunner().invoke(app, ["convert", str(tmp_path / "dino"), "--to", "fused", "-o", str(out)])
    assert ran.exit_code == 2, ran.output
    assert (
        "the conversion changes 5 modules (e.g. encoder.layer.0.norm1), which a model directory records, but "
        "transformers merges or splits this architecture's tensors as it loads them"
    ) in " ".join(ran.output.split())
    assert ".normswap-tmp" not in ran.output and sorted(p.name for p in tmp_path.iterdir()) == ["dino"]
    ran = CliRunner().invoke(
        app, ["convert", str(tmp_path / "dino"), "--to", "fused", "-o", str(tmp_path / "d.pt2")]
    )
    assert ran.exit_code == 0, ran.output
