"""``convert DIR --to KIND --calibrate DATA --sequential``: swapped norms calibrated block by block, the same
tensors as the in-memory route, nothing written on failure, and refusals with their reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_dirs import convert_in_memory, logits, make_directory, randomize_norms, rel, token_ids
from hf_dirs import stored_tensors as _tensors
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.api import ConvertConfig
from normswap.api import checkpoint as streaming
from normswap.api.checkpoint_sequential import convert_checkpoint_sequential, sequential_route
from normswap.errors import BadInputError
from normswap.load import load_model
from normswap.load.weight_files import find_weights

runner = CliRunner()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sequential")
    made = {name: make_directory(root, name) for name in ("llama", "gemma")}
    torch.manual_seed(1)
    torch.save(torch.randint(0, 300, (12, 10)), root / "calib.pt")  # 3 batches of 4 x 10 tokens
    made["calib"] = root / "calib.pt"
    return made


def _options(dirs: dict[str, Path]) -> dict:
    return {"to": "layernorm", "calibration_data": str(dirs["calib"]), "batch_size": 4}


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_block_by_block_writes_what_the_in_memory_calibration_writes(dirs, tmp_path, name):
    in_memory = convert_in_memory(dirs[name], _options(dirs), tmp_path / "memory")
    # a budget of 20 kB: most activations go to disk
    done = convert_checkpoint_sequential(
        dirs[name], ConvertConfig(**_options(dirs), output=tmp_path / "seq"), activation_memory=20_000
    )
    fit = done.calibration
    assert fit.activations_spilled > 0 and fit.activations_peak_held <= 20_000
    ours, theirs = _tensors(tmp_path / "seq"), _tensors(tmp_path / "memory")
    assert set(ours) == set(theirs)
    changed = [k for k in ours if "norm" in k]
    assert len(changed) == 5  # two per block and the final norm: LayerNorm weights (no bias for an RMSNorm)
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype
        assert rel(theirs[key].double(), ours[key].double()) <= 1e-6, key
    assert not torch.equal(ours[changed[0]], _tensors(dirs[name])[changed[0]])  # fitted, not carried over
    record = json.loads((tmp_path / "seq" / "normswap.json").read_text())["modules"]
    assert record == json.loads((tmp_path / "memory" / "normswap.json").read_text())["modules"]
    # LayerNorm where the config builds an RMSNorm: both routes keep stock loaders out, for the same reason
    assert find_weights(tmp_path / "seq").hidden and find_weights(tmp_path / "memory").hidden
    assert "is a LayerNorm; the config builds a" in done.stock_refused
    # the same figures: site by site and for the whole model on the calibration data
    theirs_fit = in_memory.calibration.fit
    assert [s.site for s in fit.sites] == [s.site for s in theirs_fit.sites]
    for a, b in zip(fit.sites, theirs_fit.sites, strict=True):
        assert a.sqnr_before_db == pytest.approx(b.sqnr_before_db, abs=1e-4)
        assert a.sqnr_after_db == pytest.approx(b.sqnr_after_db, abs=1e-4)
    assert fit.model_sqnr_before_db == pytest.approx(theirs_fit.model_sqnr_before_db, abs=1e-4)
    assert fit.model_sqnr_after_db == pytest.approx(theirs_fit.model_sqnr_after_db, abs=1e-4)
    assert fit.model_sqnr_after_db > fit.model_sqnr_before_db
    assert fit.example.sqnr_db == pytest.approx(in_memory.calibration.overall.worst_sqnr_db, abs=1e-3)
    assert [b.block for b in fit.blocks] == [0, 1]
    assert all(b.sqnr_after_db >= b.sqnr_before_db for b in fit.blocks)
    # the directory loads, and computes what the in-memory result computes
    loaded = load_model(str(tmp_path / "seq")).model
    assert rel(logits(in_memory.model, token_ids()), logits(loaded, token_ids())) <= 1e-6
    assert (tmp_path / "seq" / "tokenizer.json").is_file()


def test_the_cli_calibrates_block_by_block_and_reports_each_block(dirs, tmp_path):
    out, report = tmp_path / "out", tmp_path / "report.json"
    args = ["convert", str(dirs["llama"]), "--to", "layernorm", "--calibrate", str(dirs["calib"])]
    args += ["--batch-size", "4", "--sequential", "--activation-memory", "0.00001", "-o", str(out)]
    result = runner.invoke(app, [*args, "--report", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["route"] == "block by block" and len(data["passes"][0]["changes"]) == 5
    # the report's fields of every route: what was written under "directory", what it stores in "size"
    assert data["directory"]["path"] == str(out) and data["directory"]["stock_refused"]
    common = ("path", "shards", "recorded_modules", "copied_files", "not_copied", "config_changes")
    assert all(key in data["directory"] for key in common)  # the keys every route's directory has
    assert data["size"]["before"]["values"] > 0 and data["size"]["after"]["values"] > 0
    blocks = data["calibration"]["blocks"]
    assert [b["block"] for b in blocks] == [0, 1] and data["calibration"]["activations_spilled"] > 0
    assert data["calibration"]["model_sqnr_after_db"] > data["calibration"]["model_sqnr_before_db"]
    shown = runner.invoke(app, [*args[:-1], str(tmp_path / "out2")])
    assert shown.exit_code == 0, shown.output
    assert "block 1:" in shown.output and "whole model on the calibration data SQNR" in shown.output
    # nothing left beside the outputs: no temporary directory, no spilled activations
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out2", "report.json"]


def test_a_failure_midway_leaves_nothing(dirs, tmp_path, monkeypatch):
    import normswap.calibrate.sequential as engine

    real, calls = engine.fit_site, []

    def fails_in_block_1(module, inputs, targets):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("stopped in block 1")
        return real(module, inputs, targets)

    monkeypatch.setattr(engine, "fit_site", fails_in_block_1)
    config = ConvertConfig(**_options(dirs), output=tmp_path / "out")
    with pytest.raises(RuntimeError, match="stopped in block 1"):
        convert_checkpoint_sequential(dirs["llama"], config, activation_memory=20_000)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_is_never_written_over(dirs, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(BadInputError, match="exists: pass overwrite=True to replace it"):
        convert_checkpoint_sequential(dirs["llama"], ConvertConfig(**_options(dirs), output=tmp_path / "out"))
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"to": "dyt"}, "the converted model's model.layers.0.input_layernorm (DyT) is not what its config"),
        ({"to": "rmsnorm"}, "--to rmsnorm and crmsnorm recenter the residual stream"),
        ({"to": "cosine"}, "--to cosine: the sequential route swaps norms for an architectural kind"),
        ({"to": "crmsnorm"}, "--calibrate fits swapped norms: give an architectural --to KIND"),
        ({"fold_norm_affine": True}, "--fold-norm-affine is not part of the sequential route"),
        ({"calibration_data": None}, "calibrates swapped norms block by block: give --calibrate DATA"),
        # the stored bytes are copied: a --dtype was dropped (float32 written), now refused up front
        ({"dtype": "bfloat16"}, "--dtype bfloat16: the block-by-block route copies every tensor the swap"),
    ],
)
def test_what_the_sequential_route_cannot_do_is_refused_with_the_reason(dirs, tmp_path, extra, reason):
    options = {**_options(dirs), **extra}
    if options["calibration_data"] is None:
        options.pop("batch_size")
    config = ConvertConfig(**options, output=tmp_path / "out")
    with pytest.raises(BadInputError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        convert_checkpoint_sequential(dirs["llama"], config)
    assert list(tmp_path.iterdir()) == []


def test_a_model_without_one_list_of_blocks_of_its_layers_is_refused(tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
    transformers.ResNetForImageClassification(config).eval().save_pretrained(tmp_path / "resnet")
    torch.save(torch.rand(4, 3, 32, 32), tmp_path / "images.pt")
    options = {"to": "groupnorm", "groups": 4, "calibration_data": str(tmp_path / "images.pt")}
    with pytest.raises(BadInputError, match="not the config's num_hidden_layers"):
        convert_checkpoint_sequential(tmp_path / "resnet", ConvertConfig(**options, output=tmp_path / "out"))
    result = runner.invoke(
        app,
        ["convert", str(tmp_path / "resnet"), "--to", "layernorm", "--sequential", "-o", str(tmp_path / "o")],
    )
    assert result.exit_code == 2 and "give --calibrate DATA" in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_a_model_that_does_not_fit_is_routed_block_by_block(dirs, monkeypatch):
    config = ConvertConfig(**_options(dirs), output="out")
    size = sum(p.stat().st_size for p in dirs["llama"].glob("*.safetensors"))
    monkeypatch.setattr(streaming, "available_memory", lambda: 3 * size + 1)  # the one memory rule
    assert sequential_route(dirs["llama"], config, asked=False) is None  # fits: in memory
    monkeypatch.setattr(streaming, "available_memory", lambda: 3 * size - 1)
    note = sequential_route(dirs["llama"], config, asked=False)
    assert note is not None and "calibrating block by block" in note
    # a conversion the route cannot take is left to the in-memory rule (which refuses it there)
    assert sequential_route(dirs["llama"], ConvertConfig(to="rmsnorm", output="out"), asked=False) is None
    assert sequential_route(dirs["llama"], config, asked=False, custom_inputs=True) is None
    # taken unasked, --dtype would be dropped as with --sequential: refused, saying why and what to do
    with pytest.raises(BadInputError, match=r"needs about .*, and --dtype float16: the block-by-block route"):
        sequential_route(
            dirs["llama"], ConvertConfig(**_options(dirs), output="out", dtype="float16"), asked=False
        )


def test_a_config_that_caches_keys_gives_the_same_result(dirs, tmp_path):
    """A block handed a key/value cache would append to it at every call (the one-block model's layer 0
    for every block): memory growing with the blocks, and later blocks attending to earlier ones' keys."""
    import shutil

    cached = tmp_path / "cached"
    shutil.copytree(dirs["llama"], cached)
    config = json.loads((cached / "config.json").read_text())
    (cached / "config.json").write_text(json.dumps({**config, "use_cache": True}))
    for source, out in ((dirs["llama"], "plain"), (cached, "cached-out")):
        convert_checkpoint_sequential(source, ConvertConfig(**_options(dirs), output=tmp_path / out))
    ours, theirs = _tensors(tmp_path / "cached-out"), _tensors(tmp_path / "plain")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_nothing_to_swap_is_written_as_it_was_on_both_routes(dirs, tmp_path):
    """No norm of the asked kind: block by block exits 0 and writes the model as it was, as in memory does
    (it used to exit 1 there, 'no norm could be swapped')."""
    args = ["convert", str(dirs["llama"]), "--to", "layernorm", "--from", "batch", "--calibrate"]
    args += [str(dirs["calib"]), "--batch-size", "4"]
    verdicts = {}
    for route, extra in (("seq", ["--sequential"]), ("memory", [])):
        report = tmp_path / f"{route}.json"
        shown = runner.invoke(app, [*args, *extra, "-o", str(tmp_path / route), "--report", str(report)])
        assert shown.exit_code == 0, shown.output
        assert "nothing to change: no site to rewrite; the output is the model as it was" in shown.output
        data = json.loads(report.read_text())
        verdicts[route] = (data["verdict"], data["passes"][0]["changes"], data["passes"][0]["skips"])
    assert verdicts["seq"] == verdicts["memory"] == ("ok", [], [])
    source, seq, memory = _tensors(dirs["llama"]), _tensors(tmp_path / "seq"), _tensors(tmp_path / "memory")
    assert set(seq) == set(source) == set(memory)
    for key in source:
        assert torch.equal(seq[key], source[key]) and torch.equal(memory[key], source[key]), key
    assert json.loads((tmp_path / "seq.json").read_text())["calibration"] is None


