"""``normswap inspect MODEL``: what norms are there."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from normswap_cli import render
from normswap_cli.options import InputShapeOpt, InputsOpt, ModelArg, OverwriteOpt, TrustPickleOpt, WeightsOpt
from normswap_cli.shared import check_inputs_fit, check_paths, handles_errors, load, write_json


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
    from normswap.discover import find_norms
    from normswap.load import resolve_inputs

    check_paths({"MODEL": model, "--weights": weights, "--inputs": inputs}, {"--json": json_out}, overwrite)
    # a model directory is built on the meta device: its norms are found without reading a weight
    loaded = load(model, weights, trust_pickle, structure_only=True)
    resolved = resolve_inputs(loaded, inputs_file=inputs, input_shapes=input_shape)
    args, kwargs = resolved if resolved is not None else (None, None)
    if loaded.format == "directory" and resolved is not None:
        args, kwargs = _on_meta(args), _on_meta(kwargs)
    if inputs is not None or input_shape:
        check_inputs_fit(loaded.model, args, kwargs)
    with render.status("capturing a graph of the model", quiet=json_out is not None):
        inventory = find_norms(loaded.model, args, kwargs)
        cosine = _cosine_layers(loaded, inventory, args, kwargs)
    render.print_inventory(inventory, model)
    _print_cosine(cosine, loaded.format == "directory")
    if json_out is not None:
        write_json(
            json_out,
            {
                "model": model,
                "graph_method": inventory.graph_method,
                "graph_errors": inventory.capture.errors,
                "graph_notes": inventory.capture.notes,
                "counts": inventory.counts(),
                "sites": [s.to_dict() for s in inventory],
                "cosine_layers": [c.to_dict() for c in cosine],
            },
        )


def _on_meta(value: Any) -> Any:
    """Inputs for a model built on the meta device: every tensor as a meta tensor of its shape and dtype."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(v) for v in value)
    return value


def _cosine_layers(loaded: Any, inventory: Any, args: Any, kwargs: Any) -> list[Any]:
    """Cosine-normalized layers, found on the same capture. They are confirmed by running the candidate
    ops on random rows with the layer's weights, which a directory built on the meta device does not have."""
    from normswap.discover.cosine import find_cosine_sites

    if loaded.format == "directory" or (args is None and not kwargs):
        return []
    return find_cosine_sites(loaded.model, args, kwargs, captured=inventory.capture)


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
