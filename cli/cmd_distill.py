"""``normswap distill ORIGINAL CONVERTED --data DATA -o OUT``: fine-tune CONVERTED to match ORIGINAL.

Under torchrun (``torchrun --nproc-per-node N --no-python normswap distill ...``) every process runs this
command: each loads both models, reads the data and takes its rows of each batch; process 0 alone prints,
writes the report and writes the result (see :mod:`normswap.calibrate.parallel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from normswap_cli import render
from normswap_cli.options import (
    BatchSizeOpt,
    ConvertedWeightsOpt,
    DataOpt,
    InputShapeOpt,
    InputsOpt,
    NormalizeOpt,
    OutputOpt,
    OverwriteOpt,
    ReportOpt,
    TrustPickleOpt,
    WeightsOpt,
    flag,
)
from normswap_cli.render_training import print_distillation
from normswap_cli.shared import (
    check_inputs_fit,
    check_output_before_work,
    check_output_format,
    check_paths,
    data_and_holdout,
    handles_errors,
    load,
    save_trained,
    write_json,
)


@handles_errors
def distill(
    original: Annotated[
        str,
        typer.Argument(help="The model to match, the teacher (same forms as MODEL).", show_default=False),
    ],
    converted: Annotated[
        str,
        typer.Argument(
            help="The model to fine-tune, the student: e.g. convert's output (.pt2, or .pt with "
            "--trust-pickle).",
            show_default=False,
        ),
    ],
    data: DataOpt,
    steps: Annotated[
        int,
        typer.Option("--steps", help="Optimizer steps; the training batches are cycled.", show_default=False),
    ],
    output: OutputOpt,
    lr: Annotated[
        float, typer.Option("--lr", help="AdamW learning rate (constant, no weight decay).")
    ] = 1e-4,
    loss: Annotated[
        str,
        typer.Option(
            "--loss",
            help="mse: mean squared error on the outputs; kl: KL divergence of the softmax over the last "
            "dim (classifier or LM logits). An HF output's logits are used alone.",
        ),
    ] = "mse",
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Softmax temperature of --loss kl [1].")
    ] = None,
    train: Annotated[
        str,
        typer.Option(
            "--train", help="all: every floating-point parameter; norms: only the norms' parameters."
        ),
    ] = "all",
    holdout: Annotated[
        str | None,
        typer.Option(
            "--holdout",
            help="Measure before/after on the first batch of this data (same forms as --data) instead of "
            "holding out the last batch of --data.",
        ),
    ] = None,
    batch_size: BatchSizeOpt = None,
    normalize: NormalizeOpt = None,
    weights: WeightsOpt = None,
    converted_weights: ConvertedWeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option("--checkpoint-dir", help="Folder for checkpoints (student and optimizer state, DCP)."),
    ] = None,
    checkpoint_every: Annotated[
        int | None,
        typer.Option(
            "--checkpoint-every", min=1, help="Save a checkpoint every K steps (needs --checkpoint-dir)."
        ),
    ] = None,
    resume: Annotated[
        bool,
        flag(
            "--resume",
            help="Continue from the newest checkpoint in --checkpoint-dir (same options and data).",
        ),
    ] = False,
    shard_teacher: Annotated[
        bool | None,
        typer.Option(
            "--shard-teacher/--no-shard-teacher",
            help="Under torchrun: shard the teacher with FSDP2 too [when its parameters exceed 1 GiB].",
            show_default=False,
        ),
    ] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Fine-tune CONVERTED for a few steps so its outputs match ORIGINAL's on DATA; write it to -o (a .dcp
    output is a sharded torch.distributed.checkpoint folder). Runs data-parallel under torchrun."""
    from normswap.calibrate.distill import check_options
    from normswap.calibrate.distill import distill as distill_model
    from normswap.calibrate.distill_checkpoint import CheckpointPlan, save_sharded
    from normswap.calibrate.parallel import full_state_dict
    from normswap.errors import BadInputError, CheckFailedError
    from normswap.load import resolve_inputs

    check_paths(
        {
            "ORIGINAL": original,
            "CONVERTED": converted,
            "--data": data,
            "--holdout": holdout,
            "--weights": weights,
            "--converted-weights": converted_weights,
            "--inputs": inputs,
        },
        {"-o": output, "--report": report, "--checkpoint-dir": checkpoint_dir},
        overwrite,
    )
    sharded_output = output.suffix == SHARDED_SUFFIX
    if not sharded_output:
        check_output_format(output)
    if temperature is not None and loss != "kl":
        raise BadInputError("--temperature applies to --loss kl")
    if (checkpoint_every is not None or resume) and checkpoint_dir is None:
        raise BadInputError("--checkpoint-every and --resume need --checkpoint-dir")
    check_options(steps=steps, lr=lr, loss=loss, temperature=temperature or 1.0, train=train)
    plan = CheckpointPlan(checkpoint_dir, checkpoint_every, resume) if checkpoint_dir is not None else None
    if plan is not None:
        plan.check()  # before minutes of loading: another run's checkpoints, no rhythm
    with _processes() as parallel:
        if parallel is None and shard_teacher is not None:
            raise BadInputError("--shard-teacher applies under torchrun (several processes)")
        quiet = report is not None or (parallel is not None and not parallel.is_main)
        main = parallel is None or parallel.is_main
        teacher, teacher_placement = _load_teacher(original, weights, trust_pickle, parallel, shard_teacher)
        student = load(converted, converted_weights, trust_pickle)
        resolved = resolve_inputs(teacher, inputs_file=inputs, input_shapes=input_shape) or resolve_inputs(
            student
        )
        args, kwargs = resolved if resolved is not None else (None, None)
        if resolved is not None:
            # before training: minutes of training must not end in a refusal
            check_inputs_fit(teacher.model, args, kwargs, what="ORIGINAL")
            check_inputs_fit(student.model, args, kwargs, what="CONVERTED")
        if main and not sharded_output:
            check_output_before_work(student.model, output, args, kwargs, quiet=quiet)
        batches, held_out = data_and_holdout(
            data, holdout, args, kwargs, batch_size, normalize, model=teacher.model
        )
        with render.progress(disable=quiet) as progress:
            task = progress.add_task("distilling", total=steps)
            distilled, result = distill_model(
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
                on_step=lambda done, _total, value: progress.update(
                    task, completed=done, description=f"distilling (loss {value:.4g})"
                ),
                example_args=args,
                example_kwargs=kwargs,
                parallel=parallel,
                shard_teacher=shard_teacher,
                checkpoints=plan,
                teacher_placement=teacher_placement,
            )
        notes = batches.notes + result.notes
        render.out.print(batches.description, soft_wrap=True)
        print_distillation(result, notes)

        written = False
        if result.ok:
            if sharded_output:
                save_sharded(output, distilled, parallel, overwrite)
                render.out.print(f"wrote {output} (sharded, torch.distributed.checkpoint)", soft_wrap=True)
            else:
                if parallel is not None:
                    # Gathered to process 0, which writes it into a whole copy of CONVERTED as loaded.
                    state = full_state_dict(distilled, parallel)
                    del teacher, distilled
                    if main:
                        whole = load(converted, converted_weights, trust_pickle).model
                        whole.load_state_dict(state)
                        distilled = whole
                if main:
                    save_trained(
                        distilled, output, args, kwargs, batches, resolved is not None, converted, overwrite
                    )
            written = True
        if report is not None and main:
            write_json(
                report,
                {
                    "original": original,
                    "converted": converted,
                    "data": data,
                    "data_description": batches.description,
                    "output": str(output),
                    "written": written,
                    **result.to_dict(),
                    "notes": notes,
                },
            )
        if not result.ok:
            raise CheckFailedError(
                "distillation produced non-finite values (loss or held-out outputs); nothing written"
            )


