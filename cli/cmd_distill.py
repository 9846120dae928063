"""``normswap distill ORIGINAL CONVERTED --data DATA -o OUT``: fine-tune CONVERTED to match ORIGINAL."""

from __future__ import annotations

from typing import Annotated

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
    ReportOpt,
    TrustPickleOpt,
    WeightsOpt,
)
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
) -> None:
    """Fine-tune CONVERTED for a few steps so its outputs match ORIGINAL's on DATA; write it to -o."""
    from normswap.calibrate.distill import check_options
    from normswap.calibrate.distill import distill as distill_model
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
        {"-o": output, "--report": report},
    )
    check_output_format(output)
    if temperature is not None and loss != "kl":
        raise BadInputError("--temperature applies to --loss kl")
    check_options(steps=steps, lr=lr, loss=loss, temperature=temperature or 1.0, train=train)
    teacher = load(original, weights, trust_pickle)
    student = load(converted, converted_weights, trust_pickle)
    resolved = resolve_inputs(teacher, inputs_file=inputs, input_shapes=input_shape) or resolve_inputs(
        student
    )
    args, kwargs = resolved if resolved is not None else (None, None)
    if resolved is not None:
        # before training: minutes of training must not end in a refusal
        check_inputs_fit(teacher.model, args, kwargs, what="ORIGINAL")
        check_inputs_fit(student.model, args, kwargs, what="CONVERTED")
    check_output_before_work(student.model, output, args, kwargs, quiet=report is not None)
    batches, held_out = data_and_holdout(data, holdout, args, kwargs, batch_size, normalize)
    with render.progress(disable=report is not None) as progress:
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
        )
    notes = batches.notes + result.notes
    render.out.print(batches.description, soft_wrap=True)
    render.print_distillation(result, notes)

    written = False
    if result.ok:
        save_trained(distilled, output, args, kwargs, batches, resolved is not None, converted)
        written = True
    if report is not None:
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
