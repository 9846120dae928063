"""Checkpoints of a distillation run, and resuming from them; sharded results. All through
``torch.distributed.checkpoint`` (DCP), so a sharded student is saved by every process writing its own
shards, with no process ever holding the whole model, and the same files load at any process count.

A checkpoint is a folder ``DIR/step-00000040`` holding the student's parameters and buffers and the
optimizer's tensors (DCP's files) and ``run.json``: the step reached, the losses so far, the optimizer's
other values (its param_groups: lr, betas...; as JSON), and what the run must agree on to be continued
(loss, learning rate, temperature, the trained parameters, a fingerprint of each training batch and of the
teacher's weights). It is written into a hidden sibling and renamed only
once every process has written and ``run.json`` is in, so a folder named ``step-*`` is always complete;
the folders a killed run leaves are hidden, ignored by ``--resume`` and removed by the next checkpoint.
After a new one is named, this run's older ones are removed: one is kept. A run that does not resume
refuses a folder holding another run's checkpoints.

Nothing in a checkpoint is unpickled but ``.metadata``, through one restricted unpickler: DCP pickles
every non-tensor value it saves and reads those back with plain ``torch.load(weights_only=False)``, so
normswap gives DCP tensors only, and :func:`normswap.calibrate.dcp_io.screened_metadata` (the one reader of a checkpoint's
structure) refuses a ``.metadata`` that declares anything else, or that names a data file other than a
plain file of the checkpoint folder; DCP is then handed that screened metadata, never the file again.

Resuming loads the newest one into the freshly placed student and optimizer and continues at the next
step. A trained parameter that never got a gradient has no optimizer state, in the checkpoint as in the
run that wrote it, and none after resuming. Nothing in a distillation step is random (dropout is off) and the batches are cycled by step
number, so a resumed run computes what the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.calibrate.data import ModelInputs
from normswap.calibrate.dcp_io import dcp_load, dcp_save
from normswap.calibrate.parallel import DataParallel
from normswap.errors import BadInputError
from normswap.load.json_io import parse_json

RUN_FILE = "run.json"
# 2: the optimizer's non-tensor values are in run.json; format 1 had DCP pickle them
_FORMAT = 2
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
    return value if parallel is None else parallel.from_main(value)


# ---------------------------------------------------------------------------------------------------
# The optimizer's state: tensors to DCP, every other value to run.json


def _json_value(value: Any, where: str) -> Any:
    """``value`` as JSON holds it (tuples as lists); only numbers, booleans, None, strings and lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_json_value(v, where) for v in value]
    raise BadInputError(
        f"--checkpoint-dir: the optimizer's {where} is a {type(value).__name__}, which a checkpoint does not hold"
    )


def check_checkpointable(state: dict[str, Any]) -> None:
    """Before any step (the model's ``state_dict()``) and when a checkpoint is written: a model whose state
    holds a non-tensor (a module's extra state) is refused, since a checkpoint holds tensors only (module
    doc)."""
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise BadInputError(
                f"--checkpoint-dir: the converted model's state {name} is a {type(value).__name__}, not a "
                "tensor: a checkpoint holds tensors only (DCP would pickle it)"
            )


def _split_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what DCP writes: the model's and the optimizer's tensors; what run.json holds: the optimizer's other
    values, i.e. its param_groups and any non-tensor entry of a parameter's state)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    check_checkpointable(model_state)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    state: dict[str, Any] = {}
    for fqn, entries in optimizer_state["state"].items():
        tensors[fqn] = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
        values = {
            k: _json_value(v, f"{fqn}.{k}") for k, v in entries.items() if not isinstance(v, torch.Tensor)
        }
        state[fqn] = {"tensors": sorted(tensors[fqn]), "values": values}
    groups = [
        {k: _json_value(v, f"param_groups.{k}") for k, v in group.items()}
        for group in optimizer_state["param_groups"]
    ]
    return {"model": model_state, "optim": {"state": tensors}}, {"param_groups": groups, "state": state}


