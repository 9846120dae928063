"""A .pt2 of a Hugging Face model (outputs are ModelOutput classes) and of a fused model loads back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import model_zoo
import torch

from normswap.passes import FuseNorm

ROOT = Path(__file__).resolve().parents[2]


def _inspect_in_a_fresh_process(path: Path) -> str:
    # a fresh interpreter has imported neither transformers nor normswap's ops: loading must do it
    code = (
        "import sys, json\n"
        "from normswap.load import load_model\n"
        "from normswap.discover import find_norms\n"
        "loaded = load_model(sys.argv[1])\n"
        "inv = find_norms(loaded.model, loaded.example_args, loaded.example_kwargs)\n"
        "print(json.dumps([[s.kind, s.class_name, s.casting] for s in inv]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Ran into the following error" not in done.stderr  # torch's retry noise is kept quiet
    return done.stdout


def test_hf_gpt2_pt2_loads_back(tmp_path):
    model, args, kwargs = model_zoo.gpt2()
    path = tmp_path / "gpt2.pt2"
    torch.export.save(torch.export.export(model, args, kwargs, strict=False), path)
    out = _inspect_in_a_fresh_process(path)
    assert out.count('"layer"') == 5


def test_fused_llama_pt2_loads_back_into_fused_modules(tmp_path):
    from normswap.load import load_model

    model, args, kwargs = model_zoo.llama()
    fused, _ = FuseNorm()(model, args, kwargs)
    path = tmp_path / "llama_fused.pt2"
    torch.export.save(torch.export.export(fused, args, kwargs, strict=False), path)
    out = _inspect_in_a_fresh_process(path)
    assert out.count('["rms", "normswap.modules.fused.FusedRMSNorm", "llama"]') == 5
    loaded = load_model(str(path))
    lifted = dict(loaded.model.named_modules())["model.norm"]
    assert type(lifted).__name__ == "FusedRMSNorm" and lifted.casting == "llama"
    with torch.no_grad():
        expected = fused(*args, **kwargs).logits
        got = loaded.model(*args, **kwargs)
    got = got["logits"] if isinstance(got, dict) else got.logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_pt2_saved_from_batch_one_examples_takes_other_batch_sizes(tmp_path):
    """Model directories' example inputs are 1 x 16 token ids; torch.export specializes a size-1 dim, so
    the saved program is traced on a batch of two: it must take any batch and length."""
    from normswap.load import load_model, save_model

    model, _, _ = model_zoo.gpt2()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "g.pt2"
    save_model(model, path, (), {"input_ids": ids, "use_cache": False})
    loaded = load_model(path).model
    for shape in ((1, 16), (3, 16), (3, 7)):
        x = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want, got = (
                model(input_ids=x, use_cache=False).logits,
                loaded(input_ids=x, use_cache=False).logits,
            )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_users_llama_pt2_claims_no_swap_it_cannot_make(tmp_path):
    """An HF Llama exported with plain torch.export: its RMSNorm is written out as ops in the root's graph,
    and ``ep.module()`` keeps each norm's weight on a bare holder module that nothing calls. Replacing that
    holder would change nothing the model computes: the norms are found inside the forward, and every
    module rewrite skips them with that reason instead of reporting swaps it did not make."""
    import transformers
    from normswap_cli.app import app
    from typer.testing import CliRunner

    from normswap.discover import find_norms
    from normswap.load import load_model

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    path = tmp_path / "llama.pt2"
    torch.export.save(torch.export.export(model, (), {"input_ids": ids}, strict=False), path)

    loaded = load_model(str(path))
    sites = find_norms(loaded.model, loaded.example_args, loaded.example_kwargs).sites
    assert len(sites) == 3 and all(s.source == "pattern" and not s.is_module for s in sites)
    for number, option in enumerate((["--to", "layernorm"], ["--fold-norm-affine"])):
        output = tmp_path / f"out{number}.pt2"
        result = CliRunner().invoke(app, ["convert", str(path), *option, "-o", str(output)])
        assert "0 changed, 3 skipped" in result.output, result.output
        assert "inside a forward" in result.output
