"""Replace norms by another kind of norm (architectural: the function changes on purpose).

Targets: rmsnorm, layernorm, batchnorm, groupnorm (``groups``), instancenorm, dyt, derf, identity. Each swap
keeps acting on the same features, whatever the layout (see :mod:`normswap.modules.layout`):

============== ============================================ =============================================
target         on channel-first features (BN/GN/IN,         on channel-last features (LayerNorm/RMSNorm
               LayerNorm2d: NCHW, NCL, NC)                  over the last dim: tokens, hidden)
============== ============================================ =============================================
layernorm      over the channels at each position           torch-style LayerNorm over the last dim
rmsnorm        RMS over the channels at each position       RMSNorm over the last dim
batchnorm      BatchNorm1d/2d/3d                            each hidden feature over batch and tokens
groupnorm      GroupNorm (group channels x positions)       groups of hidden features at each token
instancenorm   InstanceNorm (each channel over positions)   each hidden feature over the tokens of a
                                                            sample (refused for 2-D inputs: no tokens)
dyt            tanh(alpha x) w + b per channel              tanh(alpha x) w + b per feature
derf           erf(alpha x + s) w + b per channel           erf(alpha x + s) w + b per feature
identity       the norm removed, x w + b kept               the norm removed, x w + b kept
============== ============================================ =============================================

Every figure comes from the site's record (``site.semantics``, computed once by discovery): a
LayerNorm <-> RMSNorm swap keeps eps (as the norm applies it for its dtype: ``nn.RMSNorm(eps=None)``'s
is the dtype's), weight, the LayerNorm's bias (as an RMSNorm bias), casting mode
and weight offset (Gemma's ``1 + w``). Every other swap carries the per-feature weight and bias (the
offset applied) and eps. A new BatchNorm's running statistics come from the example inputs (from the
calibration data when the caller calibrates afterwards). A norm over more than one dim (LayerNorm over
(H, W)) has no per-feature meaning and is refused with the reason.

Each change records how far the new norm moves that site's output on the example inputs (SQNR in dB
of the new norm against the old one, applied to the same captured input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from normswap.discover import NormSite
from normswap.discover.own_forward import norm_act_tail
from normswap.modules.layout import (
    Derf,
    DyT,
    FeatureAffine,
    FeatureBatchNorm,
    FeatureGroupNorm,
    FeatureInstanceNorm,
    FeatureLayerNorm,
)
from normswap.modules.norms import LayerNorm, RMSNorm
from normswap.modules.semantics import FUSED, SWAP_TARGETS, NormKind, parse_target
from normswap.passes.core.base import (
    Change,
    Pass,
    PassContext,
    PassReport,
    RecordedInputs,
    RewriteKind,
    replace_submodule,
)
from normswap.passes.swap.norm_act import is_identity, with_tail
from normswap.verify.metrics import sqnr_db

_CHANNEL_FIRST = (NormKind.BATCH, NormKind.GROUP, NormKind.INSTANCE)
_BATCH_NORMS = {3: nn.BatchNorm1d, 2: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
_INSTANCE_NORMS = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}


def feature_dim(site: NormSite) -> int | None:
    """The dim holding the features a norm's weight scales: 1 (channel-first), -1 (last), None if neither."""
    if site.kind in _CHANNEL_FIRST:
        return 1
    if site.normalized_shape is None or len(site.normalized_shape) != 1:
        return None
    if site.normalized_dims == (-1,):
        return -1
    if site.normalized_dims == (-3,):  # timm's LayerNorm2d: the channels of NCHW
        return 1
    return None


def build_norm(target_kind: str, site: NormSite, like: nn.Module) -> nn.Module:
    """A new norm of ``target_kind`` (rms or layer) with ``site``'s recorded semantics: shape, eps as
    applied, affine parameters, casting mode and weight offset."""
    params = [t for t in like.parameters(recurse=False)] + [t for t in like.buffers(recurse=False)]
    device = params[0].device if params else None
    dtype = next((t.dtype for t in params if t.is_floating_point()), None)
    cls = RMSNorm if NormKind.parse(target_kind) is NormKind.RMS else LayerNorm
    new = cls(**site.semantics.module_kwargs(), device=device, dtype=dtype)
    weight, bias = affine_tensors(site, like)
    with torch.no_grad():
        for src, dst in ((weight, new.weight), (bias, new.bias)):
            if dst is not None and src is not None:
                dst.copy_(src.reshape(dst.shape))
    return new