def _optimizer_record(record: dict[str, Any]) -> dict[str, Any]:
    """run.json's optimizer entry, its shape checked (raises TypeError/KeyError as the record's reader)."""
    saved = record["optimizer"]
    groups, state = saved["param_groups"], saved["state"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise TypeError("its optimizer param_groups are not a list of records")
    if not isinstance(state, dict):
        raise TypeError("its optimizer state is not a record")
    for fqn, entry in state.items():
        names, values = entry["tensors"], entry["values"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"its optimizer state of {fqn} names no tensors")
        if not isinstance(values, dict):
            raise TypeError(f"its optimizer state of {fqn} has no values")
    return saved


def _param_groups(path: Path, saved: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The checkpoint's param_groups, in the types the fresh optimizer's hold (JSON has no tuples)."""
    if len(saved) != len(now):
        raise BadInputError(
            f"--resume: {path} has {len(saved)} optimizer parameter groups, the run has {len(now)}"
        )
    restored = []
    for index, (old, new) in enumerate(zip(saved, now, strict=True)):
        group = {}
        for key, value in new.items():
            if key not in old:
                raise BadInputError(
                    f"--resume: {path / RUN_FILE} lacks the optimizer's {key} (group {index})"
                )
            kept = old[key]
            group[key] = tuple(kept) if isinstance(value, tuple) and isinstance(kept, list) else kept
        if group["params"] != new["params"]:
            raise BadInputError(f"--resume: {path} trains other parameters (optimizer group {index})")
        restored.append(group)
    return restored


def _finished(folder: Path) -> list[Path]:
    found = []
    if folder.is_dir():
        for entry in folder.iterdir():
            if _STEP_DIR.fullmatch(entry.name) and (entry / RUN_FILE).is_file():
                found.append(entry)
    return sorted(found)


def write_shared_folder(
    path: Path,
    parallel: DataParallel | None,
    write: Any,
    describe_run: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> None:
    """Every process writes into one hidden temp folder beside ``path``; process 0 adds ``run.json`` (when
    given) and renames it to ``path`` once all have written. On failure the temp folder is removed."""
    from normswap.errors import failed_write
    from normswap.load.save import place, reserve_temp_dir

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
            label = "checkpoint" if describe_run is not None else "-o"
            place(temp_path, path, overwrite=overwrite, label=label)
        if parallel is not None:
            parallel.barrier()
    except BaseException as exc:
        if _main(parallel):
            shutil.rmtree(temp_path, ignore_errors=True)
        said = failed_write(path, exc)  # a full disk, permissions: one line, as every output says it
        if said is not None:
            raise said from None
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
    if _main(parallel):
        plan.directory.mkdir(parents=True, exist_ok=True)
    if parallel is not None:
        parallel.barrier()
    path = plan.directory / f"step-{step:08d}"
    tensors, optimizer_values = _split_state(model, optimizer)
    record = {"format": _FORMAT, "step": step, "losses": losses, "run": run, "optimizer": optimizer_values}
    write_shared_folder(path, parallel, lambda temp: dcp_save(tensors, temp, parallel), record)
    if _main(parallel):
        for older in _finished(plan.directory):
            if older != path and _same_run(older, run):
                shutil.rmtree(older, ignore_errors=True)
    return path


def _same_run(folder: Path, run: dict[str, Any]) -> bool:
    """Whether the checkpoint in ``folder`` belongs to ``run``: only those are removed as older."""
    try:
        record = parse_json((folder / RUN_FILE).read_bytes(), str(folder / RUN_FILE), "checkpoint record")
        saved, step = record["run"], int(record["step"])
    except (OSError, ValueError, KeyError, TypeError, BadInputError):
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
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    finished = _finished(plan.directory)
    if not finished:
        raise BadInputError(f"--resume: {plan.directory} holds no finished checkpoint (step-*/{RUN_FILE})")
    path = finished[-1]
    try:
        record = parse_json(
            (path / RUN_FILE).read_bytes(), f"--resume: {path / RUN_FILE}", "checkpoint record"
        )
        step, losses, saved_run = int(record["step"]), [float(v) for v in record["losses"]], record["run"]
        if not isinstance(saved_run, dict):
            raise TypeError(f"its run is a {type(saved_run).__name__}, not a record")
        if record.get("format") != _FORMAT:
            raise BadInputError(
                f"--resume: {path} was written by another version of normswap (format {record.get('format')})"
            )
        saved_optimizer = _optimizer_record(record)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadInputError(f"--resume: {path / RUN_FILE} is not a checkpoint record: {exc}") from None
    differences = _differences(saved_run, run, step)
    if differences:
        raise BadInputError(f"--resume: {path} is from another run: " + "; ".join(differences))
    if step >= run["steps"] or len(losses) != step:
        raise BadInputError(
            f"--resume: {path} has done {step} steps, --steps is {run['steps']}: nothing to continue"
        )
    # A fresh optimizer gets a state for every parameter here (DCP's zero-gradient step): the tensors to
    # load into. Only the parameters that had a state in the checkpoint are loaded and given one; a
    # parameter that never got a gradient has none, as in the run that wrote it.
    model_state, fresh = get_state_dict(model, optimizer)
    wanted: dict[str, dict[str, Any]] = {}
    for fqn, entry in saved_optimizer["state"].items():
        here = fresh["state"].get(fqn)
        missing = [name for name in entry["tensors"] if here is None or name not in here]
        if missing:
            raise BadInputError(
                f"--resume: {path} cannot be loaded into the converted model: it holds optimizer state "
                f"{fqn}.{missing[0]}, which this run's optimizer does not have"
            )
        wanted[fqn] = {name: here[name] for name in entry["tensors"]}
    state = {"model": model_state, "optim": {"state": wanted}}
    dcp_load(state, path, parallel)
    optimizer_state = {
        "state": {
            fqn: {**state["optim"]["state"].get(fqn, {}), **entry["values"]}
            for fqn, entry in saved_optimizer["state"].items()
        },
        "param_groups": _param_groups(path, saved_optimizer["param_groups"], fresh["param_groups"]),
    }
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(strict=False))
    return step, losses, path


def save_sharded(
    path: Path, model: nn.Module, parallel: DataParallel | None, overwrite: bool = False
) -> None:
    """Write the model's state dict as a DCP folder at ``path``, each process its own shards, atomically.
    Load it with ``torch.distributed.checkpoint.load`` into the same model (any number of processes), or
    turn it into one file with ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from normswap.load.paths import check_output

    check_output("-o", path, overwrite=overwrite, directory=True)  # the output rule, as every output
    state = get_model_state_dict(model)
    write_shared_folder(path, parallel, lambda temp: dcp_save(state, temp, parallel), overwrite=overwrite)
