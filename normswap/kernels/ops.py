"""The fused norms as ``torch.library`` custom ops (tier 2), and the differentiable functions over them.

Ops, all in the ``normswap`` namespace and normalizing over the last dim::

    rms_norm_fwd(x, weight?, bias?, eps, casting, weight_offset)             -> (y, rstd)
    rms_norm_bwd(dy, x, weight?, bias?, rstd, casting, weight_offset)        -> (dx, dweight, dbias)
    layer_norm_fwd(x, weight?, bias?, eps, casting, weight_offset)           -> (y, mean, rstd)
    layer_norm_bwd(dy, x, weight?, bias?, mean, rstd, casting, weight_offset) -> (dx, dweight, dbias)
    add_rms_norm_fwd(x, residual, weight?, bias?, eps, casting, weight_offset)  -> (y, h, rstd)
    add_rms_norm_bwd(dy, dh?, h, weight?, bias?, rstd, casting, weight_offset)   -> (dx, dweight, dbias)
    add_layer_norm_fwd(x, residual, weight?, bias?, eps, casting, weight_offset) -> (y, h, mean, rstd)
    add_layer_norm_bwd(dy, dh?, h, weight?, bias?, mean, rstd, casting, weight_offset) -> (dx, dweight, dbias)

``mean``/``rstd`` are fp32 of shape ``x.shape[:-1]``; a backward returns an empty tensor for the
gradient of an absent weight or bias (an op cannot return None). For the ``add_`` ops ``h = x + residual``
and ``dx`` is the gradient of both x and residual, including ``dh`` (what reached h from its other
readers). The forward ops are differentiable (``register_autograd`` calls the backward op). A double
backward (``create_graph=True``) differentiates the reference math instead, which autograd can
differentiate again; the backward ops themselves have no derivative. Every op has a fake
implementation, so ``torch.compile`` and ``torch.export`` keep the op as one node instead of tracing
into it.

Where they run: Triton on CUDA tensors of fp32/fp16/bf16; the reference math of
:mod:`normswap.kernels.reference` (and its hand-derived backward) everywhere else, and on CPU
unless a test asks for the Triton interpreter with :func:`triton_on_cpu`. An eager call on a CUDA
tensor takes torch's own ops instead where they are measured faster for its shape (a few rows, short
rows: :mod:`normswap.kernels._routes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from normswap.kernels._eager import (
    eager_plan,
    flatten_norm_dims,
    skips_dispatcher,
    transformed,
    use_triton,
)
from normswap.kernels._launch import (
    check_args,
    launch_bwd,
    launch_fwd,
    norm_bwd,
    norm_fwd,
    output_dtype,
)
from normswap.kernels._registration import register_op
from normswap.kernels._routes import torch_route
from normswap.kernels.reference import REFERENCES, KernelNormKind, reference_bwd, reference_fwd


def _empty_grad(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def _fwd(
    kind: KernelNormKind,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    check_args(x, residual, weight, bias, casting)
    if use_triton(x, residual, weight, bias):
        return norm_fwd(kind, x, residual, weight, bias, eps, casting, weight_offset)
    return reference_fwd(kind, x, residual, weight, bias, eps, casting, weight_offset)


def _bwd(
    kind: KernelNormKind,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x, dy, dh, weight, bias):
        dx, dw, db = norm_bwd(kind, dy, dh, x, weight, bias, mean, rstd, casting, weight_offset)
    else:
        dx, dw, db = reference_bwd(kind, dy, dh, x, weight, bias, mean, rstd, casting, weight_offset)
    return dx, dw if dw is not None else _empty_grad(x), db if db is not None else _empty_grad(x)


# ---------------------------------------------------------------------------------------------------
# The eight ops, defined from one table: what differs between them is only which of residual, dh and
# mean appear in the argument and result lists, so the schemas are written out and the implementations
# unpack them.


@dataclass(frozen=True)
class _OpFamily:
    """One norm's forward and backward op: ``{add_}{kind}_norm_{fwd,bwd}``."""

    kind: KernelNormKind
    with_residual: bool

    @property
    def name(self) -> str:
        return f"{'add_' if self.with_residual else ''}{self.kind}_norm"

    @property
    def n_stats(self) -> int:
        return 2 if self.kind == "layer" else 1  # (mean,) rstd

    def fwd_schema(self) -> str:
        residual = "Tensor residual, " if self.with_residual else ""
        outs = ", ".join(["Tensor"] * (1 + self.with_residual + self.n_stats))
        return (
            f"(Tensor x, {residual}Tensor? weight, Tensor? bias, float eps, str casting, "
            f"float weight_offset) -> ({outs})"
        )

    def bwd_schema(self) -> str:
        # The add_ backwards take h (what was normalized) and the gradient dh from h's other readers.
        inputs = "Tensor? dh, Tensor h" if self.with_residual else "Tensor x"
        mean = "Tensor mean, " if self.kind == "layer" else ""
        return (
            f"(Tensor dy, {inputs}, Tensor? weight, Tensor? bias, {mean}Tensor rstd, str casting, "
            "float weight_offset) -> (Tensor, Tensor, Tensor)"
        )

    def split_fwd_args(self, args: tuple) -> tuple:
        """Forward op arguments -> (x, residual, weight, bias, eps, casting, weight_offset)."""
        if self.with_residual:
            return args
        x, *rest = args
        return (x, None, *rest)

    def pack_fwd_outputs(
        self, y: torch.Tensor, h: torch.Tensor | None, mean: torch.Tensor | None, rstd: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        hs = (h,) if self.with_residual else ()
        means = (mean,) if self.kind == "layer" else ()
        return (y, *hs, *means, rstd)

    def split_bwd_args(self, args: tuple) -> tuple:
        """Backward op arguments -> (dy, dh, x, weight, bias, mean, rstd, casting, weight_offset)."""
        dy, *rest = args
        if not self.with_residual:
            rest = [None, *rest]
        if self.kind == "rms":
            rest.insert(4, None)
        return (dy, *rest)


_FAMILIES = tuple(_OpFamily(kind, res) for res in (False, True) for kind in ("rms", "layer"))


def _define(family: _OpFamily) -> None:
    def fwd(*args):
        x, residual, weight, bias, eps, casting, weight_offset = family.split_fwd_args(args)
        return family.pack_fwd_outputs(
            *_fwd(family.kind, x, residual, weight, bias, eps, casting, weight_offset)
        )

    def fake_fwd(*args):
        x, _residual, weight, bias, _eps, casting, _offset = family.split_fwd_args(args)
        # Shapes and dtypes only, contiguous like the real outputs.
        y = x.new_empty(x.shape, dtype=output_dtype(x.dtype, weight, bias, casting))
        h = x.new_empty(x.shape)
        stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
        return family.pack_fwd_outputs(y, h, stats, stats.clone())

    def bwd(*args):
        dy, dh, x, weight, bias, mean, rstd, casting, weight_offset = family.split_bwd_args(args)
        return _bwd(family.kind, dy, dh, x, weight, bias, mean, rstd, casting, weight_offset)

    def fake_bwd(*args):
        _dy, _dh, x, weight, bias, *_ = family.split_bwd_args(args)
        dw = weight.new_empty(weight.shape) if weight is not None else _empty_grad(x)
        db = bias.new_empty(bias.shape) if bias is not None else _empty_grad(x)
        return x.new_empty(x.shape), dw, db

    # The fakes below replace the traced implementation triton_op registers as the fake: they need
    # no GPU to answer shapes (export of a CUDA model's graph on a CPU-only machine, for one).
    fwd_op = register_op(f"normswap::{family.name}_fwd", fwd, family.fwd_schema(), fake_fwd)
    bwd_op = register_op(f"normswap::{family.name}_bwd", bwd, family.bwd_schema(), fake_bwd)

    def setup_context(ctx, inputs, output) -> None:
        _x, _residual, weight, bias, _eps, casting, weight_offset = family.split_fwd_args(inputs)
        # The add_ ops save h = x + residual, the tensor that was normalized; the others x itself.
        normalized = output[1] if family.with_residual else inputs[0]
        stats = output[-family.n_stats :]
        ctx.save_for_backward(normalized, weight, bias, *stats)
        # a double backward re-derives h from the inputs: h itself is this op's output, and
        # differentiating through it from inside this op's backward would re-enter the op
        ctx.summands = (inputs[0], _residual) if family.with_residual else None
        ctx.casting, ctx.weight_offset, ctx.eps = casting, weight_offset, _eps
        ctx.mark_non_differentiable(*stats)
        # No zero tensors for the statistics' gradients (never used): autograd would build and fill
        # one per statistic on every backward, a kernel launch each where host time counts.
        ctx.set_materialize_grads(False)

    def backward(ctx, dy, *other_grads):
        normalized, weight, bias, *stats = ctx.saved_tensors
        dh = (other_grads[0],) if family.with_residual else ()
        if dy is None:  # y unused (only h reached the loss), or nothing reached this op at all
            if not dh or dh[0] is None:
                return (None,) * (len(ctx.needs_input_grad))
            dy = normalized.new_zeros(
                normalized.shape, dtype=output_dtype(normalized.dtype, weight, bias, ctx.casting)
            )
        if torch.is_grad_enabled():
            # create_graph=True (a double backward is coming): the backward op has no derivative, so
            # differentiate the reference math instead, which autograd can differentiate again
            source = ctx.summands[0] + ctx.summands[1] if family.with_residual else normalized
            dx, dw, db = _differentiable_bwd(family.kind, ctx, dy, dh, source, weight, bias)
        else:
            bwd_args = (dy, *dh, normalized, weight, bias, *stats, ctx.casting, ctx.weight_offset)
            if skips_dispatcher(dy, *dh, normalized, weight, bias):  # its forward checked the arguments
                dx, dw, db = launch_bwd(family.kind, *family.split_bwd_args(bwd_args))
            else:
                dx, dw, db = bwd_op(*bwd_args)
        # Gradients in input order: x[, residual], weight, bias, then None for eps, casting, offset.
        # x and residual enter only through h = x + residual: both get dh, the same tensor.
        i_w = 2 if family.with_residual else 1
        grads: list[torch.Tensor | None] = [dx, dx] if family.with_residual else [dx]
        grads.append(dw if weight is not None and ctx.needs_input_grad[i_w] else None)
        grads.append(db if bias is not None and ctx.needs_input_grad[i_w + 1] else None)
        return (*grads, None, None, None)

    fwd_op.register_autograd(backward, setup_context=setup_context)

    # The same forward, context and backward without the dispatcher, for eager calls (see
    # skips_dispatcher); it returns what the op returns. The forward takes ctx itself: with a separate
    # setup_context, Function.apply binds the arguments through inspect.signature on every call.
    def eager_forward(ctx, *args):
        # _norm checked the arguments and that the kernels take them
        outputs = family.pack_fwd_outputs(*launch_fwd(family.kind, *family.split_fwd_args(args)))
        setup_context(ctx, args, outputs)
        return outputs

    _EAGER_FUNCTIONS[family.name] = type(
        f"{family.name.title().replace('_', '')}Function",
        (torch.autograd.Function,),
        {"forward": staticmethod(eager_forward), "backward": staticmethod(backward)},
    )


_EAGER_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}


