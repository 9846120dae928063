"""The output rule (DESIGN.md, "One rule per promise"), for every command and every kind of output: an
existing path is refused unless --overwrite, and then replaced atomically; a symlink never; a missing or
read-only folder before the work; a full disk in one line; a .pt2 torch cannot serialize in one line."""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from normswap_cli.shared import worded
from typer.testing import CliRunner

import normswap
import normswap.load
from normswap import ConvertConfig
from normswap.errors import BadInputError, OutputExistsError
from normswap.load import save as save_module
from normswap.load.paths import check_output

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()

DATA_FACTORY = "import torch\n\n\ndef batches():\n    return [torch.randn(4, 3, 8, 8) for _ in range(3)]\n"

# A model whose program torch.export captures but cannot serialize: a Python round() of an .item(), as
# pesto-pitch's pitch model has in its forward.
ROUND_ITEM = """\
import torch
from torch import nn


class RoundItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        k = round(x.abs().max().item())
        return self.norm(self.linear(x)) * (k + 1)


def build():
    torch.manual_seed(0)
    return RoundItem().eval(), (torch.randn(2, 4),)
"""


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: torch.nn.Module) -> dict[str, Path]:
    """The user's files, and a load_model that fails the test if a refused command got as far as loading."""
    monkeypatch.chdir(tmp_path)

    def no_loading(*args, **kwargs):
        raise AssertionError("the outputs must be checked before the model is loaded")

    monkeypatch.setattr(normswap.load, "load_model", no_loading)
    conv = tmp_path / "conv.py"
    shutil.copy(REPO / "examples" / "small_convnet.py", conv)
    model = tmp_path / "model.pt"
    torch.save(tiny_model, model)
    data = tmp_path / "data.pt"
    torch.save(torch.randn(8, 3, 8, 8), data)
    return {"conv": conv, "model": model, "data": data}


def _argv(command: str, files: dict[str, Path], option: str, out: Path) -> list[str]:
    conv, model, data = (str(files[k]) for k in ("conv", "model", "data"))
    base = {
        "convert": ["convert", f"{conv}:build", "--fold-bn"],
        "export": ["export", f"{conv}:build"],
        "recalibrate": ["recalibrate", f"{conv}:build", "--data", data],
        "distill": ["distill", f"{conv}:build", f"{conv}:build", "--data", data, "--steps", "1"],
        "validate": ["validate", f"{conv}:build", model, "--trust-pickle"],
        "inspect": ["inspect", model, "--trust-pickle"],
    }[command]
    if option in ("--report", "--json", "--plot") and command in (
        "convert",
        "export",
        "recalibrate",
        "distill",
    ):
        base = [*base, "-o", "new.onnx" if command == "export" else "new.pt2"]  # in the working folder
    return [*base, option, str(out)]


# every command, every kind of output it writes
CASES = [
    ("convert", "-o", "out.pt2"),
    ("convert", "-o", "out.pt"),
    ("convert", "-o", "out.onnx"),
    ("convert", "-o", "out"),  # a model directory
    ("convert", "--report", "report.json"),
    ("export", "-o", "out.onnx"),
    ("export", "--report", "report.json"),
    ("recalibrate", "-o", "out.pt2"),
    ("recalibrate", "--report", "report.json"),
    ("distill", "-o", "out.pt2"),
    ("distill", "-o", "out.dcp"),  # a sharded checkpoint folder
    ("distill", "--report", "report.json"),
    ("validate", "--report", "report.json"),
    ("validate", "--plot", "plot.png"),
    ("inspect", "--json", "sites.json"),
]


def _occupy(path: Path) -> bytes:
    if path.suffix in ("", ".dcp"):
        path.mkdir()
        (path / "mine.txt").write_bytes(b"a folder of the user's")
        return b"a folder of the user's"
    path.write_bytes(b"a file of the user's")
    return b"a file of the user's"


def _kept(path: Path, content: bytes) -> bool:
    return (path / "mine.txt" if path.is_dir() else path).read_bytes() == content


def _no_temps(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if ".normswap-tmp-" in p.name]


