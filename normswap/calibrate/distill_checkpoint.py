"""Checkpoints of a distillation run, and resuming from them; sharded results. All through
``torch.distributed.checkpoint`` (DCP), so a sharded student is saved by every process writing its own
shards, with no process ever holding the whole model, and the same files load at any process count.

A checkpoint is a folder ``DIR/step-00000040`` holding the student's parameters and buffers and the
optimizer's state (DCP's files) and ``run.json``: the step reached, the losses so far, and what the run
must agree on to be continued (loss, learning rate, temperature, the trained parameters, a fingerprint of
each training batch and of the teacher's weights). It is written into a hidden sibling and renamed only
once every process has written and ``run.json`` is in, so a folder named ``step-*`` is always complete;
the folders a killed run leaves are hidden, ignored by ``--resume`` and removed by the next checkpoint.
After a new one is named, this run's older ones are removed: one is kept. A run that does not resume
refuses a folder holding another run's checkpoints.

Resuming loads the newest one into the freshly placed student and optimizer and continues at the next
step. Nothing in a distillation step is random (dropout is off) and the batches are cycled by step
number, so a resumed run computes what the uninterrupted run would have.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.calibrate.data import ModelInputs
from normswap.calibrate.parallel import DataParallel
from normswap.errors import BadInputError

RUN_FILE = "run.json"
_FORMAT = 1
_STEP_DIR = re.compile(r"step-(\d{8})")


@dataclass(frozen=True)
class CheckpointPlan:
    """Checkpoint every ``every`` steps into ``directory``; ``resume`` continues from its newest one."""

    directory: Path
    every: int | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        if self.every is not None and (isinstance(self.every, bool) or self.every < 1):
            raise BadInputError(f"--checkpoint-every must be at least 1, got {self.every}")
        if self.directory.exists() and not self.directory.is_dir():
            raise BadInputError(f"--checkpoint-dir {self.directory} is a file, not a folder")

    def due(self, steps_done: int, steps: int) -> bool:
        return self.every is not None and steps_done % self.every == 0 and steps_done <= steps

    def check(self) -> None:
        """Before any work: a run that does not resume must not start in a folder holding another run's
        checkpoints, and checkpoints need a rhythm or a resume."""
        if self.every is None and not self.resume:
            raise BadInputError("--checkpoint-dir needs --checkpoint-every K (or --resume)")
        finished = _finished(self.directory)
        if not self.resume and finished:
            raise BadInputError(
                f"--checkpoint-dir {self.directory} holds checkpoints of an earlier run ({finished[-1].name}): "
                "give --resume to continue it, or another folder"
            )


def batch_fingerprints(batches: list[ModelInputs]) -> list[str]:
    """sha256 of each training batch's tensors (names, dtypes, shapes, bytes)."""
    found = []
    for batch in batches:
        digest = hashlib.sha256()
        for name, tensor in batch.tensors():
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        found.append(digest.hexdigest())
    return found


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over every parameter's name, shape, dtype and float64 sum and sum of squares: the same
    weights give the same value, read before any sharding, at any process count."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # a sharded weight is gathered first (one at a time): sums of shards round otherwise
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            values = whole.detach().double()
            sums = f"{values.sum().item()!r}|{values.square().sum().item()!r}"
            digest.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{sums}".encode())
    return digest.hexdigest()


def _batches_differ(saved: list[str], now: list[str], steps_done: int) -> str | None:
    """Why the batches the first ``steps_done`` steps trained on differ now, if they do (batches are
    cycled by step number)."""
    if not saved or not now:
        return "no training batches recorded"
    for step in range(steps_done):
        if saved[step % len(saved)] != now[step % len(now)]:
            return (
                f"step {step + 1} trained on another batch than now (the data, --batch-size or --holdout "
                "changed, or the data is read in another order)"
            )
    return None


def _main(parallel: DataParallel | None) -> bool:
    """Whether this process writes what only one process writes (run.json, renames, removals)."""
    return parallel is None or parallel.is_main