def reference_decompositions() -> dict[Any, Any]:
    """Each forward op -> the same computation in torch's own operators (the reference math), for a
    program that must run without normswap (``ExportedProgram.run_decompositions``: a portable .pt2)."""
    table = {}
    for family in _FAMILIES:

        def decomposed(*args: Any, family: _OpFamily = family) -> tuple[torch.Tensor, ...]:
            x, residual, weight, bias, eps, casting, weight_offset = family.split_fwd_args(args)
            outputs = reference_fwd(family.kind, x, residual, weight, bias, eps, casting, weight_offset)
            return family.pack_fwd_outputs(*outputs)

        table[getattr(torch.ops.normswap, f"{family.name}_fwd").default] = decomposed
    return table


def _differentiable_bwd(
    kind: KernelNormKind,
    ctx: object,
    dy: torch.Tensor,
    dh: tuple[torch.Tensor, ...],
    normalized: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """First-order gradients built from differentiable ops (the reference forward, differentiated)."""
    reference = REFERENCES[kind]
    inputs = [t for t in (normalized, weight, bias) if t is not None]
    with torch.enable_grad():
        y = reference(normalized, 1, weight, bias, ctx.eps, ctx.casting, ctx.weight_offset)  # type: ignore[attr-defined]
        grads = torch.autograd.grad(y, inputs, dy, create_graph=True, allow_unused=True)
    found = dict(zip((id(t) for t in inputs), grads, strict=True))
    dx = found.get(id(normalized))
    if dh and dh[0] is not None:  # add_* ops: the sum's own gradient joins the norm's
        dx = dh[0] if dx is None else dx + dh[0]
    return (
        dx,
        found.get(id(weight)) if weight is not None else None,
        found.get(id(bias)) if bias is not None else None,
    )


for _family in _FAMILIES:
    _define(_family)


# ---------------------------------------------------------------------------------------------------
# Differentiable functions (what the fused modules call)


def apply_norm(
    kind: KernelNormKind,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
    normalized_ndim: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call the forward op of ``kind`` (with or without the residual add): returns (y, h or None).

    What the fused functions and modules call; an eager call takes its route (the kernel, or torch's own
    ops) from :func:`normswap.kernels._eager.eager_plan`."""
    if transformed():
        # torch.func transforms and forward-mode AD need every op to have their rules, which the
        # custom ops do not (they gave errors, or silently wrong jacfwd tangents): compose the reference
        # math from torch ops instead, which every transform differentiates
        h = x + residual if residual is not None else None
        reference = REFERENCES[kind]
        y = reference(h if h is not None else x, normalized_ndim, weight, bias, eps, casting, weight_offset)
        return y, h
    train = torch.is_grad_enabled() and (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )
    plan = eager_plan(kind, x, residual, weight, bias, casting, weight_offset, normalized_ndim, train)
    if plan is not None and plan.torch:
        if plan.native and residual is None:  # what the original module ran, and nothing around it
            if kind == "layer":
                return F.layer_norm(x, plan.shape, weight, bias, eps), None
            return F.rms_norm(x, plan.shape, weight, eps), None
        return torch_route(
            kind, plan.native, x, residual, weight, bias, eps, casting, weight_offset, normalized_ndim
        )
    xf, w, b = flatten_norm_dims(x, weight, bias, normalized_ndim)
    rf = None
    if residual is not None:
        rf = residual.flatten(-normalized_ndim) if normalized_ndim > 1 else residual
    name = f"{'add_' if rf is not None else ''}{kind}_norm"
    args = (xf, *((rf,) if rf is not None else ()), w, b, float(eps), casting, float(weight_offset))
    if plan is None:
        outputs = getattr(torch.ops.normswap, f"{name}_fwd")(*args)
    elif train:  # eager, checked by the plan: straight to the kernels (see _eager)
        outputs = _EAGER_FUNCTIONS[name].apply(*args)
    else:  # nothing to differentiate: no autograd node, no saved tensors
        y, h, _mean, _rstd = launch_fwd(kind, xf, rf, w, b, float(eps), casting, float(weight_offset))
        outputs = (y, h)
    if normalized_ndim > 1:  # unflatten
        outputs = [t.view(x.shape) for t in outputs[: 2 if rf is not None else 1]]
    return outputs[0], outputs[1] if rf is not None else None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    casting: str = "none",
    weight_offset: float = 0.0,
    normalized_ndim: int = 1,
) -> torch.Tensor:
    """Fused :func:`normswap.kernels.reference.rms_norm_reference`, over the last ``normalized_ndim`` dims."""
    return apply_norm("rms", x, None, weight, bias, eps, casting, weight_offset, normalized_ndim)[0]


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    casting: str = "none",
    weight_offset: float = 0.0,
    normalized_ndim: int = 1,
) -> torch.Tensor:
    """Fused :func:`normswap.kernels.reference.layer_norm_reference`, over the last ``normalized_ndim`` dims."""
    return apply_norm("layer", x, None, weight, bias, eps, casting, weight_offset, normalized_ndim)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    casting: str = "none",
    weight_offset: float = 0.0,
    normalized_ndim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; return rms_norm(h), h`` in one pass over memory."""
    y, h = apply_norm("rms", x, residual, weight, bias, eps, casting, weight_offset, normalized_ndim)
    assert h is not None
    return y, h


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    casting: str = "none",
    weight_offset: float = 0.0,
    normalized_ndim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; return layer_norm(h), h`` in one pass over memory."""
    y, h = apply_norm("layer", x, residual, weight, bias, eps, casting, weight_offset, normalized_ndim)
    assert h is not None
    return y, h


def fused_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    kind: KernelNormKind = "rms",
    casting: str = "none",
    weight_offset: float = 0.0,
    normalized_ndim: int = 1,
    channel_dim: int | None = None,
) -> torch.Tensor:
    """:func:`rms_norm` or :func:`layer_norm` over the last ``normalized_ndim`` dims, or over the one dim
    ``channel_dim`` (counted from the end: -3 is C of NCHW), which is moved last around the kernel.

    What graph passes insert for a norm they found in a graph: one call, whatever its layout.
    """
    if channel_dim is not None:
        x = x.movedim(channel_dim, -1)
    norm = rms_norm if kind == "rms" else layer_norm
    y = norm(x, weight, bias, eps, casting, weight_offset, normalized_ndim)
    return y.movedim(-1, channel_dim) if channel_dim is not None else y
