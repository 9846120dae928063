"""Find normalizations written out as elementary ops, whatever the module that runs them is called and
however their math is written.

**Decision: both — canonicalize to find and read a norm, then confirm it numerically.**

*Canonical reading.* Starting from each second-moment reduction of some value ``x`` over dims ``D``
(``mean``/``sum`` of a square, ``var``, ``std``, ``var_mean``, ``linalg_vector_norm``, ``F.normalize``),
every value computed from ``x`` is read as a polynomial over ``X`` (``x`` itself), ``M = mean_D(x)``,
``V = mean_D(x^2)`` and stored tensors, with real exponents. Means over ``D`` are linear, so a variance
is ``V - M^2`` however it was written (``var``, ``var_mean``, ``std ** 2``, ``mean((x - m)^2)``,
``E[x^2] - E[x]^2``); a non-polynomial root of the statistics (``var + eps``, ``std + eps``) becomes one
atom in a canonical form (leading coefficient 1), and ``max(., c)`` from ``F.normalize``'s clamp another.
Casts, ``clone``/``expand``/keepdim reshapes are the identity; products distribute and commute;
``rsqrt``, ``1 / sqrt``, ``pow(-0.5)``, ``reciprocal`` and a division by ``sqrt`` are all exponent
``-1/2``. A value is a norm when its polynomial is exactly

    LayerNorm:  (X - M) * (V - M^2 + eps)^(-1/2) * W + B
    RMSNorm:    X * (V + eps)^(-1/2) * W + B

with a coefficient of 1, ``W`` absent, a stored tensor or ``c + stored tensor`` (the ``(1 + w)`` offset),
and ``B`` absent or a stored tensor, both placed along ``D`` only. The weight may be multiplied before or
after the statistics, by ``x.sub(mu).div(...)`` or ``*``/``/``; eps is read from the graph (the
constant added to the statistic), never assumed. What fails this is not a norm: ``std + eps`` (eps
outside the root), an unbiased variance (the coefficient is ``sqrt((n-1)/n)``, no weight of the module),
a centered numerator over a raw RMS, a weight or shift computed from activations (adaptive LayerNorm:
the parameter-free part is the norm, the modulation is not its affine), ``F.normalize(x) * g`` without
``sqrt(d)`` (an RMSNorm only with the gain ``g / sqrt(d)``, which is not the module's tensor), softmax,
``x / x.sum()``, mean removal alone.

``F.normalize(x) * sqrt(d) * g`` (lucidrains' RMSNorm) clamps ``||x||`` at ``c`` (1e-12 by default)
instead of adding eps under the root. It is read as an RMSNorm with ``eps = c^2 / d``: the two are equal
within fp32 rounding wherever ``||x|| > ~3e3 c`` (the relative difference is ``(c / ||x||)^2 / 2``), both
give 0 for an all-zero row, and they differ (by up to ``sqrt(2)``) only for rows whose L2 norm lies in
``(0, ~3e3 c)``, 3e-9 for the default: that is what "exact" means for this form.

*Numerical confirmation.* Reading every way of writing math is not enough to trust it (an op read
wrongly, a reshape that broadcasts a weight over the wrong dim), so each candidate is also run: the
subgraph from ``x`` to the candidate output is evaluated in float64 (casts as the identity: the
confirmation is about the function, rounding is the fused kernels' business) on three draws — a shifted
and scaled input, rows with their own scales and offsets with the weight and bias replaced by random
tensors (so a stored tensor used in some other role cannot pass), and rows whose mean square is near eps
(a wrong eps shows there) — and compared with the norm it was read as, with the eps read, within
1e-9 x max|reference|. A candidate that fails is not a norm; the value before its last step is tried
next (so a norm followed by something else is still found without the something else). Where no value
can be had (a graph without shapes, tensors on the meta device) the reading stands alone.

BatchNorm in eval mode written out, ``(x - running_mean) * rsqrt(running_var + eps)`` with the
statistics as buffers, is matched separately; its statistics are tensors, not reductions. Whether a
centered match is a layer, instance or batch norm is read off its reduced dims.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from normswap.graph.analysis import GraphView
from normswap.graph.ops import (
    CAST_OPS,
    arg,
    op_name,
    rank,
    real_users,
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
        and isinstance(node.args[0], fx.Node)
        and strip_casts(node.args[0]) is strip_casts(node.args[1])
    ):
        return node.args[0]
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
_VIEW_OPS = frozenset({"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "getitem"})


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
        if op_name(current) == "getitem" and not _is_view_index(current.args[1]):
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


def find_norm_patterns(view: GraphView, root: nn.Module | None = None) -> list[NormMatch]:
    """Every hand-written normalization in the graph, in graph order.

    ``root``: the module the graph was captured from, whose parameters and buffers the graph's tensor
    placeholders stand for; it lets each candidate be confirmed numerically (see the module docstring).
    Without it, the tensors of ``get_attr`` nodes are read from the graph's owning module when it has them.
    """
    order = {n: i for i, n in enumerate(view.nodes)}
    values = _TensorValues(view, root)
    found: dict[fx.Node, NormMatch] = {}
    for node in view.nodes:
        for hypothesis in _hypotheses(view, node):
            for match in _matches_from(view, node, hypothesis, order, values):
                best = found.get(match.output)
                # the same output reached from inside (an RMS of the centered value): keep the whole norm
                if best is None or len(match.nodes) > len(best.nodes):
                    found[match.output] = match
    for root_node in view.nodes:
        if op_name(root_node) not in ("rsqrt", "sqrt") or not root_node.args:
            continue
        split = _split_add_eps(root_node.args[0]) if isinstance(root_node.args[0], fx.Node) else None
        if split is None or not view.is_param(strip_casts(split[0])):
            continue
        for norm_node, numerator in _normalizing_users(root_node):
            match = _match_batch(view, root_node, strip_casts(split[0]), split[1], norm_node, numerator)
            if match is not None and match.output not in found:
                found[match.output] = match
    return sorted(found.values(), key=lambda m: order[m.output])


# ---------------------------------------------------------------------------------------------------
# The algebra: a value as a polynomial over the input X, its statistics and stored tensors

X, M, V = ("x",), ("m",), ("v",)  # x; mean_D(x); mean_D(x^2)
_STATISTICS = ("m", "v", "root", "max")  # atoms constant along D
Mono = frozenset  # of (atom, exponent) pairs, one per atom
Poly = dict  # Mono -> coefficient

_MAX_TERMS = 32
_MAX_DEPTH = 64
_REL = 1e-9  # relative tolerance of a coefficient that must be 1, and of the numerical confirmation
_IDENTITY_OPS = CAST_OPS | {"detach", "expand", "expand_as", "broadcast_to"}
_SHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "getitem", "slice"})


def _const(value: float) -> Poly:
    return {Mono(): float(value)} if value else {}


def _atom(atom: tuple, exponent: float = 1.0) -> Poly:
    return {Mono({(atom, exponent)}): 1.0}


def _is_statistic(atom: tuple) -> bool:
    return atom[0] in _STATISTICS


def _depends_on_x(p: Poly) -> bool:
    return any(a == X or _is_statistic(a) for mono in p for a, _ in mono)


def _add(p: Poly, q: Poly, scale: float = 1.0) -> Poly:
    out = dict(p)
    for mono, c in q.items():
        out[mono] = out.get(mono, 0.0) + scale * c
    size = max((abs(c) for c in out.values()), default=0.0)
    return {m: c for m, c in out.items() if abs(c) > 1e-13 * size}


def _merge(a: Mono, b: Mono) -> Mono:
    exps = dict(a)
    for atom, e in b:
        exps[atom] = exps.get(atom, 0.0) + e
    return Mono((atom, e) for atom, e in exps.items() if e != 0)


def _mul(p: Poly | None, q: Poly | None) -> Poly | None:
    if p is None or q is None or len(p) * len(q) > _MAX_TERMS:
        return None
    out: Poly = {}
    for ma, ca in p.items():
        for mb, cb in q.items():
            out = _add(out, {_merge(ma, mb): ca * cb})
    return _expand_roots(out)


def _expand_roots(p: Poly) -> Poly | None:
    """Multiply out roots raised to a whole power (``sqrt(var) ** 2`` is ``var``) so a sum has one form."""
    for mono, c in p.items():
        for atom, e in mono:
            if atom[0] == "root" and e == int(e) and 0 < e <= 4:
                rest = {Mono(pair for pair in mono if pair[0] != atom): c}
                inner = dict(atom[1])
                out = {m: k for m, k in p.items() if m != mono}
                term: Poly | None = rest
                for _ in range(int(e)):
                    term = _mul(term, inner)
                return None if term is None else _expand_roots(_add(out, term))
    return p


def _pow(p: Poly | None, e: float) -> Poly | None:
    if p is None:
        return None
    if e == 0:
        return _const(1.0)
    if not p:
        return {} if e > 0 else None
    whole = float(e).is_integer()
    if len(p) == 1:
        ((mono, c),) = p.items()
        if c < 0 and not whole:
            return None
        return _expand_roots({Mono((a, k * e) for a, k in mono): c**e})
    if whole and 0 < e <= 4:
        out: Poly | None = _const(1.0)
        for _ in range(int(e)):
            out = _mul(out, p)
        return out
    if any(a == X or a[0] == "tensor" for mono in p for a, _ in mono):
        return None  # a root of a sum that involves x itself or a stored tensor: no norm has one
    # a root of statistics, as one atom with leading coefficient 1: var + eps and 2 var + 2 eps agree
    lead = Mono({(V, 1.0)}) if Mono({(V, 1.0)}) in p else min((m for m in p if m), key=_order_key)
    c = p[lead]
    if c < 0 and not whole:
        return None
    inner = Mono((m, k / c) for m, k in p.items())
    return {Mono({(("root", inner), float(e))}): c**e}


def _order_key(obj: object) -> str:
    """A total order on monomials that does not depend on hashing."""
    if isinstance(obj, fx.Node):
        return obj.name
    if isinstance(obj, (frozenset, tuple, list)):
        return "(" + ",".join(sorted(_order_key(o) for o in obj)) + ")"
    return repr(obj)


def _clamped(p: Poly | None, floor: object) -> Poly | None:
    """``max(p, floor)`` for a positive multiple of statistics ``p``: ``k * max(q, floor / k)``."""
    floor = _number(floor)
    if p is None or floor is None or floor <= 0 or len(p) != 1:
        return None
    ((mono, c),) = p.items()
    if c <= 0 or not mono or not all(_is_statistic(a) for a, _ in mono):
        return None
    return {Mono({(("max", mono, floor / c), 1.0)}): c}


@dataclass
class _Hypothesis:
    """A value ``x`` whose statistics a reduction computes (over the reduction's dims)."""

    x: fx.Node
    starts: list[fx.Node]  # where to look for the norm from: the reduction, or its tuple's items


def _hypotheses(view: GraphView, node: fx.Node) -> list[_Hypothesis]:
    """The inputs whose statistics ``node`` may compute, if it is a second-moment reduction."""
    name = op_name(node)
    if name in ("mean", "sum"):
        base = _square_base(strip_casts(node.args[0])) if node.args else None
        if base is None:
            return []
        sources = [base]
    elif name in ("var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "normalize"):
        sources = [node.args[0]] if node.args else []
    else:
        return []
    starts = [node]
    if name in ("var_mean", "std_mean"):
        starts = [u for u in node.users if op_name(u) == "getitem"]
    found: list[_Hypothesis] = []
    for source in sources:
        source = strip_casts(source)
        if not isinstance(source, fx.Node):
            continue
        candidates = [source]
        # a centered value (x - mean): its statistics are x's central ones
        if op_name(source) in ("sub", "add", "rsub"):
            candidates += [strip_casts(a) for a in source.args[:2] if isinstance(strip_casts(a), fx.Node)]
        for x in candidates:
            # a stored tensor normalized (weight normalization) is a reparametrization, not a norm layer
            stored = view.is_param(x) or x.op in ("get_attr", "output")
            if not stored and x not in (h.x for h in found):
                found.append(_Hypothesis(x, starts))
    return found


def _dims_of(node: fx.Node, input_rank: int | None) -> tuple[int, ...] | bool | None:
    """The reduced dims as sorted negative dims; None for every dim; False when they are not constants."""
    name = op_name(node)
    if name in ("linalg_vector_norm", "norm"):
        dims = arg(node, 2, "dim")
    elif name == "normalize":
        dims = arg(node, 2, "dim", 1)
    else:
        dims = arg(node, 1, "dim")
    if dims is None or dims == []:
        return None
    dims = (dims,) if isinstance(dims, int) else dims
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return False
    if input_rank is None:
        return tuple(sorted(dims))
    return tuple(sorted(d % input_rank - input_rank for d in dims))


class _Reading:
    """The values computed from one input ``x``, read as polynomials over ``x`` and its statistics over
    ``dims``; None for a value that is not such a polynomial (another reduction, an activation)."""

    def __init__(self, view: GraphView, x: fx.Node, dims: tuple[int, ...], order: dict[fx.Node, int]) -> None:
        self.view, self.x, self.dims, self.order = view, x, dims, order
        meta = tensor_meta(x)
        self.rank = rank(x)
        self.size = math.prod(meta[0][d] for d in dims) if meta is not None else None
        self.memo: dict[fx.Node, Poly | None] = {}
        self.independent_memo: dict[fx.Node, bool] = {}

    def __call__(self, value: object, depth: int = 0) -> Poly | None:
        number = _number(value)
        if number is not None:
            return _const(number)
        if not isinstance(value, fx.Node):
            return None
        if value not in self.memo:
            self.memo[value] = None  # a guard while it is being read
            self.memo[value] = None if depth > _MAX_DEPTH else self._read(value, depth + 1)
        return self.memo[value]

    def stored(self, node: fx.Node, depth: int = 0) -> bool:
        """True for a stored tensor and what is computed from stored tensors and constants alone."""
        if self.view.is_param(node) or node.op == "get_attr":
            return True
        if node.op not in ("call_function", "call_method") or depth > 8 or node is self.x:
            return False
        if node not in self.independent_memo:
            inputs = node.all_input_nodes
            self.independent_memo[node] = bool(inputs) and all(self.stored(a, depth + 1) for a in inputs)
        return self.independent_memo[node]

    def _over(self, node: fx.Node) -> bool:
        dims = _dims_of(node, self.rank)
        if dims is None:
            return self.rank is not None and self.dims == tuple(range(-self.rank, 0))
        return dims == self.dims

    def _mean(self, p: Poly | None) -> Poly | None:
        """mean over dims: statistics are constant along them, x^1 -> M, x^2 -> V, stored tensors vary."""
        if p is None:
            return None
        out: Poly = {}
        for mono, c in p.items():
            exps = dict(mono)
            k = exps.pop(X, 0.0)
            if any(a[0] == "tensor" for a in exps) or k not in (0.0, 1.0, 2.0):
                return None
            if k:
                stat = M if k == 1.0 else V
                exps[stat] = exps.get(stat, 0.0) + 1.0
            out = _add(out, {Mono(exps.items()): c})
        return out

    def _var(self, p: Poly | None, correction: float | None) -> Poly | None:
        """mean(p^2) - mean(p)^2, times n / (n - correction)."""
        first, second = self._mean(p), self._mean(_mul(p, p))
        square = _pow(first, 2)
        if correction is None or second is None or square is None:
            return None
        var = _add(second, square, -1.0)
        if correction:
            if self.size is None or self.size <= correction:
                return None
            var = {m: c * self.size / (self.size - correction) for m, c in var.items()}
        return var

    def _read(self, node: fx.Node, depth: int) -> Poly | None:
        if node is self.x:
            return _atom(X)
        if self.stored(node):
            return _atom(("tensor", node))
        name = op_name(node)
        if self.order.get(node, -1) < self.order.get(self.x, 0) or name is None:
            return None

        def read(value: object) -> Poly | None:
            return self(value, depth)

        args = node.args
        result: Poly | None
        if name in _IDENTITY_OPS:
            result = read(args[0]) if args else None
        elif name in ("add", "sub", "rsub") and len(args) >= 2:
            a, b = read(args[0]), read(args[1])
            alpha = _number(node.kwargs.get("alpha", 1))
            if a is None or b is None or alpha is None:
                return None
            result = _add(b, a, -alpha) if name == "rsub" else _add(a, b, alpha if name == "add" else -alpha)
        elif name == "mul" and len(args) == 2:
            result = _mul(read(args[0]), read(args[1]))
        elif name == "div" and len(args) == 2 and node.kwargs.get("rounding_mode") is None:
            result = _mul(read(args[0]), _pow(read(args[1]), -1.0))
        elif name == "neg":
            p = read(args[0])
            result = None if p is None else {m: -c for m, c in p.items()}
        elif name in ("sqrt", "rsqrt", "reciprocal", "square"):
            result = _pow(
                read(args[0]), {"sqrt": 0.5, "rsqrt": -0.5, "reciprocal": -1.0, "square": 2.0}[name]
            )
        elif name == "pow" and isinstance(args[0], fx.Node):
            exponent = _number(arg(node, 1, "exponent"))
            result = None if exponent is None else _pow(read(args[0]), exponent)
        elif name in ("mean", "sum"):
            if not self._over(node):
                return None
            result = self._mean(read(args[0]))
            if name == "sum" and result is not None:
                if self.size is None:
                    return None
                result = {m: c * self.size for m, c in result.items()}
        elif name in ("var", "std"):
            if not self._over(node):
                return None
            result = self._var(read(args[0]), var_correction(node))
            result = _pow(result, 0.5) if name == "std" else result
        elif (
            name == "getitem"
            and isinstance(args[0], fx.Node)
            and op_name(args[0]) in ("var_mean", "std_mean")
        ):
            source = args[0]
            if args[1] not in (0, 1) or not self._over(source):
                return None
            p = read(source.args[0])
            if args[1] == 1:
                result = self._mean(p)
            else:
                result = self._var(p, var_correction(source))
                result = _pow(result, 0.5) if op_name(source) == "std_mean" else result
        elif name in ("linalg_vector_norm", "norm", "normalize"):
            order = arg(node, 1, "ord" if name == "linalg_vector_norm" else "p", 2)
            if order not in (2, 2.0, "fro") or not self._over(node) or self.size is None:
                return None
            p = read(args[0])
            length = _pow(self._mean(_mul(p, p)), 0.5)
            length = None if length is None else {m: c * math.sqrt(self.size) for m, c in length.items()}
            if name == "normalize":
                result = _mul(p, _pow(_clamped(length, arg(node, 3, "eps", 1e-12)), -1.0))
            else:
                result = length
        elif name in ("clamp_min", "clamp"):
            if name == "clamp" and arg(node, 2, "max") is not None:
                return None
            result = _clamped(read(args[0]), arg(node, 1, "min"))
        elif name in _SHAPE_OPS:
            p = read(args[0])
            if p is None:
                return None
            if name == "getitem" and not _is_view_index(args[1]):
                return None
            # statistics are one value along dims however they are laid out; x only through a no-op view
            if _has_x(p) and _shape(node) != _shape(args[0]):
                return None
            result = p
        else:
            return None
        if result is not None and result and not _depends_on_x(result):
            return _atom(("tensor", node))  # computed from stored tensors alone: a stored value here
        return result


def _has_x(p: Poly) -> bool:
    return any(a == X for mono in p for a, _ in mono)


def _shape(node: object) -> tuple[int, ...] | None:
    meta = tensor_meta(node) if isinstance(node, fx.Node) else None
    return meta[0] if meta is not None else None


def _is_view_index(index: object) -> bool:
    """An index that only adds unit dims (``[..., None]``, ``[:, None, None]``)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in items)


@dataclass
class _Form:
    """A polynomial that is a norm: which one, and the stored tensors it applies."""

    centered: bool
    eps: float
    weight: tuple | None  # ("tensor", node) atoms
    bias: tuple | None


def _norm_form(p: Poly | None) -> _Form | None:
    """``(X - M) (V - M^2 + eps)^-1/2 W + B`` or ``X (V + eps)^-1/2 W + B`` (see the module docstring)."""
    if not p:
        return None
    x_terms, m_terms, rest = [], [], []
    for mono, c in p.items():
        exps = dict(mono)
        kx, km = exps.pop(X, 0.0), exps.pop(M, 0.0)
        if (kx, km) == (1.0, 0.0):
            x_terms.append((exps, c))
        elif (kx, km) == (0.0, 1.0):
            m_terms.append((exps, c))
        elif (kx, km) == (0.0, 0.0):
            rest.append((exps, c))
        else:
            return None
    if len(x_terms) != 1 or len(m_terms) > 1 or len(rest) > 1:
        return None
    exps, c = x_terms[0]
    centered = bool(m_terms)
    if centered and (m_terms[0][0] != exps or not math.isclose(m_terms[0][1], -c, rel_tol=_REL)):
        return None
    if not math.isclose(c, 1.0, rel_tol=_REL):
        return None
    tensors = [(a, e) for a, e in exps.items() if a[0] == "tensor"]
    statistics = [(a, e) for a, e in exps.items() if a[0] != "tensor"]
    if len(tensors) > 1 or (tensors and tensors[0][1] != 1.0) or len(statistics) != 1:
        return None
    eps = _statistic_eps(*statistics[0], centered)
    if eps is None:
        return None
    bias = None
    if rest:
        bias_exps, bias_c = rest[0]
        if (
            len(bias_exps) != 1
            or not math.isclose(bias_c, 1.0, rel_tol=_REL)
            or next(iter(bias_exps.items()))[0][0] != "tensor"
            or next(iter(bias_exps.values())) != 1.0
        ):
            return None
        bias = next(iter(bias_exps))
    return _Form(centered, eps, tensors[0][0] if tensors else None, bias)


_CENTRAL = Mono({(Mono({(V, 1.0)}), 1.0), (Mono({(M, 2.0)}), -1.0)})  # V - M^2, as a root's inside


def _statistic_eps(atom: tuple, exponent: float, centered: bool) -> float | None:
    """The eps of ``(second moment + eps)^-1/2`` (central if ``centered``), or None if it is not one."""
    second = _CENTRAL if centered else None
    if atom == V and exponent == -0.5 and not centered:
        return 0.0
    if atom[0] == "root" and exponent == -0.5:
        terms = dict(atom[1])
        eps = terms.pop(Mono(), 0.0)
        if eps < 0:
            return None
        if (centered and Mono(terms.items()) == second) or (
            not centered and terms == {Mono({(V, 1.0)}): 1.0}
        ):
            return eps
        return None
    if atom[0] == "max" and exponent == -1.0:
        _, inside, floor = atom
        wanted = Mono({(("root", second), 0.5)}) if centered else Mono({(V, 0.5)})
        # F.normalize's clamp max(sqrt(V), c) read as sqrt(V + c^2): see the module docstring
        return floor * floor if inside == wanted else None
    return None


# ---------------------------------------------------------------------------------------------------
# From readings to matches


@dataclass
class _Found:
    """A value that reads as a norm, with the stored tensors it applies."""

    form: _Form
    weight: tuple | None  # (parameter node, reshape nodes) of the weight
    bias: tuple | None
    offset: float


def _as_norm(view: GraphView, reading: _Reading, node: fx.Node) -> _Found | None:
    form = _norm_form(reading(node))
    if form is None:
        return None
    affine_dims = reading.dims if reading.rank is not None else None
    weight = bias = None
    offset = 0.0
    if form.weight is not None:
        stored = _stored_affine(view, form.weight[1], affine_dims, reading.rank)
        if stored is None:
            return None
        weight, offset = stored[:2], stored[2]
    if form.bias is not None:
        stored = _stored_affine(view, form.bias[1], affine_dims, reading.rank)
        if stored is None or stored[2]:
            return None
        bias = stored[:2]
    return _Found(form, weight, bias, offset)


def _stored_affine(
    view: GraphView, node: fx.Node, dims: tuple[int, ...] | None, input_rank: int | None
) -> tuple[fx.Node, list[fx.Node], float] | None:
    """(parameter, reshapes on the way, offset) for a stored tensor ``w`` or ``offset + w`` placed
    along ``dims``; None for anything computed otherwise (``2 * w``, ``w * w``)."""
    node = strip_casts(node)
    offset = 0.0
    if isinstance(node, fx.Node) and op_name(node) == "add" and len(node.args) == 2:
        if node.kwargs.get("alpha", 1) != 1:
            return None
        a, b = node.args
        if _number(a) is not None:
            offset, node = _number(a), b  # type: ignore[assignment]
        elif _number(b) is not None:
            offset, node = _number(b), a  # type: ignore[assignment]
        else:
            return None
    found = _param_operand(view, node, dims, input_rank)
    return None if found is None else (found[0], found[1], float(offset or 0.0))


def _matches_from(
    view: GraphView,
    reduction: fx.Node,
    hypothesis: _Hypothesis,
    order: dict[fx.Node, int],
    values: _TensorValues,
) -> list[NormMatch]:
    """The norms of ``hypothesis.x`` that read the statistics ``reduction`` computes."""
    x = hypothesis.x
    input_rank = rank(x)
    dims = _dims_of(reduction, input_rank)
    if dims is False:
        return []
    if dims is None:
        if input_rank is None:
            return []
        dims = tuple(range(-input_rank, 0))
    reading = _Reading(view, x, dims, order)  # type: ignore[arg-type]
    home = view.innermost_path(reduction)
    # the first values from the statistics on that read as a norm, within the module that computes them
    cores: list[fx.Node] = []
    queue = deque((start, 0) for start in hypothesis.starts)
    seen: set[fx.Node] = set()
    while queue:
        node, hops = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        if reading(node) is None:
            continue
        if _as_norm(view, reading, node) is not None:
            cores.append(node)
            continue
        if hops < 12:
            queue.extend((u, hops + 1) for u in real_users(node) if view.innermost_path(u) == home)
    matches = []
    for core in sorted(cores, key=order.__getitem__):
        # then on through its single readers while it still reads as a norm (the weight, the bias, a cast
        # back), within the module of the normalization: a cast in the caller belongs to the caller
        chain = [core]
        while True:
            users = real_users(chain[-1])
            if len(users) != 1 or view.innermost_path(users[0]) != view.innermost_path(core):
                break
            if _as_norm(view, reading, users[0]) is None:
                break
            chain.append(users[0])
        for output in reversed(chain):
            match = _match(view, reading, output, values)
            if match is not None:
                matches.append(match)
                break
    return matches


def _match(view: GraphView, reading: _Reading, output: fx.Node, values: _TensorValues) -> NormMatch | None:
    """The match ending at ``output``, or None when running it shows it is not the norm it reads as."""
    found = _as_norm(view, reading, output)
    cone = _cone(view, reading, output)
    if found is None or cone is None:
        return None
    x, dims = reading.x, reading.dims
    centered = found.form.centered
    kind = _kind_from_dims(dims, reading.rank) if centered else "rms"
    weight = found.weight[0] if found.weight else None
    bias = found.bias[0] if found.bias else None
    match = NormMatch(
        kind=kind,
        input=x,
        output=output,
        nodes=[n for n in cone if not view.is_param(n)],
        dims=_canonical_dims(dims, reading.rank),
        eps=found.form.eps,
        weight=weight,
        bias=bias,
        weight_offset=found.offset,
        casting=_casting(reading, cone, found),
    )
    clamped = any(a[0] == "max" for mono in reading(output) or {} for a, _ in mono)
    if _confirm(view, values, match, cone, centered, clamped) is False:
        return None
    return match


def _cone(view: GraphView, reading: _Reading, output: fx.Node) -> list[fx.Node] | None:
    """The ops between ``reading.x`` and ``output``, in graph order: what the norm computes. None when it
    reads anything but x and stored tensors."""
    nodes: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node in seen or node is reading.x:
            continue
        seen.add(node)
        if view.is_param(node) or node.op == "get_attr":
            continue
        if node.op not in ("call_function", "call_method") or len(seen) > 400:
            return None
        nodes.append(node)
        if op_name(node) in CAST_OPS or op_name(node) == "detach":
            stack.append(node.args[0])  # type: ignore[arg-type]  # a cast's other operand gives only a dtype
        else:
            stack.extend(node.all_input_nodes)
    return sorted(nodes, key=reading.order.__getitem__)


def _casting(reading: _Reading, cone: list[fx.Node], found: _Found) -> str:
    """``llama`` when the normalized value is cast before the weight multiply, ``gemma`` for an offset
    weight applied without such a cast, else ``none`` (see normswap.modules.functional)."""
    if found.form.weight is not None:
        weight = _atom(found.form.weight)
        for node in cone:
            if op_name(node) != "mul" or len(node.args) != 2:
                continue
            for mine, other in (node.args, node.args[::-1]):
                if (
                    isinstance(mine, fx.Node)
                    and isinstance(other, fx.Node)
                    and reading(mine) == weight
                    and _cast_after_statistics(reading, other)
                ):
                    return "llama"
    return "gemma" if found.offset else "none"


def _cast_after_statistics(reading: _Reading, node: fx.Node) -> bool:
    cast = False
    while op_name(node) in CAST_OPS and node.args and isinstance(node.args[0], fx.Node):
        cast = cast or op_name(node) == "to"
        node = node.args[0]
    p = reading(node)
    return cast and p is not None and any(a[0] in ("v", "root", "max") for mono in p for a, _ in mono)


# ---------------------------------------------------------------------------------------------------
# Numerical confirmation


class _TensorValues:
    """The stored tensors behind a graph's parameter nodes (None where there is no value to read)."""

    def __init__(self, view: GraphView, root: nn.Module | None) -> None:
        self.view = view
        self.root = root if root is not None else getattr(view.graph, "owning_module", None)

    def __call__(self, node: fx.Node) -> torch.Tensor | None:
        name = self.view.param_name(node)
        value: object = self.root
        if name is None or value is None:
            return None
        for part in name.split("."):
            value = getattr(value, part, None)
        if not isinstance(value, torch.Tensor) or value.is_meta or not value.is_floating_point():
            return None
        return value.detach().to("cpu", torch.float64)


def _confirm(
    view: GraphView,
    values: _TensorValues,
    match: NormMatch,
    cone: list[fx.Node],
    centered: bool,
    clamped: bool,
) -> bool | None:
    """Whether the cone computes ``match`` on random inputs (see the module docstring); None when it
    cannot be run (no input shape, a tensor without a value)."""
    shape = _shape(match.input)
    if shape is None or not shape:
        return None
    tensors: dict[fx.Node, torch.Tensor] = {}
    for node in cone:
        inputs = (
            [node.args[0]] if op_name(node) in CAST_OPS or op_name(node) == "detach" else node.all_input_nodes
        )
        for leaf in inputs:
            if (
                isinstance(leaf, fx.Node)
                and leaf not in tensors
                and (view.is_param(leaf) or leaf.op == "get_attr")
            ):
                value = values(leaf)
                if value is None:
                    return None
                tensors[leaf] = value
    ndim = len(shape)
    dims = tuple(d % ndim for d in match.dims)
    # Large example inputs: first the same normalized dims with at most 3 of each other dim (the cone's
    # ops are the same; a graph whose shapes are baked in raises there and is run at its own shape).
    small = tuple(s if d in dims else min(s, 3) for d, s in enumerate(shape))
    for trial in (small, shape) if math.prod(shape) > _CONFIRM_ELEMENTS else (shape,):
        verdict = _agrees(cone, match, tensors, trial, dims, centered, clamped)
        if verdict is not None:
            return verdict
    return False


_CONFIRM_ELEMENTS = 1 << 18


def _agrees(
    cone: list[fx.Node],
    match: NormMatch,
    tensors: dict[fx.Node, torch.Tensor],
    shape: tuple[int, ...],
    dims: tuple[int, ...],
    centered: bool,
    clamped: bool,
) -> bool | None:
    """The draws of the module docstring at ``shape``; None when the cone cannot run at that shape."""
    row = tuple(1 if d in dims else s for d, s in enumerate(shape))
    g = torch.Generator().manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=g, dtype=torch.float64)

    draws = [(randn(*shape) * 3 + 1.5, {})]
    shuffled = {}
    for node, center in ((match.weight, 1.0 - match.weight_offset), (match.bias, 0.0)):
        if node is not None and node in tensors:
            shuffled[node] = center + 0.5 * randn(*tensors[node].shape)
    draws.append((randn(*shape) * randn(*row).exp() + 2 * randn(*row), shuffled))
    eps = match.eps or 0.0
    if eps > 1e-30 and not clamped:
        tiny = randn(*shape) * math.sqrt(eps) * (0.5 * randn(*row)).exp()
        draws.append((tiny + (2 * math.sqrt(eps) * randn(*row) if centered else 0.0), {}))
    for x, override in draws:
        env = {**tensors, **override}
        got = _evaluate(cone, match.input, x, env)
        if got is None:
            return None
        want = _reference(
            x, dims, centered, eps, env.get(match.weight), match.weight_offset, env.get(match.bias)
        )
        if want is None or got.shape != want.shape:
            return False
        error = float((got - want).abs().max())
        if not error <= _REL * float(want.abs().max()):  # NaN fails too
            return False
    return True


def _evaluate(cone: list[fx.Node], x_node: fx.Node, x: torch.Tensor, tensors: dict) -> torch.Tensor | None:
    """Run the cone in float64 on ``x``, every cast the identity."""
    env: dict[fx.Node, Any] = {**tensors, x_node: x}

    def value(a: object) -> object:
        if isinstance(a, torch.dtype):
            return torch.float64 if a.is_floating_point else a
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    try:
        for node in cone:
            if op_name(node) in CAST_OPS or op_name(node) == "detach":
                env[node] = env[node.args[0]]  # type: ignore[index]
                continue
            args = fx.node.map_aggregate(fx.node.map_arg(node.args, env.__getitem__), value)
            kwargs = fx.node.map_aggregate(fx.node.map_arg(node.kwargs, env.__getitem__), value)
            if node.op == "call_method":
                env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)  # type: ignore[arg-type, index]
            else:
                env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # any op the cone cannot run on these values: not confirmed
        return None
    out = env[cone[-1]] if cone else x
    return out if isinstance(out, torch.Tensor) else None