def test_a_swap_a_directory_cannot_hold_is_refused_before_calibrating_on_both_routes(dirs, tmp_path):
    """--to dyt into a model directory: block by block refused it before any work, in memory after the
    whole calibration (and in other words); now both refuse it as soon as the swap is decided, alike."""
    args = [
        "convert",
        str(dirs["llama"]),
        "--to",
        "dyt",
        "--calibrate",
        str(dirs["calib"]),
        "--batch-size",
        "4",
    ]
    said = {}
    for route, extra in (("seq", ["--sequential"]), ("memory", [])):
        shown = runner.invoke(app, [*args, *extra, "-o", str(tmp_path / route)])
        assert shown.exit_code == 2, shown.output
        assert "calibration:" not in shown.output  # refused before it calibrated anything
        said[route] = " ".join(shown.output.split())
    expected = (
        "the converted model's model.layers.0.input_layernorm (DyT) is not what its config builds, and "
        "normswap cannot record it in a model directory: save as .pt2; nothing written"
    )
    assert expected in said["seq"] and expected in said["memory"]
    assert list(tmp_path.iterdir()) == []


def test_every_route_says_the_config_made_inputs_run_without_the_cache(dirs, tmp_path):
    """A config that turns the key/value cache on: the in-memory route said its made inputs run with
    use_cache=False; the streamed and block-by-block routes, which make the same inputs, said nothing."""
    import shutil

    from normswap.load.config_inputs import CACHE_OFF_NOTE

    cached = tmp_path / "cached"
    shutil.copytree(dirs["llama"], cached)
    config = json.loads((cached / "config.json").read_text())
    (cached / "config.json").write_text(json.dumps({**config, "use_cache": True}))
    calibrate = ["--to", "layernorm", "--calibrate", str(dirs["calib"]), "--batch-size", "4"]
    runs = {
        "streamed": ["--fold-norm-affine", "-o", str(tmp_path / "streamed")],
        "in memory": ["--fold-norm-affine", "-o", str(tmp_path / "memory.pt2")],
        "block by block": [*calibrate, "--sequential", "-o", str(tmp_path / "seq")],
        "in memory, calibrated": [*calibrate, "-o", str(tmp_path / "calibrated")],
    }
    for route, argv in runs.items():
        report = tmp_path / f"{len(route)}-{route[:3]}.json"
        shown = runner.invoke(app, ["convert", str(cached), *argv, "--report", str(report)])
        assert shown.exit_code == 0, (route, shown.output)
        data = json.loads(report.read_text())
        assert data["route"] == route.split(",")[0], route
        assert CACHE_OFF_NOTE in data["notes"], (route, data["notes"])


