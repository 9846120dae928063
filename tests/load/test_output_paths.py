"""No command writes over what it reads or over another of its outputs; killed writes are cleaned up."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from typer.testing import CliRunner

import normswap.load
from normswap.errors import BadInputError
from normswap.load import atomic_write
from normswap.load import save as save_module
from normswap.load.paths import check_paths, source_paths

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()

DATA_FACTORY = """\
import torch


def batches():
    return [torch.randn(4, 3, 8, 8) for _ in range(3)]
"""


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: torch.nn.Module) -> dict[str, Path]:
    """The user's files, and a load_model that fails the test if a refused command got as far as loading."""
    monkeypatch.chdir(tmp_path)

    def no_loading(*args, **kwargs):
        raise AssertionError("the paths must be checked before the model is loaded")

    monkeypatch.setattr(normswap.load, "load_model", no_loading)
    conv = tmp_path / "conv.py"
    shutil.copy(REPO / "examples" / "small_convnet.py", conv)
    model = tmp_path / "model.pt"
    torch.save(tiny_model, model)
    paths = {"conv": conv, "model": model}
    for name, value in {
        "inputs": (torch.randn(1, 3, 8, 8),),
        "weights": {"anything": torch.zeros(1)},
        "data": torch.randn(8, 3, 8, 8),
    }.items():
        paths[name] = tmp_path / f"{name}.pt"
        torch.save(value, paths[name])
    paths["datafac"] = tmp_path / "datafac.py"
    paths["datafac"].write_text(DATA_FACTORY)
    paths["out"] = tmp_path / "out.pt"
    paths["out"].write_bytes(b"the output of an earlier run, which the user keeps")
    return paths


def _refused(argv: list[object], victim: Path, reason: str) -> None:
    before = victim.read_bytes()
    was_link = victim.is_symlink()
    result = runner.invoke(app, [str(a) for a in argv])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {reason}", result.output
    assert "Traceback" not in result.output
    assert victim.read_bytes() == before and victim.is_symlink() == was_link
    leftovers = [p.name for p in victim.parent.iterdir() if "tmp" in p.name and p.name.startswith(".")]
    assert leftovers == []


def test_report_is_the_model(files):
    m = files["model"]
    argv = ["convert", m, "--trust-pickle", "--to", "fused", "--input-shape", "2,4", "-o", "new.pt"]
    _refused([*argv, "--report", m], m, f"--report {m} is also MODEL: choose another path")


def test_report_is_the_output(files):
    out = files["out"]
    argv = ["convert", files["conv"].as_posix() + ":build", "--fold-bn", "-o", out, "--report", out]
    _refused(argv, out, f"--report {out} is also -o: choose another path")


def test_report_is_the_output_spelled_differently(files):
    out = files["out"]
    other = out.parent / "." / "sub" / ".." / out.name
    (out.parent / "sub").mkdir()
    argv = ["convert", f"{files['conv']}:build", "--fold-bn", "-o", out, "--report", other]
    reason = f"--report {Path(other)} is the same file as -o {out}: choose another path"
    _refused(argv, out, reason)


@pytest.mark.parametrize("option", ["--inputs", "--weights"])
def test_output_is_an_input_file(files, option):
    victim = files[option.strip("-")]
    argv = ["convert", f"{files['conv']}:build", "--fold-bn", option, victim, "-o", victim]
    _refused(argv, victim, f"-o {victim} is also {option}: choose another path")


def test_output_is_the_data_file(files):
    d = files["data"]
    argv = ["recalibrate", f"{files['conv']}:build", "--data", d, "-o", d]
    _refused(argv, d, f"-o {d} is also --data: choose another path")


def test_report_is_the_factory_file(files):
    conv = files["conv"]
    argv = ["convert", f"{conv}:build", "--fold-bn", "-o", "new.pt", "--report", conv]
    _refused(argv, conv, f"--report {conv} is also the factory file of MODEL: choose another path")


