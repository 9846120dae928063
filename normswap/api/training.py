"""The data-driven commands as library calls: :func:`recalibrate` (``normswap recalibrate``: BatchNorm
statistics re-estimated on data) and :func:`distill` (``normswap distill``: a converted model fine-tuned
to match the original, data-parallel under torchrun). Each loads, reads the data, trains, writes the
model when the result is finite, and returns one :class:`TrainingRun`.

::

    run = normswap.api.recalibrate("model.pt2", "images/", Path("out.pt2"))
    if not run.ok:
        print(run.refusal)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normswap.api.sources import (
    check_inputs_fit,
    check_output_before_work,
    check_run_paths,
    load_for_inference,
    read_data,
    save_trained,
)
from normswap.errors import BadInputError
from normswap.load.inputs import resolve_inputs
from normswap.load.output_options import check_output_options
from normswap.load.save import check_output_format

if TYPE_CHECKING:
    from torch import nn

    from normswap.api.save import SavedOutput
    from normswap.calibrate.batchnorm import RecalibrationReport
    from normswap.calibrate.distill import DistillReport
    from normswap.calibrate.parallel import DataParallel
    from normswap.load.model_file import LoadedModel

Step = Callable[[str], None]
# (done, total or None when unknown, what is being done: "calibrating", "distilling (loss 0.12)")
Progress = Callable[[int, "int | None", str], None]

# -o with this suffix is a sharded torch.distributed.checkpoint folder (distill only)
SHARDED_SUFFIX = ".dcp"


@dataclass
class TrainingRun:
    """One recalibration or distillation: its ``report`` (what changed, the held-out figures, whether all
    is finite), the data as read (``data_description``), ``notes`` for the user, and what was written
    (``wrote``: the format, None when nothing was). ``sources`` are the specs the run read, in the order
    the JSON report names them; ``main`` is False in a torchrun process other than process 0, which
    prints and writes nothing. :meth:`to_dict` is the command's ``--report``."""

    report: RecalibrationReport | DistillReport
    sources: dict[str, str]
    output: Path
    data_description: str
    notes: list[str] = field(default_factory=list)
    wrote: str | None = None
    main: bool = True
    # the sentence that refuses the result (None when ok); it ends "nothing written"
    refusal: str | None = None
    # what normswap.save wrote (a single file): its onnxruntime check, the shapes it takes, its notes
    saved: SavedOutput | None = None

    @property
    def ok(self) -> bool:
        return self.report.ok

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.sources,
            "data_description": self.data_description,
            "output": str(self.output),
            "written": self.wrote is not None,
            **self.report.to_dict(),
            **(self.saved.to_dict() if self.saved is not None else {}),
            "notes": self.notes,
        }


def _inputs_checked(
    loaded: LoadedModel, inputs: Any, input_shapes: Any, outputs_judged: bool = True
) -> tuple[Any, Any, bool]:
    """The example inputs (``None, None`` when unknown) and whether they are known; known ones are run
    once on the model, so minutes of training do not end in a refusal."""
    resolved = resolve_inputs(loaded, inputs_file=inputs, input_shapes=input_shapes)
    args, kwargs = resolved if resolved is not None else (None, None)
    if resolved is not None:
        check_inputs_fit(loaded.model, args, kwargs, outputs_judged=outputs_judged)
    return args, kwargs, resolved is not None


