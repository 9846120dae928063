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

Legal when:
- the site is a module of its own: torch.nn's LayerNorm/RMSNorm (and subclasses such as timm's), a
  normswap reference norm, a class discovery recognized by what its forward computes (HF Llama, Gemma, T5
  RMSNorm, hand-written norms), or a module whose whole forward is one ``F.layer_norm``/``F.rms_norm``
  call (timm's RmsNorm); a norm computed inside a larger forward needs a graph rewrite
  (:class:`normswap.passes.FuseGraphNorm`);
- it normalizes the trailing dims, or one channel dim with vector affine tensors (timm's LayerNorm2d);
  not BatchNorm or GroupNorm;
- its eps is known, its casting mode one the kernels implement, and its state is exactly its
  weight and bias, each of the normalized shape;
- the fused module, run on the module's input from the example inputs (a random input without them),
  matches it within the kernel tolerance (``normswap.util.tolerance``): the check that the recorded
  semantics are the ones it computes.

Each change records the measured max abs difference of that site and what it was measured on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from normswap.discover import NormKind, NormSite
from normswap.kernels.reference import CASTING_MODES
from normswap.modules.fused import (
    FusedChannelLayerNorm,
    FusedChannelRMSNorm,
    FusedLayerNorm,
    FusedNorm,
    FusedRMSNorm,
    channel_dim_of,
)
from normswap.passes.core.base import (
    Change,
    Pass,
    PassContext,
    PassReport,
    RecordedInputs,
    RewriteKind,
    replace_submodule,
)
from normswap.util.tolerance import kernel_difference, kernel_tolerance

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
    diff: float
    where: str


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
        diff, within, where = _site_difference(state.inputs, site, original, fused)
        if math.isinf(diff):
            return (
                f"the fused module does not give its output's shape on {where}: its semantics are not "
                "the ones read off it"
            )
        if not within:
            atol, rtol = kernel_tolerance(_dtype_of(original))
            return (
                f"the fused module differs from it by {diff:.3g} on {where}, beyond the kernel tolerance "
                f"(atol {atol:g}, rtol {rtol:g}): its semantics are not the ones read off it"
            )
        return FusePlan(site, path, original, fused, diff, where)

    def apply(self, plan: FusePlan, ctx: PassContext, state: FuseNormRun) -> Change:
        site, path, original, fused, diff, where = (
            plan.site,
            plan.path,
            plan.original,
            plan.fused,
            plan.diff,
            plan.where,
        )
        atol, rtol = kernel_tolerance(_dtype_of(original))
        replace_submodule(ctx.model, path, fused)
        details: dict[str, Any] = {
            "module": path,
            "from_class": type(original).__name__,
            "to_class": type(fused).__name__,
            "eps": fused.eps,
            "casting": fused.casting,
            "weight_offset": fused.weight_offset,
            "max_abs_diff": diff,
            "tolerance": {"atol": atol, "rtol": rtol},
            "measured_on": where,
        }
        what = f"{type(original).__name__} -> {type(fused).__name__}"
        if path != site.path:
            what += f" (module {path}: its forward is this {site.source} {site.kind} norm)"
        what += f"; site max abs diff {diff:.3g}"
        return Change(self.name, site.path, self.kind, what, details)


def fuse_norm(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict | None = None,
    *,
    inplace: bool = False,
) -> tuple[nn.Module, PassReport]:
    """Functional form of :class:`FuseNorm`."""
    return FuseNorm()(model, example_args, example_kwargs, inplace=inplace)


# ---------------------------------------------------------------------------------------------------
# Legality and construction


def _build(site: NormSite, ctx: PassContext) -> tuple[str, nn.Module, nn.Module] | str:
    """(path of the module to replace, that module, its fused twin), or why there is none."""
    if site.kind not in FUSED_CLASSES:
        return (
            f"{site.kind} norm normalizes over channels or groups, not the trailing dims the fused "
            "kernels normalize"
        )
    path, module = _module_of(site, ctx)
    if module is None:
        owner = site.path.split("::")[0]
        return (
            f"{site.source} norm computed inside {_owner_name(owner)}, not a module of its own: "
            f"{_NEEDS_GRAPH_REWRITE}"
        )
    if isinstance(module, FusedNorm):
        return "already a fused module"
    shape = site.normalized_shape
    if shape is None or site.eps is None:
        return "its normalized shape or eps could not be determined"
    channel_dim = channel_dim_of(site.normalized_dims)
    if channel_dim is not None and len(shape) != 1:
        return (
            f"normalizes dim {channel_dim} with affine tensors of shape {shape}: the fused channel norm "
            "keeps them as vectors, which would change the checkpoint"
        )
    if site.normalized_dims != tuple(range(-len(shape), 0)) and channel_dim is None:
        return (
            f"normalizes dims {site.normalized_dims}: neither the trailing {len(shape)} dim(s) nor one "
            "channel dim, which the fused kernels normalize"
        )
    if site.casting not in CASTING_MODES:
        return f"casting mode {site.casting!r} is not one the kernels implement {CASTING_MODES}"
    problem = _state_problem(site, module)
    if problem is not None:
        return problem
    # built from discovery's record: the module is not read again
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


def _state_problem(site: NormSite, module: nn.Module) -> str | None:
    """Why ``module``'s state is not exactly the weight and bias its record names, or None."""
    if (site.affine and site.weight_name is None) or (site.bias and site.bias_name is None):
        return "its weight or bias is computed in the forward, not a stored tensor"
    state = module.state_dict()
    used = [n for n in (site.weight_name, site.bias_name) if n is not None]
    extra = sorted(set(state) - set(used))
    if extra:
        return f"holds state its norm does not use ({', '.join(extra)}): the fused module would drop it"
    for name in used:
        if name not in state:
            return f"its {name} is not in its state_dict: the fused module could not load it"
        if tuple(state[name].shape) != site.normalized_shape:
            return (
                f"{name} has shape {tuple(state[name].shape)}, not the normalized shape "
                f"{site.normalized_shape}"
            )
    return None


# ---------------------------------------------------------------------------------------------------
# Measuring a site


def _site_difference(
    inputs: RecordedInputs, site: NormSite, original: nn.Module, fused: nn.Module
) -> tuple[float, bool, str]:
    """(max abs difference, within the kernel tolerance, what it was measured on) at one site."""
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
        except RuntimeError:  # the semantics read off the module do not even fit its input
            return math.inf, False, where
    return (*kernel_difference(ref, out), where)


def _floating_tensors(module: nn.Module) -> list[torch.Tensor]:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return [t for t in tensors if t.is_floating_point()]


def _dtype_of(module: nn.Module) -> torch.dtype:
    tensors = _floating_tensors(module)
    return tensors[0].dtype if tensors else torch.float32


def _device_of(module: nn.Module) -> torch.device:
    tensors = _floating_tensors(module)
    return tensors[0].device if tensors else torch.device("cpu")


def _site_dtype(site: NormSite, module: nn.Module) -> torch.dtype:
    dtype = getattr(torch, site.dtype, None) if site.dtype else None
    return dtype if isinstance(dtype, torch.dtype) else _dtype_of(module)


def _owner_name(owner: str) -> str:
    return "the root module's forward" if owner in ("", "<root>") else f"{owner}'s forward"