def test_report_is_the_file_of_a_factory_module(files):
    # conv:build is imported from the working directory: its file is conv.py there
    argv = ["convert", "conv:build", "--fold-bn", "-o", "new.pt", "--report", "conv.py"]
    _refused(argv, files["conv"], "--report conv.py is also the factory file of MODEL: choose another path")


def test_report_is_the_data_factory_file(files):
    fac = files["datafac"]
    argv = ["recalibrate", f"{files['conv']}:build", "--data", f"{fac}:batches", "-o", "new.pt"]
    reason = f"--report {fac} is also the factory file of --data: choose another path"
    _refused([*argv, "--report", fac], fac, reason)


def test_output_is_a_symlink_to_the_model(files):
    m = files["model"]
    link = m.with_name("link.pt")
    link.symlink_to(m)
    argv = ["convert", m, "--trust-pickle", "--to", "fused", "--input-shape", "2,4", "-o", link]
    _refused(argv, link, f"-o {link} is the same file as MODEL {m}: choose another path")
    assert m.read_bytes() == link.read_bytes()


def test_report_is_a_hard_link_to_the_model(files):
    m = files["model"]
    hard = m.with_name("hard.pt")
    os.link(m, hard)
    argv = ["convert", m, "--trust-pickle", "--to", "fused", "--input-shape", "2,4", "-o", "new.pt"]
    _refused(
        [*argv, "--report", hard], hard, f"--report {hard} is the same file as MODEL {m}: choose another path"
    )
    assert os.path.samefile(m, hard)


def test_report_through_a_symlinked_directory(files, tmp_path):
    m = files["model"]
    alias = tmp_path.parent / f"{tmp_path.name}-alias"
    alias.symlink_to(tmp_path, target_is_directory=True)
    try:
        through = alias / m.name
        argv = ["convert", m, "--trust-pickle", "--to", "fused", "--input-shape", "2,4", "-o", "new.pt"]
        reason = f"--report {through} is the same file as MODEL {m}: choose another path"
        _refused([*argv, "--report", through], m, reason)
    finally:
        alias.unlink()


def test_outputs_that_do_not_exist_yet_meet_through_a_symlinked_directory(files, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real", target_is_directory=True)
    out, report = tmp_path / "real" / "x.pt", tmp_path / "alias" / "x.pt"
    result = runner.invoke(
        app, ["convert", f"{files['conv']}:build", "--fold-bn", "-o", str(out), "--report", str(report)]
    )
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == f"error: --report {report} is the same file as -o {out}: choose another path"
    )
    assert list((tmp_path / "real").iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "victim", "reason"),
    [
        (["inspect", "{model}", "--trust-pickle", "--json", "{model}"], "model", "--json {model} is also MODEL"),
        (
            ["export", "{conv}:build", "--inputs", "{inputs}", "-o", "new.onnx", "--report", "{inputs}"],
            "inputs",
            "--report {inputs} is also --inputs",
        ),
        (
            ["validate", "{conv}:build", "{model}", "--trust-pickle", "--report", "{model}"],
            "model",
            "--report {model} is also CONVERTED",
        ),
        (
            ["validate", "{model}", "{conv}:build", "--trust-pickle", "--plot", "{out}", "--report", "{out}"],
            "out",
            "--report {out} is also --plot",
        ),
        (
            ["validate", "{conv}:build", "{conv}:build", "--converted-weights", "{weights}", "--report",
             "{weights}"],
            "weights",
            "--report {weights} is also --converted-weights",
        ),
        (
            ["distill", "{conv}:build", "{conv}:build", "--data", "{data}", "--holdout", "{inputs}", "--steps",
             "1", "-o", "{inputs}"],
            "inputs",
            "-o {inputs} is also --holdout",
        ),
        (
            ["distill", "{conv}:build", "{model}", "--trust-pickle", "--data", "{data}", "--steps", "1", "-o",
             "{model}"],
            "model",
            "-o {model} is also CONVERTED",
        ),
        (
            ["convert", "{conv}:build", "--to", "groupnorm", "--groups", "2", "--calibrate", "{data}", "-o",
             "{data}"],
            "data",
            "-o {data} is also --calibrate",
        ),
    ],
)  # fmt: skip
def test_every_command_checks_every_output(files, argv, victim, reason):
    fill = {name: str(path) for name, path in files.items()}
    argv = [a.format(**fill) for a in argv]
    _refused(argv, files[victim], reason.format(**fill) + ": choose another path")


