"""The same input gives the same verdict, exit code, report and model whichever route ran.

A model directory converted into a model directory streams when its rewrite streams; the same command
with example inputs of the user's (``--input-shape``, which the stream does not take) runs in memory.
For every rewrite both routes run, and for the two ways a run ends without a change (nothing to change;
a refusal of the exact policy), the two runs must agree: exit code, verdict, refusal, each change and
each skip with its reason and typed cause, the notes, and every tensor written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_dirs import make_directory, randomize_norms, wav2vec2_config
from hf_dirs import stored_tensors as _tensors
from normswap_cli.app import app
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

runner = CliRunner()
# what the stream builds from each model's config (normswap.load.config_inputs): batch 1 x 16 token ids,
# one image of the configured size (224 where the config has none), raw audio for 16 frames
SAME_INPUTS = {
    "text": ["--input-shape", "int64:1,16"],
    "resnet": ["--input-shape", "float32:1,3,224,224"],
    "convnext": ["--input-shape", "float32:1,3,64,64"],
    "wav2vec2": ["--input-shape", f"float32:1,{17 * 5 * 2 + 10 + 3}"],
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity")
    made = {name: make_directory(root, name) for name in ("gpt2", "llama")}
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=300
    )
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(config).eval()  # a head reads the last block's norm
    randomize_norms(bert)
    bert.save_pretrained(root / "bert")
    made["bert"] = root / "bert"
    resnet = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5)
    made["resnet"] = _saved(transformers.ResNetForImageClassification(resnet), root / "resnet")
    convnext = transformers.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 2], num_stages=2, image_size=64)
    made["convnext"] = _saved(transformers.ConvNextModel(convnext), root / "convnext")
    made["wav2vec2"] = _saved(transformers.Wav2Vec2ForCTC(wav2vec2_config(vocab_size=20)), root / "wav2vec2")
    # GPT-J: LayerNorms with a bias read by q/k/v projections without one (the fold gives them one)
    gptj = transformers.GPTJConfig(
        n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=300, use_cache=False
    )
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(gptj).eval()
    randomize_norms(model)
    made["gptj"] = _saved(model, root / "gptj")
    return made


def _saved(model: torch.nn.Module, path: Path) -> Path:
    """``model`` with random norm statistics and scales (not its initial ones and zeros), saved in shards."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("running_var", "layer_scale_parameter")):
                tensor.copy_(torch.rand_like(tensor) + 0.5)
            elif name.endswith("running_mean"):
                tensor.copy_(torch.randn_like(tensor))
    model.eval().save_pretrained(path, max_shard_size="50KB")
    return path


def _run(argv: list[str], report: Path) -> tuple[int, dict]:
    result = runner.invoke(app, [*argv, "--report", str(report)])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(report.read_text())


def _decisions(report: dict) -> list[tuple]:
    return [
        (
            p["pass_name"],
            sorted(c["site"] for c in p["changes"]),
            sorted((s["site"], s["reason"], s["cause"]) for s in p["skips"]),
        )
        for p in report["passes"]
    ]


@pytest.mark.parametrize(
    ("name", "options", "exit_code"),
    [
        ("gpt2", ["--fold-norm-affine"], 0),
        ("llama", ["--fold-norm-affine"], 0),
        # the readers gain a bias on both routes (the stream refused the fold: "the config does not build")
        ("gptj", ["--fold-norm-affine"], 0),
        ("gpt2", ["--to", "rmsnorm", "--exact"], 0),
        ("gpt2", ["--fold-bn"], 0),  # nothing to change: done, said, the model written as it was
        ("resnet", ["--fold-bn"], 0),
        ("convnext", ["--fold-layerscale"], 0),
        ("wav2vec2", ["--remove-weight-norm"], 0),
        ("wav2vec2", ["--add-weight-norm", "lm_head"], 0),
        ("bert", ["--to", "rmsnorm", "--exact"], 1),  # post-LN: refused by the exact policy
        # post-LN: the last block's norm folds into the head, moving that block's output by design (the
        # stream checked it alone and exited 1 where memory exited 0; now checked through the head)
        ("bert", ["--fold-norm-affine"], 0),
    ],
)
def test_streamed_and_in_memory_agree(dirs, tmp_path, name, options, exit_code):
    source = str(dirs[name])
    streamed_out, memory_out = tmp_path / "streamed", tmp_path / "memory"
    code_s, streamed = _run(["convert", source, *options, "-o", str(streamed_out)], tmp_path / "s.json")
    code_m, memory = _run(
        ["convert", source, *options, *SAME_INPUTS.get(name, SAME_INPUTS["text"]), "-o", str(memory_out)],
        tmp_path / "m.json",
    )
    assert (streamed["route"], memory["route"]) == ("streamed", "in memory")
    assert code_s == code_m == exit_code
    assert streamed["verdict"] == memory["verdict"]
    assert streamed["refusal"] == memory["refusal"]
    assert _decisions(streamed) == _decisions(memory)
    nothing = any(note.startswith("nothing to change") for note in streamed["notes"])
    assert not (name == "bert" and exit_code == 0 and nothing), "the BERT fold must change its last norm"
    assert nothing or any(changes for _, changes, _ in _decisions(streamed)), "compared no change"
    assert streamed["written"] == memory["written"] == (exit_code == 0)
    # the same notes, but the route's own ("... does not stream yet: converting in memory") and what only
    # a model in memory can measure: the hidden states a caller may ask for (None: not measured)
    measured = ("converting in memory", "outputs not preserved when asked for")
    assert streamed["notes"] == [n for n in memory["notes"] if not any(m in n for m in measured)]
    assert streamed["outputs_not_preserved"] is None
    # what the model stores before and after: what the files hold, whichever route wrote them (in memory
    # reported its model, where a folded norm is weightless and the directory stores neutral values)
    if exit_code == 0:
        assert streamed["size"] == memory["size"] and memory["size"]["before"]["values"] > 0
        stored = _tensors(memory_out)
        assert memory["size"]["after"] == {
            "values": sum(t.numel() for t in stored.values()),
            "bytes": sum(t.numel() * t.element_size() for t in stored.values()),
        }
    if exit_code:
        assert not streamed_out.exists() and not memory_out.exists()
        return
    ours, theirs = _tensors(streamed_out), _tensors(memory_out)
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    # the same modules recorded, and the same judgement of what a stock loader would build
    assert streamed["directory"]["stock_refused"] == memory["directory"]["stock_refused"]
    common = ("path", "shards", "recorded_modules", "copied_files", "not_copied", "config_changes")
    assert all(key in streamed["directory"] and key in memory["directory"] for key in common)
    recorded = [json.loads((out / "normswap.json").read_text())["modules"] if (out / "normswap.json").exists()
                else {} for out in (streamed_out, memory_out)]  # fmt: skip
    assert recorded[0] == recorded[1]


