"""Swap norms for fused modules that compute the same function (exact, within the kernel tolerance).

Each RMSNorm / LayerNorm over the trailing ``k`` dims of its input computes, row by row over those dims,

    RMS:   y = x / sqrt(mean(x^2) + eps) * (offset + w) + b
    Layer: y = (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) * (offset + w) + b

with a casting mode saying where it rounds (``normswap.kernels.reference``: plain, HF Llama/T5's cast
before the weight multiply, Gemma's fp32 throughout with ``offset = 1``). Flattening the trailing ``k``
dims leaves the rows unchanged, so :class:`normswap.modules.fused.FusedRMSNorm` / ``FusedLayerNorm``, with
the same eps, affine parameters, bias, casting mode and weight offset, compute the same ``y`` up to the
kernels' rounding. Those are read from the site's record (``site.semantics``, computed once by discovery,
eps as the norm applies it for its dtype: ``nn.RMSNorm(eps=None)`` included); the module is not read or
captured again. The fused module keeps the replaced module's parameter names (the record's), so a
checkpoint of the original model loads into the converted one.

Legal when the site is a module of its own (torch.nn's LayerNorm/RMSNorm and subclasses such as timm's, a
normswap reference norm, a class discovery recognized by what its forward computes: HF Llama, Gemma, T5
RMSNorm, hand-written norms, timm's RmsNorm) whose state is exactly its weight and bias, and the rules of
:mod:`.legality` hold; a norm inside a larger forward needs a graph rewrite
(:class:`normswap.passes.FuseGraphNorm`). The fused module is measured on the module's input from the
example inputs (a random input without them): the check that the recorded semantics are the ones it
computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from normswap.discover import NormKind, NormSite
from normswap.modules.fused import (
    FusedChannelLayerNorm,
    FusedChannelRMSNorm,
    FusedLayerNorm,
    FusedNorm,
    FusedRMSNorm,
    channel_dim_of,
)
from normswap.modules.semantics import module_dtype
from normswap.passes.core.base import (
    Change,
    Pass,
    PassContext,
    RecordedInputs,
    RewriteKind,
    replace_submodule,
)
from normswap.passes.fuse.legality import Measured, fused_call, kind_refusal, measure

FUSED_CLASSES: dict[NormKind, type[FusedNorm]] = {NormKind.RMS: FusedRMSNorm, NormKind.LAYER: FusedLayerNorm}
CHANNEL_CLASSES = {NormKind.RMS: FusedChannelRMSNorm, NormKind.LAYER: FusedChannelLayerNorm}
_NEEDS_GRAPH_REWRITE = "fusing it needs a graph rewrite (FuseGraphNorm; convert --fuse-inline)"


@dataclass
class FuseNormRun:
    """What the sites of one run share: the modules' recorded inputs."""

    inputs: RecordedInputs


@dataclass(frozen=True)
class FusePlan:
    """A module to replace by its fused twin, and the difference measured between them."""

    site: NormSite
    path: str
    original: nn.Module
    fused: nn.Module
    measured: Measured


class FuseNorm(Pass[NormSite, FusePlan, FuseNormRun]):
    name = "fuse_norm"
    kind = RewriteKind.EXACT
    keeps_capture = True  # norms become normswap's own norm classes; weights change value only

    def prepare(self, ctx: PassContext) -> FuseNormRun:
        # one forward records the inputs of every module a site may replace, before any is replaced
        modules = [m for m in (_module_of(site, ctx)[1] for site in ctx.inventory) if m is not None]
        return FuseNormRun(RecordedInputs(ctx, modules))

    def candidates(self, ctx: PassContext, state: FuseNormRun) -> list[NormSite]:
        # Every site: the ones the kernels cannot take are reported with the reason.
        return list(ctx.inventory)

    def check(self, site: NormSite, ctx: PassContext, state: FuseNormRun) -> FusePlan | str:
        built = _build(site, ctx)
        if isinstance(built, str):
            return built
        path, original, fused = built
        measured = _site_difference(state.inputs, site, original, fused)
        return measured if isinstance(measured, str) else FusePlan(site, path, original, fused, measured)

    def apply(self, plan: FusePlan, ctx: PassContext, state: FuseNormRun) -> Change:
        site, path, original, fused = plan.site, plan.path, plan.original, plan.fused
        replace_submodule(ctx.model, path, fused)
        details: dict[str, Any] = {
            "module": path,
            "from_class": type(original).__name__,
            "to_class": type(fused).__name__,
            "eps": fused.eps,
            "casting": fused.casting,
            "weight_offset": fused.weight_offset,
            **plan.measured.details(),
        }
        what = f"{type(original).__name__} -> {type(fused).__name__}"
        if path != site.path:
            what += f" (module {path}: its forward is this {site.source} {site.kind} norm)"
        what += f"; {plan.measured.summary}"
        return Change(self.name, site.path, self.kind, what, details)


