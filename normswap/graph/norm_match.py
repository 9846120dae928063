"""What a hand-written norm found in a graph is (:class:`NormMatch`), and the small readings of graph
values the pattern modules share: constants, ``x + eps``, squares, the dims a norm reduces, and the
stored weight and bias applied after a norm (see :mod:`normswap.graph.patterns`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import fx

from normswap.graph.analysis import GraphView
from normswap.graph.ops import (
    CAST_OPS,
    arg,
    op_name,
    real_users,
    strip_casts,
    tensor_meta,
)


@dataclass
class NormMatch:
    """A normalization found as a subgraph."""

    kind: str  # "rms" | "layer" | "batch" | "instance"
    input: fx.Node
    output: fx.Node
    nodes: list[fx.Node] = field(default_factory=list)
    dims: tuple[int, ...] = ()
    eps: float | None = None
    weight: fx.Node | None = None
    bias: fx.Node | None = None
    weight_offset: float = 0.0
    casting: str = "none"


def constant_number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def split_add_eps(node: fx.Node) -> tuple[fx.Node, float] | None:
    if op_name(node) != "add" or len(node.args) < 2:
        return None
    a, b = node.args[0], node.args[1]
    if isinstance(a, fx.Node) and constant_number(b) is not None:
        return a, constant_number(b)  # type: ignore[return-value]
    if isinstance(b, fx.Node) and constant_number(a) is not None:
        return b, constant_number(a)  # type: ignore[return-value]
    return None


def square_base(node: fx.Node) -> fx.Node | None:
    name = op_name(node)
    if (
        name == "pow"
        and constant_number(arg(node, 1, "exponent")) == 2.0
        and isinstance(node.args[0], fx.Node)
    ):
        return node.args[0]
    if name == "square" and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if (
        name == "mul"
        and len(node.args) == 2
        and isinstance(node.args[0], fx.Node)
        and strip_casts(node.args[0]) is strip_casts(node.args[1])
    ):
        return node.args[0]
    return None


def canonical_dims(dims: tuple[int, ...], input_rank: int | None) -> tuple[int, ...]:
    if input_rank is None:
        return dims
    return tuple(d - input_rank if d >= 0 else d for d in dims)


def kind_from_dims(dims: tuple[int, ...], input_rank: int | None) -> str:
    if input_rank is None:
        return "layer"
    positive = sorted(d % input_rank for d in dims)
    if 0 in positive and 1 not in positive and input_rank >= 2:
        return "batch"
    # over the last dim of a 3-D input is a LayerNorm of (batch, tokens, hidden) far more often than an
    # instance norm of (N, C, L); a spatial instance norm reduces two or more trailing dims
    if input_rank >= 4 and positive == list(range(2, input_rank)):
        return "instance"
    return "layer"


# Reshapes that can only add or drop unit dims when they keep a parameter's element count.
_VIEW_OPS = frozenset({"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "getitem"})


def param_operand(
    view: GraphView, node: object, dims: tuple[int, ...] | None, input_rank: int | None
) -> tuple | None:
    """(parameter, reshapes on the way) when ``node`` is a stored tensor seen through casts and reshapes
    that only place it along the normalized ``dims`` (negative) of an input of ``input_rank`` dims, e.g.
    ``w.reshape(1, -1, 1, 1)`` of a norm over the C of NCHW; None for anything else, including a
    per-channel tensor of another dim or one of more dims than the input (it would broadcast it up)."""
    reshapes: list[fx.Node] = []
    current = strip_casts(node)
    while isinstance(current, fx.Node) and op_name(current) in _VIEW_OPS and current.args:
        if op_name(current) == "getitem" and not is_view_index(current.args[1]):
            return None
        reshapes.append(current)
        current = strip_casts(current.args[0])
    if not view.is_param(current):
        return None
    if reshapes:
        shaped = tensor_meta(reshapes[0])
        if dims is None or shaped is None:
            return None
        shape = shaped[0]
        if input_rank is None or len(shape) > input_rank:
            return None
        along = {i - len(shape) for i, size in enumerate(shape) if size != 1}
        base = tensor_meta(current)
        if along != set(dims) or base is None or math.prod(base[0]) != math.prod(shape):
            return None
    return current, reshapes


def follow_affine(
    view: GraphView,
    node: fx.Node,
    nodes: list[fx.Node],
    dims: tuple[int, ...] | None,
    input_rank: int | None,
) -> tuple:
    """Walk from the normalized value through casts, a weight multiply and a bias add over ``dims``
    (negative; None when the input's rank is unknown)."""
    weight = bias = None
    offset = 0.0
    cast_before_weight = False
    current = node

    home = view.innermost_path(node)

    def single_user(n: fx.Node) -> fx.Node | None:
        # the norm ends where its module ends: a cast in the caller belongs to the caller
        users = real_users(n)
        return users[0] if len(users) == 1 and view.innermost_path(users[0]) == home else None

    while (nxt := single_user(current)) is not None and op_name(nxt) in CAST_OPS:
        nodes.append(nxt)
        current = nxt
        cast_before_weight = True
    nxt = single_user(current)
    if nxt is not None and op_name(nxt) == "mul" and len(nxt.args) == 2:
        other = nxt.args[1] if nxt.args[0] is current else nxt.args[0]
        other_base = strip_casts(other)
        found = param_operand(view, other_base, dims, input_rank)
        if found is not None:
            weight = found[0]
            nodes += found[1]
        elif isinstance(other_base, fx.Node) and op_name(other_base) == "add":
            split = split_add_eps(other_base)
            found = param_operand(view, split[0], dims, input_rank) if split is not None else None
            if found is not None:
                weight, offset = found[0], split[1]  # type: ignore[index]
                nodes += [other_base, *found[1]]
        if weight is not None:
            nodes.append(nxt)
            current = nxt
    if weight is None:
        cast_before_weight = False
    while (nxt := single_user(current)) is not None and op_name(nxt) in CAST_OPS:
        nodes.append(nxt)
        current = nxt
    nxt = single_user(current)
    if nxt is not None and op_name(nxt) == "add" and len(nxt.args) == 2:
        other = nxt.args[1] if nxt.args[0] is current else nxt.args[0]
        found = param_operand(view, other, dims, input_rank)
        if found is not None:
            bias = found[0]
            nodes += [*found[1], nxt]
            current = nxt
    return current, weight, bias, offset, cast_before_weight


def node_shape(node: object) -> tuple[int, ...] | None:
    meta = tensor_meta(node) if isinstance(node, fx.Node) else None
    return meta[0] if meta is not None else None


def is_view_index(index: object) -> bool:
    """An index that only adds unit dims (``[..., None]``, ``[:, None, None]``)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in items)