@pytest.mark.parametrize(("command", "option", "name"), CASES)
def test_an_existing_output_is_refused_before_any_work(files, tmp_path, command, option, name):
    out = tmp_path / name
    content = _occupy(out)
    result = runner.invoke(app, _argv(command, files, option, out))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {option} {out} exists: pass --overwrite to replace it"
    assert _kept(out, content) and _no_temps(tmp_path)


def test_the_data_file_of_an_onnx_output_is_an_output_too(files, tmp_path):
    data = tmp_path / "out.onnx.data"
    data.write_bytes(b"weights of the user's")
    result = runner.invoke(app, _argv("export", files, "-o", tmp_path / "out.onnx"))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: -o {data} exists: pass --overwrite to replace it"
    assert data.read_bytes() == b"weights of the user's"


@pytest.mark.parametrize(("command", "option", "name"), CASES)
def test_a_symlink_is_never_written_through_even_with_overwrite(files, tmp_path, command, option, name):
    target = tmp_path / "elsewhere"
    content = _occupy(target)
    link = tmp_path / name
    link.symlink_to(target, target_is_directory=target.is_dir())
    result = runner.invoke(app, [*_argv(command, files, option, link), "--overwrite"])
    assert result.exit_code == 2, result.output
    reason = f"{option} {link} is a symlink: normswap never writes through one; choose another path"
    assert result.stderr.strip() == f"error: {reason}"
    assert link.is_symlink() and _kept(target, content)


@pytest.mark.parametrize(("command", "option", "name"), CASES)
def test_a_missing_folder_is_refused_before_any_work(files, tmp_path, command, option, name):
    out = tmp_path / "missing" / name
    result = runner.invoke(app, _argv(command, files, option, out))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {option} {out}: folder {out.parent} does not exist"


@pytest.mark.parametrize(("command", "option", "name"), CASES[::3])
def test_a_folder_that_cannot_be_written_is_refused_before_any_work(files, tmp_path, command, option, name):
    if os.geteuid() == 0:  # root writes anywhere: chmod does not bite, so the "folder" is a file
        parent = tmp_path / "a-file"
        parent.write_bytes(b"")
        reason = f"{parent} is not a folder"
    else:
        parent = tmp_path / "read-only"
        parent.mkdir(mode=0o555)
        reason = f"folder {parent} is not writable"
    out = parent / name
    result = runner.invoke(app, _argv(command, files, option, out))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {option} {out}: {reason}"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_output_never_replaces_a_folder(tmp_path, overwrite):
    """Without overwrite the refusal offered overwrite=True, which then gave this refusal: the folder's
    refusal comes first, so no refusal offers a way that does not work."""
    (tmp_path / "out.pt2").mkdir()
    with pytest.raises(BadInputError, match=r"^-o .*out\.pt2 is a folder: choose a file path$") as refused:
        check_output("-o", tmp_path / "out.pt2", overwrite=overwrite)
    assert not isinstance(refused.value, OutputExistsError)


def test_the_output_refusal_survives_pickling_and_copying():
    """A worker process raises it to its parent by pickling: its args hold only the sentence, so it is
    rebuilt from its cause (it raised TypeError in pickle.loads and copy.copy)."""
    refusal = OutputExistsError("--plot", "out.png", appeared=True)
    for again in (pickle.loads(pickle.dumps(refusal)), copy.copy(refusal)):
        assert (again.label, again.path, again.appeared) == ("--plot", "out.png", True)
        assert str(again) == "out.png appeared while it was written: pass overwrite=True to replace it"
        assert again.sentence("--overwrite") == (
            "--plot out.png appeared while it was written: pass --overwrite to replace it"
        )


# --- --overwrite replaces, atomically ---------------------------------------------------------------


def test_overwrite_replaces_a_pt2_and_its_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "examples" / "small_convnet.py", tmp_path / "conv.py")
    out, report = tmp_path / "out.pt2", tmp_path / "report.json"
    out.write_bytes(b"an earlier output")
    report.write_text("{}")
    argv = ["convert", "conv.py:build", "--fold-bn", "-o", str(out), "--report", str(report), "--overwrite"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert torch.export.load(out) is not None
    assert '"model": "conv.py:build"' in report.read_text()
    assert _no_temps(tmp_path)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "renames"])
