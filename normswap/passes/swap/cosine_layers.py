"""Turn Linear and Conv layers into cosine-normalized layers (architectural; Luo et al. 2017).

A layer ``y = W x + b`` becomes ``y' = s * cos([x, 1], [W, b])`` (:mod:`normswap.modules.cosine`), with
``s`` a learnable per-output scale. Since ``y_j = ||x~|| ||w~_j|| cos_j`` exactly, the change divides each
output row by a per-row scalar ``||x~||`` (per sample, per position for a conv) and each output feature
by ``||w~_j||``, which the scale absorbs. So:

- read only by a LayerNorm/RMSNorm over (a part of) the same row, through ops that commute with a
  positive scale (views, permutes, eval dropout, ReLU), the per-row scalar cancels in the norm and the
  change is lossless up to the norm's eps, *provided* ``s = k ||w~||`` with one ``k`` for all outputs
  (a norm removes a common factor, not a per-feature one). That is the fit taken there:
  ``k = sum (||w~|| c) y / sum (||w~|| c)^2`` over the example rows;
- anywhere else (a BatchNorm in eval, which is a per-feature affine; a GroupNorm or InstanceNorm,
  which pool positions of different norms; a GELU, a residual add, a model output) the per-row scalar
  survives and the function changes: ``s_j = sum c_j y_j / sum c_j^2``, the per-output least-squares
  fit to the original outputs on the example inputs (``--calibrate`` refits it on data, layer by layer).

Which layers: ``layers`` (glob patterns on module paths; each that matches no Linear/Conv is a skip with
that reason), or by default every Linear/Conv whose output is read only by norms (the case where the
scale is discarded anyway). Refused, with the reason: a grouped conv or one with non-zero padding modes,
a ConvTranspose or a Linear/Conv subclass with its own forward (not a candidate: its class is kept), a
layer called at more than one site, a shared or parametrized weight.

Each change reports the SQNR of the layer's output against the original on the example inputs and,
when norms read it, of the norms' outputs (measured with the layer swapped into the model).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from normswap.discover import NormKind, NormSite
from normswap.graph.analysis import GraphView
from normswap.graph.ops import op_name, real_users, tensor_meta
from normswap.modules.cosine import CosineConv, CosineLinear, feature_rows, fit_cosine_scale
from normswap.passes.core.base import (
    Change,
    Pass,
    PassContext,
    RecordedInputs,
    Refusal,
    RewriteKind,
    SkipCause,
    capture_refusal,
    replace_submodule,
)
from normswap.verify.metrics import sqnr_db

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Ops through which a positive per-row factor reaches the norm unchanged (f(a x) = a f(x), a > 0).
_SCALE_COMMUTING = frozenset(
    {
        "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "flatten", "unflatten", "unsqueeze",
        "squeeze", "contiguous", "clone", "alias", "to", "detach", "dropout", "feature_dropout", "relu",
        "leaky_relu", "expand",
    }
)  # fmt: skip
NOT_A_NORM_READER = (
    "the default selection takes the layers whose output only norms read (name it with --layers to "
    "convert it anyway)"
)


@dataclass(frozen=True)
class LayerSite:
    """A layer to convert, or (``module`` None) a ``layers`` pattern that matched none."""

    path: str
    module: nn.Module | None = None


@dataclass(frozen=True)
class CosinePlan:
    site: LayerSite
    readers: tuple[NormSite, ...]
    # every reader is a LayerNorm/RMSNorm over features of one row: the per-row factor cancels there
    scale_invariant: bool
    sample: torch.Tensor | None


@dataclass
class _Prepared:
    inputs: RecordedInputs
    norm_of: dict[fx.Node, NormSite] = field(default_factory=dict)


def _is_plain_layer(module: nn.Module) -> bool:
    """A Linear/Conv whose forward is its class's own (a subclass with another forward computes
    something else, which a cosine layer would not keep)."""
    base = next((cls for cls in _LAYERS if isinstance(module, cls)), None)
    return base is not None and type(module).forward is base.forward


def _moved_feature_dim(user: fx.Node, dim: int | None) -> int | None:
    """Where the layer's feature dim is in ``user``'s output, after a layout op; None once unknown."""
    if dim is None:
        return None
    name, meta = op_name(user), tensor_meta(user)
    ndim = len(meta[0]) if meta is not None else None
    source = user.args[0] if user.args else None
    source_meta = tensor_meta(source) if isinstance(source, fx.Node) else None
    rank = len(source_meta[0]) if source_meta is not None else None
    if name in ("transpose", "t", "permute", "movedim") and rank is not None:
        order = list(range(rank))
        if name == "t":
            order = order[::-1]
        elif name == "transpose":
            a, b = (int(x) % rank for x in user.args[1:3])
            order[a], order[b] = order[b], order[a]
        elif name == "permute":
            order = [int(x) % rank for x in user.args[1]]
        else:
            return None  # movedim: not followed
        return order.index(dim)
    if name in ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze", "expand"):
        # the last dim keeps the features only if it keeps its size: otherwise unknown
        if rank is not None and ndim is not None and dim == rank - 1 and source_meta[0][-1] == meta[0][-1]:
            return ndim - 1
        return None
    return dim


def _readers(
    view: GraphView, path: str, norm_of: dict[fx.Node, NormSite]
) -> tuple[list[tuple[NormSite, bool | None]], str | None]:
    """The norm sites that read the output of the layer at ``path`` (through scale-commuting ops), each
    with whether the layer's features reach it in its last dim (None: not followed), or the reason some
    other op reads it."""
    call = view.calls[path][0]
    inside = call.node_set
    found: list[tuple[NormSite, bool | None]] = []
    starts = [(n, _feature_dim_of(n)) for n in call.outputs()]
    frontier, seen = starts, set()
    while frontier:
        node, dim = frontier.pop()
        for user in real_users(node):
            if user in inside or user in seen:
                continue
            seen.add(user)
            site = norm_of.get(user)
            if site is not None:
                meta = tensor_meta(node)
                last = None if dim is None or meta is None else dim == len(meta[0]) - 1
                if all(site is not f for f, _ in found):
                    found.append((site, last))
            elif op_name(user) in _SCALE_COMMUTING:
                frontier.append((user, _moved_feature_dim(user, dim)))
            elif user.op == "output":
                return [], f"its output is a model output: {NOT_A_NORM_READER}"
            else:
                what = op_name(user) or str(user.target)
                return [], f"its output reaches {what}, not only norms: {NOT_A_NORM_READER}"
    if not found:
        return [], f"nothing reads its output: {NOT_A_NORM_READER}"
    return found, None


def _feature_dim_of(node: fx.Node) -> int | None:
    """The feature dim of a Linear's or Conv's output: the last for a Linear, 1 for a conv (ndim > 2)."""
    meta = tensor_meta(node)
    if meta is None:
        return None
    return 1 if op_name(node) in ("conv1d", "conv2d", "conv3d", "convolution") else len(meta[0]) - 1


def _removes_row_scale(site: NormSite, features: int, last: bool | None) -> bool:
    """A LayerNorm/RMSNorm module whose normalized features lie within one output row of the layer: the
    layer's features reach it in its last dim (``last``; None where a reshape was not followed, when the
    sizes must agree instead)."""
    if site.kind not in (NormKind.LAYER, NormKind.RMS) or not site.is_module or site.normalized_shape is None:
        return False
    if last is False:
        return False
    size = math.prod(site.normalized_shape)
    return size <= features and features % size == 0


class CosineLayers(Pass[LayerSite, CosinePlan, _Prepared]):
    name = "cosine_layers"
    kind = RewriteKind.ARCHITECTURAL

    def __init__(self, layers: Sequence[str] | None = None) -> None:
        """``layers``: glob patterns on module paths (``encoder.*.dense``); None: the layers that feed a norm."""
        self.layers = tuple(layers) if layers else None

    def prepare(self, ctx: PassContext) -> _Prepared:
        layers = [m for m in ctx.modules.values() if isinstance(m, _LAYERS)]
        prepared = _Prepared(RecordedInputs(ctx, layers))
        if ctx.view is not None:
            for site in ctx.inventory:
                if site.is_module:
                    for call in ctx.view.calls.get(site.path, []):
                        prepared.norm_of.update(dict.fromkeys(call.nodes, site))
        return prepared

    def candidates(self, ctx: PassContext, state: _Prepared) -> list[LayerSite]:
        plain = [(p, m) for p, m in ctx.modules.items() if p and _is_plain_layer(m)]
        if self.layers is None:
            return [LayerSite(p, m) for p, m in plain]
        chosen = [
            LayerSite(p, m) for p, m in plain if any(fnmatch.fnmatchcase(p, pat) for pat in self.layers)
        ]
        missing = [
            LayerSite(pat) for pat in self.layers if not any(fnmatch.fnmatchcase(p, pat) for p, _ in plain)
        ]
        return chosen + missing

    def check(self, site: LayerSite, ctx: PassContext, state: _Prepared) -> CosinePlan | Refusal | str:
        module = site.module
        if module is None:
            return Refusal(
                f"--layers pattern {site.path!r} matches no Linear or Conv1d/2d/3d module",
                SkipCause.UNSUPPORTED,
            )
        if parametrize.is_parametrized(module):
            return "its weight is computed by a parametrization (weight norm?): --remove-weight-norm first"
        if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            if module.groups != 1:
                return Refusal(
                    f"grouped conv (groups={module.groups}): its receptive field is one group's channels, "
                    "a patch norm per group that CosineConv does not build",
                    SkipCause.UNSUPPORTED,
                )
            if module.padding_mode != "zeros":
                return Refusal(
                    f"padding_mode={module.padding_mode!r}: CosineConv pads with zeros", SkipCause.UNSUPPORTED
                )
        shared = [
            p
            for p, m in ctx.modules.items()
            if m is not module and getattr(m, "weight", None) is module.weight
        ]
        if shared:
            return f"its weight is shared with {shared[0]}: a cosine layer of one would change the other"
        read: list[tuple[NormSite, bool | None]] = []
        if ctx.view is not None:
            calls = ctx.view.call_count(site.path)
            if calls > 1:
                return f"called at {calls} sites: one scale cannot be fitted to each"
            if calls == 0 and self.layers is None and ctx.has_inputs:
                return Refusal(
                    f"it does not run on the example inputs, so what reads it is unknown: {NOT_A_NORM_READER}",
                    SkipCause.ARCHITECTURE,
                )
            if calls == 1:
                read, reason = _readers(ctx.view, site.path, state.norm_of)
                if reason is not None and self.layers is None:
                    return Refusal(reason, SkipCause.ARCHITECTURE)
        elif self.layers is None:
            return capture_refusal(ctx, "which layers feed a norm")
        features = module.out_features if isinstance(module, nn.Linear) else module.out_channels
        readers = [r for r, _ in read]
        invariant = bool(read) and all(_removes_row_scale(r, features, last) for r, last in read)
        return CosinePlan(site, tuple(readers), invariant, state.inputs.of(module))

    def apply(self, plan: CosinePlan, ctx: PassContext, state: _Prepared) -> Change:
        path, old = plan.site.path, plan.site.module
        assert old is not None
        new = cosine_twin(old)
        conv = isinstance(new, CosineConv)
        details: dict[str, Any] = {
            "from_class": type(old).__name__,
            "to_class": type(new).__name__,
            "readers": [r.path for r in plan.readers],
            "scale_invariant_readers": plan.scale_invariant,
        }
        new.shared_scale = plan.scale_invariant  # what calibration refits: one factor, or one per output
        base = new.weight_norms().detach()
        with torch.no_grad():
            if plan.sample is None:
                # no rows to fit on: the per-feature factor alone (the output is the original / ||x~||)
                new.scale.copy_(base)
                details["fit"] = "weight norms (no example inputs)"
            else:
                cos = feature_rows(new.cosine(plan.sample), conv)
                want = feature_rows(old(plan.sample), conv)
                scale = fit_cosine_scale(cos, want, base if plan.scale_invariant else None)
                new.scale.copy_(scale.to(new.scale.dtype))
                details["fit"] = "shared factor" if plan.scale_invariant else "per output"
                details["fit_rows"] = int(cos.shape[0])
                details["site_sqnr_db"] = sqnr_db(old(plan.sample), new(plan.sample))
        if plan.sample is not None and plan.readers:
            details["reader_sqnr_db"] = _reader_sqnr(ctx, path, new, plan.readers)
        else:
            replace_submodule(ctx.model, path, new)
        fit = details["fit"]
        return Change(
            self.name,
            path,
            self.kind,
            f"{type(old).__name__} -> {type(new).__name__} (scale: {fit})",
            details,
        )


def cosine_twin(layer: nn.Module) -> CosineLinear | CosineConv:
    """A cosine layer with ``layer``'s weight and bias (copied), dtype and device; its scale is 1."""
    weight = layer.weight
    bias = layer.bias is not None
    new: CosineLinear | CosineConv
    if isinstance(layer, nn.Linear):
        new = CosineLinear(
            layer.in_features, layer.out_features, bias, device=weight.device, dtype=weight.dtype
        )
    else:
        new = CosineConv(
            layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, layer.padding,
            layer.dilation, bias, device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
    with torch.no_grad():
        new.weight.copy_(weight)
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
    return new


def _reader_sqnr(ctx: PassContext, path: str, new: nn.Module, readers: Sequence[NormSite]) -> float:
    """Put ``new`` at ``path`` and return the worst SQNR of the readers' outputs against those of the
    model before the swap, on the example inputs."""
    modules = [r.module for r in readers if r.module is not None]

    def outputs() -> list[torch.Tensor]:
        seen: list[torch.Tensor] = []
        handles = [
            m.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone())) for m in modules
        ]
        try:
            with torch.no_grad():
                ctx.model(*(ctx.example_args or ()), **(ctx.example_kwargs or {}))
        finally:
            for h in handles:
                h.remove()
        return seen

    before = outputs()
    replace_submodule(ctx.model, path, new)
    after = outputs()
    return min((sqnr_db(b, a) for b, a in zip(before, after, strict=True)), default=math.inf)