def recalibrate(
    model: str,
    data: str,
    output: str | Path,
    *,
    batches: int | None = None,
    batch_size: int | None = None,
    normalize: str | None = None,
    holdout: str | None = None,
    weights: str | Path | None = None,
    trust_pickle: bool = False,
    inputs: str | Path | None = None,
    input_shapes: list[str] | None = None,
    overwrite: bool = False,
    opset: int | None = None,
    static_shapes: bool = False,
    dtype: str | None = None,
    on_step: Step | None = None,
    on_progress: Progress | None = None,
) -> TrainingRun:
    """Re-estimate ``model``'s BatchNorm statistics as averages over the first ``batches`` batches of
    ``data``, compare outputs before/after on ``holdout``'s first batch (else the next batch of
    ``data``), and write the model to ``output`` when every value is finite (``ok``). The output's
    format is checked before the work; ``normalize`` names a dataset's image mean/std ("imagenet");
    ``opset``, ``static_shapes`` and ``dtype`` say how the output is written, as for convert."""
    from normswap.calibrate import recalibrate_batchnorm

    output = Path(output)  # a str as ConvertConfig(output=...) takes one
    check_output_format(output)
    # options the output does not use, before the work
    check_output_options(output, opset=opset, static_shapes=static_shapes)
    # the output rule every command checks first (an existing output, one that is an input), as the CLI
    reads = {"MODEL": model, "--data": data, "--holdout": holdout, "--weights": weights, "--inputs": inputs}
    check_run_paths(reads, {"-o": output}, overwrite)
    # the statistics are re-estimated without being read: broken ones are what this command repairs
    loaded = load_for_inference(model, weights, trust_pickle, statistics_replaced=True)
    args, kwargs, known = _inputs_checked(loaded, inputs, input_shapes, outputs_judged=False)
    check_output_before_work(loaded.model, output, args, kwargs, on_step, dtype)
    calibration, held_out = read_data(data, holdout, args, kwargs, batch_size, normalize, model=loaded.model)
    if on_progress is not None:
        on_progress(0, None, "calibrating")
    recalibrated, report = recalibrate_batchnorm(
        loaded.model,
        calibration,
        holdout=held_out,
        max_batches=batches,
        inplace=True,
        on_batch=None if on_progress is None else lambda done, total: on_progress(done, total, "calibrating"),
    )
    run = TrainingRun(
        report,
        {"model": model, "data": data},
        output,
        calibration.description,
        calibration.notes + report.notes,
    )
    if report.ok:
        saved = save_trained(
            recalibrated,
            output,
            args,
            kwargs,
            calibration,
            known,
            model,
            overwrite,
            opset=opset,
            static_shapes=static_shapes,
            dtype=dtype,
        )
        run.wrote, run.saved = saved.format, saved
    else:
        bad = ", ".join(report.non_finite_layers) or "the held-out outputs"
        run.refusal = f"recalibration produced non-finite values in {bad}; nothing written"
    return run


