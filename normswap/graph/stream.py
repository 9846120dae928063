"""Residual streams whose mean no reader sees, and the parameters that write into them.

A LayerNorm over the last dim is blind to the mean of its input across that dim. In a pre-LN
transformer every reader of the residual stream is such a LayerNorm, so the stream's mean never reaches
the output. Subtract the mean from every value written into the stream (embedding rows, positional
embeddings, class tokens, the output projections of attention and MLP, a patch-embedding conv) and the
model computes the same function, while each LayerNorm now sees zero-mean inputs, where it equals an
RMSNorm (Jiang et al., "Pre-RMSNorm and Pre-CRMSNorm Transformers", NeurIPS 2023).

:func:`close_stream` answers, on a captured graph and starting from a LayerNorm's input: which values
must be zero-mean along the hidden dim (the "stream"), which parameters must be centered to make them
so — or why it cannot be done, as a sentence for a person.

The stream is closed in both directions. Backwards, a value is zero-mean if it is a sum of zero-mean
values, a reshaping/selection that keeps the hidden dim whole, or written by a linear map whose weight
(and bias) can be centered. Forwards, every reader of a stream value must be a mean-blind LayerNorm or
itself part of the stream (a residual add, a dropout, a permute...); anything else would see the
change.

A refusal says whether the graph shows the stream cannot be recentered (a reader that sees the mean, a
normalized value or a nonlinearity written into the stream: a post-LN layout, ``Stream.limit`` False)
or normswap could not tell (a shape it does not know, an op or a form of the hidden dim it does not
follow: ``Stream.limit`` True). Only the first is the model's architecture; after the second an exact
route may well exist.
"""

from __future__ import annotations

import math

from torch import fx, nn

from normswap.graph.analysis import GraphView
from normswap.graph.ops import arg, op_name, real_users, reduce_dims
from normswap.graph.stream_params import (
    IDENTITY_OPS,
    ParamRecorder,
    Stream,
    StreamRefused,
    shape_of_node,
)

_RESHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"})
_SUM_OPS = frozenset({"add", "sub"})
_SCALE_OPS = frozenset({"mul", "div"})
_NORM_OPS = frozenset({"layer_norm", "rms_norm", "batch_norm", "group_norm", "instance_norm"})
# Nonlinear ops: what they output has a mean no centering of the parameters before them controls, and
# what they read they see whole. One of them writing or reading the stream rules recentering out.
_NONLINEAR_OPS = frozenset(
    {
        "relu", "relu6", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu", "softplus",
        "hardtanh", "hardswish", "hardsigmoid", "tanh", "sigmoid", "glu", "softmax", "_softmax",
        "log_softmax", "exp", "log", "sqrt", "rsqrt", "reciprocal", "pow", "square", "abs", "sign",
        "clamp", "clamp_min", "clamp_max", "erf", "sin", "cos",
    }
)  # fmt: skip
# Ops that read every feature of a value (a linear map over the hidden dim, a statistic of it): a
# stream value read by one sees its mean.
_READS_FEATURES_OPS = frozenset(
    {
        "linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d",
        "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "scaled_dot_product_attention", "var", "std", "var_mean", "std_mean", "amax", "amin", "max",
        "min", "norm", "linalg_vector_norm", "logsumexp", "argmax", "argmin",
    }
)  # fmt: skip


def _map_reshape(src: tuple[int, ...], dst: tuple[int, ...], d: int) -> int | None:
    """Where dim ``d`` of ``src`` lands in ``dst`` when a reshape keeps it whole, else None.

    A dim survives a reshape intact when the product of the dims before it, and its own size, are the
    same on both sides.
    """
    before, size = math.prod(src[:d]), src[d]
    for i, s in enumerate(dst):
        if s == size and math.prod(dst[:i]) == before:
            return i
    return None


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _reads_as_input(user: fx.Node, value: fx.Node) -> bool:
    """A norm op reads ``value`` as the tensor it normalizes, not as its weight or bias."""
    if user.op == "call_function" and op_name(user) == "layer_norm":
        return bool(user.args) and user.args[0] is value
    return True


