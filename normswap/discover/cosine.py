"""Cosine-normalized layers already in a model (Luo et al. 2017), found on the captured graph by what they
compute, whatever the module is called and however the cosine is written (:mod:`normswap.graph.cosine_match`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from normswap.graph.analysis import GraphView, module_path, view_of
from normswap.graph.capture import CapturedGraph, capture_graph
from normswap.graph.cosine_match import CosineMatch, find_cosine_layers


@dataclass
class CosineSite:
    """One cosine layer: the module whose forward computes it (``path``; "" for the root), ``source``
    ``"module"`` when that is the module's whole forward and ``"pattern"`` when it is part of a larger
    one, the weight's name, whether the bias sits inside the cosine (``augmented``), and the scale form
    read off it (``"none"``: 1, ``"scalar"``: one value, ``"per-output"``)."""

    path: str
    source: str
    class_name: str
    weight_name: str
    out_features: int
    conv: bool
    augmented: bool
    scale: str
    shift: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _common_path(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _site(view: GraphView, modules: dict[str, nn.Module], match: CosineMatch) -> CosineSite:
    path = _common_path([module_path(n) for n in match.nodes])
    calls = view.calls.get(path, [])
    own = {n for n in calls[0].nodes if not view.is_param(n)} if calls else set()
    whole = bool(calls) and own <= set(match.nodes) | {match.input}
    scale = match.scale
    if bool(((scale - 1).abs() < 1e-6).all()):
        form = "none"
    elif bool(((scale - scale[0]).abs() <= 1e-6 * scale.abs().max()).all()):
        form = "scalar"
    else:
        form = "per-output"
    module = modules.get(path)
    return CosineSite(
        path=path,
        source="module" if whole and path else "pattern",
        class_name=type(module).__name__ if module is not None else "",
        weight_name=match.weight,
        out_features=match.out_features,
        conv=match.conv,
        augmented=match.augmented,
        scale=form,
        shift=bool((match.shift.abs() > 1e-6 * max(float(scale.abs().max()), 1e-30)).any()),
    )


def find_cosine_sites(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    captured: CapturedGraph | None = None,
) -> list[CosineSite]:
    """Every cosine-normalized layer of ``model``; empty when no graph with shapes can be captured."""
    if captured is None:
        captured = capture_graph(model, example_args, example_kwargs)
    if not captured.ok:
        return []
    view = view_of(captured)
    modules = dict(model.named_modules())
    return [_site(view, modules, m) for m in find_cosine_layers(view, model)]
