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
readers). The forward ops are differentiable (``register_autograd`` calls the backward op); the backward
ops are not (no double backward). Every op has a fake implementation, so ``torch.compile`` and
``torch.export`` keep the op as one node instead of tracing into it.

Where they run: Triton on CUDA tensors of fp32/fp16/bf16; the reference math of
:mod:`normswap.modules.functional` (and its hand-derived backward below) everywhere else, and on CPU
unless a test asks for the Triton interpreter with :func:`triton_on_cpu`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from normswap.kernels._launch import (
    NormKind,
    check_args,
    interpreter_enabled,
    norm_bwd,
    norm_fwd,
    output_dtype,
    triton_available,
    triton_supports,
)
from normswap.modules.functional import layer_norm_reference, rms_norm_reference

_force_triton_on_cpu = 0


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Make the ops run their Triton kernels on CPU tensors, through the interpreter.

    For tests on machines without a GPU: it needs triton and ``TRITON_INTERPRET=1``. A plain counter
    rather than a context variable, because the autograd engine may run the backward on another thread.
    """
    global _force_triton_on_cpu
    if not triton_available():
        raise RuntimeError("triton_on_cpu() needs triton installed")
    if not interpreter_enabled():
        raise RuntimeError(
            "triton_on_cpu() needs TRITON_INTERPRET=1: compiled kernels cannot read CPU memory"
        )
    _force_triton_on_cpu += 1
    try:
        yield
    finally:
        _force_triton_on_cpu -= 1


def _use_triton(*tensors: torch.Tensor | None) -> bool:
    x = tensors[0]
    assert x is not None
    if not triton_supports(*tensors):
        return False
    if x.device.type == "cuda":
        return triton_available()
    return x.device.type == "cpu" and _force_triton_on_cpu > 0


def _empty_grad(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


# ---------------------------------------------------------------------------------------------------
# Reference implementations (CPU and anything Triton does not take)


def _reference_fwd(
    kind: NormKind,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    h = x + residual if residual is not None else None
    src = h if h is not None else x
    reference = rms_norm_reference if kind == "rms" else layer_norm_reference
    # The reference function defines y; the statistics are recomputed beside it the same way, for the
    # backward. Outputs are made contiguous because the fake implementations promise that.
    y = reference(src, 1, weight, bias, eps, casting, weight_offset).contiguous()
    x32 = src.float()
    mean = None
    if kind == "rms":
        rstd = torch.rsqrt(x32.pow(2).mean(dim=-1) + eps)
    else:
        mean = x32.mean(dim=-1)
        rstd = torch.rsqrt((x32 - mean.unsqueeze(-1)).pow(2).mean(dim=-1) + eps)
        mean = mean.contiguous()
    return y, h.contiguous() if h is not None else None, mean, rstd.contiguous()


def _reference_bwd(
    kind: NormKind,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward of the reference math in fp32, from the saved statistics (see ``_kernels`` docs)."""
    n_features = x.shape[-1]
    x32 = x.float()
    dy32 = dy.float()
    rstd_ = rstd.float().unsqueeze(-1)
    if kind == "rms":
        n = x32 * rstd_
    else:
        assert mean is not None
        n = (x32 - mean.float().unsqueeze(-1)) * rstd_
    dw = None
    if weight is not None:
        if casting == "llama":
            # What the reference multiplies: (w + offset) rounded in w's dtype, n rounded to x's dtype.
            w_eff = (weight + weight_offset).float() if weight_offset else weight.float()
            n_w = n.to(x.dtype).float()
        else:
            w_eff = weight.float() + weight_offset
            n_w = n
        g = dy32 * w_eff
        dw = (dy32 * n_w).reshape(-1, n_features).sum(0).to(weight.dtype)
    else:
        g = dy32
    db = dy32.reshape(-1, n_features).sum(0).to(bias.dtype) if bias is not None else None
    dx = g - n * (g * n).mean(dim=-1, keepdim=True)
    if kind == "layer":
        dx = dx - g.mean(dim=-1, keepdim=True)
    dx = dx * rstd_
    if dh is not None:
        dx = dx + dh.float()
    return dx.to(x.dtype).contiguous(), dw, db


