"""The public API's annotations are a contract (the package ships ``py.typed``): mypy, configured in
pyproject.toml's [tool.mypy], finds no error in ``normswap/__init__.py`` and ``normswap/api/``, and the
same check catches a caller who passes the wrong type."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock  # a dependency of torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".mypy_cache"  # mypy's default, ignored by git: a user's `mypy` at the root shares it

pytest.importorskip("mypy", reason="the type check needs mypy (pip install -e '.[test]')")


def _mypy(*files: str | Path) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration (on its [tool.mypy] files when none are given). Runs one at
    a time, so that two test workers never write the incremental cache together."""
    CACHE.mkdir(exist_ok=True)
    with FileLock(CACHE / "normswap-tests.lock"):
        return subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *map(str, files)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )


def test_public_api_type_checks():
    run = _mypy()
    assert run.returncode == 0, f"mypy found errors in the public API:\n{run.stdout}{run.stderr}"
    assert "no issues found" in run.stdout, run.stdout + run.stderr


def test_the_check_catches_a_wrong_argument_type(tmp_path):
    caller = tmp_path / "caller.py"
    caller.write_text(
        "import torch\n"
        "import normswap\n"
        "\n"
        "result = normswap.convert(torch.nn.LayerNorm(4), normswap.ConvertConfig())\n"
        'normswap.save(result, "out.onnx", opset="17")\n'
    )
    run = _mypy(caller)
    assert run.returncode == 1, run.stdout + run.stderr
    assert 'caller.py:5: error: Argument "opset" to "save" has incompatible type "str"' in run.stdout, (
        run.stdout + run.stderr
    )
    assert "caller.py:4" not in run.stdout, run.stdout  # the correct call passes