def _collective(parallel: DataParallel | None, value: Any) -> Any:
    """Process 0's ``value`` on every process."""
    if parallel is None:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _one_process_quietly(parallel: DataParallel | None) -> Iterator[None]:
    # DCP warns that it "assumes the intent" of one process even when told so with no_dist.
    with warnings.catch_warnings():
        if parallel is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _dcp_save(state: dict[str, Any], folder: Path, parallel: DataParallel | None) -> None:
    import torch.distributed.checkpoint as dcp

    with _one_process_quietly(parallel):
        dcp.save(state, checkpoint_id=str(folder), no_dist=parallel is None)


# What DCP's ``.metadata`` pickle may name (found by loading what DCP writes): its own metadata classes,
# the file system reader's storage record, torch sizes, dtypes and layouts, and paths. DCP reads that file
# with plain ``pickle.load``, which runs whatever a pickle names: a checkpoint folder from elsewhere is
# checked with this list first, as normswap checks every other file it is given.
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import importlib

        # nothing is imported for a name outside the list: an import runs the module's code
        known = module in (_DCP_METADATA_MODULE, "torch") or (module, name) in _DCP_ALLOWED
        found = getattr(importlib.import_module(module), name, None) if known else None
        own_class = module == _DCP_METADATA_MODULE and isinstance(found, type) and found.__module__ == module
        dtype = module == "torch" and isinstance(found, torch.dtype)
        if found is None or not (own_class or dtype or (module, name) in _DCP_ALLOWED):
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which a checkpoint's metadata does not hold"
            )
        return found


def _check_metadata(folder: Path) -> None:
    """Refuse a checkpoint whose ``.metadata`` pickle names anything but DCP's own metadata (see above)."""
    try:
        with open(folder / ".metadata", "rb") as handle:
            _MetadataUnpickler(handle).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise BadInputError(f"--resume: {folder / '.metadata'} is refused: {exc}") from None


def _dcp_load(state: dict[str, Any], folder: Path, parallel: DataParallel | None) -> None:
    import torch.distributed.checkpoint as dcp

    with _one_process_quietly(parallel):
        dcp.load(state, checkpoint_id=str(folder), no_dist=parallel is None)


def _finished(folder: Path) -> list[Path]:
    found = []
    if folder.is_dir():
        for entry in folder.iterdir():
            if _STEP_DIR.fullmatch(entry.name) and (entry / RUN_FILE).is_file():
                found.append(entry)
    return sorted(found)


def _write_shared_folder(
    path: Path, parallel: DataParallel | None, write: Any, describe_run: dict[str, Any] | None = None
) -> None:
    """Every process writes into one hidden temp folder beside ``path``; process 0 adds ``run.json`` (when
    given) and renames it to ``path`` once all have written. On failure the temp folder is removed."""
    from normswap.load.save import publish_directory, reserve_temp_dir

    reserved: tuple[str | None, str | None] = (None, None)
    if _main(parallel):
        try:
            reserved = (str(reserve_temp_dir(path)), None)
        except BadInputError as exc:  # every process must hear it, or the others wait in the broadcast
            reserved = (None, str(exc))
    temp, error = _collective(parallel, reserved)
    if error is not None:
        raise BadInputError(error)
    temp_path = Path(temp)
    try:
        write(temp_path)
        if parallel is not None:
            parallel.barrier()
        if _main(parallel):
            if describe_run is not None:
                (temp_path / RUN_FILE).write_text(json.dumps(describe_run, indent=2) + "\n")
            publish_directory(temp_path, path, label="checkpoint" if describe_run is not None else "-o")
        if parallel is not None:
            parallel.barrier()
    except BaseException:
        if _main(parallel):
            shutil.rmtree(temp_path, ignore_errors=True)
        raise


