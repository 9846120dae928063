"""Every script in examples/ runs as a user would run it, and prints what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_lossless_rmsnorm_example_is_exact():
    out = _run("lossless_rmsnorm.py")
    assert "5 LayerNorms -> RMSNorm" in out and out.rstrip().endswith("; exact")
    assert "LayerNorm modules left: 0" in out
    assert "LM head tied to the token embedding: yes" in out  # one matrix, as the original holds


@pytest.mark.slow
def test_fuse_norms_example_is_exact_and_exports_standard_onnx():
    out = _run("fuse_norms.py")
    assert "logits vs original: max abs 0; exact" in out and "RMSNormalization" in out
