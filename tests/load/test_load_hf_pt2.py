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
