"""``normswap export MODEL -o OUT.onnx``: ONNX with an onnxruntime check."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from normswap_cli import render
from normswap_cli.options import (
    InputShapeOpt,
    InputsOpt,
    ModelArg,
    OpsetOpt,
    OverwriteOpt,
    ReportOpt,
    TrustPickleOpt,
    WeightsOpt,
    flag,
)
from normswap_cli.shared import check_inputs_fit, check_paths, existing, handles_errors, load, write_json


@handles_errors
def export(
    model: ModelArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="The .onnx file to write.")],
    opset: OpsetOpt = None,
    dynamic_batch: Annotated[
        bool, flag("--dynamic-batch", help="Make dim 0 of every input a dynamic batch dim.")
    ] = False,
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
    from normswap.api import save
    from normswap.errors import BadInputError
    from normswap.export.onnx import check_target
    from normswap.load import check_writable, require_inputs

    check_paths(
        {"MODEL": model, "--weights": weights, "--inputs": inputs},
        {"-o": output, "--report": report},
        overwrite,
    )
    if output.suffix.lower() != ".onnx":
        raise BadInputError(f"-o {output}: an ONNX export is written to a .onnx file")
    check_target(target)  # before the model is loaded
    loaded = load(model, weights, trust_pickle)
    check_writable(loaded.model, output, None)  # the ONNX packages, before the model is run
    args, kwargs = require_inputs(loaded, inputs_file=inputs, input_shapes=input_shape)
    check_inputs_fit(loaded.model, args, kwargs)
    quiet = report is not None
    with (
        render.stdout_kept(),
        render.status(f"exporting {output} to ONNX and checking it in onnxruntime", quiet),
    ):
        saved = save(
            loaded.model,
            output,
            args,
            kwargs,
            opset=opset,
            dynamic_batch=dynamic_batch,
            refuse_path=existing(model),
            target=target,
            overwrite=overwrite,
        )
    render.print_saved(saved)
    if report is not None:
        write_json(report, {"model": model, "output": str(output), "written": True, **saved.to_dict()})
