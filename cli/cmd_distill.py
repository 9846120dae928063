"""``normswap distill ORIGINAL CONVERTED --data DATA -o OUT``: fine-tune CONVERTED to match ORIGINAL.

Under torchrun (``torchrun --nproc-per-node N --no-python normswap distill ...``) every process runs this
command: each loads both models, reads the data and takes its rows of each batch; process 0 alone prints,
writes the report and writes the result (the library's :func:`normswap.api.distill` decides which).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from normswap_cli import render
from normswap_cli.options import (
    BatchSizeOpt,
    ConvertedWeightsOpt,
    DataOpt,
    DtypeOpt,
    InputShapeOpt,
    InputsOpt,
    NormalizeOpt,
    OpsetOpt,
    OutputOpt,
    OverwriteOpt,
    ReportOpt,
    StaticShapesOpt,
    TrustPickleOpt,
    WeightsOpt,
    flag,
)
from normswap_cli.render_training import print_distillation, print_training
from normswap_cli.shared import handles_errors


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
    mixed_precision: Annotated[
        bool,
        flag(
            "--mixed-precision",
            help="Under torchrun: the student computes in bfloat16 and reduces gradients in float32 (FSDP2's "
            "MixedPrecisionPolicy); its weights and optimizer state stay float32.",
        ),
    ] = False,
    activation_checkpointing: Annotated[
        bool,
        flag(
            "--activation-checkpointing",
            help="Each block of the student recomputes its activations in the backward instead of keeping "
            "them (less memory, about one more forward per step).",
        ),
    ] = False,
    overwrite: OverwriteOpt = False,
    opset: OpsetOpt = None,
    static_shapes: StaticShapesOpt = False,
    dtype: DtypeOpt = None,
) -> None:
    """Fine-tune CONVERTED for a few steps so its outputs match ORIGINAL's on DATA; write it to -o (a .dcp
    output is a sharded torch.distributed.checkpoint folder). Runs data-parallel under torchrun."""
    from normswap.api import check_run_paths, write_report
    from normswap.api import distill as distill_model
    from normswap.errors import CheckFailedError

    check_run_paths(
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
    # under torchrun process 0 alone hears progress and prints; the others stay quiet
    with (
        render.stdout_kept(output.suffix.lower() == ".onnx"),
        render.activity(quiet=report is not None) as shown,
    ):
        run = distill_model(
            original,
            converted,
            data,
            output,
            steps=steps,
            lr=lr,
            loss=loss,
            temperature=temperature,
            train=train,
            holdout=holdout,
            batch_size=batch_size,
            normalize=normalize,
            weights=weights,
            converted_weights=converted_weights,
            trust_pickle=trust_pickle,
            inputs=inputs,
            input_shapes=input_shape,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            resume=resume,
            shard_teacher=shard_teacher,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            overwrite=overwrite,
            opset=opset,
            static_shapes=static_shapes,
            dtype=dtype,
            on_step=shown.step,
            on_progress=shown.count,
        )
    if run.main:
        print_training(run, print_distillation)
        if report is not None:
            write_report(report, run.to_dict())
    if not run.ok:
        raise CheckFailedError(run.refusal or "nothing written")
