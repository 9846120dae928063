"""Say what runs, and refuse what cannot be run: factories are code the user chose (and only that code),
a model without values is refused, an archive whose internals were edited is one line, exit 2.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from test_pt2_tamper import _ConstantModel, _rewrite
from torch import nn
from typer.testing import CliRunner

from normswap.errors import BadInputError
from normswap.load import load_model

runner = CliRunner()
NORMSWAP = str(Path(sys.executable).parent / "normswap")


def _write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def test_working_directory_does_not_shadow_an_installed_module(tmp_path: Path) -> None:
    """`normswap inspect shadowed:build` from a folder holding its own shadowed.py imports the module
    found on the path first (here PYTHONPATH stands for site-packages), not the stray file."""
    marker = tmp_path / "stray-module-ran"
    installed = tmp_path / "site"
    _write(
        installed / "shadowed.py",
        """
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), torch.randn(2, 4)
        """,
    )
    workdir = tmp_path / "project"
    _write(workdir / "shadowed.py", f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run(
        [NORMSWAP, "inspect", "shadowed:build"], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert "1 norm sites" in done.stdout


def test_a_module_only_in_the_working_directory_still_imports(tmp_path: Path, monkeypatch) -> None:
    _write(
        tmp_path / "local_only_factory.py",
        """
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        """,
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    loaded = load_model("local_only_factory:build")
    assert isinstance(loaded.model[1], nn.LayerNorm)
    assert str(tmp_path) not in sys.path  # put there for the import only


def test_help_says_that_factories_run_code_next_to_trust_pickle() -> None:
    result = runner.invoke(app, ["convert", "--help"])
    text = " ".join(result.output.replace("│", " ").split())  # rich's box, unwrapped
    assert "A factory is Python code that normswap imports and runs" in text
    assert "Unpickling runs whatever code the file names" in text


def _meta_factory(path: Path) -> Path:
    """A factory that builds its model on the meta device, as accelerate's init_empty_weights does."""
    return _write(
        path,
        """
        import torch
        def build():
            with torch.device("meta"):
                return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        """,
    )


def test_model_on_the_meta_device_is_refused(tmp_path: Path) -> None:
    factory = _meta_factory(tmp_path / "meta_factory.py")
    out = tmp_path / "out.pt2"
    result = runner.invoke(
        app, ["convert", f"{factory}:build", "--to", "fused", "--input-shape", "2,4", "-o", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "4 tensors on the meta device" in result.output and "0.weight" in result.output
    assert not out.exists()


def test_meta_model_takes_its_values_from_weights(tmp_path: Path) -> None:
    factory = _meta_factory(tmp_path / "meta_factory2.py")
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    torch.save(real.state_dict(), tmp_path / "w.pt")
    loaded = load_model(f"{factory}:build", weights=tmp_path / "w.pt")
    x = torch.randn(3, 4)
    torch.testing.assert_close(loaded.model(x), real(x), rtol=0, atol=0)


def test_meta_model_with_partial_weights_is_refused(tmp_path: Path) -> None:
    factory = _meta_factory(tmp_path / "meta_factory3.py")
    torch.save({"0.weight": torch.ones(4, 4), "0.bias": torch.ones(4)}, tmp_path / "w.pt")
    with pytest.raises(BadInputError, match=r"missing keys: 1\.weight, 1\.bias"):
        load_model(f"{factory}:build", weights=tmp_path / "w.pt")


def _saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _drop_module_call_graph(data: bytes) -> bytes:
    program = json.loads(data)
    program["graph_module"]["module_call_graph"] = []
    return json.dumps(program).encode()


@pytest.mark.parametrize(
    ("replace", "reason"),
    [
        pytest.param(
            {"data/sample_inputs/model.pt": lambda _: _saved((1, 2))},
            "cannot rebuild the program",
            id="inputs-of-ints",
        ),
        pytest.param(
            {"data/sample_inputs/model.pt": lambda _: _saved(((torch.ones(4, 8),), {}, 1))},
            "cannot rebuild the program",
            id="inputs-of-three",
        ),
        pytest.param(
            {"models/model.json": _drop_module_call_graph}, "cannot rebuild the program", id="no-call-graph"
        ),
        pytest.param(
            {"models/model.json": lambda data: data[: len(data) // 2]}, "is not valid JSON", id="cut-program"
        ),
        pytest.param(
            {"data/weights/model_weights_config.json": lambda _: b"[]"},
            "is not a payload config",
            id="weights-config",
        ),
        pytest.param(
            {"data/sample_inputs/model.pt": lambda _: _saved(((torch.ones(3, 5),), {}))},
            "does not run on the example inputs",
            id="inputs-that-do-not-fit",
        ),
    ],
)
def test_archive_with_edited_internals_is_one_line_exit_2(tmp_path: Path, replace: dict, reason: str) -> None:
    torch.manual_seed(0)
    ep = torch.export.export(_ConstantModel().eval(), (torch.randn(4, 8),))
    clean = tmp_path / "clean.pt2"
    torch.export.save(ep, clean)
    tampered = _rewrite(clean, tmp_path / "tampered.pt2", replace)
    out = tmp_path / "out.pt2"
    result = runner.invoke(app, ["convert", str(tampered), "--fold-bn", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and reason in error_lines[0], result.output
    assert not out.exists()