def _fwd(
    kind: NormKind,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    check_args(x, residual, weight, bias, casting)
    if _use_triton(x, residual, weight, bias):
        return norm_fwd(kind, x, residual, weight, bias, eps, casting, weight_offset)
    return _reference_fwd(kind, x, residual, weight, bias, eps, casting, weight_offset)


def _bwd(
    kind: NormKind,
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
    if _use_triton(x, dy, dh, weight, bias):
        dx, dw, db = norm_bwd(kind, dy, dh, x, weight, bias, mean, rstd, casting, weight_offset)
    else:
        dx, dw, db = _reference_bwd(kind, dy, dh, x, weight, bias, mean, rstd, casting, weight_offset)
    return dx, dw if dw is not None else _empty_grad(x), db if db is not None else _empty_grad(x)


# ---------------------------------------------------------------------------------------------------
# Fake implementations: shapes and dtypes only, contiguous like the real outputs.


def _fake_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    casting: str,
    n_stats: int,
    with_h: bool,
) -> tuple[torch.Tensor, ...]:
    y = x.new_empty(x.shape, dtype=output_dtype(x.dtype, weight, bias, casting))
    h = (x.new_empty(x.shape),) if with_h else ()
    stats = tuple(x.new_empty(x.shape[:-1], dtype=torch.float32) for _ in range(n_stats))
    return (y, *h, *stats)


def _fake_bwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = x.new_empty(x.shape)
    dw = weight.new_empty(weight.shape) if weight is not None else _empty_grad(x)
    db = bias.new_empty(bias.shape) if bias is not None else _empty_grad(x)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------------
# RMSNorm


@torch.library.custom_op("normswap::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, _, rstd = _fwd("rms", x, None, weight, bias, eps, casting, weight_offset)
    return y, rstd


@rms_norm_fwd.register_fake
def _(x, weight, bias, eps, casting, weight_offset):
    return _fake_fwd(x, weight, bias, casting, n_stats=1, with_h=False)


@torch.library.custom_op("normswap::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd("rms", dy, None, x, weight, bias, None, rstd, casting, weight_offset)


@rms_norm_bwd.register_fake
def _(dy, x, weight, bias, rstd, casting, weight_offset):
    return _fake_bwd(x, weight, bias)


def _rms_setup(ctx, inputs, output) -> None:
    x, weight, bias, _eps, casting, weight_offset = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, bias, rstd)
    ctx.casting, ctx.weight_offset = casting, weight_offset
    ctx.mark_non_differentiable(rstd)


def _rms_backward(ctx, dy, _drstd):
    x, weight, bias, rstd = ctx.saved_tensors
    dx, dw, db = rms_norm_bwd(dy, x, weight, bias, rstd, ctx.casting, ctx.weight_offset)
    return _param_grads(ctx, dx, dw, db, weight, bias, has_residual=False)


rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


# ---------------------------------------------------------------------------------------------------
# LayerNorm


@torch.library.custom_op("normswap::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, _, mean, rstd = _fwd("layer", x, None, weight, bias, eps, casting, weight_offset)
    assert mean is not None
    return y, mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, casting, weight_offset):
    return _fake_fwd(x, weight, bias, casting, n_stats=2, with_h=False)


@torch.library.custom_op("normswap::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd("layer", dy, None, x, weight, bias, mean, rstd, casting, weight_offset)


@layer_norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, casting, weight_offset):
    return _fake_bwd(x, weight, bias)


def _layer_setup(ctx, inputs, output) -> None:
    x, weight, bias, _eps, casting, weight_offset = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.casting, ctx.weight_offset = casting, weight_offset
    ctx.mark_non_differentiable(mean, rstd)


def _layer_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(dy, x, weight, bias, mean, rstd, ctx.casting, ctx.weight_offset)
    return _param_grads(ctx, dx, dw, db, weight, bias, has_residual=False)


layer_norm_fwd.register_autograd(_layer_backward, setup_context=_layer_setup)


# ---------------------------------------------------------------------------------------------------
# Residual add + RMSNorm / LayerNorm


@torch.library.custom_op("normswap::add_rms_norm_fwd", mutates_args=())
def add_rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, _, rstd = _fwd("rms", x, residual, weight, bias, eps, casting, weight_offset)
    assert h is not None
    return y, h, rstd


@add_rms_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, casting, weight_offset):
    return _fake_fwd(x, weight, bias, casting, n_stats=1, with_h=True)


@torch.library.custom_op("normswap::add_rms_norm_bwd", mutates_args=())
def add_rms_norm_bwd(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd("rms", dy, dh, h, weight, bias, None, rstd, casting, weight_offset)


@add_rms_norm_bwd.register_fake
def _(dy, dh, h, weight, bias, rstd, casting, weight_offset):
    return _fake_bwd(h, weight, bias)


def _add_rms_setup(ctx, inputs, output) -> None:
    _x, _residual, weight, bias, _eps, casting, weight_offset = inputs
    _, h, rstd = output
    ctx.save_for_backward(h, weight, bias, rstd)
    ctx.casting, ctx.weight_offset = casting, weight_offset
    ctx.mark_non_differentiable(rstd)


def _add_rms_backward(ctx, dy, dh, _drstd):
    h, weight, bias, rstd = ctx.saved_tensors
    dx, dw, db = add_rms_norm_bwd(dy, dh, h, weight, bias, rstd, ctx.casting, ctx.weight_offset)
    return _param_grads(ctx, dx, dw, db, weight, bias, has_residual=True)


add_rms_norm_fwd.register_autograd(_add_rms_backward, setup_context=_add_rms_setup)


@torch.library.custom_op("normswap::add_layer_norm_fwd", mutates_args=())
def add_layer_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, mean, rstd = _fwd("layer", x, residual, weight, bias, eps, casting, weight_offset)
    assert h is not None and mean is not None
    return y, h, mean, rstd


@add_layer_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, casting, weight_offset):
    return _fake_fwd(x, weight, bias, casting, n_stats=2, with_h=True)


@torch.library.custom_op("normswap::add_layer_norm_bwd", mutates_args=())
def add_layer_norm_bwd(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd("layer", dy, dh, h, weight, bias, mean, rstd, casting, weight_offset)


@add_layer_norm_bwd.register_fake
def _(dy, dh, h, weight, bias, mean, rstd, casting, weight_offset):
    return _fake_bwd(h, weight, bias)


def _add_layer_setup(ctx, inputs, output) -> None:
    _x, _residual, weight, bias, _eps, casting, weight_offset = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h, weight, bias, mean, rstd)
    ctx.casting, ctx.weight_offset = casting, weight_offset
    ctx.mark_non_differentiable(mean, rstd)


def _add_layer_backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = add_layer_norm_bwd(dy, dh, h, weight, bias, mean, rstd, ctx.casting, ctx.weight_offset)
    return _param_grads(ctx, dx, dw, db, weight, bias, has_residual=True)


add_layer_norm_fwd.register_autograd(_add_layer_backward, setup_context=_add_layer_setup)


def _param_grads(
    ctx,
    dx: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    has_residual: bool,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients in input order: x[, residual], weight, bias, then None for eps, casting, offset."""
    i_w = 2 if has_residual else 1
    # x and residual enter only through h = x + residual: both get dh, the same tensor.
    grads: list[torch.Tensor | None] = [dx, dx] if has_residual else [dx]
    grads.append(dw if weight is not None and ctx.needs_input_grad[i_w] else None)
    grads.append(db if bias is not None and ctx.needs_input_grad[i_w + 1] else None)
    return (*grads, None, None, None)


# ---------------------------------------------------------------------------------------------------
# Differentiable functions (what the fused modules call)


def _flatten(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    normalized_ndim: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    # The kernels normalize the last dim; normalizing the last k dims is the same over their flattening.
    if normalized_ndim == 1:
        return x, weight, bias
    if normalized_ndim < 1 or x.ndim < normalized_ndim:
        raise ValueError(f"cannot normalize the last {normalized_ndim} dims of a {x.ndim}-d input")
    flat = x.flatten(-normalized_ndim)
    return (
        flat,
        weight.reshape(-1) if weight is not None else None,
        bias.reshape(-1) if bias is not None else None,
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    casting: str = "none",
    weight_offset: float = 0.0,
    normalized_ndim: int = 1,
) -> torch.Tensor:
    """Fused :func:`normswap.modules.functional.rms_norm_reference`, over the last ``normalized_ndim`` dims."""
    xf, w, b = _flatten(x, weight, bias, normalized_ndim)
    y, _ = torch.ops.normswap.rms_norm_fwd(xf, w, b, float(eps), casting, float(weight_offset))
    return y.view(x.shape)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    casting: str = "none",
    weight_offset: float = 0.0,
    normalized_ndim: int = 1,
) -> torch.Tensor:
    """Fused :func:`normswap.modules.functional.layer_norm_reference`, over the last ``normalized_ndim`` dims."""
    xf, w, b = _flatten(x, weight, bias, normalized_ndim)
    y, _, _ = torch.ops.normswap.layer_norm_fwd(xf, w, b, float(eps), casting, float(weight_offset))
    return y.view(x.shape)


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
    xf, w, b = _flatten(x, weight, bias, normalized_ndim)
    rf = residual.flatten(-normalized_ndim) if normalized_ndim > 1 else residual
    y, h, _ = torch.ops.normswap.add_rms_norm_fwd(xf, rf, w, b, float(eps), casting, float(weight_offset))
    return y.view(x.shape), h.view(x.shape)


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
    xf, w, b = _flatten(x, weight, bias, normalized_ndim)
    rf = residual.flatten(-normalized_ndim) if normalized_ndim > 1 else residual
    y, h, _, _ = torch.ops.normswap.add_layer_norm_fwd(
        xf, rf, w, b, float(eps), casting, float(weight_offset)
    )
    return y.view(x.shape), h.view(x.shape)