def test_check_paths_lets_distinct_paths_through(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "cat.jpg").write_bytes(b"jpeg")
    reads = {"MODEL": tmp_path / "model.pt", "--data": images, "--inputs": None}
    check_paths(reads, {"-o": tmp_path / "out.pt", "--report": tmp_path / "report.json", "--json": None})
    with pytest.raises(BadInputError, match=r"^--report .*cat\.jpg is inside --data .*images, which this"):
        check_paths(reads, {"-o": tmp_path / "out.pt", "--report": images / "cat.jpg"})
    # a new file too: the folder would then hold it, and the next run on that data refuses a non-image
    # (a user hunt: recalibrate --data imgs -o imgs/x.pt2, then 'x.pt2 is not a JPEG')
    for label, inside in (("--report", images / "report.json"), ("-o", images / "x.pt2")):
        with pytest.raises(
            BadInputError, match=rf"^{label} .* is inside --data .*images, which this command"
        ):
            check_paths(reads, {label: inside})


def test_source_paths_of_model_and_data_specs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "models.py").write_text("")
    (tmp_path / "m.pt").write_bytes(b"x")
    assert source_paths("MODEL", "m.pt") == {"MODEL": Path("m.pt")}
    assert source_paths("MODEL", "pkg.models:build") == {"the factory file of MODEL": Path("pkg/models.py")}
    assert source_paths("--data", "lib/data.py:batches") == {
        "the factory file of --data": Path("lib/data.py")
    }
    assert source_paths("MODEL", "no_such_module:build") == {}
    assert source_paths("--holdout", None) == {}


# --- temp files of killed runs ----------------------------------------------------------------------


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".normswap-tmp-" in p.name)


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork and SIGKILL")
def test_a_killed_write_leaves_a_temp_that_the_next_write_removes(tmp_path):
    dest = tmp_path / "model.pt"
    dest.write_bytes(b"the previous model")
    chunk = b"\x17" * (1 << 20)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: writes 50 MB of a 100 MB file, says so, then hangs until killed
        try:
            os.close(read_end)

            def slow(temp: Path) -> None:
                with open(temp, "wb") as f:
                    for _ in range(50):
                        f.write(chunk)
                    f.flush()
                    os.write(write_end, b"x")
                    signal.pause()

            atomic_write(dest, slow)
        finally:
            os._exit(1)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"x"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
    assert dest.read_bytes() == b"the previous model"
    (stale,) = _temps(tmp_path)
    assert stale.startswith(f".model.pt.normswap-tmp-{save_module._host()}-{pid}-") and stale.endswith(".pt")
    assert (tmp_path / stale).stat().st_size == 50 << 20

    def complete(temp: Path) -> None:
        with open(temp, "wb") as f:
            for _ in range(100):
                f.write(chunk)

    atomic_write(dest, complete)
    assert _temps(tmp_path) == []
    assert dest.stat().st_size == 100 << 20