class _StreamBuilder(ParamRecorder):
    """The walk that closes a stream: backwards from each stream value to what writes it, forwards to
    what reads it."""

    def in_norm(self, node: fx.Node) -> bool:
        """The value is computed by a norm (a mean-blind LayerNorm, or an fx leaf norm module)."""
        if node in self.mean_blind:
            return True
        module = self.modules.get(str(node.target)) if node.op == "call_module" else None
        return module is not None and "norm" in type(module).__name__.lower()

    def add(self, node: fx.Node, d: int) -> None:
        assert self.stream is not None
        known = self.stream.nodes.get(node)
        if known is None:
            self.stream.nodes[node] = d
            self.work.append(node)
        elif known != d:
            raise StreamRefused(
                f"{self.describe(node)} carries the hidden dim at two positions ({known}, {d})", limit=True
            )

    def build(self, seed: fx.Node) -> Stream:
        shape = shape_of_node(seed)
        if not shape:
            return Stream(
                hidden=0, reason="the graph records no shapes (no example inputs to export with)", limit=True
            )
        self.stream = Stream(hidden=shape[-1])
        try:
            self.add(seed, len(shape) - 1)
            while self.work:
                node = self.work.pop()
                self.backward(node, self.stream.nodes[node])
                self.forward(node, self.stream.nodes[node])
            self.finish()
        except StreamRefused as exc:
            self.stream.reason = str(exc)
            self.stream.limit = exc.limit
        return self.stream

    # -- backwards: how is this value made, and can it be made zero-mean?
    def backward(self, node: fx.Node, d: int) -> None:
        name = op_name(node)
        shape = shape_of_node(node)
        if self.view.is_param(node):
            self.write_param_name(
                self.view.param_name(node), d, "direct", self.view.innermost_path(node), node
            )
            return
        if node.op == "placeholder":
            raise StreamRefused(
                f"graph input {node.name} is written into the residual stream as it is", limit=False
            )
        if shape is None:
            raise StreamRefused(f"shape of {self.describe(node)} is unknown", limit=True)
        if self.writer(node, name, d, shape):
            return
        if self.identity_module(node):
            self.add(node.args[0], d)
        elif name in IDENTITY_OPS:
            if name == "dropout" and arg(node, 2, "train", False):
                raise StreamRefused(f"{self.describe(node)} is a dropout in training mode", limit=False)
            self.add(node.args[0], d)
        elif name in _SUM_OPS:
            for operand in node.args[:2]:
                self.sum_operand(node, operand, d, shape)
            alpha = node.kwargs.get("alpha", 1)
            if not isinstance(alpha, (int, float)):
                raise StreamRefused(f"{self.describe(node)} has a tensor alpha", limit=True)
        elif name in _SCALE_OPS or name == "neg":
            self.scaled(node, d, shape)
        elif name in _RESHAPE_OPS:
            src = node.args[0]
            d_in = _map_reshape(shape, shape_of_node(src) or (), d)
            if d_in is None:
                raise StreamRefused(f"{self.describe(node)} splits or merges the hidden dim", limit=True)
            self.add(src, d_in)
        elif name in ("permute", "transpose", "t", "expand", "select", "slice", "cat", "mean", "sum"):
            self.layout(node, name, d, shape)
        elif name in _NORM_OPS or self.in_norm(node):
            raise StreamRefused(
                f"the output of {self.describe(node)} is written into the residual stream (a post-LN block): "
                "a normalized value cannot be recentered through parameters",
                limit=False,
            )
        elif name in _NONLINEAR_OPS:
            raise StreamRefused(
                f"{self.describe(node)} ({name}) writes into the residual stream and is not a linear map "
                "whose weights can be centered",
                limit=False,
            )
        else:
            # an op this analysis does not model (torch.roll, a gather, an unrecognized linear map...):
            # it may well keep the stream zero-mean, but normswap cannot tell
            raise StreamRefused(
                f"{self.describe(node)} ({name or node.op}) writes into the residual stream, and normswap "
                "does not know whether it keeps the stream's mean zero",
                limit=True,
            )

    def sum_operand(self, node: fx.Node, operand: object, d: int, shape: tuple[int, ...]) -> None:
        if isinstance(operand, (int, float)):
            if operand != 0:
                raise StreamRefused(
                    f"{self.describe(node)} adds the constant {operand} to the stream", limit=False
                )
            return
        if not isinstance(operand, fx.Node):
            raise StreamRefused(f"{self.describe(node)} has an operand of unknown kind", limit=True)
        op_shape = shape_of_node(operand)
        if op_shape is None:
            raise StreamRefused(f"shape of {self.describe(operand)} is unknown", limit=True)
        d_op = d - (len(shape) - len(op_shape))
        if d_op < 0 or op_shape[d_op] != shape[d]:
            # broadcast along the hidden dim: the same value added to every feature is pure mean
            raise StreamRefused(
                f"{self.describe(node)} adds {self.describe(operand)}, which is constant across the hidden dim",
                limit=False,
            )
        self.add(operand, d_op)

    def scaled(self, node: fx.Node, d: int, shape: tuple[int, ...]) -> None:
        """A product keeps zero mean when only one factor varies along the hidden dim."""
        operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        full = []
        for operand in operands:
            op_shape = shape_of_node(operand)
            if op_shape is None:
                raise StreamRefused(f"shape of {self.describe(operand)} is unknown", limit=True)
            d_op = d - (len(shape) - len(op_shape))
            if d_op >= 0 and op_shape[d_op] != 1:
                full.append((operand, d_op))
        name = op_name(node)
        if len(full) == 2 and name == "mul" and self.fold_scale(node, full, d):
            return
        if len(full) != 1 or (name == "div" and full[0][0] is not node.args[0]):
            raise StreamRefused(
                f"{self.describe(node)} scales the stream by a per-feature factor that cannot be folded "
                "into the layer before it",
                limit=False,
            )
        self.add(*full[0])

    def layout(self, node: fx.Node, name: str | None, d: int, shape: tuple[int, ...]) -> None:
        src = node.args[0]
        if name == "cat":
            dim = _norm_dim(arg(node, 1, "dim", 0), len(shape))
            if dim == d:
                # zero-mean parts make a zero-mean whole, but the parts do not have the hidden size
                raise StreamRefused(f"{self.describe(node)} concatenates along the hidden dim", limit=True)
            for part in src:
                self.add(part, d)
            return
        src_shape = shape_of_node(src)
        if src_shape is None:
            raise StreamRefused(f"shape of {self.describe(src)} is unknown", limit=True)
        if name == "permute":
            self.add(src, list(arg(node, 1, "dims"))[d] % len(src_shape))
        elif name in ("transpose", "t"):
            a, b = (
                (0, 1)
                if name == "t"
                else (_norm_dim(node.args[1], len(shape)), _norm_dim(node.args[2], len(shape)))
            )
            self.add(src, b if d == a else a if d == b else d)
        elif name == "expand":
            d_in = d - (len(shape) - len(src_shape))
            if d_in < 0 or src_shape[d_in] != shape[d]:
                raise StreamRefused(
                    f"{self.describe(node)} broadcasts one value across the hidden dim", limit=False
                )
            self.add(src, d_in)
        elif name == "select":
            dim = _norm_dim(node.args[1], len(src_shape))
            self.add(src, d + 1 if dim <= d else d)
        elif name == "slice":
            dim = _norm_dim(arg(node, 1, "dim", 0), len(src_shape))
            if dim == d:
                raise StreamRefused(f"{self.describe(node)} keeps only part of the hidden dim", limit=True)
            self.add(src, d)
        else:  # mean / sum over other dims: an average of zero-mean vectors is zero-mean
            dims = reduce_dims(node)
            if dims is None:
                raise StreamRefused(
                    f"{self.describe(node)} reduces over dims that are not constant", limit=True
                )
            reduced = {_norm_dim(x, len(src_shape)) for x in dims} or set(range(len(src_shape)))
            kept = (
                list(range(len(src_shape)))
                if arg(node, 2, "keepdim", False)
                else [i for i in range(len(src_shape)) if i not in reduced]
            )
            if kept[d] in reduced:
                raise StreamRefused(f"{self.describe(node)} reduces over the hidden dim", limit=False)
            self.add(src, kept[d])

    # -- forwards: who reads this value, and do they all not care about its mean?
    def forward(self, node: fx.Node, d: int) -> None:
        shape = shape_of_node(node)
        for user in real_users(node):
            if user in self.stream.nodes:  # type: ignore[union-attr]
                continue
            if user in self.mean_blind and _reads_as_input(user, node):
                if shape is None or d != len(shape) - 1:
                    raise StreamRefused(
                        f"{self.describe(user)} normalizes the stream over another dim", limit=False
                    )
                continue
            if user.op == "output":
                raise StreamRefused(
                    f"{self.describe(node)} is an output of the model, which would see its mean", limit=False
                )
            d_out = self.forward_dim(user, node, d, shape)
            if d_out is None:
                what = f"{self.describe(node)} is read by {self.describe(user)} ({op_name(user) or user.op})"
                if self.sees_mean(user, d, shape):
                    raise StreamRefused(f"{what}, which would see its mean", limit=False)
                raise StreamRefused(
                    f"{what}, and normswap does not know whether that reader sees the stream's mean",
                    limit=True,
                )
            self.add(user, d_out)

    def sees_mean(self, user: fx.Node, d: int, shape: tuple[int, ...] | None) -> bool:
        """``user``, which is not part of the stream, is known to see the mean of the stream value it
        reads (hidden dim ``d``): a linear map, a nonlinearity, another norm, a statistic, or a
        selection or reduction of the hidden dim. False where normswap does not know the op, or not
        what it does to the hidden dim (a reshape that splits it, a concatenation along it, an
        unknown shape)."""
        if user.op == "call_module":
            module = self.modules.get(str(user.target))
            linear = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
            return isinstance(module, linear) or self.in_norm(user)
        name = op_name(user)
        if name in _NONLINEAR_OPS or name in _READS_FEATURES_OPS or name in _NORM_OPS:
            return True
        if shape is None or shape_of_node(user) is None:
            return False
        if name in ("select", "slice"):  # reads some features only
            return True
        if name in ("mean", "sum"):  # over the hidden dim (forward_dim followed any other)
            return reduce_dims(user) is not None
        return False

    def forward_dim(self, user: fx.Node, src: fx.Node, d: int, shape: tuple[int, ...] | None) -> int | None:
        """The hidden dim of ``user``'s output if ``user`` is part of the stream, else None."""
        name = op_name(user)
        out = shape_of_node(user)
        if out is None or shape is None:
            return None
        if self.identity_module(user):
            return d
        if name in IDENTITY_OPS or name in _SUM_OPS or name in _SCALE_OPS or name in ("neg", "expand"):
            d_out = d + len(out) - len(shape)
            return d_out if out[d_out] == shape[d] else None
        if name in _RESHAPE_OPS:
            return _map_reshape(shape, out, d)
        if name == "permute":
            return [_norm_dim(x, len(out)) for x in arg(user, 1, "dims")].index(d)
        if name in ("transpose", "t"):
            a, b = (
                (0, 1)
                if name == "t"
                else (_norm_dim(user.args[1], len(out)), _norm_dim(user.args[2], len(out)))
            )
            return b if d == a else a if d == b else d
        if name == "select":
            dim = _norm_dim(user.args[1], len(shape))
            return None if dim == d else d - 1 if dim < d else d
        if name == "slice":
            return None if _norm_dim(arg(user, 1, "dim", 0), len(shape)) == d else d
        if name == "cat":
            return None if _norm_dim(arg(user, 1, "dim", 0), len(out)) == d else d
        if name in ("mean", "sum"):
            dims = reduce_dims(user)
            if dims is None:
                return None
            dims = tuple(_norm_dim(x, len(shape)) for x in dims) or tuple(range(len(shape)))
            if d in dims:
                return None
            return d if bool(arg(user, 2, "keepdim", False)) else d - sum(1 for x in dims if x < d)
        return None


def close_stream(
    view: GraphView, seed: fx.Node, mean_blind: set[fx.Node], modules: dict[str, nn.Module]
) -> Stream:
    """The residual stream around ``seed`` (a LayerNorm's input, hidden dim last); see the module doc.

    ``mean_blind`` holds the graph nodes that read a value without seeing its mean along its last dim
    (the ops of every LayerNorm over the last dim); ``modules`` is the model's ``named_modules()``.
    """
    return _StreamBuilder(view, mean_blind, modules).build(seed)