def _reference(
    x: torch.Tensor,
    dims: tuple[int, ...],
    centered: bool,
    eps: float,
    weight: torch.Tensor | None,
    offset: float,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """The norm the match reads as, in float64, over ``dims`` (non-negative)."""
    c = x - x.mean(dims, keepdim=True) if centered else x
    y = c / torch.sqrt((c * c).mean(dims, keepdim=True) + eps)
    along = [x.shape[d] if d in dims else 1 for d in range(x.ndim)]
    for tensor, add in ((weight, False), (bias, True)):
        if tensor is None:
            continue
        if tensor.numel() != math.prod(along):
            return None
        y = y + tensor.reshape(along) if add else y * (tensor.reshape(along) + offset)
    return y


# ---------------------------------------------------------------------------------------------------
# Eval-mode BatchNorm written out with its statistics as buffers


def _match_batch(
    view: GraphView, root: fx.Node, stat: fx.Node, eps: float, norm_node: fx.Node, numerator: object
) -> NormMatch | None:
    """``(x - running_mean) * rsqrt(running_var + eps)`` with buffers as statistics, then the affine."""
    nodes: list[fx.Node] = [stat, root.args[0], root, norm_node]  # type: ignore[list-item]
    num = strip_casts(numerator)
    if not isinstance(num, fx.Node) or op_name(num) != "sub" or not view.is_param(strip_casts(num.args[1])):
        return None
    nodes.append(num)
    x_raw = strip_casts(num.args[0])
    input_rank = rank(x_raw)
    if input_rank is not None and input_rank < 2:
        return None
    affine_dims = (1 - input_rank,) if input_rank is not None else None
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
        kind="batch",
        input=x_raw,
        output=output,
        nodes=unique,
        dims=(1,),
        eps=eps,
        weight=weight,
        bias=bias,
        weight_offset=offset,
        casting=casting,
    )