def affine_tensors(site: NormSite, module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The norm's stored weight and bias, under the names discovery recorded for them."""
    found = []
    for name in (site.weight_name, site.bias_name):
        tensor = None
        if name is not None:
            try:
                tensor = module.get_parameter(name)
            except AttributeError:
                try:
                    tensor = module.get_buffer(name)
                except AttributeError:
                    tensor = getattr(module, name, None)
        found.append(tensor.detach() if isinstance(tensor, torch.Tensor) else None)
    return found[0], found[1]


def _effective_affine(site: NormSite, module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The per-feature weight and bias a norm applies (Gemma's stored ``w`` means ``1 + w``)."""
    weight, bias = affine_tensors(site, module)
    weight = weight.reshape(-1) + site.weight_offset if weight is not None else None
    bias = bias.reshape(-1) if bias is not None else None
    return weight, bias


def build_layout_norm(
    target: str, site: NormSite, like: nn.Module, sample: torch.Tensor | None, groups: int | None
) -> nn.Module:
    """The ``target`` norm for ``site``'s features (see the module doc's table), parameters carried."""
    dim = feature_dim(site)
    assert dim is not None and site.normalized_shape is not None
    features = site.normalized_shape[0]
    eps = float(site.eps) if site.eps is not None else 1e-5
    ndim = sample.ndim if sample is not None else None
    if target in ("rms", "layer"):
        if dim == -1:
            return build_norm(target, site, like)
        new: nn.Module = FeatureLayerNorm(features, eps, dim=1, rms=target == "rms")
    elif target == "batch":
        if dim == 1:
            new = _BATCH_NORMS[ndim or 4](features, eps=eps)
        else:
            new = FeatureBatchNorm(features, eps=eps, dim=-1)
        new.eval()
        if sample is not None:
            _statistics_from(new, sample, dim)
    elif target == "group":
        assert groups is not None
        new = FeatureGroupNorm(groups, features, eps=eps, dim=dim)
    elif target == "instance":
        new = (
            FeatureInstanceNorm(features, eps, dim=dim)
            if dim == -1
            else _INSTANCE_NORMS[ndim or 4](features, eps=eps, affine=True)
        )
    elif target == "dyt":
        new = DyT(features, dim=dim)
    elif target == "derf":
        new = Derf(features, dim=dim)
    else:
        new = FeatureAffine(features, dim=dim)
    weight, bias = _effective_affine(site, like)
    with torch.no_grad():
        if weight is not None and getattr(new, "weight", None) is not None:
            new.weight.copy_(weight)
        if bias is not None and getattr(new, "bias", None) is not None:
            new.bias.copy_(bias)
    params = [*like.parameters(recurse=False), *like.buffers(recurse=False)]
    floating = next((t for t in params if t.is_floating_point()), None)
    # the old norm's device and dtype: a GPU model swapped without example inputs stays on its GPU
    return new.to(device=floating.device, dtype=floating.dtype) if floating is not None else new


def _statistics_from(bn: nn.Module, sample: torch.Tensor, dim: int) -> None:
    """Running mean/var of a new BatchNorm from one batch of its input (population variance)."""
    x = sample.detach().double().movedim(dim, 0).reshape(sample.shape[dim], -1)
    with torch.no_grad():
        bn.running_mean.copy_(x.mean(1))
        bn.running_var.copy_(x.var(1, unbiased=False))


@dataclass(frozen=True)
class SwapPlan:
    """A norm to swap, with the input it sees on the example inputs (None without them)."""

    site: NormSite
    sample: torch.Tensor | None


class SwapNorm(Pass[NormSite, SwapPlan, RecordedInputs]):
    name = "swap_norm"
    kind = RewriteKind.ARCHITECTURAL

    def __init__(self, to: str, from_kinds: tuple[str, ...] | None = None, groups: int | None = None) -> None:
        """``to``: a key of ``SWAP_TARGETS`` or a kind (``rmsnorm`` or ``rms``); ``from_kinds``: only
        norms of these kinds (``layer`` or ``layernorm``: :meth:`normswap.discover.NormKind.parse`)."""
        try:
            target = parse_target(to)
        except ValueError:
            target = FUSED
        if target == FUSED:  # not a swap: FuseNorm's
            raise ValueError(f"unknown norm target {to!r}; choose from {', '.join(SWAP_TARGETS)}")
        to = target
        if to == "groupnorm" and (groups is None or groups < 1):
            raise ValueError("groupnorm needs the number of groups (groups >= 1)")
        self.to = to
        self.target_kind = SWAP_TARGETS[to]
        self.from_kinds = tuple(NormKind.parse(k) for k in from_kinds) if from_kinds is not None else None
        self.groups = groups

    def prepare(self, ctx: PassContext) -> RecordedInputs:
        # one forward records the inputs of every candidate module, before any of them is replaced
        return RecordedInputs(ctx, [s.module for s in ctx.inventory if s.is_module and s.module is not None])

    def candidates(self, ctx: PassContext, state: RecordedInputs) -> list[NormSite]:
        return [
            s
            for s in ctx.inventory
            if s.kind != self.target_kind and (self.from_kinds is None or s.kind in self.from_kinds)
        ]

    def check(self, site: NormSite, ctx: PassContext, state: RecordedInputs) -> SwapPlan | str:
        if not site.is_module:
            return f"{site.source} norm computed {site.inside()}, not a module: swapping it needs a graph rewrite"
        if site.normalized_shape is None:
            return "its normalized shape could not be determined"
        dim = feature_dim(site)
        if dim is None:
            return (
                f"normalizes dims {site.normalized_dims} of shape {site.normalized_shape}: no single feature "
                f"dim, so a {self.to} has no defined meaning here"
            )
        if site.kind in ("layer", "rms") and dim == -1 and self.target_kind in ("layer", "rms"):
            ndim = len(site.normalized_shape)
            if site.normalized_dims != tuple(range(-ndim, 0)):
                return f"normalizes dims {site.normalized_dims}, not the trailing {ndim} dim(s) its shape implies"
        if site.kind in ("layer", "rms") and site.eps is None:
            return "its eps could not be determined"
        if (site.affine and site.weight_name is None) or (site.bias and site.bias_name is None):
            return "its weight or bias is computed in the forward, not a stored tensor: it cannot be carried"
        features = site.normalized_shape[0]
        if self.target_kind == "group" and features % (self.groups or 1):
            return f"{features} features do not split into {self.groups} groups"
        assert site.module is not None
        sample = state.of(site.module)
        if self.target_kind == "instance" and dim == -1 and (sample is None or sample.ndim < 3):
            what = "unknown (no example inputs)" if sample is None else f"{sample.ndim}-D"
            return (
                f"input is {what}: an instance norm needs positions (tokens) to normalize each feature over"
            )
        if self.target_kind == "instance" and sample is not None and sample.ndim >= 3:
            positions = sample[0].numel() // sample.shape[dim]
            if positions == 1:
                return "its input has one position per feature: an instance norm would output its bias alone"
        if self.target_kind in ("batch", "instance") and dim == 1 and sample is None and site.kind != "batch":
            return f"the input rank is unknown (no example inputs), so the {self.to} class cannot be chosen"
        if self.target_kind == "batch" and sample is not None and sample.numel() == sample.shape[dim]:
            # the statistics come from the example's values per feature: from one, the variance is 0 and
            # the new BatchNorm divides by sqrt(eps) (a 1x16 example blew outputs up 300x)
            return (
                f"the example inputs give it one value per feature (shape {tuple(sample.shape)}): a "
                "BatchNorm's statistics need several; give example inputs with more rows or tokens"
            )
        return SwapPlan(site, sample)

    def apply(self, plan: SwapPlan, ctx: PassContext, state: RecordedInputs) -> Change:
        site, sample = plan.site, plan.sample
        old = site.module
        assert old is not None
        new = build_layout_norm(self.target_kind, site, old, sample, self.groups)
        details: dict[str, Any] = {
            "from_class": type(old).__name__,
            "to_class": type(new).__name__,
            "feature_dim": feature_dim(site),
        }
        if self.target_kind == "batch":
            details["statistics"] = "example inputs" if sample is not None else "defaults (mean 0, var 1)"
        tail = norm_act_tail(old)
        if tail and not is_identity(tail):
            # timm's BatchNormAct2d: only the norm is swapped; its dropout and activation still follow
            new = with_tail(tail, new, head_name="norm")
            details["kept"] = [name for name, _ in tail]
        if sample is not None:
            new = new.to(sample.device)
            with torch.no_grad():
                details["site_sqnr_db"] = sqnr_db(old(sample), new(sample))
        replace_submodule(ctx.model, site.path, new)
        what = f"{type(old).__name__} -> {details['to_class']}"
        if "kept" in details:
            what += f", then its {' and '.join(details['kept'])} as before"
        return Change(self.name, site.path, self.kind, what, details)


def swap_norm(
    model: nn.Module,
    to: str,
    example_args: tuple | None = None,
    example_kwargs: dict | None = None,
    *,
    groups: int | None = None,
    inplace: bool = False,
) -> tuple[nn.Module, PassReport]:
    """Functional form of :class:`SwapNorm`."""
    return SwapNorm(to, groups=groups)(model, example_args, example_kwargs, inplace=inplace)
