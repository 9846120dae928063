"""Outputs a deployment can load. A rewrite that makes an exported graph (--to crmsnorm, --to fused
--fuse-add, --defer-rms) is written as .pt too: the file holds the program (normswap.load.exported_module)
and loads with torch.load(weights_only=False) in a fresh process. A .pt2 says what loading it needs
besides torch, and --portable writes one that plain torch.export.load reads in a process that never
imports normswap or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import model_zoo
import pytest
import torch

import normswap

LOAD = """
import sys, torch
model = torch.load(sys.argv[1], weights_only=False)  # imports what its program names itself
ids = torch.load(sys.argv[2])
with torch.no_grad():
    out = model(ids, use_cache=False)
torch.save(out.logits if hasattr(out, "logits") else out[0], sys.argv[3])
print(type(model).__name__)
"""


@pytest.mark.parametrize(
    "options",
    [
        {"to": "crmsnorm", "exact": True},
        {"to": "fused", "fuse_add": True, "exact": True},
    ],
    ids=["crmsnorm", "fuse-add"],
)
def test_a_graph_result_is_written_as_pt_and_loads_in_a_fresh_process(tmp_path: Path, options):
    model, args, kwargs = model_zoo.gpt2()
    out = tmp_path / "g.pt"
    result = normswap.convert(model, normswap.ConvertConfig(output=out, **options), args, kwargs)
    assert result.ok, result.refusal
    assert normswap.save(result).format == "pickle" and out.exists()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    torch.save(ids, tmp_path / "ids.pt")
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(out), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ExportedModule"
    got = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


PLAIN = """
import sys, torch
program = torch.export.load(sys.argv[1])
ids = torch.load(sys.argv[2])
with torch.no_grad():
    out = program.module()(ids, use_cache=False)
torch.save(out["logits"], sys.argv[3])
print(sorted(m for m in ("normswap", "transformers") if m in sys.modules))
"""


def test_a_portable_pt2_loads_with_torch_alone(tmp_path: Path):
    model, args, kwargs = model_zoo.gpt2()
    config = normswap.ConvertConfig(to="fused", fuse_add=True, exact=True, output=tmp_path / "g.pt2")
    result = normswap.convert(model, config, args, kwargs)
    assert result.ok, result.refusal
    # by default the note says what loading it needs: normswap's fused ops and transformers' output class
    saved = normswap.save(result)
    needs = [n for n in saved.messages if "loads with torch.export.load after" in n]
    assert needs and "import normswap.kernels" in needs[0] and "import transformers." in needs[0]
    portable = normswap.save(result, tmp_path / "portable.pt2", portable=True)
    assert not any("loads with torch.export.load after" in n for n in portable.messages)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    torch.save(ids, tmp_path / "ids.pt")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            PLAIN,
            str(tmp_path / "portable.pt2"),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "l.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"  # neither was imported
    got = torch.load(tmp_path / "l.pt")
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_portable_is_refused_before_the_work_for_other_outputs(tmp_path: Path):
    with pytest.raises(normswap.BadInputError, match=r"--portable is for a \.pt2 output, not .*g\.onnx"):
        normswap.ConvertConfig(to="rmsnorm", exact=True, output=tmp_path / "g.onnx", portable=True).validate()