def test_a_run_with_nothing_to_change_says_so(dirs, tmp_path):
    code, report = _run(
        ["convert", str(dirs["gpt2"]), "--fold-bn", "-o", str(tmp_path / "out")], tmp_path / "r.json"
    )
    assert code == 0 and report["verdict"] == "ok"
    assert report["notes"] == ["nothing to change: no site to rewrite; the output is the model as it was"]
    # every tensor is the input's, byte for byte
    before, after = _tensors(dirs["gpt2"]), _tensors(tmp_path / "out")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_wrong_fold_past_the_last_block_is_caught_through_the_head(dirs, tmp_path, monkeypatch):
    """The last block of a post-LN model is also tried through the head, and a fold 1% off there passes
    neither: the stream's verification fails, naming the block, and nothing is written."""
    import normswap.passes.affine.arithmetic as affine_arithmetic

    real = affine_arithmetic.fold_affine_into_linear

    def off(weight, bias, gain, shift, in_dim):
        w, b = real(weight, bias, gain, shift, in_dim)
        return w * 1.01, b

    monkeypatch.setattr(affine_arithmetic, "fold_affine_into_linear", off)
    out = tmp_path / "out"
    code, report = _run(
        ["convert", str(dirs["bert"]), "--fold-norm-affine", "-o", str(out)], tmp_path / "r.json"
    )
    assert code == 1 and report["route"] == "streamed"
    assert "block 1 of the written model is outside the exact tolerance" in report["refusal"]
    assert not out.exists()


def test_validate_blockwise_checks_a_folded_last_block_through_the_head(dirs, tmp_path):
    """validate --blockwise of the folded BERT against its original: the last block's stored tensors
    changed, so it is compared through the head, as the stream verified it (PASS, not a divergence)."""
    out = tmp_path / "folded"
    code, converted = _run(
        ["convert", str(dirs["bert"]), "--fold-norm-affine", "-o", str(out)], tmp_path / "c.json"
    )
    assert code == 0 and [c["site"] for p in converted["passes"] for c in p["changes"]], converted["notes"]
    code, report = _run(["validate", str(dirs["bert"]), str(out), "--blockwise"], tmp_path / "v.json")
    assert code == 0, report
    for shape in report["blockwise"]:
        assert shape["ok"] and [s["stage"] for s in shape["stages"]][-1] == "block 1 + head", [
            s["stage"] for s in shape["stages"]
        ]


def test_a_directory_the_stream_cannot_verify_converts_in_memory_and_says_why(dirs, tmp_path):
    """ConvNext's stages grow in width, so the block-by-block verification (one block slot) cannot run
    them: the fold was refused with a shape error after the work (found by the directory sweep); now
    the route is chosen before any write: in memory, with the reason."""
    out = tmp_path / "folded"
    code, report = _run(
        ["convert", str(dirs["convnext"]), "--fold-norm-affine", "-o", str(out)], tmp_path / "r.json"
    )
    assert code == 0 and report["route"] == "in memory" and (out / "config.json").is_file()
    assert any("differ in shape: converting in memory" in n for n in report["notes"]), report["notes"]