def save_checkpoint(
    plan: CheckpointPlan,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    run: dict[str, Any],
    losses: list[float],
    parallel: DataParallel | None,
) -> Path:
    """Write the checkpoint after ``step`` steps (module doc); returns its folder."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if _main(parallel):
        plan.directory.mkdir(parents=True, exist_ok=True)
    if parallel is not None:
        parallel.barrier()
    path = plan.directory / f"step-{step:08d}"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    record = {"format": _FORMAT, "step": step, "losses": losses, "run": run}
    _write_shared_folder(
        path,
        parallel,
        lambda temp: _dcp_save({"model": model_state, "optim": optimizer_state}, temp, parallel),
        record,
    )
    if _main(parallel):
        for older in _finished(plan.directory):
            if older != path and _same_run(older, run):
                shutil.rmtree(older, ignore_errors=True)
    return path


def _same_run(folder: Path, run: dict[str, Any]) -> bool:
    """Whether the checkpoint in ``folder`` belongs to ``run``: only those are removed as older."""
    try:
        record = json.loads((folder / RUN_FILE).read_text())
        saved, step = record["run"], int(record["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(saved, dict):
        return False
    return not _differences(saved, run, step)


# Keys of a run record compared by their own rules, not by equality.
_NOT_EQUAL_KEYS = ("steps", "training_batches", "trained_parameters", "teacher")


def _differences(saved: dict[str, Any], run: dict[str, Any], steps_done: int) -> list[str]:
    found = [
        f"{key} {saved.get(key)!r} in the checkpoint, {value!r} now"
        for key, value in run.items()
        if key not in _NOT_EQUAL_KEYS and saved.get(key) != value
    ]
    if saved.get("trained_parameters") != run["trained_parameters"]:
        before, now = set(saved.get("trained_parameters") or ()), set(run["trained_parameters"])
        only_saved, only_now = sorted(before - now)[:3], sorted(now - before)[:3]
        found.append(
            f"the trained parameters differ (only in the checkpoint: {only_saved}; only now: {only_now})"
        )
    if saved.get("teacher") != run.get("teacher"):
        found.append("the original model's weights differ")
    batches = _batches_differ(saved.get("training_batches") or [], run["training_batches"], steps_done)
    if batches is not None:
        found.append(batches)
    return found


def load_checkpoint(
    plan: CheckpointPlan,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    run: dict[str, Any],
    parallel: DataParallel | None,
) -> tuple[int, list[float], Path]:
    """Load the newest checkpoint of ``plan.directory`` into ``model`` and ``optimizer``; returns the steps
    it had done, their losses and its folder. Refuses a checkpoint of a different run (module doc)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    finished = _finished(plan.directory)
    if not finished:
        raise BadInputError(f"--resume: {plan.directory} holds no finished checkpoint (step-*/{RUN_FILE})")
    path = finished[-1]
    try:
        record = json.loads((path / RUN_FILE).read_text())
        step, losses, saved_run = int(record["step"]), [float(v) for v in record["losses"]], record["run"]
        if not isinstance(saved_run, dict):
            raise TypeError(f"its run is a {type(saved_run).__name__}, not a record")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"--resume: {path / RUN_FILE} is not a checkpoint record: {exc}") from None
    if record.get("format") != _FORMAT:
        raise BadInputError(
            f"--resume: {path} was written by another version of normswap (format {record.get('format')})"
        )
    differences = _differences(saved_run, run, step)
    if differences:
        raise BadInputError(f"--resume: {path} is from another run: " + "; ".join(differences))
    if step >= run["steps"] or len(losses) != step:
        raise BadInputError(
            f"--resume: {path} has done {step} steps, --steps is {run['steps']}: nothing to continue"
        )
    _check_metadata(path)  # before DCP unpickles it
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    try:
        _dcp_load(state, path, parallel)
    except Exception as exc:  # DCP wraps a missing or mis-shaped tensor in its own exception types
        raise BadInputError(
            f"--resume: {path} does not fit the converted model: {str(exc).splitlines()[0]}"
        ) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step, losses, path


def save_sharded(path: Path, model: nn.Module, parallel: DataParallel | None) -> None:
    """Write the model's state dict as a DCP folder at ``path``, each process its own shards, atomically.
    Load it with ``torch.distributed.checkpoint.load`` into the same model (any number of processes), or
    turn it into one file with ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if path.exists():
        raise BadInputError(f"-o {path} exists: not written over")
    state = get_model_state_dict(model)
    _write_shared_folder(path, parallel, lambda temp: _dcp_save(state, temp, parallel))
