"""``normswap validate ORIGINAL CONVERTED``: compare two models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from normswap_cli import render, render_validation
from normswap_cli.options import (
    DATA_SHORT_HELP,
    BatchSizeOpt,
    ConvertedWeightsOpt,
    InputShapeOpt,
    InputsOpt,
    OverwriteOpt,
    ReportOpt,
    TrustPickleOpt,
    WeightsOpt,
    flag,
)
from normswap_cli.shared import handles_errors


@handles_errors
def validate(
    original: Annotated[
        str, typer.Argument(help="The reference model (same forms as MODEL).", show_default=False)
    ],
    converted: Annotated[str, typer.Argument(help="The model to check against it.", show_default=False)],
    exact: Annotated[
        bool, flag("--exact", help="Fail (exit 1) unless every output is within the exact tolerance.")
    ] = False,
    min_sqnr: Annotated[
        float | None,
        typer.Option(
            "--min-sqnr",
            help="Fail (exit 1) if an output's SQNR is below this many dB; also the "
            "per-layer threshold for the first divergent layer [40].",
        ),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG of the per-layer SQNR, norm sites marked.")
    ] = None,
    data: Annotated[
        str | None, typer.Option("--data", help="Compare on the batches of DATA. " + DATA_SHORT_HELP)
    ] = None,
    batches: Annotated[
        int | None, typer.Option("--batches", min=1, help="Use the first N batches of --data.")
    ] = None,
    batch_size: BatchSizeOpt = None,
    weights: WeightsOpt = None,
    converted_weights: ConvertedWeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    blockwise: Annotated[
        bool,
        flag(
            "--blockwise",
            help="Compare block by block: every block of CONVERTED runs on ORIGINAL's activation, and the "
            "first block outside --exact or --min-sqnr is named. Two model directories are compared "
            "holding neither model, on inputs from their config (no --data, --inputs, --input-shape); "
            "no --plot.",
        ),
    ] = False,
    centered: Annotated[
        bool,
        flag(
            "--centered",
            help="With --blockwise: CONVERTED carries the residual stream centered (a --to rmsnorm --exact "
            "result): compare through the centering.",
        ),
    ] = False,
    overwrite: OverwriteOpt = False,
) -> None:
    """Compare CONVERTED with ORIGINAL on the same inputs: per output, per layer, per norm site."""
    from normswap.api import check_run_paths, write_report
    from normswap.api import validate as compare
    from normswap.errors import CheckFailedError

    check_run_paths(
        {
            "ORIGINAL": original,
            "CONVERTED": converted,
            "--weights": weights,
            "--converted-weights": converted_weights,
            "--inputs": inputs,
            "--data": data,
        },
        {"--plot": plot, "--report": report},
        overwrite,
    )
    # a progress bar from four batches on; a block-by-block comparison names the block it is on
    with render.activity(quiet=report is not None, least=4) as shown:
        result = compare(
            original,
            converted,
            exact=exact,
            min_sqnr=min_sqnr,
            data=data,
            batches=batches,
            batch_size=batch_size,
            weights=weights,
            converted_weights=converted_weights,
            trust_pickle=trust_pickle,
            inputs=inputs,
            input_shapes=input_shape,
            blockwise=blockwise,
            centered=centered,
            plot=plot,
            overwrite=overwrite,
            on_step=shown.step,
            on_progress=shown.count,
        )
    if result.layerwise is not None:
        render_validation.print_validation(result.layerwise)
        for note in result.notes:
            render.out.print(f"note: {note}", soft_wrap=True)
    else:
        _print_blockwise(result)
    _print_verdict(result)
    if result.plot is not None:
        render.final(f"wrote {result.plot}")
    if report is not None:
        write_report(report, result.to_dict())
    if not result.ok:
        raise CheckFailedError(result.refusal or "the comparison failed")


def _print_blockwise(result: Any) -> None:
    """One line per input shape of a block-by-block :class:`normswap.api.Validation`, then its verdict
    under the rule asked (as the whole-model comparison prints it)."""
    for shape, block in zip(result.blockwise_shapes, result.blockwise, strict=True):
        within = (
            "all within the exact tolerance"
            if block.ok
            else f"first outside the exact tolerance: {block.first_divergent}"
        )
        output = "" if block.output is None else f"; output SQNR {render.fmt_float(block.output.sqnr_db)} dB"
        render.out.print(
            f"inputs {shape}, {block.blocks_path}: {len(block.stages)} stages, worst "
            f"{render.fmt_float(block.worst_rel)} x max|ref| ({within}), lowest SQNR "
            f"{render.fmt_float(min(c.sqnr_db for _, c in block.stages))} dB{output}",
            soft_wrap=True,
        )
    shown = result.to_dict()
    if shown["output_sqnr_db"] is not None:  # run end to end: the figure --min-sqnr is judged on
        on = shown["output_sqnr_inputs"]
        inputs = f"inputs {on[0]}" if len(on) == 1 else f"the {len(on)} inputs pooled"
        render.out.print(
            f"output SQNR judged on {inputs} (as the whole-model comparison): "
            f"{render.fmt_float(shown['output_sqnr_db'])} dB",
            soft_wrap=True,
        )
    for note in result.notes:
        render.out.print(f"note: {note}", soft_wrap=True)


def _print_verdict(result: Any) -> None:
    """The comparison's verdict under the rule asked, the same line on both routes (the whole model's
    said FAIL against its display threshold, 40 dB, when nothing was asked and the command exited 0)."""
    rule = "figures only: give --exact or --min-sqnr for a verdict"
    if result.exact or result.min_sqnr is not None:
        rule = "exact tolerance" if result.exact else f"min SQNR {result.min_sqnr:g} dB"
    how = "block by block, " if result.layerwise is None else ""
    shown = {"passed": "[green]PASS[/]", "failed": "[bold red]FAIL[/]", "not_judged": "not judged"}
    render.out.print(f"verdict ({how}{rule}): {shown[result.verdict.value]}", soft_wrap=True)
