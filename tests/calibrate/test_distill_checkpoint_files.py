"""What ``--resume`` reads from a checkpoint folder it was given: nothing in it runs as code, nothing is read
from outside it, and a refused checkpoint stays where it is (issue 29, items 1 and 4). A hostile folder is
made the way an attacker would: DCP's own writer, given the genuine checkpoint's tensors with one value
replaced by an object whose unpickling writes a marker file."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path

import model_zoo
import pytest
import torch
import torch.distributed.checkpoint as dcp
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

from normswap.calibrate.distill import distill
from normswap.calibrate.distill_checkpoint import CheckpointPlan
from normswap.errors import BadInputError
from normswap.passes import SwapNorm


class _WritesAMarker:
    """Unpickling it calls ``open(path, "w")``: any callable would do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _gpt2_pair():
    teacher, args, kwargs = model_zoo.gpt2()
    student, _ = SwapNorm("dyt")(teacher, args, kwargs)
    g = torch.Generator().manual_seed(0)
    return teacher, student, [torch.randint(0, 128, (4, 12), generator=g) for _ in range(4)]


OPTIONS = {"steps": 4, "lr": 2e-3, "loss": "kl", "temperature": 2.0}


def _genuine(tmp_path: Path):
    teacher, student, data = _gpt2_pair()
    plan = CheckpointPlan(tmp_path / "ck", every=2)
    distill(teacher, student, data, **{**OPTIONS, "steps": 2}, checkpoints=plan)
    return teacher, student, data, plan.directory / "step-00000002"


def _state_of(folder: Path) -> dict:
    """The checkpoint's whole state as DCP wrote it (a genuine folder: read in full here, in the test)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = folder.parent / "whole.pt"
    dcp_to_torch_save(str(folder), str(whole))
    state = torch.load(whole, weights_only=False)
    whole.unlink()
    return state


def _first_step_key(state: dict) -> tuple[str, str]:
    fqn = sorted(state["optim"]["state"])[0]
    return fqn, "step"


def _write_hostile(folder: Path, target: Path, poison: str, marker: Path) -> None:
    """DCP files of ``folder``'s state with one value poisoned, written to ``target`` (run.json untouched)."""
    state = _state_of(folder)
    if poison == "read tensor":  # a value the loader asks for: DCP reads what the metadata says it is
        fqn, key = _first_step_key(state)
        state["optim"]["state"][fqn][key] = _WritesAMarker(marker)
    else:  # a non-tensor entry, as the optimizer's param_groups were (lr, betas...) before they were JSON
        groups = state["optim"].get("param_groups") or [{"params": []}]
        groups[0]["lr"] = _WritesAMarker(marker)
        state["optim"]["param_groups"] = groups
    temp = target.parent / f"{target.name}.hostile"
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(temp), no_dist=True)
    target.mkdir(exist_ok=True)
    for entry in target.iterdir():
        if entry.name != "run.json":
            entry.unlink()
    for entry in temp.iterdir():
        shutil.move(str(entry), target / entry.name)
    temp.rmdir()


def _resume(teacher, student, data, directory: Path):
    return distill(
        teacher, student, data, **OPTIONS, checkpoints=CheckpointPlan(directory, every=2, resume=True)
    )


@pytest.mark.parametrize("poison", ["read tensor", "extra object"])
def test_a_pickled_payload_in_the_data_files_is_refused_before_it_runs(tmp_path, poison):
    teacher, student, data, folder = _genuine(tmp_path)
    marker = tmp_path / "ran"
    _write_hostile(folder, folder, poison, marker)
    with pytest.raises(
        BadInputError, match=r"step-00000002/\.metadata is refused: it declares .* as a pickled object"
    ):
        _resume(teacher, student, data, folder.parent)
    assert not marker.exists()
    assert (folder / "run.json").is_file() and (folder / ".metadata").is_file()  # not removed as "older"


