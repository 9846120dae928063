"""ONNX translations of the ``normswap::*`` fused-norm ops, to standard ONNX operators.

For ``torch.onnx.export(..., dynamo=True, custom_translation_table=translation_table(opset))``:

- LayerNorm: ``LayerNormalization`` (opset >= 17);
- RMSNorm: ``RMSNormalization`` at opset >= 23; below that the same function written out
  (``ReduceMean(x*x) + eps``, ``Sqrt``, ``Div``), which is the body ONNX itself defines for it;
- residual add + norm: ``Add`` then the norm; ``h`` is the sum.

Both standard ops take ``stash_type=1``: statistics in fp32, the normalized value cast back to the input
type, then the scale multiply in the input type. That is the ``"llama"`` casting mode of
:mod:`normswap.kernels.reference`, and the same as every mode in fp32. For half inputs in the
``"none"``/``"gemma"`` modes (weight applied in fp32, one cast at the end) the op runs on the input cast to
fp32 and its output is cast back; a ``weight_offset`` (Gemma's ``1 + w``) is an ``Add`` on the weight,
folded into the initializer by the exporter's optimizer. The statistics outputs (mean, rstd) are written
out too; an inference graph does not read them and the optimizer removes them.

onnxscript and onnx_ir come with torch's ONNX exporter; only this module imports them, never
``import normswap``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript import opset23 as op23

RMS_NORMALIZATION_OPSET = 23
LAYER_NORMALIZATION_OPSET = 17
_FLOAT = ir.DataType.FLOAT

# Order in which mixed dtypes promote (torch.promote_types on these three).
_PROMOTION = {ir.DataType.BFLOAT16: 0, ir.DataType.FLOAT16: 0, ir.DataType.FLOAT: 1, ir.DataType.DOUBLE: 2}


def _promote(*dtypes: ir.DataType) -> ir.DataType:
    if len(set(dtypes)) == 1:
        return dtypes[0]
    widest = max(dtypes, key=lambda d: _PROMOTION.get(d, 1))
    # bf16 with fp16 promotes to fp32 in torch.
    return _FLOAT if _PROMOTION.get(widest, 1) == 0 else widest


def _scalar(value: float) -> Any:
    # A ``value`` tensor, not ``value_float``: onnx's version converter (opset 18 -> 17) only reads that.
    return op.Constant(value=ir.tensor(value, dtype=_FLOAT))


def _last_axis() -> Any:
    return op.Constant(value=ir.tensor([-1], dtype=ir.DataType.INT64))


def _cast(value: Any, to: ir.DataType, from_: ir.DataType) -> Any:
    # Values made inside a translation carry no type yet, so the caller says what ``value`` holds.
    return value if from_ == to else op.Cast(value, to=to)


def _ones_like_last_dim(x: Any) -> Any:
    """A scale of ones, [N], of x's type: the standard ops require a scale input."""
    return op.Expand(op.CastLike(_scalar(1.0), x), op.Shape(x, start=-1))


def _mean_last(x: Any, keepdims: int) -> Any:
    # noop_with_empty_axes left unset: onnxscript would write its default, which ReduceMean-13 lacks,
    # and the 18 -> 17 conversion keeps it, giving an invalid model.
    return op.ReduceMean(x, _last_axis(), keepdims=keepdims, noop_with_empty_axes=None)


def _normalize(kind: str, x: Any, dtype: ir.DataType, scale: Any, bias: Any, eps: float, opset: int) -> Any:
    """The standard op with stash_type=1 (or its written-out body below opset 23, for RMS).

    ``x``, ``scale`` and ``bias`` all hold ``dtype``.
    """
    if kind == "layer":
        inputs = (x, scale) if bias is None else (x, scale, bias)
        # The exporter gives the node all three outputs (Y, Mean, InvStdDev); only Y is used here.
        return op.LayerNormalization(*inputs, axis=-1, epsilon=eps, stash_type=1)[0]
    if opset >= RMS_NORMALIZATION_OPSET:
        y = op23.RMSNormalization(x, scale, axis=-1, epsilon=eps, stash_type=1)
    else:
        x32 = _cast(x, _FLOAT, dtype)
        rms = op.Sqrt(op.Add(_mean_last(op.Mul(x32, x32), keepdims=1), _scalar(eps)))
        y = op.Mul(_cast(op.Div(x32, rms), dtype, _FLOAT), scale)
    return y if bias is None else op.Add(y, bias)


def _with_offset(weight: Any, weight_offset: float) -> Any:
    return op.Add(weight, op.CastLike(_scalar(weight_offset), weight)) if weight_offset else weight


