"""Swap norms for fused modules that compute the same function (exact, within the kernel tolerance).

Each RMSNorm / LayerNorm over the trailing ``k`` dims of its input computes, row by row over those dims,

    RMS:   y = x / sqrt(mean(x^2) + eps) * (offset + w) + b
    Layer: y = (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) * (offset + w) + b

with a casting mode saying where it rounds (``normswap.modules.functional``: plain, HF Llama/T5's cast
before the weight multiply, Gemma's fp32 throughout with ``offset = 1``). Flattening the trailing ``k``
dims leaves the rows unchanged, so :class:`normswap.modules.fused.FusedRMSNorm` / ``FusedLayerNorm``, with
the same eps, affine parameters, bias, casting mode and weight offset, compute the same ``y`` up to the
kernels' rounding. The fused module keeps the replaced module's parameter names, so a checkpoint of the
original model loads into the converted one.

Legal when:
- the site is a module of its own: torch.nn's LayerNorm/RMSNorm (and subclasses such as timm's), a
  normswap reference norm, a class discovery recognized by what its forward computes (HF Llama, Gemma, T5
  RMSNorm, hand-written norms), or a module whose whole forward is one ``F.layer_norm``/``F.rms_norm``
  call (timm's RmsNorm); a norm computed inside a larger forward needs a graph rewrite
  (:class:`normswap.passes.FuseGraphNorm`);
- it normalizes the trailing dims (not the channels of an NCHW tensor: BatchNorm, GroupNorm, LayerNorm2d);
- its eps is a constant, its casting mode one the kernels implement, and its state is exactly its
  weight and bias, each of the normalized shape;
- the fused module, run on the module's input from the example inputs (a random input without them),
  matches it within the kernel tolerance (``normswap.kernels.tolerance``): the check that the semantics
  read off the module are the ones it computes.

Each change records the measured max abs difference of that site and what it was measured on.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from normswap.discover import NormSite
from normswap.graph.analysis import GraphView
from normswap.graph.capture import capture_graph
from normswap.graph.ops import CAST_OPS, CHECK_OPS, arg, op_name
from normswap.graph.patterns import find_norm_patterns
from normswap.kernels.tolerance import kernel_difference, kernel_tolerance
from normswap.modules.functional import CASTING_MODES
from normswap.modules.fused import (
    FusedChannelLayerNorm,
    FusedChannelRMSNorm,
    FusedLayerNorm,
    FusedNorm,
    FusedRMSNorm,
    NormSpec,
    channel_dim_of,
    spec_of,
)
from normswap.modules.norms import LayerNorm, RMSNorm
from normswap.passes.base import Change, Pass, PassContext, PassReport, RewriteKind, replace_submodule
from normswap.validate.metrics import record_module_inputs

FUSED_CLASSES: dict[str, type[FusedNorm]] = {"rms": FusedRMSNorm, "layer": FusedLayerNorm}
CHANNEL_CLASSES = {"rms": FusedChannelRMSNorm, "layer": FusedChannelLayerNorm}
# Classes whose attributes state their semantics; anything else is read off its graph.
_DECLARED = (nn.LayerNorm, nn.RMSNorm, LayerNorm, RMSNorm)
_FUNCTIONAL_NORMS = ("layer_norm", "rms_norm")
_INPUTS_KEY = "fuse_norm_inputs"
_NEEDS_GRAPH_REWRITE = "fusing it needs a graph rewrite (FuseGraphNorm; convert --fuse-inline)"


class FuseNorm(Pass):
    name = "fuse_norm"
    kind = RewriteKind.EXACT

    def candidates(self, ctx: PassContext) -> list[NormSite]:
        # Every site: the ones the kernels cannot take are reported with the reason.
        return list(ctx.inventory)

    def check(self, site: NormSite, ctx: PassContext) -> str | None:
        built = _build(site, ctx)
        if isinstance(built, str):
            return built
        path, original, fused = built
        diff, within, where = _site_difference(ctx, site, path, original, fused)
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
        return None

    def rewrite(self, site: NormSite, ctx: PassContext) -> Change:
        built = _build(site, ctx)
        assert not isinstance(built, str), built
        path, original, fused = built
        diff, _, where = _site_difference(ctx, site, path, original, fused)
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
    spec = _spec(site, module, ctx)
    if isinstance(spec, str):
        return spec
    if channel_dim is not None:
        return path, module, CHANNEL_CLASSES[site.kind].from_channel_norm(module, spec, channel_dim)
    return path, module, FUSED_CLASSES[site.kind].from_module(module, spec)


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
    """The module computing the site: its own for module sites; for a functional call, the module whose
    forward it sits in (whether that forward is nothing but the call is checked in :func:`_spec`)."""
    if site.is_module:
        return site.path, site.module
    owner = site.path.split("::")[0]
    if site.source not in ("functional", "pattern") or owner in ("", "<root>"):
        return owner, None
    module = ctx.modules.get(owner)
    if module is None or list(module.children()):
        return owner, None
    return owner, module


def _spec(site: NormSite, module: nn.Module, ctx: PassContext) -> NormSpec | str:
    """What the fused module must reproduce, or why it cannot."""
    if isinstance(module, _DECLARED) and site.source == "module":
        try:
            return spec_of(module, RMSNorm if site.kind == "rms" else LayerNorm)
        except (TypeError, ValueError) as exc:
            return str(exc)
    names = _parameter_names(module, site, ctx)
    if isinstance(names, str):
        return names
    weight_name, bias_name = names
    state = module.state_dict()
    used = {n for n in names if n is not None}
    extra = sorted(set(state) - used)
    if extra:
        return f"holds state its norm does not use ({', '.join(extra)}): the fused module would drop it"
    assert site.normalized_shape is not None and site.eps is not None
    for name in used:
        if tuple(state[name].shape) != site.normalized_shape:
            return (
                f"{name} has shape {tuple(state[name].shape)}, not the normalized shape "
                f"{site.normalized_shape}"
            )
    return NormSpec(
        normalized_shape=site.normalized_shape,
        eps=site.eps,
        elementwise_affine=weight_name is not None,
        bias=bias_name is not None,
        casting=site.casting,
        weight_offset=site.weight_offset,
        weight_name=weight_name or "weight",
        bias_name=bias_name or "bias",
    )


def _parameter_names(
    module: nn.Module, site: NormSite, ctx: PassContext
) -> tuple[str | None, str | None] | str:
    """Names of the tensors the module's norm uses as weight and bias, read off its own graph, or why
    the module cannot be replaced as a whole.

    The module is captured alone on a small input; its forward must be one norm (written out, or one
    ``F.layer_norm``/``F.rms_norm`` call) and casts, nothing else. Modules of one class, dtype, shape
    and state names share the answer, so each such group is captured once per pass run.
    """
    key = (type(module), _dtype_of(module), site.normalized_shape, tuple(module.state_dict()))
    cache = ctx.cache.setdefault("fuse_norm_parameter_names", {})
    if key not in cache:
        cache[key] = _read_parameter_names(module, site)
    return cache[key]


def _read_parameter_names(module: nn.Module, site: NormSite) -> tuple[str | None, str | None] | str:
    view = _probe_graph(module, site)
    if isinstance(view, str):
        return view
    ops = [n for n in view.nodes if n.op in ("call_function", "call_method", "call_module")]
    matches = find_norm_patterns(view, module)
    if len(matches) == 1:
        covered = set(matches[0].nodes)
        weight, bias = matches[0].weight, matches[0].bias
    else:
        calls = [n for n in ops if op_name(n) in _FUNCTIONAL_NORMS]
        if matches or len(calls) != 1:
            return (
                f"{site.source} norm: the forward of {type(module).__name__} is not one norm, so it "
                f"cannot be replaced as a whole; {_NEEDS_GRAPH_REWRITE}"
            )
        covered = {calls[0]}
        weight = arg(calls[0], 2, "weight")
        bias = arg(calls[0], 3, "bias") if op_name(calls[0]) == "layer_norm" else None
    if any(n not in covered and op_name(n) not in CAST_OPS and op_name(n) not in CHECK_OPS for n in ops):
        return (
            f"{site.source} norm: the forward of {type(module).__name__} computes more than the norm; "
            f"{_NEEDS_GRAPH_REWRITE}"
        )
    names = []
    for node in (weight, bias):
        name = view.param_name(node) if node is not None else None
        if node is not None and name is None:
            return "its weight or bias is computed in the forward, not a stored tensor"
        names.append(name)
    return names[0], names[1]


def _probe_graph(module: nn.Module, site: NormSite) -> GraphView | str:
    assert site.normalized_shape is not None
    x = torch.randn(_sample_shape(site, (2, 3)), dtype=_dtype_of(module), device=_device_of(module))
    captured = capture_graph(module, (x,))
    if not captured.ok:
        return (
            f"{type(module).__name__} could not be captured alone to read its parameters: {captured.reason}"
        )
    return GraphView(captured)


# ---------------------------------------------------------------------------------------------------
# Measuring a site


def _site_difference(
    ctx: PassContext, site: NormSite, path: str, original: nn.Module, fused: nn.Module
) -> tuple[float, bool, str]:
    """(max abs difference, within the kernel tolerance, what it was measured on) at one site."""
    x = _recorded_input(ctx, original)
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


def _recorded_input(ctx: PassContext, module: nn.Module) -> torch.Tensor | None:
    """The input ``module`` sees when the model runs on the example inputs (None without inputs).

    One forward records the inputs of every module a site may replace, before any is replaced.
    """
    if ctx.example_args is None and not ctx.example_kwargs:
        return None
    if _INPUTS_KEY not in ctx.cache:
        targets = []
        for site in ctx.inventory:
            _, candidate = _module_of(site, ctx)
            if candidate is not None:
                targets.append(candidate)
        ctx.cache[_INPUTS_KEY] = record_module_inputs(
            ctx.model, targets, ctx.example_args, ctx.example_kwargs
        )
    return ctx.cache[_INPUTS_KEY].get(id(module))


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