def test_a_tampered_data_file_under_the_genuine_metadata_runs_nothing(tmp_path):
    """.metadata byte for byte the genuine one; in the data file, the bytes of one item it declares are
    replaced by a pickle that writes the marker (padded to the item's length): a pickled item if the format
    has any (DCP reads those with ``torch.load(weights_only=False)``), else a tensor's."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    teacher, student, data, folder = _genuine(tmp_path)
    before = (folder / ".metadata").read_bytes()
    metadata = pickle.loads(before)
    pickled = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    chosen = pickled[0] if pickled else next(iter(metadata.state_dict_metadata))
    marker = tmp_path / "ran"
    payload = pickle.dumps(_WritesAMarker(marker))
    for index, info in metadata.storage_data.items():
        if index.fqn == chosen:
            assert len(payload) <= info.length
            with open(folder / info.relative_path, "r+b") as handle:
                handle.seek(info.offset)
                handle.write(payload.ljust(info.length, b"\0"))
    with pytest.raises(
        BadInputError, match=r"--resume: .*step-00000002 cannot be loaded into the converted model"
    ):
        _resume(teacher, student, data, folder.parent)
    assert not marker.exists()
    assert (folder / ".metadata").read_bytes() == before and (folder / "run.json").is_file()


def _point_storage(folder: Path, rename) -> None:
    """Rewrite ``folder/.metadata`` so each storage file is ``rename(file name)``."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=rename(info.relative_path))
        for index, info in metadata.storage_data.items()
    }
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("route", ["dot-dot", "absolute", "symlink"])
def test_storage_outside_the_checkpoint_folder_is_refused(tmp_path, route):
    """The metadata names data files; one outside the folder (by '..', an absolute path or a symlink) is
    refused before anything is read from it."""
    teacher, student, data, folder = _genuine(tmp_path)
    marker = tmp_path / "ran"
    elsewhere = tmp_path / "elsewhere"
    _write_hostile(folder, elsewhere, "read tensor", marker)
    names = [p.name for p in elsewhere.glob("*.distcp")]
    if route == "symlink":
        for name in names:
            (folder / name).unlink()
            (folder / name).symlink_to(elsewhere / name)
        shutil.copy(elsewhere / ".metadata", folder / ".metadata")
        reason = r"storage file '__0_0\.distcp' is a symlink"
    else:
        shutil.copy(elsewhere / ".metadata", folder / ".metadata")
        if route == "dot-dot":
            _point_storage(folder, lambda name: f"../../elsewhere/{name}")
            reason = r"storage file '\.\./\.\./elsewhere/__0_0\.distcp' is not a file name inside the folder"
        else:
            _point_storage(folder, lambda name: str(elsewhere / name))
            reason = "storage file '/.*/elsewhere/__0_0.distcp' is not a file name inside the folder"
    with pytest.raises(BadInputError, match=r"step-00000002/\.metadata is refused: .*" + reason):
        _resume(teacher, student, data, folder.parent)
    assert not marker.exists()
    assert (folder / "run.json").is_file()


def test_a_genuine_checkpoint_holds_no_pickled_object(tmp_path):
    """The optimizer's settings (lr, betas...) are in run.json as JSON numbers: DCP's files hold tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _, _, _, folder = _genuine(tmp_path)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    kinds = {type(item) for item in metadata.state_dict_metadata.values()}
    assert kinds == {TensorStorageMetadata}
    import json

    record = json.loads((folder / "run.json").read_text())
    assert record["optimizer"]["param_groups"][0]["lr"] == 2e-3


# ---------------------------------------------------------------------------------------------------
# Parameters that never get a gradient, and DCP's own failures (item 4)


class _Net(nn.Module):
    """A LayerNorm MLP with a trained parameter that no output depends on: AdamW keeps no state for it."""

    def __init__(self, hidden: int = 16, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 4)
        if unused:
            self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)).relu())


def _mlp_pair(hidden: int = 16):
    torch.manual_seed(0)
    teacher = _Net()
    torch.manual_seed(1)
    student = _Net(hidden, unused=True)
    g = torch.Generator().manual_seed(0)
    return teacher, student, [torch.randn(4, 8, generator=g) for _ in range(4)]


def test_a_parameter_without_optimizer_state_resumes_into_the_uninterrupted_run(tmp_path):
    teacher, student, data = _mlp_pair()
    options = {"steps": 6, "lr": 1e-2}
    straight, straight_report = distill(teacher, student, data, **options)
    plan = CheckpointPlan(tmp_path / "ck", every=2)
    distill(teacher, student, data, **{**options, "steps": 4}, checkpoints=plan)
    resumed, report = distill(
        teacher, student, data, **options, checkpoints=CheckpointPlan(plan.directory, every=2, resume=True)
    )
    assert report.resumed_from_step == 4 and report.losses == straight_report.losses
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_that_does_not_fit_is_one_line_naming_it(tmp_path):
    """DCP's CheckpointException derives from BaseException: it is caught by type, not let through."""
    teacher, student, data = _mlp_pair()
    plan = CheckpointPlan(tmp_path / "ck", every=2)
    distill(teacher, student, data, steps=2, lr=1e-2, checkpoints=plan)
    _, wider, _ = _mlp_pair(hidden=32)  # same parameter names, other shapes
    with pytest.raises(BadInputError) as caught:
        distill(
            teacher, wider, data, steps=4, lr=1e-2, checkpoints=CheckpointPlan(plan.directory, resume=True)
        )
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"--resume: {plan.directory / 'step-00000002'} cannot be loaded into the")
    assert "Size mismatch between saved torch.Size([16, 8]) and current: torch.Size([32, 8])" in message