def distill(
    original: str,
    converted: str,
    data: str,
    output: str | Path,
    *,
    steps: int,
    lr: float = 1e-4,
    loss: str = "mse",
    temperature: float | None = None,
    train: str = "all",
    holdout: str | None = None,
    batch_size: int | None = None,
    normalize: str | None = None,
    weights: str | Path | None = None,
    converted_weights: str | Path | None = None,
    trust_pickle: bool = False,
    inputs: str | Path | None = None,
    input_shapes: list[str] | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    shard_teacher: bool | None = None,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
    overwrite: bool = False,
    opset: int | None = None,
    static_shapes: bool = False,
    dtype: str | None = None,
    on_step: Step | None = None,
    on_progress: Progress | None = None,
) -> TrainingRun:
    """Fine-tune ``converted`` (the student) for ``steps`` AdamW steps so its outputs match ``original``'s
    (the teacher) on ``data`` (``loss`` "mse" or "kl" at ``temperature``; ``train`` "all" parameters or
    only the "norms'"), and write it to ``output`` when every value is finite (a .dcp output is a sharded
    torch.distributed.checkpoint folder). ``checkpoint_dir`` keeps checkpoints every ``checkpoint_every``
    steps; ``resume`` continues from its newest. ``opset``, ``static_shapes`` and ``dtype`` say how a
    single-file output is written, as for convert.

    Under torchrun every process calls this: each loads both models, reads the data and takes its rows of
    each batch; a student that is a model directory, a .pt2 or a factory with ``converted_weights``, and
    such a teacher when it is large or ``shard_teacher``, are read straight into FSDP2 shards (no process
    holds them whole); process 0 alone reports progress and writes (``main`` in the result). Options are checked
    before any model is loaded. On glibc it fixes malloc's mmap threshold for the process at 1 MiB, so
    that the memory of freed tensors is given back (:mod:`normswap.util.freed_memory`).
    """
    from normswap.api.save import SavedOutput
    from normswap.calibrate.distill import check_mixed_precision, check_options
    from normswap.calibrate.distill import distill as distill_model
    from normswap.calibrate.distill_checkpoint import CheckpointPlan, save_sharded
    from normswap.calibrate.parallel import full_state_dict
    from normswap.load.checkpoint_write import is_directory_output

    output = Path(output)  # a str as ConvertConfig(output=...) takes one
    sharded_output = output.suffix == SHARDED_SUFFIX
    if not sharded_output:
        check_output_format(output)
    # options the output does not use, before the work
    check_output_options(output, opset=opset, static_shapes=static_shapes)
    if temperature is not None and loss != "kl":
        raise BadInputError("--temperature applies to --loss kl")
    if (checkpoint_every is not None or resume) and checkpoint_dir is None:
        raise BadInputError("--checkpoint-every and --resume need --checkpoint-dir")
    check_options(steps=steps, lr=lr, loss=loss, temperature=temperature or 1.0, train=train)
    # the output rule every command checks first (an existing output, one that is an input), as the CLI
    reads: dict[str, Any] = {
        "ORIGINAL": original,
        "CONVERTED": converted,
        "--data": data,
        "--holdout": holdout,
    }
    reads |= {"--weights": weights, "--converted-weights": converted_weights, "--inputs": inputs}
    check_run_paths(reads, {"-o": output, "--checkpoint-dir": checkpoint_dir}, overwrite)
    plan = CheckpointPlan(checkpoint_dir, checkpoint_every, resume) if checkpoint_dir is not None else None
    if plan is not None:
        plan.check()  # before minutes of loading: another run's checkpoints, no rhythm
    from normswap.util.freed_memory import give_back_freed_tensors

    give_back_freed_tensors()  # a step's freed tensors leave the process (normswap.util.freed_memory)
    with _processes() as parallel:
        if parallel is None and shard_teacher is not None:
            raise BadInputError("--shard-teacher applies under torchrun (several processes)")
        check_mixed_precision(mixed_precision, parallel)  # before the models are loaded
        main = parallel is None or parallel.is_main
        say, count = (on_step, on_progress) if main else (None, None)
        teacher, teacher_placement = _load_teacher(original, weights, trust_pickle, parallel, shard_teacher)
        student, student_fill, written_as = _load_student(
            converted, converted_weights, trust_pickle, parallel
        )
        if student_fill is not None and dtype is not None and is_directory_output(output):
            raise BadInputError(
                f"--dtype: {output} is written shard by shard in {converted}'s dtypes; convert the written "
                "directory with --dtype, or write a single file"
            )
        resolved = resolve_inputs(teacher, inputs_file=inputs, input_shapes=input_shapes) or resolve_inputs(
            student
        )
        args, kwargs = resolved if resolved is not None else (None, None)
        if resolved is not None:
            # before training: minutes of training must not end in a refusal (a student on the meta
            # device cannot run eagerly: its first step is its check, and an export below, if any)
            check_inputs_fit(teacher.model, args, kwargs, what="ORIGINAL")
            if student_fill is None:
                check_inputs_fit(student.model, args, kwargs, what="CONVERTED")
        if main and not sharded_output:
            check_output_before_work(written_as, output, args, kwargs, say, dtype)
        batches, held_out = read_data(data, holdout, args, kwargs, batch_size, normalize, model=teacher.model)
        if count is not None:
            count(0, steps, "distilling")
        distilled, report = distill_model(
            teacher.model,
            student.model,
            batches,
            steps=steps,
            lr=lr,
            loss=loss,
            temperature=temperature if temperature is not None else 1.0,
            train=train,
            holdout=held_out,
            inplace=True,
            on_step=None
            if count is None
            else lambda done, total, value: count(done, total, f"distilling (loss {value:.4g})"),
            example_args=args,
            example_kwargs=kwargs,
            parallel=parallel,
            shard_teacher=shard_teacher,
            checkpoints=plan,
            teacher_placement=teacher_placement,
            student_fill=student_fill,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
        )
        sources = {"original": original, "converted": converted, "data": data}
        made = teacher.notes if inputs is None and not input_shapes else []  # the teacher's inputs ran
        run = TrainingRun(
            report, sources, output, batches.description, made + batches.notes + report.notes, main=main
        )
        if not report.ok:
            run.refusal = (
                "distillation produced non-finite values (loss or held-out outputs); nothing written"
            )
        elif sharded_output:
            save_sharded(output, distilled, parallel, overwrite)
            run.wrote = "sharded, torch.distributed.checkpoint"
        elif student_fill is not None and is_directory_output(output):
            from normswap.calibrate.parallel_save import save_directory_sharded

            assert parallel is not None and student.checkpoint is not None
            written = save_directory_sharded(output, distilled, student.checkpoint, parallel, overwrite)
            run.saved = SavedOutput(output, "directory", directory=written) if main else None
            run.wrote = "directory, written shard by shard"
        else:
            if parallel is not None:
                # Gathered to process 0, which writes it into a whole copy of CONVERTED as loaded.
                state = full_state_dict(distilled, parallel)
                del teacher, distilled
                if main:
                    whole = load_for_inference(converted, converted_weights, trust_pickle).model
                    whole.load_state_dict(state)
                    distilled = whole
            if main:
                saved = save_trained(
                    distilled,
                    output,
                    args,
                    kwargs,
                    batches,
                    resolved is not None,
                    converted,
                    overwrite,
                    opset=opset,
                    static_shapes=static_shapes,
                    dtype=dtype,
                )
                run.wrote, run.saved = saved.format, saved
        return run


