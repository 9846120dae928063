"""Distil a converted model back towards the original: a short fine-tune on the original's outputs.

Why: an architectural swap (BatchNorm -> GroupNorm, LayerNorm -> DyT) changes the function on purpose.
Calibration (:mod:`normswap.calibrate.affine_fit`) refits each new norm's affine parameters in closed
form, one layer at a time, and can move nothing else. Distillation trains the converted model (the
student) end to end so that its outputs match the original's (the teacher's) on data: the starting point
for a user who will train the swapped architecture further.

Loss, per batch, on the loss targets: the ``logits`` entry when the output is a mapping that has one (an
HF ModelOutput, whose other entries are caches and hidden states), else every floating-point output.
With student outputs ``s`` and teacher outputs ``t``:

- ``mse``: ``mean((s - t)^2)`` over every element of every target, pooled;
- ``kl``: ``T^2 * KL(softmax(t / T) || softmax(s / T))`` over the last dim (classes, vocabulary), summed
  over it, averaged over every other position (samples, tokens) and then over targets. The ``T^2`` keeps
  the gradient's scale independent of the temperature (Hinton et al., 2015).

Both are computed in fp32 whatever the model's dtype. The optimizer is AdamW with a constant learning
rate and no weight decay: the goal is the teacher's function, and decay would pull norm gains away from
it.

Settings: both models run with the settings :func:`normswap.graph.capture.capture_friendly` turns off
for ``convert``'s capture (an HF config's ``use_cache``) off, unless the batches set them: the model
``convert`` wrote returns no key/value cache, so the original's cache is not an output to match. The
report says which were turned off; the configs are restored afterwards.

Modes: the teacher runs in eval mode without gradients. The student runs with gradients but with every
module's training flag off, so dropout is off and a BatchNorm normalizes with, and keeps, its running
statistics: only parameters move. Switching off only the Dropout modules would not do: HF attention
layers apply dropout functionally, keyed on their own training flag. The selected parameters get
``requires_grad=True`` for the run and every other parameter ``False``; modes and ``requires_grad`` flags
are restored afterwards, on failure too.

Data: the training batches are cycled in order for ``steps`` steps. Without an explicit ``holdout`` the
last batch read is held out (never trained on) and the figures before and after (SQNR, cosine, max abs,
top-1 agreement of student vs teacher) are measured on it. At most ``steps + 1`` batches are read
(``steps`` with a holdout given), since no more can be used: with more data than that, the batch after
the first ``steps`` is the held-out one, as with ``recalibrate --batches``. The batches read are kept in
memory to be cycled.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from normswap.calibrate.batchnorm import ModelModes
from normswap.calibrate.data import ModelInputs, as_model_inputs
from normswap.calibrate.distill_checkpoint import (
    CheckpointPlan,
    batch_fingerprints,
    check_checkpointable,
    load_checkpoint,
    model_fingerprint,
    save_checkpoint,
)
from normswap.calibrate.distill_loss import (
    check_kl_targets,
    check_same_structure,
    distillation_loss,
    loss_targets,
)
from normswap.calibrate.distill_report import DistillReport
from normswap.calibrate.feeding import device_and_dtype, fit_to_models, run_batch, to_model
from normswap.calibrate.parallel import TEACHER_SHARD_BYTES, DataParallel, parameter_bytes
from normswap.calibrate.recompute import recomputed_blocks
from normswap.errors import BadInputError
from normswap.graph.capture import capture_friendly
from normswap.verify import ModelComparison, compare_outputs

LOSSES = ("mse", "kl")
TRAIN_SETS = ("all", "norms")

# Called after each step with (steps done, steps in all, that step's training loss).
StepCallback = Callable[[int, int, float], None]


# ---------------------------------------------------------------------------------------------------
# Which parameters


def _is_normswap_norm(module: nn.Module) -> bool:
    # DyT, FeatureAffine (a removed norm's affine), FeatureLayerNorm/InstanceNorm: what normswap puts in
    # for a norm, and which discovery does not classify as norms (DyT computes no statistics).
    from normswap.modules.layout import PerFeature

    return isinstance(module, PerFeature)


def norm_modules(model: nn.Module, example: ModelInputs | None = None) -> list[tuple[str, nn.Module]]:
    """The modules that are norms: what :func:`normswap.discover.find_norms` finds as whole modules (on
    the captured graph when ``example`` is given, so HF RMSNorm classes count) plus the modules normswap
    puts in for a norm. Functional norms inside a larger module own no parameters of their own: left out."""
    from normswap.discover import find_norms

    args, kwargs = (example.args, example.kwargs) if example is not None else (None, None)
    paths = {site.path for site in find_norms(model, args, kwargs) if site.is_module}
    found = []
    for path, module in model.named_modules():
        if path in paths or _is_normswap_norm(module):
            found.append((path, module))
    return found


def _floating_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            if p.is_floating_point() and id(p) not in seen:
                seen[id(p)] = p
    return list(seen.values())


# ---------------------------------------------------------------------------------------------------
# Data


def _read_batches(
    batches: Iterable[Any], steps: int, holdout: Any | None
) -> tuple[list[ModelInputs], ModelInputs | None, str, bool]:
    """(training batches, held-out batch, where it came from, whether the data may hold more)."""
    wanted = steps if holdout is not None else steps + 1
    read = [as_model_inputs(b) for b in itertools.islice(iter(batches), wanted)]
    try:
        available: int | None = len(batches)  # type: ignore[arg-type]
    except TypeError:
        available = None
    more = len(read) == wanted and (available is None or available > wanted)
    if holdout is not None:
        return read, as_model_inputs(holdout), "separate held-out batch", more
    if not read:
        return [], None, "", more
    source = f"the batch after the first {steps} of the data" if more else "last batch of the data"
    return read[:-1], read[-1], source, more


# ---------------------------------------------------------------------------------------------------
# Distillation


def check_options(*, steps: int, lr: float, loss: str, temperature: float, train: str) -> None:
    """Refuse options :func:`distill` cannot use, before anything slow (loading, reading data) runs."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise BadInputError(f"--steps must be at least 1, got {steps}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise BadInputError(f"--lr must be a positive number, got {lr}")
    if loss not in LOSSES:
        raise BadInputError(f"--loss {loss!r}: choose from {', '.join(LOSSES)}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise BadInputError(f"--temperature must be a positive number, got {temperature}")
    if train not in TRAIN_SETS:
        raise BadInputError(f"--train {train!r}: choose from {', '.join(TRAIN_SETS)}")


def check_mixed_precision(mixed_precision: bool, parallel: DataParallel | None) -> None:
    """Mixed precision is FSDP2's, over the processes of a torchrun job: refused in one process."""
    if mixed_precision and parallel is None:
        raise BadInputError(
            "--mixed-precision applies under torchrun (FSDP2's MixedPrecisionPolicy over several processes)"
        )


def distill(
    teacher: nn.Module,
    student: nn.Module,
    batches: Iterable[Any],
    *,
    steps: int,
    lr: float = 1e-4,
    loss: str = "mse",
    temperature: float = 1.0,
    train: str = "all",
    holdout: Any | None = None,
    inplace: bool = False,
    on_step: StepCallback | None = None,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    parallel: DataParallel | None = None,
    shard_teacher: bool | None = None,
    checkpoints: CheckpointPlan | None = None,
    teacher_placement: str | None = None,
    student_fill: Callable[[nn.Module, bool], str] | None = None,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
) -> tuple[nn.Module, DistillReport]:
    """Fine-tune ``student`` for ``steps`` AdamW steps so its outputs match ``teacher``'s (module doc).

    ``batches`` yields tensors, tuples/lists of positional inputs, dicts of keyword inputs or
    :class:`ModelInputs`; ``holdout`` is one batch, or None to hold out the last batch read.
    ``train="norms"`` trains only the parameters of the student's norm modules, found on a graph captured
    with ``example_args``/``example_kwargs`` (default: the first training batch). Returns the student (a
    copy unless ``inplace``; with ``inplace`` a failure mid-way leaves it partly trained) and the report.

    ``parallel`` (one process of a torchrun job, :class:`~normswap.calibrate.parallel.DataParallel`):
    each batch is the global batch, split over the processes; the student is sharded with FSDP2, and so is
    the teacher when ``shard_teacher`` (default: when it is larger than ``TEACHER_SHARD_BYTES``); both are
    changed in place, and the returned student is sharded (``parallel.full_state_dict`` gathers it).
    ``checkpoints`` saves every ``every`` steps and, with ``resume``, continues from the newest checkpoint.
    ``teacher_placement``: the teacher is placed already (sharded while it was loaded, as this says).
    ``student_fill``: the student was built on the meta device; this shards it and reads each process's
    shards from its files (:func:`~normswap.calibrate.parallel_load.load_directory_sharded`), returning
    what it did, so no process holds the student whole. ``mixed_precision`` (under ``parallel``): the
    student computes in bfloat16 and reduces its gradients in float32 (FSDP2's ``MixedPrecisionPolicy``).
    ``activation_checkpointing``: the student's blocks recompute their activations in the backward
    (:mod:`normswap.calibrate.recompute`).

    Raises BadInputError on bad options, when there are no training batches, when the two models'
    outputs differ in structure or shape, or when no parameter is selected for training.
    """
    check_options(steps=steps, lr=lr, loss=loss, temperature=temperature, train=train)
    check_mixed_precision(mixed_precision, parallel)
    if checkpoints is not None:
        checkpoints.check()
    if teacher is student:
        raise BadInputError("the original and the converted model are the same object: nothing to distil")
    target = student if inplace or parallel is not None else copy.deepcopy(student)
    teacher_ids = {id(p) for p in teacher.parameters()}
    if any(id(p) in teacher_ids for p in target.parameters()):
        raise BadInputError(
            "the converted model shares parameters with the original: training it would change both"
        )
    if checkpoints is not None:
        check_checkpointable(target.state_dict())

    train_batches, held_out, holdout_source, more = _read_batches(batches, steps, holdout)
    # both models run on every batch as both take it (feeding's one rule): a model directory's labels
    # are fed to neither when its .pt2 is the student, which takes the use_cache=False it was exported with
    fitting: list[str] = []
    train_batches = [fit_to_models((teacher, target), b, fitting) for b in train_batches]
    held_out = None if held_out is None else fit_to_models((teacher, target), held_out, fitting)
    if not train_batches:
        if held_out is not None and holdout is None:
            detail = "a single batch, which is held out to compare outputs; give more data or a holdout"
        else:
            detail = "no batches"
        raise BadInputError(f"nothing to distil on: the data yields {detail}")

    report = DistillReport(
        steps=steps,
        lr=float(lr),
        loss=loss,
        temperature=float(temperature) if loss == "kl" else None,
        train=train,
    )
    report.notes += fitting
    report.batches = len(train_batches)
    report.samples = sum(b.num_samples for b in train_batches)
    report.holdout_source = holdout_source
    if more:
        report.notes.append(
            f"{steps} steps use at most {report.batches} training batches: the data was read no further"
        )
    elif report.batches < steps:
        report.notes.append(f"{report.batches} training batches cycled over {steps} steps")

    everything = _floating_parameters([target])
    report.total_elements = sum(p.numel() for p in everything)
    if train == "norms":
        if example_args is not None or example_kwargs is not None:
            example = ModelInputs(tuple(example_args or ()), dict(example_kwargs or {}))
        else:
            example = train_batches[0]
        norms = norm_modules(target, to_model(example, *device_and_dtype(target)))
        params = _floating_parameters(m for _, m in norms)
        report.trained_modules = [path for path, m in norms if _floating_parameters([m])]
        if not params:
            raise BadInputError(
                "--train norms: the converted model has no norm module with floating-point parameters to train"
                + (f" (norms found: {', '.join(p or '(root)' for p, _ in norms[:5])})" if norms else "")
            )
    else:
        params = everything
        if not params:
            raise BadInputError("the converted model has no floating-point parameters to train")
    report.trained_tensors = len(params)
    report.trained_elements = sum(p.numel() for p in params)
    # By name: FSDP2 replaces every parameter object when it shards.
    selected = {id(p) for p in params}
    trained_names = [name for name, p in target.named_parameters() if id(p) in selected]
    run = {
        "loss": loss,
        "lr": float(lr),
        "temperature": report.temperature,
        "train": train,
        "trained_parameters": trained_names,
        "training_batches": batch_fingerprints(train_batches),
        "teacher": model_fingerprint(teacher) if checkpoints is not None else None,
        "steps": steps,
    }
    if parallel is not None:
        for index, batch in enumerate(train_batches):
            parallel.local_rows(batch, f"training batch {index}")  # refuses batches too small to split

    grad_flags = {name: p.requires_grad for name, p in target.named_parameters()}
    student_modes, teacher_modes = ModelModes(target), ModelModes(teacher)
    start = time.perf_counter()
    settings = contextlib.ExitStack()
    try:
        # convert's rule for its capture, applied to every run of both models (module doc): one function
        for model in (teacher, target):
            off = settings.enter_context(
                capture_friendly(model, train_batches[0].args, train_batches[0].kwargs)
            )
            for note in off:
                text = (
                    f"{note} for both models' runs, as for convert's capture (set it in the data to keep it)"
                )
                if text not in report.notes:
                    report.notes.append(text)
        teacher_modes.all_eval()
        student_modes.all_eval()
        if activation_checkpointing:
            report.notes.append(settings.enter_context(recomputed_blocks(target)))
        for name, p in target.named_parameters():
            p.requires_grad_(name in trained_names)
        if parallel is not None:
            report.processes = parallel.world_size
            if shard_teacher is None:
                shard_teacher = parameter_bytes(teacher) > TEACHER_SHARD_BYTES
            placed = teacher_placement or parallel.place(teacher, shard_teacher)
            if (
                mixed_precision
            ):  # float32 weights and optimizer state, whatever dtype the student is stored in
                target.float()
            student_placed = (
                student_fill(target, mixed_precision)
                if student_fill is not None
                else parallel.shard(target, mixed_precision=mixed_precision)
            )
            report.placement = f"student: {student_placed}; teacher: {placed}"
            params = [p for name, p in target.named_parameters() if name in trained_names]
            report.notes.append(
                f"{parallel.world_size} processes, each batch split over them; {report.placement}"
            )
        loop = _Loop(teacher, target, loss, temperature, parallel)

        reference = None
        if held_out is not None:
            report.holdout_samples = held_out.num_samples
            reference = loop.teacher_outputs(held_out, "held-out batch")
            report.before, report.holdout_loss_before = loop.holdout_figures(held_out, reference, check=True)
            report.loss_outputs = [name for name, _ in loop.targets_of(reference)]

        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        first = 0
        if checkpoints is not None and checkpoints.resume:
            first, report.losses, resumed = load_checkpoint(checkpoints, target, optimizer, run, parallel)
            report.resumed_from_step = first
            report.notes.append(f"resumed from {resumed} after {first} of {steps} steps")
        # Gradients are dropped as soon as the optimizer has used them, not before the next backward:
        # the next step's forward (teacher and student) then runs without a copy of the gradients.
        optimizer.zero_grad(set_to_none=True)
        # A caller inside torch.no_grad() would otherwise leave no graph to step on.
        with torch.enable_grad():
            for step in range(first, steps):
                index = step % len(train_batches)
                current, value = loop.step_loss(
                    train_batches[index], f"training batch {index}", step < len(train_batches)
                )
                if not report.loss_outputs:
                    report.loss_outputs = loop.loss_outputs
                report.losses.append(current)
                if not math.isfinite(current):
                    report.notes.append(
                        f"the training loss is {current} at step {step + 1}: training stopped"
                    )
                    break
                if not value.requires_grad:
                    raise BadInputError(
                        f"the outputs the loss compares ({', '.join(report.loss_outputs)}) do not depend on "
                        "the parameters selected for training"
                    )
                value.backward()
                if parallel is not None:
                    parallel.average_replicated_gradients()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if checkpoints is not None and checkpoints.due(step + 1, steps):
                    written = save_checkpoint(
                        checkpoints, step + 1, target, optimizer, run, report.losses, parallel
                    )
                    report.checkpoint = str(written)
                if on_step is not None:
                    on_step(step + 1, steps, current)
        # the optimizer's state and the last graph are no longer needed; the holdout runs without them
        del optimizer
        for p in params:
            p.grad = None

        if reference is not None:
            report.after, report.holdout_loss_after = loop.holdout_figures(held_out, reference)
    finally:
        settings.close()
        for name, p in target.named_parameters():
            p.requires_grad_(grad_flags.get(name, p.requires_grad))
        student_modes.restore()
        teacher_modes.restore()
    report.seconds = time.perf_counter() - start
    return target, report


class _Loop:
    """One distillation step's computations, on one process or on this process's rows of a global batch."""

    def __init__(
        self,
        teacher: nn.Module,
        student: nn.Module,
        loss: str,
        temperature: float,
        parallel: DataParallel | None,
    ) -> None:
        self.teacher, self.student, self.loss, self.temperature = teacher, student, loss, temperature
        self.parallel = parallel
        self.t_device, self.t_dtype = device_and_dtype(teacher)
        self.s_device, self.s_dtype = device_and_dtype(student)
        self.loss_outputs: list[str] = []

    def teacher_outputs(self, batch: ModelInputs, what: str) -> Any:
        with torch.no_grad():
            return run_batch(self.teacher, to_model(copy.deepcopy(batch), self.t_device, self.t_dtype), what)

    def student_outputs(self, batch: ModelInputs, what: str) -> Any:
        return run_batch(self.student, to_model(batch, self.s_device, self.s_dtype), what)

    def targets_of(self, output: Any) -> list[tuple[str, torch.Tensor]]:
        found = loss_targets(output)
        if self.loss == "kl":
            check_kl_targets(found)
        return found

    def step_loss(self, batch: ModelInputs, what: str, check: bool) -> tuple[float, torch.Tensor]:
        """(the loss on the whole batch, the tensor to differentiate on this process)."""
        share = 1.0
        if self.parallel is not None:
            batch, share = self.parallel.local_rows(batch, what)
        wanted = self.teacher_outputs(batch, what)
        got = self.student_outputs(batch, what)
        if check:
            check_same_structure(wanted, got, what)
        targets = self.targets_of(got)
        self.loss_outputs = [name for name, _ in targets]
        value = distillation_loss(targets, self.targets_of(wanted), self.loss, self.temperature)
        if self.parallel is None:
            return float(value.detach()), value
        # Weighted so FSDP's average of the processes' gradients is the whole batch's gradient.
        whole = self.parallel.sum(float(value.detach()) * share)
        return whole, value * (share * self.parallel.world_size)

    def holdout_figures(
        self, batch: ModelInputs, reference: Any, check: bool = False
    ) -> tuple[ModelComparison, float]:
        """Every process runs the whole held-out batch: the same figures everywhere."""
        with torch.no_grad():
            out = self.student_outputs(batch, "held-out batch")
            if check:
                check_same_structure(reference, out, "the held-out batch")
            value = distillation_loss(
                self.targets_of(out), self.targets_of(reference), self.loss, self.temperature
            )
        return compare_outputs(reference, out), float(value)