@contextlib.contextmanager
def _processes() -> Iterator[Any]:
    """This process's place in a torchrun job (None when run alone); non-zero ranks print nothing to
    stdout, and the process group is left on the way out, also on error."""
    from normswap.calibrate.parallel import DataParallel, launched_by_torchrun

    parallel = DataParallel.from_environment() if launched_by_torchrun() else None
    if parallel is not None and not parallel.is_main:
        render.out.quiet = True
    try:
        yield parallel
    finally:
        if parallel is not None:
            parallel.close()


SHARDED_SUFFIX = ".dcp"


def _load_teacher(
    original: str, weights: Path | None, trust_pickle: bool, parallel: Any, shard_teacher: bool | None
) -> tuple[Any, str | None]:
    """ORIGINAL, and how it was placed when that was done while loading: under torchrun a model directory
    to be sharded (asked, or larger than TEACHER_SHARD_BYTES) is read straight into its shards, so no
    process holds it whole."""
    import dataclasses

    from normswap.calibrate.parallel import TEACHER_SHARD_BYTES
    from normswap.load.checkpoint_dir import is_checkpoint_directory
    from normswap.load.config_inputs import example_inputs

    if parallel is None or not is_checkpoint_directory(original):
        return load(original, weights, trust_pickle), None
    # built on the meta device (no weight read) to learn its size and, when sharded, to be filled
    structure = load(original, weights, trust_pickle, structure_only=True)
    if shard_teacher is None:
        shard_teacher = structure.checkpoint.total_bytes > TEACHER_SHARD_BYTES
    if not shard_teacher:
        return load(original, weights, trust_pickle), None
    from normswap.calibrate.parallel_load import load_directory_sharded

    placement = load_directory_sharded(structure.model, structure.checkpoint, parallel, trained=False)
    args, kwargs = example_inputs(structure.model, structure.checkpoint.config, device=parallel.device)
    return dataclasses.replace(structure, example_args=args, example_kwargs=kwargs), placement