def _load_student(
    converted: str, weights: str | Path | None, trust_pickle: bool, parallel: Any
) -> tuple[LoadedModel, Callable[[nn.Module, bool], str] | None, nn.Module]:
    """CONVERTED, under torchrun for a model directory, a .pt2 or a factory with --converted-weights the
    way to fill it later (else None), and the module a single-file output is checked as. A student filled
    later is built on the meta device (no weight read) and the distillation shards it and reads each
    process's rows from the files, so no process holds the student whole; elsewhere it is loaded whole
    (one process, a .pt, a factory without weights: :func:`~normswap.api.shard_reading.unfilled_model`)."""
    from normswap.api.shard_reading import unfilled_model

    unfilled = None if parallel is None else unfilled_model(converted, weights, trust_pickle, written=True)
    if unfilled is None:
        loaded = load_for_inference(converted, weights, trust_pickle)
        return loaded, None, loaded.model
    fill = unfilled.fill
    return (
        unfilled.loaded,
        lambda model, mixed_precision: fill(model, parallel, True, mixed_precision),
        unfilled.written_as or unfilled.loaded.model,
    )


@contextlib.contextmanager
def _processes() -> Iterator[DataParallel | None]:
    """This process's place in a torchrun job (None when run alone); the process group is left on the
    way out, also on error."""
    from normswap.calibrate.parallel import DataParallel, launched_by_torchrun

    parallel = DataParallel.from_environment() if launched_by_torchrun() else None
    try:
        yield parallel
    except BaseException:
        if parallel is not None:  # no barrier: another process may never reach it
            parallel.close()
        raise
    if parallel is not None:
        # every process done (process 0 writes the result last) before any tears its process group down,
        # so none leaves while another is still in its last collective (the command then exits without
        # the interpreter's finalization: normswap_cli.app.main says why)
        parallel.barrier()
        parallel.close()


def _load_teacher(
    original: str, weights: str | Path | None, trust_pickle: bool, parallel: Any, shard_teacher: bool | None
) -> tuple[LoadedModel, str | None]:
    """ORIGINAL, and how it was placed when that was done while loading: under torchrun a model directory,
    a .pt2 or a factory with --weights to be sharded (asked, or larger than TEACHER_SHARD_BYTES) is read
    straight into its shards, so no process holds it whole."""
    from normswap.api.shard_reading import unfilled_model
    from normswap.calibrate.parallel import TEACHER_SHARD_BYTES
    from normswap.load.config_inputs import example_inputs as config_inputs
    from normswap.load.config_inputs import made_inputs_notes

    if weights is not None and shard_teacher is None:  # decided before the factory runs, not after
        shard_teacher = Path(weights).is_file() and Path(weights).stat().st_size > TEACHER_SHARD_BYTES
    wanted = parallel is not None and shard_teacher is not False
    unfilled = unfilled_model(original, weights, trust_pickle) if wanted else None
    if shard_teacher is None and unfilled is not None:
        shard_teacher = unfilled.stored_bytes > TEACHER_SHARD_BYTES
    if unfilled is None or not shard_teacher:
        # sharded after a whole load when asked (a .pt, a factory without weights, a directory
        # transformers renames)
        return load_for_inference(original, weights, trust_pickle), None
    loaded = unfilled.loaded
    placement = unfilled.fill(loaded.model, parallel, False, False)
    if loaded.checkpoint is None:
        return loaded, placement
    args, kwargs = config_inputs(loaded.model, loaded.checkpoint.config, device=parallel.device)
    made = dataclasses.replace(
        loaded, example_args=args, example_kwargs=kwargs, notes=made_inputs_notes(kwargs)
    )
    return made, placement