def test_only_stale_temps_of_this_destination_and_host_are_removed(tmp_path):
    dest = tmp_path / "out.onnx"
    host, dead = save_module._host(), _dead_pid()

    def temp(path: Path, host: str, pid: int, token: str = "0a1b2c3d") -> Path:
        made = save_module._temp_path(path, host, pid, token)
        made.write_bytes(b"partial")
        return made

    stale = [temp(dest, host, dead), temp(dest, host, dead, "99aabbcc")]
    side = stale[0].with_name(stale[0].name + ".data")  # the ONNX writer's external data beside it
    side.write_bytes(b"partial")
    kept = [
        temp(dest, host, os.getpid()),  # this process: a write in progress
        temp(dest, host, 1),  # a live pid
        temp(dest, "another-host", dead),  # another machine sharing the folder
        temp(tmp_path / "other.onnx", host, dead),  # another destination
        tmp_path / f".out.onnx.normswap-tmp-{host}-{dead}-nothex!.onnx",  # not a name normswap makes
        tmp_path / "out.onnx.bak",
    ]
    for path in kept[-2:]:
        path.write_bytes(b"mine")
    atomic_write(dest, lambda t: t.write_bytes(b"new"))
    assert dest.read_bytes() == b"new"
    assert not any(p.exists() for p in [*stale, side])
    assert all(p.exists() for p in kept)


def test_temp_names_keep_the_suffix_and_stay_short(tmp_path):
    seen: list[Path] = []

    def write(temp: Path) -> None:
        seen.append(temp)
        temp.write_bytes(b"x")

    for name in ("out.pt2", "m" * 200 + ".pt2"):
        atomic_write(tmp_path / name, write)
    assert seen[0].name.startswith(f".out.pt2.normswap-tmp-{save_module._host()}-{os.getpid()}-")
    assert all(p.suffix == ".pt2" and len(p.name) < 255 for p in seen)
    assert _temps(tmp_path) == []


def test_a_model_name_with_a_version_in_it_is_a_directory(tmp_path: Path):
    """-o Qwen2.5-0.5B-folded names a model directory, as in every Hugging Face tool (it was refused as
    an unknown output format: what follows its last dot is a version, not a file extension); a real
    unknown extension is still refused before any work."""
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from hf_dirs import make_directory

    from normswap.load.checkpoint_write import is_directory_output

    assert is_directory_output("Qwen2.5-0.5B-folded") and is_directory_output("out/")
    assert not is_directory_output("m.pt2") and not is_directory_output("m.onxx")
    source = make_directory(tmp_path, "gpt2")
    out = tmp_path / "gpt2-2.5-folded"
    ran = runner.invoke(app, ["convert", str(source), "--fold-norm-affine", "-o", str(out)])
    assert ran.exit_code == 0, ran.output
    assert (out / "config.json").is_file()
    typo = runner.invoke(app, ["convert", str(source), "--fold-norm-affine", "-o", str(tmp_path / "m.onxx")])
    assert typo.exit_code == 2 and "unknown output format" in " ".join(typo.output.split())


# --- an output folder that holds an input: replacing it would delete the input ------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "{model}", "--trust-pickle", "--fold-bn", "-o", "{holder}", "--overwrite"],
        ["export", "{model}", "--trust-pickle", "-o", "{holder}", "--overwrite"],
        ["recalibrate", "{model}", "--trust-pickle", "--data", "{data}", "-o", "{holder}", "--overwrite"],
        ["distill", "{model}", "{model}", "--trust-pickle", "--data", "{data}", "--steps", "1", "-o", "{holder}",
         "--overwrite"],
        ["validate", "{model}", "{model}", "--trust-pickle", "--report", "{holder}", "--overwrite"],
        ["inspect", "{model}", "--trust-pickle", "--json", "{holder}", "--overwrite"],
    ],
    ids=["convert", "export", "recalibrate", "distill", "validate", "inspect"],
)  # fmt: skip
def test_no_command_writes_a_folder_that_holds_its_input(files, tmp_path, argv):
    holder = tmp_path / "project"
    holder.mkdir()
    model = holder / "model.pt"
    shutil.copy(files["model"], model)
    argv = [a.format(model=model, holder=holder, data=files["data"]) for a in argv]
    label = argv[argv.index(str(holder)) - 1]
    read = "ORIGINAL" if argv[0] in ("distill", "validate") else "MODEL"
    _refused(argv, model, f"{label} {holder} holds {read} {model}: writing it would replace the input; "
             "choose another path")  # fmt: skip