def _embeddings(path: Path, width: int) -> Path:
    """Keyword batches of ``inputs_embeds`` saved as float64 (a float32 model's data, kept in float64)."""
    generator = torch.Generator().manual_seed(5)
    batches = [{"inputs_embeds": torch.randn(4, 10, width, dtype=torch.float64, generator=generator)}]
    torch.save(batches * 2, path)
    return path


def test_both_routes_feed_the_batches_as_the_feeding_rule_makes_them(dirs, tmp_path):
    """float64 keyword batches for a float32 model: in memory, feeding's rule cast them to the model's
    dtype; block by block fed them as they came, and the first block failed with "expected m1 and m2 to
    have the same dtype" (exit 3, "internal error"). Now both routes feed the same batches."""
    from normswap import convert

    options = {"to": "layernorm", "calibration_data": str(_embeddings(tmp_path / "embeds.pt", 64))}
    loaded = load_model(str(dirs["llama"]))
    in_memory = convert(loaded.model, ConvertConfig(**options), loaded.example_args, loaded.example_kwargs)
    sequential = convert(dirs["llama"], ConvertConfig(**options, sequential=True, output=tmp_path / "seq"))
    assert sequential.route == "block by block"
    done = sequential.written_directory
    # the same report keys (block by block had no overall_after_calibration); what it wrote is "directory"
    assert set(sequential.to_dict()) - {"directory"} == set(in_memory.to_dict())
    ours, theirs = _tensors(tmp_path / "seq"), in_memory.model.state_dict()
    fitted = [k for k in ours if "norm" in k]
    assert len(fitted) == 5  # two LayerNorms per block and the final one, fitted on the same batches
    for key in fitted:
        assert rel(theirs[key].double(), ours[key].double()) <= 1e-6, key
    fit, theirs_fit = done.calibration, in_memory.calibration.fit
    assert fit.batches == theirs_fit.batches == 2
    assert fit.model_sqnr_after_db == pytest.approx(theirs_fit.model_sqnr_after_db, abs=1e-4)
    assert fit.model_sqnr_after_db > fit.model_sqnr_before_db