# ---------------------------------------------------------------------------------------------------
# Legality (:mod:`.legality`, and what only a module has) and construction


def _build(site: NormSite, ctx: PassContext) -> tuple[str, nn.Module, nn.Module] | str:
    """(path of the module to replace, that module, its fused twin), or why there is none."""
    path, module = _module_of(site, ctx)
    if module is None:
        return kind_refusal(site.kind) or (
            f"{site.source} norm computed inside {_owner_name(path)}, not a module of its own: "
            f"{_NEEDS_GRAPH_REWRITE}"
        )
    if isinstance(module, FusedNorm):
        return "already a fused module"
    state = module.state_dict()
    call = fused_call(site.semantics, state)
    if isinstance(call, str):
        return call
    extra = sorted(set(state) - {site.weight_name, site.bias_name})
    if extra:
        return f"holds state its norm does not use ({', '.join(extra)}): the fused module would drop it"
    # built from discovery's record: the module is not read again
    channel_dim = call["channel_dim"]
    if channel_dim is not None:
        return path, module, CHANNEL_CLASSES[site.kind].from_channel_norm(module, site.semantics, channel_dim)
    return path, module, FUSED_CLASSES[site.kind].from_module(module, site.semantics)


def _sample_shape(site: NormSite, lead: tuple[int, int]) -> tuple[int, ...]:
    """An input shape the site's norm accepts: ``lead`` then the normalized shape, or for a channel
    norm, the channel at its dim between small sizes (``(lead[0], C, lead[1], 5)`` for dim -3)."""
    assert site.normalized_shape is not None
    channel_dim = channel_dim_of(site.normalized_dims)
    if channel_dim is None:
        return (*lead, *site.normalized_shape)
    after = [lead[1], 5, 6, 7][: -channel_dim - 1]
    return (lead[0], *site.normalized_shape, *after)


def _module_of(site: NormSite, ctx: PassContext) -> tuple[str, nn.Module | None]:
    """The module computing the site, if it is a module of its own; for a norm inside a larger forward,
    that forward's module path and None. Discovery decided which: a module whose whole forward is the
    norm is a ``structural`` site (:mod:`normswap.discover.find`)."""
    if site.is_module:
        return site.path, site.module
    return site.path.split("::")[0], None


# ---------------------------------------------------------------------------------------------------
# Measuring a site


def _site_difference(
    inputs: RecordedInputs, site: NormSite, original: nn.Module, fused: nn.Module
) -> Measured | str:
    """The fused module against the module it replaces, on the module's input: :func:`.legality.measure`."""
    x = inputs.of(original)
    where = "the example inputs"
    if x is None:
        assert site.normalized_shape is not None
        g = torch.Generator().manual_seed(0)
        x = torch.randn(_sample_shape(site, (4, 8)), generator=g).to(
            dtype=_site_dtype(site, original), device=_device_of(original)
        )
        where = "a random input"
    with torch.no_grad():
        ref = original(x)
        try:
            out = fused(x)
        except (RuntimeError, ValueError):  # the semantics read off the module do not fit its input
            out = None
    return measure(ref, out, "module", where)


def _device_of(module: nn.Module) -> torch.device:
    tensors = (*module.parameters(recurse=False), *module.buffers(recurse=False))
    return next((t.device for t in tensors if t.is_floating_point()), torch.device("cpu"))


def _site_dtype(site: NormSite, module: nn.Module) -> torch.dtype:
    dtype = getattr(torch, site.dtype, None) if site.dtype else None
    return dtype if isinstance(dtype, torch.dtype) else module_dtype(module) or torch.float32


def _owner_name(owner: str) -> str:
    return "the root module's forward" if owner in ("", "<root>") else f"{owner}'s forward"
