"""``normswap convert --help`` groups its options by family, so a user finds a rewrite by what it does."""

from __future__ import annotations

import re

from normswap_cli.app import app
from typer.testing import CliRunner

PANELS = {
    "Swap norms": ["--to", "--from", "--groups", "--layers"],
    "Exact folds": ["--fold-bn", "--fold-norm-affine", "--defer-rms"],
    "Fused kernels": ["--fuse-add", "--fuse-inline"],
    "Weight norm": ["--add-weight-norm", "--weight-norm-dim", "--remove-weight-norm"],
    "Exactness": ["--exact", "--allow-lossy"],
    "Calibration": ["--calibrate", "--calibrate-batches", "--sequential", "--activation-memory"],
    "Model and inputs": ["--weights", "--trust-pickle", "--inputs", "--input-shape"],
    "Output and report": ["--output", "--opset", "--report", "--overwrite"],
}


def _panels(text: str) -> dict[str, list[str]]:
    """Each panel's title -> the options listed in it, read off the rendered help."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        title = re.match(r"\s*╭─ (.+?) ─", line)
        if title:
            current = title.group(1)
            found[current] = []
        elif current is not None:
            # a row of the panel starts with its option (after a "*" when it is required)
            option = re.match(r"│\s*\*?\s*(--[a-z][a-z-]*)", line)
            if option:
                found[current].append(option.group(1))
    return found


def test_convert_help_groups_every_option_in_its_panel():
    result = CliRunner().invoke(app, ["convert", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    panels = _panels(result.output)
    for title, options in PANELS.items():
        assert title in panels, f"no panel {title!r} in convert --help"
        missing = [o for o in options if o not in panels[title]]
        assert not missing, f"{title}: {missing} not listed there ({panels[title]})"
