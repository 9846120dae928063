"""The options that mean the same thing in every command: model loading, inputs, output, reports."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

# The help panels options are grouped in, the same in every command (``--help`` lists them by panel).
MODEL_PANEL = "Model and inputs"
OUTPUT_PANEL = "Output and report"
DATA_PANEL = "Data"


def flag(*names: str, help: str, panel: str | None = None) -> Any:
    """An on/off option. typer's rich help prints the type of every option, flags included
    ("--exact <bool>"), unless it has a metavar: an empty one shows a flag as the bare flag it is."""
    return typer.Option(*names, help=help, metavar="", rich_help_panel=panel)


MODEL_HELP = (
    "A .pt2 archive (torch.export), a Hugging Face model directory (config.json + safetensors; no code "
    "from it runs), a factory 'package.module:callable' or 'file.py:callable' returning "
    "the model or (model, example_inputs), or a pickled module (.pt) with --trust-pickle. A factory is "
    "Python code that normswap imports and runs, as you asked; installed packages win over same-named "
    "modules in the working directory. A .pt2 runs nothing of its own."
)
ModelArg = Annotated[str, typer.Argument(help=MODEL_HELP, show_default=False)]
WeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--weights",
        help="Weights for a factory model: safetensors or a state dict.",
        rich_help_panel=MODEL_PANEL,
    ),
]
ConvertedWeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--converted-weights", help="Weights for a factory CONVERTED model.", rich_help_panel=MODEL_PANEL
    ),
]
TrustPickleOpt = Annotated[
    bool,
    flag(
        "--trust-pickle",
        panel=MODEL_PANEL,
        help="Allow unpickling: a pickled module (.pt), and pickled members of a .pt2 that torch's "
        "weights-only loader refuses. Unpickling runs whatever code the file names: only for files you "
        "trust. (Factories, package.module:callable, always run: they are code you chose.)",
    ),
]
InputsOpt = Annotated[
    Path | None,
    typer.Option(
        "--inputs",
        help="Example inputs: a tuple or dict of tensors saved with torch.save.",
        rich_help_panel=MODEL_PANEL,
    ),
]
InputShapeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--input-shape",
        help="Example input shape, e.g. 1,3,224,224 or int64:1,16 for token ids. Repeat for several inputs.",
        rich_help_panel=MODEL_PANEL,
    ),
]
OutputOpt = Annotated[
    Path,
    typer.Option(
        "-o",
        "--output",
        help="Output file: .pt2, .pt or .onnx; a name without a suffix is a Hugging Face model directory "
        "(transformers models), created anew.",
        rich_help_panel=OUTPUT_PANEL,
    ),
]
OpsetOpt = Annotated[
    int | None,
    typer.Option(
        "--opset",
        min=7,
        help="ONNX opset of a .onnx output (RMSNormalization needs 23); default: the exporter's. Refused "
        "for any other output.",
        rich_help_panel=OUTPUT_PANEL,
    ),
]
OverwriteOpt = Annotated[
    bool,
    flag(
        "--overwrite",
        panel=OUTPUT_PANEL,
        help="Replace outputs that exist (-o, --report, --json, --plot), atomically: the old output stays "
        "whole until the new one is complete. Without it an existing output is refused before any work. "
        "A symlink is never written through.",
    ),
]
PortableOpt = Annotated[
    bool,
    flag(
        "--portable",
        help="A .pt2 that plain torch.export.load reads with torch alone: outputs as plain dicts and tuples, "
        "normswap's fused ops as torch's own (without their kernels).",
        panel=OUTPUT_PANEL,
    ),
]
StaticShapesOpt = Annotated[
    bool,
    flag(
        "--static-shapes",
        help="Write the program (.pt2, .onnx, a graph's .pt) for the example's shapes only. By default it "
        "takes any batch and sequence length the model leaves free, and an exact conversion whose file "
        "would not take a shape it was verified on is refused. Refused for a model directory (weights only).",
        panel=OUTPUT_PANEL,
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Write the output in this floating dtype: float32, float16 or bfloat16 (default: the model's). "
        "A bf16 checkpoint exports to ONNX with --dtype float32: onnxruntime's CPU build cannot check bf16.",
        rich_help_panel=OUTPUT_PANEL,
    ),
]
ReportOpt = Annotated[
    Path | None,
    typer.Option(
        "--report", help="Also write the report as JSON to this file.", rich_help_panel=OUTPUT_PANEL
    ),
]
BatchSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        min=1,
        help="Batch size for an image folder or a single tensor (default 32).",
        rich_help_panel=DATA_PANEL,
    ),
]
NormalizeOpt = Annotated[
    str | None, typer.Option("--normalize", help="Normalize images with a dataset's mean/std: imagenet.")
]

DATA_SHORT_HELP = (
    "DATA: a folder of images, a .pt file of tensors or batches, or a factory returning an iterable of "
    "batches (see recalibrate --help)."
)
DATA_HELP = (
    "Calibration data: a folder of images (resized and centre-cropped to the model's input H x W, scaled "
    "to [0, 1]), a .pt file holding a tensor (N, ...), a list of batch tensors or a list of batches, or a "
    "factory 'package.module:callable' / 'file.py:callable' returning an iterable of batches (a factory is "
    "code that normswap imports and runs)."
)
DataOpt = Annotated[str, typer.Option("--data", help=DATA_HELP, show_default=False)]
