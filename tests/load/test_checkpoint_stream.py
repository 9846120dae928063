"""Model directories rewritten as a stream (analysis on the meta device, tensors computed group by group
in float64, untouched tensors copied as bytes) and verified block by block.

The streamed result must be the in-memory route's result, tensor for tensor; it must load (stock
``from_pretrained`` for a fold, normswap's loader for RMSNorm) and match the original; a wrong tensor
must be caught by the block-by-block check at the block it is in, and then nothing is written.
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

from hf_dirs import convert_in_memory, logits, make_directory, rel, stream, token_ids  # noqa: E402
from hf_dirs import stored_tensors as _tensors  # noqa: E402

from normswap.api import ConvertConfig  # noqa: E402
from normswap.api.checkpoint import plan_checkpoint  # noqa: E402
from normswap.errors import BadInputError, CheckFailedError  # noqa: E402
from normswap.load import load_model  # noqa: E402
from normswap.load.checkpoint_dir import read_checkpoint_directory  # noqa: E402
from normswap.load.safetensors_io import read_header  # noqa: E402
from normswap.load.weight_files import find_weights  # noqa: E402
from normswap.verify.blockwise import centered, identity, verify_blockwise  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream")
    made = {name: make_directory(root, name) for name in ("gpt2", "llama", "opt", "phi", "gemma")}
    made["llama-bf16"] = make_directory(root, "llama", torch.bfloat16)
    return made


def _bytes(path: Path) -> dict[str, bytes]:
    """Each tensor's raw bytes, as stored."""
    found = {}
    for shard in sorted(path.glob("*.safetensors")):
        entries, _ = read_header(shard)
        data = shard.read_bytes()
        found.update({name: data[e.start : e.end] for name, e in entries.items()})
    return found


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("gpt2", {"fold_norm_affine": True}),
        ("llama", {"fold_norm_affine": True}),
        ("llama-bf16", {"fold_norm_affine": True}),
        ("opt", {"fold_norm_affine": True}),
        ("gemma", {"fold_norm_affine": True}),
        ("gpt2", {"to": "rmsnorm", "exact": True}),
        ("opt", {"to": "rmsnorm", "exact": True}),
        ("phi", {"fold_norm_affine": True}),
        ("phi", {"to": "rmsnorm", "exact": True}),
    ],
)
def test_the_stream_writes_what_the_in_memory_route_writes(dirs, tmp_path, name, options):
    source = dirs[name]
    streamed = stream(source, tmp_path / "streamed", **options)
    result = convert_in_memory(source, options, tmp_path / "memory")
    loaded = load_model(str(source))
    ours, theirs = _tensors(tmp_path / "streamed"), _tensors(tmp_path / "memory")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [
        k for k in ours if not torch.equal(ours[k], theirs[k])
    ]
    assert len(streamed.report.changes) == len(result.report.passes[0].changes) >= 3
    # untouched tensors are the input's bytes; every edited one was planned
    before, after = _bytes(source), _bytes(tmp_path / "streamed")
    untouched = [k for k in before if before[k] == after.get(k)]
    assert streamed.copied_tensors + streamed.edited_tensors == len(after)
    # an edit may leave a tensor's bytes as they were (a zero bias centered), a copy never changes them
    assert len(untouched) >= streamed.copied_tensors > 0
    # the index lists every tensor in the shard that holds it, and the config says what changed
    index = find_weights(tmp_path / "streamed")
    assert set(index.weight_map) == set(after) and len(streamed.shards) == len(set(index.weight_map.values()))
    # named alike by both routes: for normswap's loader alone where the classes changed
    assert index.hidden == find_weights(tmp_path / "memory").hidden == ("exact" in options)
    # a tied token embedding stays tied (GPT-2's LM head): its module centres the rows it looks up
    config = json.loads((tmp_path / "streamed" / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert config["tie_word_embeddings"] == original.get("tie_word_embeddings", True)
    assert set(after) == set(before)
    # verified on two input shapes, every block and the head within the exact tolerance
    blocks = 2
    assert [len(v.stages) for v in streamed.verification] == [blocks + 2, blocks + 2]
    assert all(v.ok for v in streamed.verification)
    # and what a user loads from it computes the original's function
    back = (
        transformers.AutoModelForCausalLM.from_pretrained
        if "to" not in options
        else lambda p: load_model(str(p)).model
    )(tmp_path / "streamed")
    ids = token_ids()
    tolerance = 1.6e-2 if name.endswith("bf16") else 1e-5
    assert rel(logits(loaded.model, ids), logits(back, ids)) <= tolerance


def test_a_wrong_tensor_is_caught_at_its_block_and_nothing_is_written(dirs, tmp_path, monkeypatch):
    import normswap.api.checkpoint as streaming

    real = streaming._stream

    def damaged(checkpoint, headers, plan, temp, *rest):
        # one reader of block 1's attention gets a wrong value, as a bug in the fold math would give
        for edit in plan.edits:
            if edit.label == "fold model.layers.1.input_layernorm":
                compute = edit.compute

                def wrong(tensors, compute=compute):
                    out = compute(tensors)
                    out["model.layers.1.self_attn.q_proj.weight"] = (
                        out["model.layers.1.self_attn.q_proj.weight"] * 1.01
                    )
                    return out

                edit.compute = wrong
        return real(checkpoint, headers, plan, temp, *rest)

    monkeypatch.setattr(streaming, "_stream", damaged)
    out = tmp_path / "out"
    with pytest.raises(CheckFailedError, match=r"verification: block 1 of the written model is outside"):
        stream(dirs["llama"], out, fold_norm_affine=True)
    assert list(tmp_path.iterdir()) == []


def test_blockwise_verification_names_the_first_divergent_block(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(dirs["gpt2"], copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    name = "transformer.h.1.mlp.c_proj.weight"
    shard = copy / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name] * 1.001
    save_file(tensors, shard, metadata={"format": "pt"})
    original, damaged = read_checkpoint_directory(dirs["gpt2"]), read_checkpoint_directory(copy)
    inputs = {"input_ids": token_ids()}
    [same] = verify_blockwise(original, original, [((), inputs)])
    assert same.ok and same.worst_rel == 0.0 and len(same.stages) == 4
    [report] = verify_blockwise(original, damaged, [((), inputs)])
    assert not report.ok and report.first_divergent == "block 1"
    # the next block and the head start again from the original's activation: the error does not carry over
    assert [c.within_tolerance for _, c in report.stages] == [True, True, False, True]
    # a recentered model is compared through the centering; without it, the embeddings already differ
    rms = tmp_path / "rms"
    stream(dirs["gpt2"], rms, to="rmsnorm", exact=True)
    [related] = verify_blockwise(original, read_checkpoint_directory(rms), [((), inputs)], centered)
    [unrelated] = verify_blockwise(original, read_checkpoint_directory(rms), [((), inputs)], identity)
    assert related.ok and unrelated.first_divergent == "embeddings"


def test_the_cli_streams_dir_to_dir_and_runs_the_rest_in_memory(dirs, tmp_path):
    streamed = runner.invoke(
        app, ["convert", str(dirs["llama"]), "--fold-norm-affine", "-o", str(tmp_path / "a")]
    )
    assert streamed.exit_code == 0, streamed.output
    assert "fold_norm_affine (exact, streamed): 5 changed" in streamed.output
    assert streamed.output.count("verified block by block (model.layers (2 blocks))") == 2
    fused = runner.invoke(app, ["convert", str(dirs["llama"]), "--to", "fused", "-o", str(tmp_path / "b")])
    assert fused.exit_code == 0, fused.output
    assert "does not stream" in fused.output and "converting in memory" in fused.output
    assert json.loads((tmp_path / "b" / "normswap.json").read_text())["modules"]


def test_a_model_that_neither_streams_nor_fits_is_refused(dirs, tmp_path, monkeypatch):
    import normswap.api.checkpoint as streaming

    monkeypatch.setattr(streaming, "available_memory", lambda: 1000)
    result = runner.invoke(app, ["convert", str(dirs["llama"]), "--to", "fused", "-o", str(tmp_path / "b")])
    assert result.exit_code == 2
    assert "converting in memory needs about" in result.output and not (tmp_path / "b").exists()


def test_exact_rmsnorm_on_a_post_ln_model_fails_and_writes_nothing(tmp_path):
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=300
    )
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(tmp_path / "bert")
    with pytest.raises(CheckFailedError, match="cannot become RMSNorm exactly"):
        stream(tmp_path / "bert", tmp_path / "out", to="rmsnorm", exact=True)
    assert not (tmp_path / "out").exists()
    with pytest.raises(BadInputError, match="a stream runs one rewrite"):
        plan_checkpoint(
            tmp_path / "bert",
            ConvertConfig(to="rmsnorm", exact=True, fold_norm_affine=True, output=tmp_path / "out"),
        )


def test_validate_blockwise_compares_two_directories(dirs, tmp_path):
    out = tmp_path / "rms"
    stream(dirs["opt"], out, to="rmsnorm", exact=True)
    report = tmp_path / "report.json"
    argv = ["validate", str(dirs["opt"]), str(out), "--blockwise"]
    through = runner.invoke(app, [*argv, "--centered", "--report", str(report)])
    assert through.exit_code == 0, through.output
    stages = json.loads(report.read_text())["blockwise"]
    assert [len(s["stages"]) for s in stages] == [4, 4] and all(s["ok"] for s in stages)
    # compared as it is, the recentered stream differs from the original's from the embeddings on
    raw = runner.invoke(app, [*argv, "--exact"])
    assert raw.exit_code == 1 and "first outside the exact tolerance: embeddings" in raw.output


def test_validate_blockwise_compares_a_directory_with_a_model_in_memory(dirs, tmp_path):
    pickled = tmp_path / "rms.pt"
    done = runner.invoke(app, ["convert", str(dirs["opt"]), "--to", "rmsnorm", "--exact", "-o", str(pickled)])
    assert done.exit_code == 0, done.output
    argv = ["validate", str(dirs["opt"]), str(pickled), "--trust-pickle", "--blockwise", "--centered"]
    report = tmp_path / "report.json"
    through = runner.invoke(app, [*argv, "--report", str(report)])
    assert through.exit_code == 0, through.output
    stages = json.loads(report.read_text())["blockwise"]
    assert [len(s["stages"]) for s in stages] == [4] and all(s["ok"] for s in stages)
    assert "model.decoder.layers (2 blocks)" in through.output
    raw = runner.invoke(app, [*argv[:-1], "--exact"])  # without --centered: differs from the embeddings on
    assert raw.exit_code == 1 and "first outside the exact tolerance: embeddings" in raw.output


def test_a_killed_run_leaves_no_directory_that_looks_complete(dirs, tmp_path):
    import subprocess
    import sys

    from normswap.load.save import _host

    # a run killed mid-write: its hidden folder is there, the output name is not
    out = tmp_path / "out"
    script = (
        "import os, signal, normswap.api.checkpoint as c\n"
        "def die(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "c.finish_from_source = die\n"
        "import normswap\n"
        f"normswap.convert({str(dirs['llama'])!r}, normswap.ConvertConfig(output={str(out)!r}, fold_norm_affine=True))\n"
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert killed.returncode == -9
    left = [p.name for p in tmp_path.iterdir()]
    assert not out.exists() and len(left) == 1 and left[0].startswith(f".out.normswap-tmp-{_host()}-")
    # the next write of the same output removes it (its process is gone) and writes the whole directory
    stream(dirs["llama"], out, fold_norm_affine=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (
        read_checkpoint_directory(out).weight_map.keys()
        == read_checkpoint_directory(dirs["llama"]).weight_map.keys()
    )


@pytest.mark.parametrize("in_dim", [0, 1])
def test_the_fold_in_slices_equals_the_fold_on_the_whole_weight(in_dim):
    from normswap.passes.affine.arithmetic import fold_affine_into_linear, fold_in_slices

    generator = torch.Generator().manual_seed(0)
    shape = (37, 24) if in_dim == 1 else (24, 37)  # 37 output features, 24 inputs
    weight = torch.randn(shape, generator=generator).to(torch.bfloat16)
    bias = torch.randn(37, generator=generator).to(torch.bfloat16)
    gain, shift = torch.rand(24, generator=generator) + 0.5, torch.randn(24, generator=generator)
    for b in (bias, None):
        whole = fold_affine_into_linear(weight, b, gain, shift, in_dim)
        into = weight.clone()
        sliced = fold_in_slices(into, b, gain, shift, in_dim, slice_elements=100)  # 4 rows a slice
        assert torch.equal(whole[0], sliced[0]) and torch.equal(whole[1], sliced[1])
        assert sliced[0] is into  # written over the weight it read: the group holds it once


def test_a_tied_embedding_is_stored_once_and_each_group_holds_one_tensor(dirs, tmp_path):
    """Recentering GPT-2 keeps its LM head tied to the embedding: the matrix is stored once, as the input
    stored it (its embedding centres the rows it looks up, recorded in normswap.json), and every other
    writer is centred in place, a group's memory that one tensor."""
    source = dirs["gpt2"]
    streamed = stream(source, tmp_path / "out", to="rmsnorm", exact=True)
    before, after = _bytes(source), _bytes(tmp_path / "out")
    assert set(after) == set(before) and "lm_head.weight" not in after
    assert after["transformer.wte.weight"] == before["transformer.wte.weight"]
    record = json.loads((tmp_path / "out" / "normswap.json").read_text())
    assert record["modules"]["transformer.wte"]["class"] == "CenteredEmbedding"
    changed = [k for k in before if after[k] != before[k]]
    assert "transformer.h.0.mlp.c_proj.weight" in changed
    assert streamed.largest_group_bytes == max(len(before[k]) for k in changed)


def test_a_group_that_fails_stops_the_copies_and_leaves_nothing(dirs, tmp_path, monkeypatch):
    import normswap.passes.recenter.stream as recenter_stream

    real = recenter_stream._tensor_edit
    calls = []

    def failing(*args, **kwargs):
        edit = real(*args, **kwargs)
        if calls:  # the second group fails while the copies run beside it
            edit.compute = lambda t: (_ for _ in ()).throw(MemoryError("no memory for this group"))
        calls.append(edit)
        return edit

    monkeypatch.setattr(recenter_stream, "_tensor_edit", failing)
    with pytest.raises(MemoryError, match="no memory for this group"):
        stream(dirs["opt"], tmp_path / "out", to="rmsnorm", exact=True)
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary folder


def test_read_tensor_reads_into_a_given_tensor_and_refuses_one_that_does_not_fit(dirs, tmp_path):
    from normswap.load.safetensors_io import read_tensor

    shard = max(dirs["llama"].glob("*.safetensors"), key=lambda p: p.stat().st_size)
    entries, _ = read_header(shard)
    name, entry = max(entries.items(), key=lambda kv: kv[1].nbytes)
    expected = _tensors(dirs["llama"])[name]
    into = torch.empty(entry.shape, dtype=expected.dtype)
    assert read_tensor(shard, entry, out=into) is into and torch.equal(into, expected)
    with pytest.raises(ValueError, match="cannot read F32"):
        read_tensor(shard, entry, out=torch.empty(entry.shape, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        read_tensor(shard, entry, out=torch.empty(tuple(reversed(entry.shape))).t())
