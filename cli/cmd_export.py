"""``normswap export MODEL -o OUT.onnx``: ONNX with an onnxruntime check."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from normswap_cli import render
from normswap_cli.options import (
    DtypeOpt,
    InputShapeOpt,
    InputsOpt,
    ModelArg,
    OpsetOpt,
    OverwriteOpt,
    ReportOpt,
    StaticShapesOpt,
    TrustPickleOpt,
    WeightsOpt,
)
from normswap_cli.shared import handles_errors


@handles_errors
def export(
    model: ModelArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="The .onnx file to write.")],
    opset: OpsetOpt = None,
    static_shapes: StaticShapesOpt = False,
    dtype: DtypeOpt = None,
    target: Annotated[
        str,
        typer.Option(
            "--target",
            help="standard: ONNX's own ops; onnxruntime: RMSNorm, LayerNorm and residual add + norm as "
            "ONNX Runtime's fused ops (SimplifiedLayerNormalization, Skip[Simplified]LayerNormalization).",
        ),
    ] = "standard",
    weights: WeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Export MODEL to ONNX and check the file in onnxruntime against PyTorch before writing it."""
    from normswap.api import check_run_paths, export_onnx, write_report

    check_run_paths(
        {"MODEL": model, "--weights": weights, "--inputs": inputs},
        {"-o": output, "--report": report},
        overwrite,
    )
    with render.stdout_kept(), render.activity(quiet=report is not None) as shown:
        saved = export_onnx(
            model,
            output,
            opset=opset,
            static_shapes=static_shapes,
            dtype=dtype,
            target=target,
            weights=weights,
            trust_pickle=trust_pickle,
            inputs=inputs,
            input_shapes=input_shape,
            overwrite=overwrite,
            on_step=shown.step,
        )
    render.print_saved(saved)
    if report is not None:
        write_report(report, {"model": model, "output": str(output), "written": True, **saved.to_dict()})