@pytest.mark.parametrize("narrow", [0, 1])
def test_data_the_model_cannot_be_fed_is_refused_alike_on_both_routes(dirs, tmp_path, narrow):
    """Embeddings 32 wide for a 64-wide model: the in-memory route refused them before any work (exit 2,
    "calibration batch 0 ... does not fit the model"); block by block crashed inside the first block
    (exit 3, "internal error ... this is a bug in normswap"). A narrow second batch passes the first
    batch's check and is refused where the block-by-block route runs it (feeding.data_fault)."""
    generator = torch.Generator().manual_seed(5)
    widths = [64, 64]
    widths[narrow] = 32
    data = tmp_path / "narrow.pt"
    torch.save([{"inputs_embeds": torch.randn(4, 10, w, generator=generator)} for w in widths], data)
    args = ["convert", str(dirs["llama"]), "--to", "layernorm", "--calibrate", str(data)]
    said = {}
    for route, extra in (("seq", ["--sequential"]), ("memory", [])):
        shown = runner.invoke(app, [*args, *extra, "-o", str(tmp_path / route)])
        assert shown.exit_code == 2, shown.output
        said[route] = " ".join(shown.output.split())
    expected = (
        f"error: calibration batch {narrow} (kwargs['inputs_embeds'] (4, 10, 32)) does not fit the model: "
        "RuntimeError: The size of tensor a (64) must match the size of tensor b (32)"
    )
    assert expected in said["seq"] and expected in said["memory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["narrow.pt"]  # nothing written


def _vision_directory(root: Path, name: str) -> Path:
    """A ViT (transformers renames its stored ``vit.encoder.layer.0.attention.attention.query`` to the
    model's ``vit.layers.0.attention.q_proj`` as it loads) or a Dinov2, saved by save_pretrained."""
    import transformers

    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    sizes |= {"image_size": 32, "patch_size": 8}
    torch.manual_seed(0)
    if name == "vit":
        model = transformers.ViTForImageClassification(transformers.ViTConfig(**sizes, num_labels=3))
    else:
        model = transformers.Dinov2Model(transformers.Dinov2Config(**sizes))
    randomize_norms(model.eval())
    model.save_pretrained(root / name)
    return root / name


def test_a_model_whose_tensors_transformers_renames_runs_block_by_block_as_in_memory(tmp_path):
    """ViT's files store other names than its model's: block by block refused it ('vit: 16 tensors not
    stored (e.g. vit.layers.0.attention.q_proj.weight)'), convert --sequential and validate --blockwise
    alike. The one-block model now reads each tensor under the name transformers' loader maps to it."""
    from safetensors.torch import save_file

    vit = _vision_directory(tmp_path, "vit")
    torch.manual_seed(1)
    torch.save(torch.randn(8, 3, 32, 32), tmp_path / "images.pt")
    args = ["convert", str(vit), "--to", "layernorm", "--calibrate", str(tmp_path / "images.pt")]
    args += ["--batch-size", "4"]
    seen = {}
    for route, extra in (("seq", ["--sequential"]), ("memory", [])):
        report = tmp_path / f"{route}.json"
        shown = runner.invoke(app, [*args, *extra, "-o", str(tmp_path / route), "--report", str(report)])
        assert shown.exit_code == 0, shown.output
        data = json.loads(report.read_text())
        seen[route] = (data["verdict"], data["passes"][0]["changes"], data["passes"][0]["skips"])
    assert json.loads((tmp_path / "seq.json").read_text())["route"] == "block by block"
    assert seen["seq"] == seen["memory"] == ("ok", [], [])  # its norms are LayerNorms already
    source, seq, memory = _tensors(vit), _tensors(tmp_path / "seq"), _tensors(tmp_path / "memory")
    assert set(seq) == set(memory) == set(source) and "vit.encoder.layer.1.layernorm_after.weight" in seq
    assert all(torch.equal(seq[k], source[k]) and torch.equal(memory[k], source[k]) for k in source)
    # block by block verification reads every block's own tensors: the output passes, and a copy with
    # block 1's layernorm_after changed in its file fails at block 1
    shown = runner.invoke(app, ["validate", str(vit), str(tmp_path / "seq"), "--blockwise", "--exact"])
    assert shown.exit_code == 0, shown.output
    assert (
        "vit.layers (2 blocks): 4 stages, worst 0 x max|ref| (all within the exact tolerance)" in shown.output
    )
    assert "verdict (block by block, exact tolerance): PASS" in shown.output
    doubled = "vit.encoder.layer.1.layernorm_after.weight"
    save_file({**seq, doubled: 2 * seq[doubled]}, tmp_path / "seq" / "model.safetensors", {"format": "pt"})
    shown = runner.invoke(app, ["validate", str(vit), str(tmp_path / "seq"), "--blockwise", "--exact"])
    assert shown.exit_code == 1, shown.output
    assert "outside the exact tolerance: block 1:" in " ".join(shown.output.split())


def test_a_model_whose_loading_merges_tensors_is_refused_block_by_block_with_the_reason(tmp_path):
    """Dinov2's loader may merge stored tensors (its SwiGLU weights): no model name is one stored tensor,
    so its one-block model cannot be filled; refused in one sentence before any data is read."""
    dino = _vision_directory(tmp_path, "dinov2")
    config = ConvertConfig(
        to="layernorm", calibration_data=str(tmp_path / "absent.pt"), output=tmp_path / "o"
    )
    with pytest.raises(
        BadInputError,
        match="merges or splits this architecture's tensors as it loads them, "
        "and a model with one block is filled tensor by tensor",
    ):
        convert_checkpoint_sequential(dino, config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dinov2"]
