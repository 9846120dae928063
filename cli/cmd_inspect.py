"""``normswap inspect MODEL``: what norms are there."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from normswap_cli import render
from normswap_cli.options import InputShapeOpt, InputsOpt, ModelArg, OverwriteOpt, TrustPickleOpt, WeightsOpt
from normswap_cli.shared import handles_errors


@handles_errors
def inspect(
    model: ModelArg,
    weights: WeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the sites as JSON.")] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """List every normalization in MODEL: kind, shape, eps, affine, and what feeds and reads it."""
    from normswap.api import check_run_paths, write_report
    from normswap.api import inspect as find

    check_run_paths(
        {"MODEL": model, "--weights": weights, "--inputs": inputs}, {"--json": json_out}, overwrite
    )
    with render.activity(quiet=json_out is not None) as shown:
        found = find(
            model,
            weights=weights,
            trust_pickle=trust_pickle,
            inputs=inputs,
            input_shapes=input_shape,
            on_step=shown.step,
        )
    render.print_inventory(found.inventory, model)
    _print_cosine(found.cosine, not found.weights_read)
    if json_out is not None:
        write_report(json_out, found.to_dict())


def _print_cosine(sites: list[Any], directory: bool) -> None:
    if directory:
        render.out.print("cosine-normalized layers: not looked for (the weights of a directory are not read)")
    for site in sites:
        scale = {"none": "no scale", "scalar": "one scale", "per-output": "a scale per output"}[site.scale]
        bias = (
            "bias inside the cosine" if site.augmented else ("a shift after it" if site.shift else "no bias")
        )
        where = f"{site.path or '<root>'} ({site.class_name or 'functional'}, {site.source})"
        render.out.print(
            f"cosine-normalized layer: {where}: {site.out_features} outputs of {site.weight_name}, {scale}, "
            f"{bias}",
            soft_wrap=True,
        )
