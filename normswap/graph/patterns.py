"""Find normalizations written out as elementary ops, whatever the module that runs them is called.

Recognized forms (casts to fp32 and back may appear anywhere along them):

- RMSNorm:   ``y = x * rsqrt(mean(x^2, dims) + eps)``            or ``x / sqrt(mean(x*x) + eps)``
- LayerNorm: ``c = x - mean(x, dims); y = c * rsqrt(mean(c^2, dims) + eps)``
             or ``c / sqrt(var(x, dims, unbiased=False) + eps)``
- BatchNorm (eval): ``y = (x - running_mean) * rsqrt(running_var + eps)`` with buffers as statistics
followed by an optional weight multiply (``w * y`` or ``(1 + w) * y``) and an optional bias add.

Whether a LayerNorm-form match is a layer, instance or batch norm is read off its reduced dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import fx

from normswap.graph.analysis import GraphView
from normswap.graph.ops import (
    CAST_OPS,
    arg,
    op_name,
    rank,
    real_users,
    reduce_dims,
    strip_casts,
    tensor_meta,
    var_correction,
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


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _split_add_eps(node: fx.Node) -> tuple[fx.Node, float] | None:
    if op_name(node) != "add" or len(node.args) < 2:
        return None
    a, b = node.args[0], node.args[1]
    if isinstance(a, fx.Node) and _number(b) is not None:
        return a, _number(b)  # type: ignore[return-value]
    if isinstance(b, fx.Node) and _number(a) is not None:
        return b, _number(a)  # type: ignore[return-value]
    return None


def _square_base(node: fx.Node) -> fx.Node | None:
    name = op_name(node)
    if name == "pow" and _number(arg(node, 1, "exponent")) == 2.0 and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if name == "square" and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if (
        name == "mul"
        and len(node.args) == 2
        and node.args[0] is node.args[1]
        and isinstance(node.args[0], fx.Node)
    ):
        return node.args[0]
    return None


def _same_value(a: object, b: object) -> bool:
    return isinstance(a, fx.Node) and isinstance(b, fx.Node) and strip_casts(a) is strip_casts(b)


def _mean_of(node: object, dims: tuple[int, ...]) -> fx.Node | None:
    """If ``node`` is mean(x, dims), return x."""
    node = strip_casts(node)
    if isinstance(node, fx.Node) and op_name(node) == "mean" and reduce_dims(node) == dims:
        return node.args[0]  # type: ignore[return-value]
    return None


def _centered_input(node: object, dims: tuple[int, ...]) -> fx.Node | None:
    """If ``node`` is x - mean(x, dims), return x."""
    node = strip_casts(node)
    if not isinstance(node, fx.Node) or op_name(node) != "sub" or len(node.args) < 2:
        return None
    x, m = node.args[0], node.args[1]
    mean_arg = _mean_of(m, dims)
    if mean_arg is not None and _same_value(mean_arg, x):
        return x  # type: ignore[return-value]
    return None


def _normalizing_users(stat_root: fx.Node) -> list[tuple[fx.Node, object]]:
    """(normalize node, numerator) pairs: ``num * rsqrt(...)`` or ``num / sqrt(...)``."""
    found = []
    name = op_name(stat_root)
    for user in real_users(stat_root):
        uname = op_name(user)
        if name == "rsqrt" and uname == "mul" and len(user.args) == 2:
            other = user.args[1] if user.args[0] is stat_root else user.args[0]
            found.append((user, other))
        elif name == "sqrt" and uname == "div" and len(user.args) == 2 and user.args[1] is stat_root:
            found.append((user, user.args[0]))
    return found


def _canonical_dims(dims: tuple[int, ...], input_rank: int | None) -> tuple[int, ...]:
    if input_rank is None:
        return dims
    return tuple(d - input_rank if d >= 0 else d for d in dims)


def _kind_from_dims(dims: tuple[int, ...], input_rank: int | None) -> str:
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
_VIEW_OPS = frozenset({"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze"})


def _param_operand(
    view: GraphView, node: object, dims: tuple[int, ...] | None, input_rank: int | None
) -> tuple | None:
    """(parameter, reshapes on the way) when ``node`` is a stored tensor seen through casts and reshapes
    that only place it along the normalized ``dims`` (negative) of an input of ``input_rank`` dims, e.g.
    ``w.reshape(1, -1, 1, 1)`` of a norm over the C of NCHW; None for anything else, including a
    per-channel tensor of another dim or one of more dims than the input (it would broadcast it up)."""
    reshapes: list[fx.Node] = []
    current = strip_casts(node)
    while isinstance(current, fx.Node) and op_name(current) in _VIEW_OPS and current.args:
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


def _follow_affine(
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
        found = _param_operand(view, other_base, dims, input_rank)
        if found is not None:
            weight = found[0]
            nodes += found[1]
        elif isinstance(other_base, fx.Node) and op_name(other_base) == "add":
            split = _split_add_eps(other_base)
            found = _param_operand(view, split[0], dims, input_rank) if split is not None else None
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
        found = _param_operand(view, other, dims, input_rank)
        if found is not None:
            bias = found[0]
            nodes += [*found[1], nxt]
            current = nxt
    return current, weight, bias, offset, cast_before_weight


def find_norm_patterns(view: GraphView) -> list[NormMatch]:
    """Every hand-written normalization in the graph, in graph order."""
    matches: list[NormMatch] = []
    for root in view.nodes:
        if op_name(root) not in ("rsqrt", "sqrt") or not root.args:
            continue
        split = _split_add_eps(root.args[0]) if isinstance(root.args[0], fx.Node) else None
        if split is None:
            continue
        stat, eps = split
        stat_name = op_name(strip_casts(stat))
        stat = strip_casts(stat)
        for norm_node, numerator in _normalizing_users(root):
            match = _match_one(view, root, stat, stat_name, eps, norm_node, numerator)
            if match is not None:
                matches.append(match)
    return matches


def _match_one(
    view: GraphView,
    root: fx.Node,
    stat: fx.Node,
    stat_name: str | None,
    eps: float,
    norm_node: fx.Node,
    numerator: object,
) -> NormMatch | None:
    nodes: list[fx.Node] = [stat, root.args[0], root, norm_node]  # type: ignore[list-item]
    if stat_name == "mean":
        dims = reduce_dims(stat)
        base = _square_base(strip_casts(stat.args[0]))
        if dims is None or base is None:
            return None
        nodes.append(strip_casts(stat.args[0]))
        centered_x = _centered_input(base, dims)
        if centered_x is not None:
            if not (_same_value(numerator, base) or _centered_input(numerator, dims) is not None):
                return None
            x, kind_hint = centered_x, "layer"
            nodes += [strip_casts(base), strip_casts(strip_casts(base).args[1])]
        else:
            if not _same_value(numerator, base):
                return None
            x, kind_hint = base, "rms"
    elif stat_name == "var":
        dims = reduce_dims(stat)
        if dims is None or var_correction(stat) != 0.0:
            return None
        x = stat.args[0]
        if _centered_input(numerator, dims) is None or not _same_value(_centered_input(numerator, dims), x):
            return None
        kind_hint = "layer"
        nodes += [strip_casts(numerator), strip_casts(strip_casts(numerator).args[1])]
    elif view.is_param(stat):
        # eval-mode BatchNorm written out with its running statistics as buffers
        num = strip_casts(numerator)
        if (
            not isinstance(num, fx.Node)
            or op_name(num) != "sub"
            or not view.is_param(strip_casts(num.args[1]))
        ):
            return None
        x, dims, kind_hint = num.args[0], (0,), "batch"
        nodes.append(num)
    else:
        return None

    x_raw = strip_casts(x)
    input_rank = rank(x_raw)
    if kind_hint == "batch":
        kind, canon = "batch", (1,)
        if input_rank is not None and input_rank < 2:
            return None
        affine_dims = (1 - input_rank,) if input_rank is not None else None
    else:
        canon = _canonical_dims(dims, input_rank)
        kind = "rms" if kind_hint == "rms" else _kind_from_dims(dims, input_rank)
        affine_dims = canon if input_rank is not None else None
    output, weight, bias, offset, cast_before_weight = _follow_affine(
        view, norm_node, nodes, affine_dims, input_rank
    )
    casting = "llama" if cast_before_weight else "none"
    if offset and not cast_before_weight:
        casting = "gemma"
    unique: list[fx.Node] = []
    for n in nodes:
        if isinstance(n, fx.Node) and n not in unique:
            unique.append(n)
    return NormMatch(
        kind=kind,
        input=x_raw,
        output=output,
        nodes=unique,
        dims=canon,
        eps=eps,
        weight=weight,
        bias=bias,
        weight_offset=offset,
        casting=casting,
    )
