"""The algebra of :mod:`normswap.graph.patterns`: every value computed from a norm's input ``x`` read as
a polynomial over ``X`` (``x`` itself), ``M = mean_D(x)``, ``V = mean_D(x^2)`` and stored tensors, with
real exponents; the hypotheses a reading starts from (a second-moment reduction of ``x`` over dims
``D``); and the canonical forms of LayerNorm and RMSNorm a polynomial is compared with. The module
docstring of :mod:`normswap.graph.patterns` states the decision and what is and is not a norm."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from normswap.graph.analysis import GraphView
from normswap.graph.norm_match import constant_number, is_view_index, node_shape, square_base
from normswap.graph.ops import (
    CAST_OPS,
    arg,
    op_name,
    rank,
    strip_casts,
    tensor_meta,
    var_correction,
)

X, M, V = ("x",), ("m",), ("v",)  # x; mean_D(x); mean_D(x^2)
_STATISTICS = ("m", "v", "root", "max")  # atoms constant along D
# the largest floor of a clamped RMS read as an eps: F.normalize's default on the L2 norm (1e-12), which
# on the RMS is 1e-12 / sqrt(d), below this for every d
MAX_CLAMP_FLOOR = 1e-12
Mono = frozenset  # of (atom, exponent) pairs, one per atom
Poly = dict  # Mono -> coefficient

_MAX_TERMS = 32
_MAX_DEPTH = 64
RELATIVE_TOLERANCE = (
    1e-9  # relative tolerance of a coefficient that must be 1, and of the numerical confirmation
)
_IDENTITY_OPS = CAST_OPS | {"detach", "expand", "expand_as", "broadcast_to"}
_SHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "getitem", "slice"})


def _const(value: float) -> Poly:
    return {Mono(): float(value)} if value else {}


def norm_atom(atom: tuple, exponent: float = 1.0) -> Poly:
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
    floor = constant_number(floor)
    if p is None or floor is None or floor <= 0 or len(p) != 1:
        return None
    ((mono, c),) = p.items()
    if c <= 0 or not mono or not all(_is_statistic(a) for a, _ in mono):
        return None
    return {Mono({(("max", mono, floor / c), 1.0)}): c}


@dataclass
class NormHypothesis:
    """A value ``x`` whose statistics a reduction computes (over the reduction's dims)."""

    x: fx.Node
    starts: list[fx.Node]  # where to look for the norm from: the reduction, or its tuple's items


def norm_hypotheses(view: GraphView, node: fx.Node) -> list[NormHypothesis]:
    """The inputs whose statistics ``node`` may compute, if it is a second-moment reduction."""
    name = op_name(node)
    if name in ("mean", "sum"):
        base = square_base(strip_casts(node.args[0])) if node.args else None
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
    found: list[NormHypothesis] = []
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
                found.append(NormHypothesis(x, starts))
    return found


def dims_of(node: fx.Node, input_rank: int | None) -> tuple[int, ...] | bool | None:
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


class NormReading:
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
        number = constant_number(value)
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
        dims = dims_of(node, self.rank)
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
            return norm_atom(X)
        if self.stored(node):
            return norm_atom(("tensor", node))
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
            alpha = constant_number(node.kwargs.get("alpha", 1))
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
            exponent = constant_number(arg(node, 1, "exponent"))
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
            if name == "getitem" and not is_view_index(args[1]):
                return None
            # statistics are one value along dims however they are laid out; x only through a no-op view
            if _has_x(p) and node_shape(node) != node_shape(args[0]):
                return None
            result = p
        else:
            return None
        if result is not None and result and not _depends_on_x(result):
            return norm_atom(("tensor", node))  # computed from stored tensors alone: a stored value here
        return result


def _has_x(p: Poly) -> bool:
    return any(a == X for mono in p for a, _ in mono)


@dataclass
class NormForm:
    """A polynomial that is a norm: which one, and the stored tensors it applies."""

    centered: bool
    eps: float
    weight: tuple | None  # ("tensor", node) atoms
    bias: tuple | None


def norm_form(p: Poly | None) -> NormForm | None:
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
    if centered and (
        m_terms[0][0] != exps or not math.isclose(m_terms[0][1], -c, rel_tol=RELATIVE_TOLERANCE)
    ):
        return None
    if not math.isclose(c, 1.0, rel_tol=RELATIVE_TOLERANCE):
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
            or not math.isclose(bias_c, 1.0, rel_tol=RELATIVE_TOLERANCE)
            or next(iter(bias_exps.items()))[0][0] != "tensor"
            or next(iter(bias_exps.values())) != 1.0
        ):
            return None
        bias = next(iter(bias_exps))
    return NormForm(centered, eps, tensors[0][0] if tensors else None, bias)


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
        # F.normalize's clamp max(sqrt(V), c) read as sqrt(V + c^2) for a floor no larger than its default
        # (normswap.graph.patterns): a larger one changes rows of real activations, not an eps
        return floor * floor if inside == wanted and floor <= MAX_CLAMP_FLOOR else None
    return None