def test_no_command_writes_the_folder_it_runs_in(files, tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the model is not in it
    result = runner.invoke(app, ["convert", str(files["model"]), "--trust-pickle", "--fold-bn", "-o", ".",
                                 "--overwrite"])  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: -o . is the working directory or holds it: writing it would replace the folder the command "
        "runs in; choose another path"
    )
    assert files["model"].exists()


def test_a_checkpoint_folder_may_hold_the_inputs_it_is_never_replaced(tmp_path):
    reads = {"MODEL": tmp_path / "model.pt"}
    check_paths(reads, {"--checkpoint-dir": tmp_path}, working=("--checkpoint-dir",))
    with pytest.raises(BadInputError, match=r"^-o .* holds MODEL .*model\.pt: writing it would replace"):
        check_paths(reads, {"-o": tmp_path})
    # but never inside an output folder, which replacing would delete with the checkpoints in it
    writes = {"-o": tmp_path / "out.dcp", "--checkpoint-dir": tmp_path / "out.dcp" / "steps"}
    with pytest.raises(BadInputError, match=r"^--checkpoint-dir .*steps is inside -o .*out\.dcp: writing -o"):
        check_paths(reads, writes, working=("--checkpoint-dir",))


@pytest.mark.parametrize("route", ["streamed", "in memory"])
def test_a_library_call_never_writes_a_folder_that_holds_its_input(tmp_path, route):
    """``normswap.convert`` with an output, and ``normswap.save`` after an in-memory conversion, keep the
    rule the commands check first (a folder output replaced with overwrite=True used to take the input
    model directory inside it with it)."""
    import hf_dirs

    import normswap

    holder = tmp_path / "project"
    holder.mkdir()
    source = hf_dirs.make_directory(holder, "gpt2")
    before = sorted(p.name for p in source.iterdir())
    read = "MODEL" if route == "streamed" else "the input model"  # the API's check, then the writer's
    reason = rf"^-o {holder} holds {read} {source}: writing it would replace the input; choose another path$"
    with pytest.raises(BadInputError, match=reason):
        if route == "streamed":
            normswap.convert(
                source, normswap.ConvertConfig(fold_norm_affine=True, output=holder, overwrite=True)
            )
        else:
            result = normswap.convert(source, normswap.ConvertConfig(fold_norm_affine=True))
            normswap.save(result, holder, overwrite=True)
    assert sorted(p.name for p in source.iterdir()) == before


@pytest.mark.parametrize("command", ["recalibrate", "convert"])
def test_an_output_inside_the_data_folder_is_refused_before_any_work(files, tmp_path, command):
    """recalibrate --data imgs -o imgs/x.pt2 wrote the model into the image folder, and the next run on the
    same data refused it ('x.pt2 is not a JPEG'): an output inside a folder the command reads is refused,
    on every command (one rule: check_paths), before the model is loaded (the fixture fails a load)."""
    images = tmp_path / "imgs"
    images.mkdir()
    (images / "cat.jpg").write_bytes(b"jpeg")
    out = images / "x.pt2"
    argv = {
        "recalibrate": ["recalibrate", f"{files['conv']}:build", "--data", str(images), "-o", str(out)],
        "convert": ["convert", f"{files['conv']}:build", "--to", "groupnorm", "--groups", "2", "--calibrate",
                    str(images), "-o", str(out)],
    }[command]  # fmt: skip
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: -o {out} is inside --{'data' if command == 'recalibrate' else 'calibrate'} {images}, which "
        "this command reads: choose a path outside it"
    )
    assert sorted(p.name for p in images.iterdir()) == ["cat.jpg"]