def test_a_folder_is_replaced_whole(tmp_path, monkeypatch, exchange):
    if not exchange:  # a system without renameat2: the old folder goes aside, then the new takes its name
        monkeypatch.setattr(save_module, "_renameat2", lambda *args: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.safetensors").write_bytes(b"old")
    temp = save_module.reserve_temp_dir(out)
    (temp / "new.safetensors").write_bytes(b"new")
    with pytest.raises(
        OutputExistsError, match=r"appeared while it was written: pass overwrite=True to replace it$"
    ):
        save_module.place(temp, out)
    assert [p.name for p in out.iterdir()] == ["old.safetensors"]
    save_module.place(temp, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["new.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_file_appearing_while_written_is_not_replaced_without_overwrite(tmp_path):
    out = tmp_path / "out.pt"

    def write(temp: Path) -> None:
        temp.write_bytes(b"new")
        out.write_bytes(b"another process's")

    with pytest.raises(
        OutputExistsError, match=r"appeared while it was written: pass overwrite=True"
    ) as refused:
        save_module.atomic_write(out, write, overwrite=False)
    assert out.read_bytes() == b"another process's" and _no_temps(tmp_path)
    # the command line says the same refusal with its option
    assert worded(refused.value) == f"-o {out} appeared while it was written: pass --overwrite to replace it"


# --- one refusal, in the words of whoever called ----------------------------------------------------

API_CALLS = {
    "convert": lambda f, out: normswap.convert(f"{f['conv']}:build", ConvertConfig(fold_bn=True, output=out)),
    "save": lambda f, out: normswap.save(torch.nn.Linear(2, 2), out, (torch.randn(1, 2),)),
    "export_onnx": lambda f, out: normswap.export_onnx(f"{f['conv']}:build", out),
}


@pytest.mark.parametrize("call", sorted(API_CALLS))
def test_an_existing_output_is_refused_in_the_words_of_its_caller(tmp_path, call):
    """The library's refusal told a Python caller to "pass --overwrite", an option of the command line;
    its parameter is overwrite=True. The error carries its cause (OutputExistsError) and each caller
    names its own way: the library's text the parameter, the command line its option."""
    files = {"conv": tmp_path / "conv.py", "data": tmp_path / "data.pt", "model": tmp_path / "model.pt"}
    shutil.copy(REPO / "examples" / "small_convnet.py", files["conv"])
    out = tmp_path / ("out.onnx" if call == "export_onnx" else "out.pt2")
    out.write_bytes(b"a file of the user's")
    with pytest.raises(OutputExistsError) as refused:
        API_CALLS[call](files, out)
    assert str(refused.value) == f"{out} exists: pass overwrite=True to replace it"
    assert isinstance(refused.value, BadInputError) and refused.value.exit_code == 2
    assert (refused.value.label, Path(refused.value.path), refused.value.appeared) == ("-o", out, False)
    assert out.read_bytes() == b"a file of the user's"
    command = {"export_onnx": "export", "save": "convert"}.get(call, call)
    shown = runner.invoke(app, _argv(command, files, "-o", out))
    assert shown.exit_code == 2, shown.output
    assert shown.stderr.strip() == f"error: -o {out} exists: pass --overwrite to replace it"
    assert out.read_bytes() == b"a file of the user's"


# A model (and data) factory that fails as soon as anything reads it: a refusal that names the output
# proves the output was checked before the model or the data was loaded.
UNREADABLE = "raise RuntimeError('the model was loaded')\n"


class _Unrunnable(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the model was run")


BEFORE_WORK = {
    "convert": lambda m, out: normswap.convert(m, ConvertConfig(fold_bn=True, output=out)),
    "save": lambda m, out: normswap.save(_Unrunnable(), out, (torch.randn(1, 2),)),
    "export_onnx": lambda m, out: normswap.export_onnx(m, out),
    "recalibrate": lambda m, out: normswap.recalibrate(m, m.replace(":build", ":batches"), out),
    "distill": lambda m, out: normswap.distill(m, m, m.replace(":build", ":batches"), out, steps=1),
    "validate": lambda m, out: normswap.validate(m, m, plot=out),
}


@pytest.mark.parametrize("call", sorted(BEFORE_WORK))
def test_every_writing_entry_point_refuses_an_existing_output_before_any_work(tmp_path, call):
    """recalibrate refused an existing output only as it saved, after the recalibration had run;
    export_onnx loaded the model first; validate replaced an existing --plot (it had no overwrite). Every
    library call that writes now checks its outputs first, by the command line's rule (check_run_paths):
    the model below fails as soon as it is loaded (or run), so the refusal proves nothing was."""
    (tmp_path / "unreadable.py").write_text(UNREADABLE)
    model = f"{tmp_path / 'unreadable.py'}:build"
    out = tmp_path / {"export_onnx": "out.onnx", "validate": "out.png"}.get(call, "out.pt2")
    out.write_bytes(b"a file of the user's")
    with pytest.raises(OutputExistsError) as refused:
        BEFORE_WORK[call](model, out)
    assert str(refused.value) == f"{out} exists: pass overwrite=True to replace it"
    assert refused.value.label == ("--plot" if call == "validate" else "-o")  # what the CLI names
    assert out.read_bytes() == b"a file of the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, "unreadable.py"])


# --- a full disk, an unserializable program ---------------------------------------------------------

_FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    import torch
    from torch import nn
    from normswap.errors import BadInputError
    from normswap.load import save_model

    model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256)).eval()
    # writes past 64 KiB fail (EFBIG, with SIGXFSZ ignored) as a full disk fails them (ENOSPC): torch's
    # zip writer used to abort the interpreter there (exit 134)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    try:
        save_model(model, Path(sys.argv[1]), (torch.randn(2, 256),))
    except BadInputError as exc:
        print(exc)
    """
)


def test_a_pt2_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "out.pt2"
    run = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(out)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == f"cannot write {out}: File too large"
    assert "terminate called" not in run.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_names_itself(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.export, "save", full)
    out = tmp_path / "out.pt2"
    with pytest.raises(BadInputError) as info:
        normswap.load.save_model(torch.nn.Linear(2, 2), out, (torch.randn(1, 2),))
    assert (
        str(info.value) == f"no space left on device writing {out}: free some space or choose another folder"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_program_torch_cannot_serialize_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "round_item.py").write_text(ROUND_ITEM)
    out = tmp_path / "out.pt2"
    result = runner.invoke(app, ["convert", "round_item.py:build", "--to", "fused", "-o", str(out)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: -o {out}: the model cannot be written to a .pt2 (torch cannot serialize")
    assert "round()" in line and line.endswith("save as .onnx, or as .pt with --trust-pickle to load it")
    assert "Traceback" not in result.output and not out.exists() and _no_temps(tmp_path)


def test_a_program_torch_cannot_serialize_is_refused_before_the_work(tmp_path, monkeypatch):
    # found on the capture normswap takes anyway, before any pass runs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "round_item.py").write_text(ROUND_ITEM)
    import normswap.passes.core.pipeline as pipeline

    def no_work(*args, **kwargs):
        raise AssertionError("the .pt2 must be judged before the passes run")

    monkeypatch.setattr(pipeline.Pipeline, "__call__", no_work)
    out = tmp_path / "out.pt2"
    result = runner.invoke(app, ["convert", "round_item.py:build", "--to", "fused", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert "the model cannot be written to a .pt2" in result.stderr


def test_a_directory_output_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(BadInputError) as info, save_module.directory_output(out) as temp:
        (temp / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")
    assert (
        str(info.value) == f"no space left on device writing {out}: free some space or choose another folder"
    )
    assert list(tmp_path.iterdir()) == []


_DIRECTORY_FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    import hf_dirs
    from normswap.errors import BadInputError

    source, out, route = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))  # the shards are ~180 KB each
    try:
        if route == "streamed":
            hf_dirs.stream(source, out, to="rmsnorm", exact=True)
        else:
            hf_dirs.convert_in_memory(source, {"to": "rmsnorm", "exact": True}, out)
    except BadInputError as exc:
        print(exc)
    """
)


@pytest.mark.parametrize("route", ["streamed", "in memory"])
def test_each_directory_route_on_a_full_disk_says_one_line_and_leaves_nothing(tmp_path, route):
    """The stream and the in-memory directory writer share one rule for a failed write (they used to word
    it each their own way)."""
    import hf_dirs

    source = hf_dirs.make_directory(tmp_path, "gpt2")
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-c", _DIRECTORY_FULL_DISK, str(source), str(out), route],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == f"cannot write {out}: File too large"
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]