class _WithExtraState(_Net):
    """A module whose state_dict holds a non-tensor (its extra state), which DCP would pickle."""

    def get_extra_state(self) -> dict:
        return {"note": "kept"}

    def set_extra_state(self, state: dict) -> None:
        pass


def test_a_model_with_non_tensor_state_is_refused_before_any_step(tmp_path):
    teacher, _, data = _mlp_pair()
    torch.manual_seed(1)
    student = _WithExtraState()
    steps: list[int] = []
    with pytest.raises(
        BadInputError, match=r"state _extra_state is a dict, not a tensor: a checkpoint holds"
    ):
        distill(
            teacher,
            student,
            data,
            steps=2,
            lr=1e-2,
            checkpoints=CheckpointPlan(tmp_path / "ck", every=1),
            on_step=lambda done, *_: steps.append(done),
        )
    assert steps == [] and not (tmp_path / "ck").exists()


# ---------------------------------------------------------------------------------------------------
# The command line: exit 2, one line, nothing run, the checkpoint left in place

FACTORIES = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)).relu())


def teacher():
    torch.manual_seed(0)
    return Net(), (torch.randn(4, 8),)


def student():
    torch.manual_seed(1)
    return Net(), (torch.randn(4, 8),)
"""


def test_cli_resume_of_a_hostile_checkpoint_exits_2_and_runs_nothing(tmp_path):
    factories = tmp_path / "tiny.py"
    factories.write_text(FACTORIES)
    data = tmp_path / "data.pt"
    torch.save(torch.randn(20, 8, generator=torch.Generator().manual_seed(0)), data)
    ck = tmp_path / "ck"
    common = [
        "distill", f"{factories}:teacher", f"{factories}:student", "--data", str(data), "--batch-size", "4",
        "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
    ]  # fmt: skip
    runner = CliRunner()
    first = runner.invoke(app, [*common, "--steps", "2", "-o", str(tmp_path / "a.pt2")])
    assert first.exit_code == 0, first.output
    folder = ck / "step-00000002"
    marker = tmp_path / "ran"
    _write_hostile(folder, folder, "read tensor", marker)
    result = runner.invoke(app, [*common, "--steps", "4", "--resume", "-o", str(tmp_path / "b.pt2")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: --resume: {folder / '.metadata'} is refused: it declares"), (
        result.output
    )
    assert "Traceback" not in result.output
    assert not marker.exists() and (folder / "run.json").is_file() and not (tmp_path / "b.pt2").exists()


@pytest.mark.slow
def test_torchrun_resume_of_a_hostile_checkpoint_runs_nothing_on_any_process(tmp_path):
    """Every process screens the checkpoint the same way before DCP reads it: all refuse, none runs it."""
    import os
    import subprocess
    import sys

    factories = tmp_path / "tiny.py"
    factories.write_text(FACTORIES)
    data = tmp_path / "data.pt"
    torch.save(torch.randn(20, 8, generator=torch.Generator().manual_seed(0)), data)
    ck = tmp_path / "ck"
    common = [
        "distill", f"{factories}:teacher", f"{factories}:student", "--data", str(data), "--batch-size", "4",
        "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
    ]  # fmt: skip
    first = CliRunner().invoke(app, [*common, "--steps", "2", "-o", str(tmp_path / "a.pt2")])
    assert first.exit_code == 0, first.output
    folder = ck / "step-00000002"
    marker = tmp_path / "ran"
    _write_hostile(folder, folder, "read tensor", marker)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "normswap_cli", *common, "--steps", "4", "--resume", "-o", str(tmp_path / "b.pt2")]
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert done.returncode != 0, done.stdout
    refusal = f"error: --resume: {folder / '.metadata'} is refused: it declares"
    assert done.stdout.count(refusal) == 2, done.stdout  # each process, one line
    assert not marker.exists() and (folder / "run.json").is_file() and not (tmp_path / "b.pt2").exists()


def test_a_checkpoint_written_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """Distillation's folders (checkpoints, a .dcp output) fail a write as every output does."""
    from normswap.calibrate.distill_checkpoint import write_shared_folder

    def write(folder: Path) -> None:
        (folder / "part").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    path = tmp_path / "step-00000002"
    with pytest.raises(BadInputError) as info:
        write_shared_folder(path, None, write, {"step": 2})
    assert (
        str(info.value) == f"no space left on device writing {path}: free some space or choose another folder"
    )
    assert list(tmp_path.iterdir()) == []
