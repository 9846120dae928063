"""Replace norm modules by another kind of norm (architectural: the function changes on purpose).

A LayerNorm becomes ``RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w + b``: same eps, same weight, and the
LayerNorm's bias kept as an RMSNorm bias so no parameter is lost. An RMSNorm becomes a LayerNorm the
same way (a bias-free RMSNorm gives a bias-free LayerNorm). Casting mode and weight offset (Gemma's
``1 + w``) carry over, so the stored weights keep their meaning. Only norms over the trailing dims are
swapped here; a norm over the channels of an NCHW tensor (BatchNorm, GroupNorm, ConvNeXt's LayerNorm2d)
needs a layout mapping and is skipped with that reason.

Each change records how far the new norm moves that site's output on the example inputs (SQNR in dB
of the new norm against the old one, applied to the same captured input).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from normswap.discover import NormSite
from normswap.modules.norms import LayerNorm, RMSNorm
from normswap.passes.base import Change, Pass, PassContext, PassReport, RewriteKind, replace_submodule
from normswap.validate.metrics import record_module_inputs, sqnr_db

SWAP_TARGETS = {"rmsnorm": "rms", "layernorm": "layer"}


def build_norm(target_kind: str, site: NormSite, like: nn.Module) -> nn.Module:
    """A new norm of ``target_kind`` with ``site``'s shape, eps, affine parameters and numerics."""
    assert site.normalized_shape is not None and site.eps is not None
    params = [t for t in like.parameters(recurse=False)] + [t for t in like.buffers(recurse=False)]
    device = params[0].device if params else None
    dtype = next((t.dtype for t in params if t.is_floating_point()), None)
    cls = RMSNorm if target_kind == "rms" else LayerNorm
    new = cls(
        site.normalized_shape,
        eps=site.eps,
        elementwise_affine=site.affine,
        bias=site.bias,
        casting=site.casting,
        weight_offset=site.weight_offset,
        device=device,
        dtype=dtype,
    )
    with torch.no_grad():
        for name in ("weight", "bias"):
            src, dst = getattr(like, name, None), getattr(new, name)
            if dst is not None and isinstance(src, torch.Tensor):
                dst.copy_(src.reshape(dst.shape))
    return new


class SwapNorm(Pass):
    name = "swap_norm"
    kind = RewriteKind.ARCHITECTURAL

    def __init__(self, to: str, from_kinds: tuple[str, ...] | None = None) -> None:
        if to not in SWAP_TARGETS:
            raise ValueError(f"unknown norm target {to!r}; choose from {sorted(SWAP_TARGETS)}")
        self.to = to
        self.target_kind = SWAP_TARGETS[to]
        self.from_kinds = from_kinds

    def candidates(self, ctx: PassContext) -> list[NormSite]:
        return [
            s
            for s in ctx.inventory
            if s.kind != self.target_kind and (self.from_kinds is None or s.kind in self.from_kinds)
        ]

    def check(self, site: NormSite, ctx: PassContext) -> str | None:
        if not site.is_module:
            return f"{site.source} norm computed inside a forward, not a module: swapping it needs a graph rewrite"
        if site.kind not in ("layer", "rms"):
            return (
                f"{site.kind} norm normalizes over channels, not the trailing dims; "
                f"a {site.kind} -> {self.to} swap needs a layout mapping"
            )
        ndim = len(site.normalized_shape or ())
        if site.normalized_dims != tuple(range(-ndim, 0)):
            return f"normalizes dims {site.normalized_dims}, not the trailing {ndim} dim(s) its shape implies"
        if site.normalized_shape is None or site.eps is None:
            return "its normalized shape or eps could not be determined"
        return None

    def rewrite(self, site: NormSite, ctx: PassContext) -> Change:
        old = site.module
        assert old is not None
        new = build_norm(self.target_kind, site, old)
        details: dict[str, Any] = {"from_class": type(old).__name__, "to_class": type(new).__name__}
        sample = _captured_input(ctx, old)
        if sample is not None:
            with torch.no_grad():
                details["site_sqnr_db"] = sqnr_db(old(sample), new.to(sample.device)(sample))
        replace_submodule(ctx.model, site.path, new)
        return Change(
            self.name, site.path, self.kind, f"{type(old).__name__} -> {type(new).__name__}", details
        )


def _captured_input(ctx: PassContext, module: nn.Module) -> torch.Tensor | None:
    """The input ``module`` sees when the model runs on the example inputs (None without inputs).

    One forward pass records the inputs of every candidate module, before any of them is replaced.
    """
    if ctx.example_args is None and not ctx.example_kwargs:
        return None
    if "norm_inputs" not in ctx.cache:
        targets = [s.module for s in ctx.inventory if s.is_module and s.module is not None]
        ctx.cache["norm_inputs"] = record_module_inputs(
            ctx.model, targets, ctx.example_args, ctx.example_kwargs
        )
    return ctx.cache["norm_inputs"].get(id(module))


def swap_norm(
    model: nn.Module,
    to: str,
    example_args: tuple | None = None,
    example_kwargs: dict | None = None,
    *,
    inplace: bool = False,
) -> tuple[nn.Module, PassReport]:
    """Functional form of :class:`SwapNorm`."""
    return SwapNorm(to)(model, example_args, example_kwargs, inplace=inplace)
