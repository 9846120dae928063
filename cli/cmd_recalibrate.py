"""``normswap recalibrate MODEL --data DATA -o OUT``: re-estimate BatchNorm statistics."""

from __future__ import annotations

from typing import Annotated

import typer
from normswap_cli import render
from normswap_cli.options import (
    BatchSizeOpt,
    DataOpt,
    DtypeOpt,
    InputShapeOpt,
    InputsOpt,
    ModelArg,
    NormalizeOpt,
    OpsetOpt,
    OutputOpt,
    OverwriteOpt,
    ReportOpt,
    StaticShapesOpt,
    TrustPickleOpt,
    WeightsOpt,
)
from normswap_cli.render_training import print_recalibration, print_training
from normswap_cli.shared import handles_errors


@handles_errors
def recalibrate(
    model: ModelArg,
    data: DataOpt,
    output: OutputOpt,
    batches: Annotated[
        int | None,
        typer.Option(
            "--batches",
            min=1,
            help="Calibrate on the first N batches (the next one is held out unless --holdout is given).",
        ),
    ] = None,
    batch_size: BatchSizeOpt = None,
    normalize: NormalizeOpt = None,
    holdout: Annotated[
        str | None,
        typer.Option(
            "--holdout",
            help="Compare outputs before/after on the first batch of this data (same forms as --data) "
            "instead of holding out the last batch of --data.",
        ),
    ] = None,
    weights: WeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    overwrite: OverwriteOpt = False,
    opset: OpsetOpt = None,
    static_shapes: StaticShapesOpt = False,
    dtype: DtypeOpt = None,
) -> None:
    """Re-estimate MODEL's BatchNorm statistics as averages over the batches of DATA; write it to -o."""
    from normswap.api import check_run_paths, write_report
    from normswap.api import recalibrate as recalibrate_model
    from normswap.errors import CheckFailedError

    check_run_paths(
        {"MODEL": model, "--data": data, "--holdout": holdout, "--weights": weights, "--inputs": inputs},
        {"-o": output, "--report": report},
        overwrite,
    )
    with (
        render.stdout_kept(output.suffix.lower() == ".onnx"),
        render.activity(quiet=report is not None) as shown,
    ):
        run = recalibrate_model(
            model,
            data,
            output,
            batches=batches,
            batch_size=batch_size,
            normalize=normalize,
            holdout=holdout,
            weights=weights,
            trust_pickle=trust_pickle,
            inputs=inputs,
            input_shapes=input_shape,
            overwrite=overwrite,
            opset=opset,
            static_shapes=static_shapes,
            dtype=dtype,
            on_step=shown.step,
            on_progress=shown.count,
        )
    print_training(run, print_recalibration)
    if report is not None:
        write_report(report, run.to_dict())
    if not run.ok:
        raise CheckFailedError(run.refusal or "nothing written")
