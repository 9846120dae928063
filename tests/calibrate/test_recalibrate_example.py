"""examples/recalibrate_batchnorm.py runs and shows recalibration recovering the reference model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "recalibrate_batchnorm.py"


@pytest.mark.slow
def test_example_recovers_the_reference():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, check=True, timeout=300
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "reference: 3 BatchNorm layers estimated on 8 batches (128 samples)"
    scaled = re.fullmatch(
        r"stem conv x0\.5: stale statistics (\S+) dB SQNR vs reference, recalibrated (\S+) dB "
        r"\(stem\.bn var ratio 0\.250\.\.0\.250\)",
        lines[1],
    )
    assert scaled is not None, lines[1]
    # BatchNorm divides the scale out: only eps keeps the recalibrated model from matching exactly
    assert float(scaled[1]) < 10 and float(scaled[2]) > 60
    pruned = re.fullmatch(
        r"50% of conv weights pruned: stale statistics (\S+) dB SQNR vs reference, recalibrated (\S+) dB",
        lines[2],
    )
    assert pruned is not None, lines[2]
    assert float(pruned[2]) > float(pruned[1]) + 6