def test_validate_blockwise_refuses_blocks_it_cannot_run_with_the_same_reason(dirs, tmp_path):
    """validate --blockwise asks the stream's own question first: ConvNext's stages cannot share one
    block slot, said before any block is read (it was a shape error from deep in the shell)."""
    code, _ = _run(
        ["convert", str(dirs["convnext"]), "--fold-norm-affine", "-o", str(tmp_path / "f")],
        tmp_path / "c.json",
    )
    assert code == 0
    ran = runner.invoke(app, ["validate", str(dirs["convnext"]), str(tmp_path / "f"), "--blockwise"])
    assert ran.exit_code == 2
    text = " ".join(ran.output.split())
    assert "--blockwise cannot compare" in text and "differ in shape; compare without --blockwise" in text


def test_dtype_on_a_directory_converts_in_memory_and_writes_that_dtype(dirs, tmp_path):
    """--dtype does not stream: the directory converts in memory, says why, and is written in the dtype."""
    out = tmp_path / "half"
    code, report = _run(
        ["convert", str(dirs["llama"]), "--fold-norm-affine", "--dtype", "float16", "-o", str(out)],
        tmp_path / "r.json",
    )
    assert code == 0 and report["route"] == "in memory"
    assert any("--dtype does not stream yet" in n for n in report["notes"]), report["notes"]
    # every tensor in it, a folded norm's neutral values too (they took the config's float32 before)
    stored = _tensors(out)
    assert {n: t.dtype for n, t in stored.items() if t.dtype != torch.float16} == {}
    # the size after is what the directory stores (it said the float32 model's bytes)
    assert report["size"]["after"]["bytes"] == sum(2 * t.numel() for t in stored.values())
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float16"


def test_a_model_the_meta_capture_cannot_judge_converts_in_memory(dirs, tmp_path):
    """wav2vec2's forward makes a CPU tensor beside the meta weights, so the stream's analysis captured no
    graph and skipped every site, folding 0 norms where memory folds 2 (directory sweep). A plan that
    could judge nothing is not streamed: the directory converts in memory, with the reason."""
    out = tmp_path / "folded"
    code, report = _run(
        ["convert", str(dirs["wav2vec2"]), "--fold-norm-affine", "-o", str(out)], tmp_path / "r.json"
    )
    assert code == 0 and report["route"] == "in memory"
    assert any("cannot be captured on the meta device" in n for n in report["notes"]), report["notes"]
    assert sum(len(p["changes"]) for p in report["passes"]) == 2


@pytest.mark.parametrize(("name", "options", "pass_name"), [("gpt2", ["--to", "crmsnorm"], "compress_stream"),
                                                            ("llama", ["--defer-rms"], "defer_rms")])  # fmt: skip
def test_a_graph_rewrite_of_the_model_in_memory_rewrites_what_its_directory_does(
    dirs, tmp_path, name, options, pass_name
):
    """The same HF model (use_cache on, as built) from its directory and unpickled: the written program
    returns no cache either way, so the graph rewrite is exported without it on both routes and changes
    the same norms (in memory it skipped every one: "torch.export failed: DynamicCache"). Without an
    output, the rewritten model replaces the user's and must keep the cache: skipped, saying how."""
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs[name]).eval()
    model.config.use_cache = True  # as a model built the usual way has it
    pickled, ids = tmp_path / "model.pt", tmp_path / "ids.pt"
    torch.save(model, pickled)
    torch.save({"input_ids": torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))}, ids)
    runs = {}
    for route, source in (
        ("directory", [str(dirs[name])]),
        ("memory", [str(pickled), "--trust-pickle", "--inputs", str(ids)]),
    ):
        report = tmp_path / f"{route}.json"
        result = runner.invoke(
            app, ["convert", *source, *options, "-o", str(tmp_path / f"{route}.pt2"), "--report", str(report)]
        )
        assert result.exit_code == 0, result.output
        runs[route] = json.loads(report.read_text())
    passes = {
        route: next(p for p in run["passes"] if p["pass_name"] == pass_name) for route, run in runs.items()
    }
    changed = {route: [c["site"] for c in p["changes"]] for route, p in passes.items()}
    assert changed["memory"] == changed["directory"] and len(changed["memory"]) >= 4
    assert [s["reason"] for s in passes["memory"]["skips"]] == [
        s["reason"] for s in passes["directory"]["skips"]
    ]
    assert (
        "the example inputs run with use_cache=False: the written program returns no cache"
        in runs["memory"]["notes"]
    )

    import normswap

    rewrite = {"to": "crmsnorm"} if name == "gpt2" else {"defer_rms": True}
    # without an output, or to a .pt (the eager model when nothing changed, which returns its cache)
    for output in (None, tmp_path / "kept.pt"):
        config = normswap.ConvertConfig(**rewrite, output=output)
        kept = normswap.convert(model, config, (), {"input_ids": torch.load(ids)["input_ids"]})
        report = kept.pass_report(pass_name)
        assert report.changes == [] and "give use_cache=False in the example inputs" in report.skips[0].reason
