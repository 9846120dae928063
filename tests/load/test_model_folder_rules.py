"""What a model folder may hold, the same on every route: symlinks that stay inside the folder, JSON
that a parser can read, a config whose model and quantization normswap can build, and files that hold
exactly the model's tensors. The streamed route (``convert DIR --fold-norm-affine -o OUT``) and the
in-memory one (``convert DIR --to fused -o OUT``) refuse the same folders with the same reason."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hf_dirs import make_directory
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.errors import BadInputError
from normswap.load.checkpoint_dir import read_checkpoint_directory

runner = CliRunner()
STREAMED = ["--fold-norm-affine"]
IN_MEMORY = ["--to", "fused"]
ROUTES = pytest.mark.parametrize("route", [STREAMED, IN_MEMORY], ids=["streamed", "in-memory"])


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_directory(tmp_path_factory.mktemp("folders"), "gpt2")


def _copy(source: Path, root: Path, name: str = "model") -> Path:
    target = root / name
    shutil.copytree(source, target, symlinks=True)
    return target


def _refused(argv: list[str], out: Path, *parts: str) -> str:
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    assert not out.exists()
    return lines[0]


# --- symlinks --------------------------------------------------------------------------------------


@ROUTES
def test_a_side_file_linked_outside_the_folder_is_refused_not_copied(gpt2, tmp_path, route):
    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    model = _copy(gpt2, tmp_path)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    _refused(
        ["convert", str(model), *route, "-o", str(out)],
        out,
        f"{model / 'tokenizer.json'} is a symlink to {secret}, outside the model folder",
    )


def test_a_config_or_shard_linked_outside_is_refused(gpt2, tmp_path):
    outside = _copy(gpt2, tmp_path, "elsewhere")
    for name in ("config.json", "model-00002-of-00004.safetensors", "model.safetensors.index.json"):
        model = _copy(gpt2, tmp_path, f"m-{name}")
        (model / name).unlink()
        (model / name).symlink_to(outside / name)
        with pytest.raises(BadInputError, match=f"{name} is a symlink to .*, outside the model folder"):
            read_checkpoint_directory(model)


def test_links_inside_the_folder_are_followed(gpt2, tmp_path):
    model = _copy(gpt2, tmp_path)
    (model / "sub").mkdir()
    os.replace(model / "tokenizer.json", model / "sub" / "tok.json")
    (model / "tokenizer.json").symlink_to("sub/tok.json")
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(model), *STREAMED, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not (out / "tokenizer.json").is_symlink()


def _hub_cache(gpt2: Path, root: Path) -> Path:
    """The layout of the Hugging Face hub cache: snapshots/<rev>/<file> -> ../../blobs/<name>."""
    repo = root / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in gpt2.iterdir():
        blob = repo / "blobs" / f"sha-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    return snapshot


def test_a_hub_cache_snapshot_reads_its_blobs_and_nothing_beyond_its_repository(gpt2, tmp_path):
    snapshot = _hub_cache(gpt2, tmp_path)
    assert read_checkpoint_directory(snapshot).architecture == "GPT2LMHeadModel"
    # a link into another repository's blobs leaves the repository's folder: refused
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "x").write_text("{}")
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(other / "x")
    with pytest.raises(BadInputError, match=r"outside the model folder .*models--org--tiny"):
        read_checkpoint_directory(snapshot)


# --- what the folder describes and holds: one acceptance check, both routes -----------------------


def _config(change: dict) -> object:
    def damage(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config.update(change)
        (model / "config.json").write_text(json.dumps(config))

    return damage


def _float8_shard(model: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    shard = (
        model
        / json.loads((model / "model.safetensors.index.json").read_text())["weight_map"][
            "transformer.h.0.mlp.c_fc.weight"
        ]
    )
    tensors = load_file(shard)
    name = "transformer.h.0.mlp.c_fc.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, shard, metadata={"format": "pt"})


def _recipe(model: Path) -> None:
    huge = {"normalized_shape": [2**40], "eps": 1e-5, "elementwise_affine": True, "bias": True}
    recipe = {"class": "LayerNorm", "kwargs": {**huge, "casting": "none", "weight_offset": 0.0}}
    record = {"format": "normswap-checkpoint", "version": 1, "modules": {"transformer.ln_f": recipe}}
    (model / "normswap.json").write_text(json.dumps(record))


FOLDERS = {
    "deep-config": (
        lambda m: (m / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "config.json is not a valid model config: it nests lists/objects too deeply to be one",
    ),
    "deep-record": (
        lambda m: (m / "normswap.json").write_text("[" * 100_000 + "]" * 100_000),
        "normswap.json is not a valid normswap record: it nests lists/objects too deeply",
    ),
    "float8-tensor": (_float8_shard, "is stored as F8_E4M3, a dtype normswap does not read"),
    "float8-config": (
        _config({"torch_dtype": "float8_e4m3fn", "dtype": "float8_e4m3fn"}),
        "config.json: dtype float8_e4m3fn is not one normswap rewrites",
    ),
    "architecture": (
        _config({"architectures": ["LlamaForCausalLM"]}),
        "config.json: architecture LlamaForCausalLM takes a 'llama' config, but model_type is 'gpt2'",
    ),
    "nested-auto-map": (
        _config({"text_config": {"auto_map": {"AutoModel": "x.Y"}}}),
        "asks for the repository's own Python code (text_config.auto_map: ['AutoModel'])",
    ),
    "more-layers-in-files": (
        _config({"n_layer": 1}),
        "the weights do not match the model: 11 unexpected (e.g. transformer.h.1.attn.c_attn.weight)",
    ),
    "unknown-model-type": (
        _config({"model_type": "no-such-model"}),
        "has model type `no-such-model` but Transformers does not recognize this architecture",
    ),
    "quantized": (
        _config({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}),
        "config.json describes quantized weights (quantization_config: 'bitsandbytes')",
    ),
    "headless": (
        _config({"architectures": ["GPT2Model"]}),
        "the files hold a model with a head or a base-model prefix ['transformer']",
    ),
    "4-TB-config": (
        _config({"n_embd": 2**26, "vocab_size": 2**24}),
        "transformer.wpe.weight has shape [1024, 64] where the model its config.json describes has [1024, 67108864]",
    ),
    "4-TB-recipe": (
        _recipe,
        "transformer.ln_f.bias has shape [64] where the model its config.json describes has [1099511627776]",
    ),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_both_routes_refuse_the_same_folders_with_the_same_reason(gpt2, tmp_path, case):
    damage, reason = FOLDERS[case]
    model = _copy(gpt2, tmp_path)
    damage(model)
    lines = [
        _refused(["convert", str(model), *route, "-o", str(tmp_path / "out")], tmp_path / "out", reason)
        for route in (STREAMED, IN_MEMORY)
    ]
    assert lines[0] == lines[1]