def _norm(
    kind: str,
    x: Any,
    dtype: ir.DataType,
    weight: Any,
    bias: Any,
    eps: float,
    casting: str,
    weight_offset: float,
    opset: int,
) -> Any:
    """y of the fused op on ``x`` (holding ``dtype``), with the casting semantics of
    ``normswap.kernels.reference``."""
    params = [t.dtype for t in (weight, bias) if t is not None]
    if casting == "llama":
        # Round the normalized value to x's type, then (offset + w) * n + b in the promoted type, the
        # offset added in w's own type.
        if all(p == dtype for p in params):
            scale = _with_offset(weight, weight_offset) if weight is not None else _ones_like_last_dim(x)
            return _normalize(kind, x, dtype, scale, bias, eps, opset)
        out = _promote(dtype, *params)
        y = _cast(_normalize(kind, x, dtype, _ones_like_last_dim(x), None, eps, opset), out, dtype)
        if weight is not None:
            y = op.Mul(y, _cast(_with_offset(weight, weight_offset), out, weight.dtype))
        return y if bias is None else op.Add(y, _cast(bias, out, bias.dtype))
    # "none" / "gemma": everything in fp32 (no casts for an fp32 model), one cast to x's type at the end.
    x32 = _cast(x, _FLOAT, dtype)
    scale = _ones_like_last_dim(x32)
    if weight is not None:
        scale = _with_offset(_cast(weight, _FLOAT, weight.dtype), weight_offset)
    b32 = _cast(bias, _FLOAT, bias.dtype) if bias is not None else None
    return _cast(_normalize(kind, x32, _FLOAT, scale, b32, eps, opset), dtype, _FLOAT)


def _statistics(kind: str, x: Any, dtype: ir.DataType, eps: float) -> tuple[Any, ...]:
    """(mean,) rstd in fp32 with shape x.shape[:-1], as the op returns them for its backward."""
    x32 = _cast(x, _FLOAT, dtype)
    if kind == "rms":
        centered = x32
    else:
        mean = _mean_last(x32, keepdims=1)
        centered = op.Sub(x32, mean)
    rstd = op.Reciprocal(op.Sqrt(op.Add(_mean_last(op.Mul(centered, centered), keepdims=0), _scalar(eps))))
    return (rstd,) if kind == "rms" else (op.Squeeze(mean, _last_axis()), rstd)


def _translation(kind: str, with_residual: bool, opset: int) -> Callable[..., tuple]:
    """The translation of ``normswap::{add_}{kind}_norm_fwd`` (arguments as in its schema)."""

    def translate(*args: Any) -> tuple:
        if with_residual:
            x, residual, weight, bias, eps, casting, weight_offset = args
            # h = x + residual, rounded to x's type like the kernels' h.
            normalized = op.Add(x, residual)
            outputs: tuple = (normalized,)
        else:
            x, weight, bias, eps, casting, weight_offset = args
            normalized, outputs = x, ()
        dtype = x.dtype
        y = _norm(kind, normalized, dtype, weight, bias, eps, casting, weight_offset, opset)
        return (y, *outputs, *_statistics(kind, normalized, dtype, eps))

    translate.__name__ = f"normswap_{'add_' if with_residual else ''}{kind}_norm_fwd"
    return translate


def translation_table(opset: int | None = None) -> dict[torch._ops.OpOverload, Callable[..., tuple]]:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)`` of a model with fused norms.

    ``opset`` is the one passed to the export; None stands for the exporter's default, which is below 23
    (20 in torch 2.14), so RMSNorm is written out. Below 18 the exporter builds at 18 and converts down;
    LayerNormalization needs 17 or more.
    """
    import normswap.kernels.ops  # noqa: F401  (registers the ops the table is keyed by)

    opset = 18 if opset is None else opset
    if opset < LAYER_NORMALIZATION_OPSET:
        raise ValueError(
            f"fused norms export to ONNX from opset {LAYER_NORMALIZATION_OPSET} (LayerNormalization); "
            f"got opset {opset}"
        )
    ops = torch.ops.normswap
    return {
        ops.rms_norm_fwd.default: _translation("rms", False, opset),
        ops.layer_norm_fwd.default: _translation("layer", False, opset),
        ops.add_rms_norm_fwd.default: _translation("rms", True, opset),
        ops.add_layer_norm_fwd.default: _translation("layer", True, opset),
    }


__all__ = ["LAYER_NORMALIZATION_OPSET", "RMS_NORMALIZATION_OPSET", "translation_table"]
