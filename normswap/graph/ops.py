"""One vocabulary for the ops of export (aten) graphs and fx (torch/Tensor method) graphs.

Pattern matching and analysis ask "is this a mean over dims (-1,)?" without caring whether the node is
``aten.mean.dim`` or ``x.mean(-1, keepdim=True)``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

_FUNCTION_NAMES: dict[Any, str] = {
    operator.add: "add",
    operator.iadd: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    operator.pow: "pow",
    operator.neg: "neg",
    torch.add: "add",
    torch.sub: "sub",
    torch.mul: "mul",
    torch.div: "div",
    torch.pow: "pow",
    torch.mean: "mean",
    torch.var: "var",
    torch.rsqrt: "rsqrt",
    torch.sqrt: "sqrt",
    torch.reciprocal: "reciprocal",
    torch.square: "square",
    F.layer_norm: "layer_norm",
    F.batch_norm: "batch_norm",
    F.group_norm: "group_norm",
    F.instance_norm: "instance_norm",
    F.conv1d: "conv1d",
    F.conv2d: "conv2d",
    F.conv3d: "conv3d",
    F.linear: "linear",
}
if hasattr(F, "rms_norm"):
    _FUNCTION_NAMES[F.rms_norm] = "rms_norm"

# aten names that mean the same as another name in this vocabulary.
_ATEN_ALIASES = {
    "_to_copy": "to",
    "_native_batch_norm_legit_no_training": "batch_norm",
    "_native_batch_norm_legit": "batch_norm",
    "native_batch_norm": "batch_norm",
    "native_layer_norm": "layer_norm",
    "native_group_norm": "group_norm",
    "_fused_rms_norm": "rms_norm",
    "add_": "add",
    "mul_": "mul",
    "true_divide": "div",
    "convolution": "convolution",
    "type_as": "to",
}

_METHOD_ALIASES = {"float": "to", "half": "to", "bfloat16": "to", "type_as": "to", "type": "to"}

CAST_OPS = frozenset({"to", "clone", "contiguous", "alias"})
# Ops that hand their input on unchanged (up to aliasing), whatever its dtype.
PASS_THROUGH_OPS = frozenset({"alias", "clone", "contiguous", "detach", "lift_fresh_copy"})
# Ops whose only purpose is checking; they read a value without being a real consumer of it.
CHECK_OPS = frozenset({"_assert_tensor_metadata", "sym_constrain_range_for_size", "_assert_scalar"})
# What a norm module's own forward may hold besides its norm op and still be only that norm: casts around
# it (fp32 LayerNorms), checks, moves and views of the normalized dim (timm's LayerNorm2d), reads of shapes
# (fx records ``self.weight.shape``) and the items of a (normalized, mean, rstd) result. Anything else is
# more than the norm: a ``tanh(x)`` added to it, arithmetic on its weight (Nemotron's ``weight + 1``).
BESIDE_NORM_OPS = (
    CAST_OPS
    | PASS_THROUGH_OPS
    | CHECK_OPS
    | frozenset(
        {
            "getitem",
            "permute",
            "movedim",
            "transpose",
            "view",
            "reshape",
            "unsqueeze",
            "squeeze",
            "flatten",
            "unflatten",
        }
    )
    | frozenset({"getattr", "size", "sym_size", "dim", "numel"})
)


def op_name(node: fx.Node) -> str | None:
    """The vocabulary name of ``node``'s operation, or None for placeholders, outputs and modules."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            name = target._schema.name.split("::", 1)[1]
            return _ATEN_ALIASES.get(name, name)
        if isinstance(target, torch._ops.OpOverloadPacket):
            name = target._qualified_op_name.split("::", 1)[1]
            return _ATEN_ALIASES.get(name, name)
        return _FUNCTION_NAMES.get(target, getattr(target, "__name__", None))
    if node.op == "call_method":
        name = str(node.target)
        return _METHOD_ALIASES.get(name, name.rstrip("_") if name.endswith("_") else name)
    return None


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument access that works for aten and torch call forms."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def reduce_dims(node: fx.Node) -> tuple[int, ...] | None:
    """The reduced dims of a mean/var node, or None if they are not a constant."""
    dims = arg(node, 1, "dim")
    if dims is None:
        return None
    if isinstance(dims, int):
        return (dims,)
    if isinstance(dims, (list, tuple)) and all(isinstance(d, int) for d in dims):
        return tuple(dims)
    return None


def keepdim(node: fx.Node) -> bool:
    value = arg(node, 2, "keepdim", False)
    if op_name(node) == "var":
        value = node.kwargs.get("keepdim", arg(node, 3, "keepdim", False))
    return bool(value)


def var_correction(node: fx.Node) -> float | None:
    """0 for a biased variance, 1 for unbiased, None when unknown."""
    if "correction" in node.kwargs:
        return float(node.kwargs["correction"])
    if "unbiased" in node.kwargs:
        return 1.0 if node.kwargs["unbiased"] else 0.0
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        overload = node.target._overloadname
        if overload == "correction":
            return 1.0  # the default of aten.var.correction when no correction kwarg is given
        if overload == "dim" and len(node.args) > 2:
            return 1.0 if node.args[2] else 0.0
    if len(node.args) > 2 and isinstance(node.args[2], bool):
        return 1.0 if node.args[2] else 0.0
    return 1.0


def tensor_meta(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Shape and dtype recorded on ``node`` by export (``val``) or shape propagation."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return tuple(int(d) for d in val.shape), val.dtype
        except (TypeError, ValueError):  # symbolic sizes
            return None
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return tuple(int(d) for d in meta.shape), meta.dtype
    return None


def rank(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.ndim
    meta = node.meta.get("tensor_meta")
    return len(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def strip_casts(node: Any) -> Any:
    """Follow dtype casts and no-op copies back to the value they came from."""
    while isinstance(node, fx.Node) and op_name(node) in CAST_OPS and node.args:
        node = node.args[0]
    return node


def real_users(node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` that consume its value (shape/metadata assertions excluded)."""
    return [u for u in node.users if op_name(u) not in CHECK_OPS]
