"""``normswap convert MODEL -o OUT``: parse the options into a ConvertConfig, call normswap.convert, print
the result, save it. What runs, in which order, and when a result is refused is the library's."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer
from normswap_cli import render
from normswap_cli.options import (
    DATA_SHORT_HELP,
    BatchSizeOpt,
    DtypeOpt,
    InputShapeOpt,
    InputsOpt,
    ModelArg,
    OpsetOpt,
    OutputOpt,
    OverwriteOpt,
    PortableOpt,
    ReportOpt,
    StaticShapesOpt,
    TrustPickleOpt,
    WeightsOpt,
    flag,
)
from normswap_cli.shared import handles_errors

from normswap import rewrites

# convert's rewrites, grouped in --help by their family; their help and family are the registry's
# (normswap.rewrites: no torch import, so --help stays fast)
SWAP_PANEL = rewrites.SWAP
POLICY_PANEL = "Exactness"
CALIBRATION_PANEL = "Calibration"


def rewrite_flag(option: str) -> Any:
    """The on/off option of a registered rewrite, with its help and family."""
    entry = rewrites.BY_OPTION[option]
    return flag(option, help=entry.help, panel=entry.family)


ToOpt = Annotated[
    str | None,
    typer.Option(
        "--to",
        help=rewrites.to_help(),
        rich_help_panel=SWAP_PANEL,
    ),
]
FromOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--from",
        help="Only replace norms of this kind (batch, layer, rms, group, instance); repeatable. "
        "Default: every kind that differs from --to.",
        rich_help_panel=SWAP_PANEL,
    ),
]
LayersOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--layers",
        help="With --to cosine: the Linear/Conv layers to convert, glob patterns on module paths "
        "(comma-separated or repeated). Default: the layers whose output only norms read.",
        rich_help_panel=SWAP_PANEL,
    ),
]
CalibrateOpt = Annotated[
    str | None,
    typer.Option(
        "--calibrate",
        help="Fit the swapped norms' affine parameters (and BatchNorm statistics) to the original "
        "norms' outputs on this data, layer by layer. " + DATA_SHORT_HELP,
        rich_help_panel=CALIBRATION_PANEL,
    ),
]
# the on/off rewrites, one flag each by its config field; --add-weight-norm takes a module list (below)
ON_OFF = tuple(r for r in rewrites.OPTIONS if r.field != "add_weight_norm")


def with_rewrite_flags(command: Callable[..., None], after: str) -> Callable[..., None]:
    """``command``, taking one on/off option per rewrite of the registry into its ``**flags``, listed after
    its parameter ``after`` (typer reads the options from the signature and the annotations, and calls
    with keywords), so a new rewrite needs no edit here."""
    signature = inspect.signature(command, eval_str=True)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = next(i for i, p in enumerate(params) if p.name == after) + 1
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for entry in reversed(ON_OFF):
        annotation = Annotated[bool, rewrite_flag(entry.option)]
        params.insert(at, inspect.Parameter(entry.field, kind, default=False, annotation=annotation))
        command.__annotations__[entry.field] = annotation
    command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return command


AddWeightNormOpt = Annotated[
    str | None,
    typer.Option(
        "--add-weight-norm",
        help=rewrites.BY_OPTION["--add-weight-norm"].help,
        rich_help_panel=rewrites.WEIGHT_NORM,
    ),
]
SequentialOpt = Annotated[
    bool,
    flag(
        "--sequential",
        help="With a model directory, --to KIND (architectural) and --calibrate: swap and calibrate block by "
        "block, holding one block and the activations (on disk past --activation-memory). Taken without "
        "the flag when the model does not fit in memory.",
        panel=CALIBRATION_PANEL,
    ),
]
ActivationMemoryOpt = Annotated[
    float | None,
    typer.Option(
        "--activation-memory",
        min=0,
        help="Block-by-block calibration: GB of activations held in memory before they go to disk "
        "(default: a quarter of the available memory, at most 4).",
        rich_help_panel=CALIBRATION_PANEL,
    ),
]
AllowLossyOpt = Annotated[
    bool,
    flag(
        "--allow-lossy",
        help="With --to rmsnorm: accept the architectural (lossy) LayerNorm -> RMSNorm swap where the "
        "exact route failed (no graph captured, a form normswap does not handle). Without it such a "
        "run fails and writes nothing; post-LN LayerNorms, which have no exact route, are swapped "
        "either way.",
        panel=POLICY_PANEL,
    ),
]


@handles_errors
def convert(
    model: ModelArg,
    output: OutputOpt,
    to: ToOpt = None,
    from_kinds: FromOpt = None,
    groups: Annotated[
        int | None,
        typer.Option("--groups", min=1, help="Groups of --to groupnorm.", rich_help_panel=SWAP_PANEL),
    ] = None,
    layers: LayersOpt = None,
    calibrate: CalibrateOpt = None,
    calibrate_batches: Annotated[
        int | None,
        typer.Option(
            "--calibrate-batches",
            min=1,
            help="Use the first N batches of --calibrate.",
            rich_help_panel=CALIBRATION_PANEL,
        ),
    ] = None,
    batch_size: BatchSizeOpt = None,
    add_weight_norm: AddWeightNormOpt = None,
    weight_norm_dim: Annotated[
        str,
        typer.Option(
            "--weight-norm-dim",
            help="Weight-norm magnitude dim: 'output' (one per output channel), an int, or 'none'.",
            rich_help_panel=rewrites.WEIGHT_NORM,
        ),
    ] = "output",
    exact: Annotated[
        bool, flag("--exact", help="Fail instead of applying any non-exact rewrite.", panel=POLICY_PANEL)
    ] = False,
    allow_lossy: AllowLossyOpt = False,
    sequential: SequentialOpt = False,
    activation_memory: ActivationMemoryOpt = None,
    opset: OpsetOpt = None,
    weights: WeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    overwrite: OverwriteOpt = False,
    portable: PortableOpt = False,
    static_shapes: StaticShapesOpt = False,
    dtype: DtypeOpt = None,
    **flags: bool,
) -> None:
    """Rewrite MODEL's norms, check the result against the original, and write it to -o."""
    from normswap.api import SAVE_FORMATS, ConvertConfig, check_run_paths, convert, save, write_report
    from normswap.errors import CheckFailedError

    check_run_paths(
        {"MODEL": model, "--weights": weights, "--inputs": inputs, "--calibrate": calibrate},
        {"-o": output, "--report": report},
        overwrite,
    )
    config = ConvertConfig(
        **flags,
        to=to,
        from_kinds=from_kinds,
        groups=groups,
        layers=layers,
        add_weight_norm=add_weight_norm,
        weight_norm_dim=weight_norm_dim,
        exact=exact,
        allow_lossy=allow_lossy,
        calibration_data=calibrate,
        calibration_batches=calibrate_batches,
        batch_size=batch_size,
        output=output,
        overwrite=overwrite,
        portable=portable,
        static_shapes=static_shapes,
        opset=opset,
        dtype=dtype,
        sequential=sequential,
        activation_memory=activation_memory,
    )
    config.validate()  # option mistakes are said before the model is loaded
    quiet = report is not None
    # the library chooses the route (in memory, streamed, block by block) and judges the result
    with render.status("converting", quiet) as say:
        result = convert(
            model,
            config,
            weights=weights,
            trust_pickle=trust_pickle,
            inputs=inputs,
            input_shapes=input_shape,
            on_step=say,
        )
    saving = result.ok and result.model is not None
    render.print_conversion(result, saved_next=saving)
    if saving:
        label = SAVE_FORMATS.get(output.suffix, "directory")
        what = {
            "onnx": f"exporting {output} to ONNX and checking it in onnxruntime",
            "pt2": f"exporting {output}",
            "directory": f"writing the model directory {output} and loading it back",
        }.get(label, f"writing {output}")
        with render.stdout_kept(label == "onnx"), render.status(what, quiet):
            saved = save(result)
        render.print_saved(saved)
        render.print_size(result)  # what the output stores (a directory's shards, the model in its dtype)
    if report is not None:
        write_report(report, {"model": model, **result.to_dict()})
    if not result.ok:
        raise CheckFailedError(result.refusal or "nothing written")


with_rewrite_flags(convert, after="batch_size")
