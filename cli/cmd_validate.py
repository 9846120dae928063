"""``normswap validate ORIGINAL CONVERTED``: compare two models."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Any

import typer
from normswap_cli import render
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
from normswap_cli.shared import check_paths, data_and_holdout, handles_errors, load, write_json


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
            help="Compare block by block (exact tolerance): every block of CONVERTED runs on ORIGINAL's "
            "activation, and the first block outside is named. Two model directories are compared "
            "holding neither model.",
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
    from normswap.errors import BadInputError, CheckFailedError
    from normswap.validate.layerwise import DEFAULT_MIN_SQNR_DB, plot_norm_sites, validate_models

    check_paths(
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
    if blockwise and Path(original).is_dir() and Path(converted).is_dir():
        _validate_blockwise(original, converted, centered, report)
        return
    if centered and not blockwise:
        raise BadInputError("--centered applies to --blockwise")
    if exact and min_sqnr is not None:
        raise BadInputError("--exact and --min-sqnr are two different checks: give one")
    if plot is not None and plot.suffix.lower() != ".png":
        raise BadInputError(f"--plot {plot}: the plot is a PNG file")
    reference = load(original, weights, trust_pickle)
    candidate = load(converted, converted_weights, trust_pickle)
    if blockwise:
        from normswap.load import require_inputs

        pair = require_inputs(reference, inputs_file=inputs, input_shapes=input_shape)
        _validate_blockwise(original, converted, centered, report, (reference.model, candidate.model, pair))
        return
    if data is not None:
        from normswap.load import resolve_inputs

        resolved = resolve_inputs(reference, inputs_file=inputs, input_shapes=input_shape)
        args, kwargs = resolved if resolved is not None else (None, None)
        source, _ = data_and_holdout(data, None, args, kwargs, batch_size, None, model=reference.model)
        pairs = [(b.args, b.kwargs) for b in itertools.islice(source, batches)]
        if not pairs:
            raise BadInputError(f"--data {data} yields no batch")
    else:
        from normswap.load import require_inputs

        pairs = [require_inputs(reference, inputs_file=inputs, input_shapes=input_shape)]
    with render.status("finding the norm sites of ORIGINAL", quiet=report is not None):
        norm_paths = _norm_paths(reference.model, pairs[0])
    with render.progress(disable=len(pairs) < 4 or report is not None) as bar:
        task = bar.add_task("comparing", total=len(pairs))
        try:
            result = validate_models(
                reference.model,
                candidate.model,
                pairs,
                exact=exact,
                min_sqnr_db=DEFAULT_MIN_SQNR_DB if min_sqnr is None else min_sqnr,
                norm_paths=norm_paths,
                on_batch=lambda _i: bar.advance(task),
            )
        except ValueError as exc:
            raise BadInputError(f"cannot compare: {exc}") from None
    render.print_validation(result)
    if plot is not None:
        from normswap.load import atomic_write

        try:
            atomic_write(
                plot, lambda tmp: plot_norm_sites(result, str(tmp), title=f"{converted} vs {original}")
            )
        except ImportError:
            raise BadInputError("--plot needs matplotlib: pip install 'normswap[plot]'") from None
        render.out.print(f"wrote {plot}")
    if report is not None:
        write_json(report, {"original": original, "converted": converted, **result.to_dict()})
    # a NaN or Inf in an output fails the comparison whatever was asked (nothing was compared there)
    nonfinite = any(o.comparison.nonfinite for o in result.outputs)
    if (exact or min_sqnr is not None or nonfinite) and not result.passed:
        where = f"; first divergent layer: {result.first_divergent}" if result.first_divergent else ""
        if not (exact or min_sqnr is not None):
            raise CheckFailedError(f"{result.failure}{where}")
        what = "exact tolerance" if exact else f"{min_sqnr:g} dB"
        raise CheckFailedError(f"outputs are not within the {what}: {result.failure}{where}")


def _norm_paths(model: Any, pair: tuple) -> list[str]:
    from normswap.discover import find_norms

    inventory = find_norms(model, *pair)
    return [site.path for site in inventory if site.is_module]


def _validate_blockwise(
    original: str,
    converted: str,
    centered: bool,
    report: Path | None,
    in_memory: tuple[Any, Any, tuple] | None = None,
) -> None:
    """Two models compared block by block (normswap.validate.blockwise); exit 1 when a stage is outside
    the exact tolerance. Two model directories are compared holding neither model, on the inputs a
    streamed conversion is verified on; other models (``in_memory``: both models and the example
    inputs) are held and compared on the example inputs."""
    from normswap.api.checkpoint_checks import VERIFY_SHAPES
    from normswap.errors import CheckFailedError
    from normswap.load.checkpoint_dir import build_on_meta, read_checkpoint_directory
    from normswap.load.config_inputs import example_inputs
    from normswap.validate import blockwise

    relate = blockwise.centered if centered else blockwise.identity
    with render.status("comparing block by block", quiet=report is not None) as say:
        if in_memory is not None:
            reference, candidate, pair = in_memory
            shapes = [_shape_of(pair)]
            results = blockwise.verify_blockwise_models(reference, candidate, [pair], relate, on_block=say)
        else:
            checkpoints = {
                label: read_checkpoint_directory(path)
                for label, path in (("ORIGINAL", original), ("CONVERTED", converted))
            }
            meta = build_on_meta(checkpoints["ORIGINAL"])
            inputs = [
                example_inputs(meta, checkpoints["ORIGINAL"].config, batch=b, length=n, device="cpu")
                for b, n in VERIFY_SHAPES
            ]
            shapes = [f"{b}x{n}" for b, n in VERIFY_SHAPES]
            results = blockwise.verify_blockwise(
                checkpoints["ORIGINAL"], checkpoints["CONVERTED"], inputs, relate, on_block=say
            )
    for shape, result in zip(shapes, results, strict=True):
        verdict = "[green]PASS[/]" if result.ok else f"[red]FAIL[/] (first: {result.first_divergent})"
        render.out.print(
            f"inputs {shape}, {result.blocks_path}: {len(result.stages)} stages, worst "
            f"{render.fmt_float(result.worst_rel)} x max|ref| {verdict}",
            soft_wrap=True,
        )
    if report is not None:
        write_json(
            report,
            {"original": original, "converted": converted, "blockwise": [r.to_dict() for r in results]},
        )
    failed = [r for r in results if not r.ok]
    if failed:
        raise CheckFailedError(f"outside the exact tolerance: {failed[0].failure}")


def _shape_of(pair: tuple) -> str:
    """The example inputs' shapes, as the report names them (``1x16``)."""
    args, kwargs = pair
    tensors = [t for t in (*args, *kwargs.values()) if hasattr(t, "shape")]
    return ", ".join("x".join(str(d) for d in t.shape) for t in tensors) or "the example inputs"
