"""``normswap recalibrate MODEL --data DATA -o OUT``: re-estimate BatchNorm statistics."""

from __future__ import annotations

from typing import Annotated

import typer
from normswap_cli import render
from normswap_cli.options import (
    BatchSizeOpt,
    DataOpt,
    InputShapeOpt,
    InputsOpt,
    ModelArg,
    NormalizeOpt,
    OutputOpt,
    OverwriteOpt,
    ReportOpt,
    TrustPickleOpt,
    WeightsOpt,
)
from normswap_cli.render_training import print_recalibration
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
) -> None:
    """Re-estimate MODEL's BatchNorm statistics as averages over the batches of DATA; write it to -o."""
    from normswap.calibrate import recalibrate_batchnorm
    from normswap.errors import CheckFailedError
    from normswap.load import resolve_inputs

    check_paths(
        {"MODEL": model, "--data": data, "--holdout": holdout, "--weights": weights, "--inputs": inputs},
        {"-o": output, "--report": report},
        overwrite,
    )
    check_output_format(output)
    loaded = load(model, weights, trust_pickle)
    resolved = resolve_inputs(loaded, inputs_file=inputs, input_shapes=input_shape)
    args, kwargs = resolved if resolved is not None else (None, None)
    if resolved is not None:
        check_inputs_fit(loaded.model, args, kwargs)
    check_output_before_work(loaded.model, output, args, kwargs, quiet=report is not None)
    calibration, held_out = data_and_holdout(
        data, holdout, args, kwargs, batch_size, normalize, model=loaded.model
    )
    with render.progress(disable=report is not None) as progress:
        task = progress.add_task("calibrating", total=None)
        recalibrated, result = recalibrate_batchnorm(
            loaded.model,
            calibration,
            holdout=held_out,
            max_batches=batches,
            inplace=True,
            on_batch=lambda done, total: progress.update(task, completed=done, total=total),
        )
    notes = calibration.notes + result.notes
    render.out.print(calibration.description, soft_wrap=True)
    print_recalibration(result, notes)

    written = False
    if result.ok:
        save_trained(recalibrated, output, args, kwargs, calibration, resolved is not None, model, overwrite)
        written = True
    if report is not None:
        write_json(
            report,
            {
                "model": model,
                "data": data,
                "data_description": calibration.description,
                "output": str(output),
                "written": written,
                **result.to_dict(),
                "notes": notes,
            },
        )
    if not result.ok:
        bad = ", ".join(result.non_finite_layers) or "the held-out outputs"
        raise CheckFailedError(f"recalibration produced non-finite values in {bad}; nothing written")
