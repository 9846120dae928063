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
``(0, ~3e3 c)``, 3e-9 for the default: that is what "exact" means for this form. Only a floor that
small is read so (at most 1e-12 on the RMS: ``norm_algebra.MAX_CLAMP_FLOOR``): a hand-written
``x / rms(x).clamp_min(1e-6) * w`` differs from any RMSNorm by up to 29% on rows of RMS near 1e-6, which
real activations reach, so it is not a norm normswap rewrites.

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

Where the pieces are: :mod:`.norm_algebra` (the polynomial reading and the canonical forms),
:mod:`.norm_confirm` (the numerical confirmation), :mod:`.norm_match` (:class:`NormMatch` and the small
readings they share); this module turns readings into matches, and finds written-out BatchNorms.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from torch import fx, nn

from normswap.graph.analysis import GraphView
from normswap.graph.norm_algebra import (
    NormForm,
    NormHypothesis,
    NormReading,
    dims_of,
    norm_atom,
    norm_form,
    norm_hypotheses,
)
from normswap.graph.norm_confirm import TensorValues, confirm_norm
from normswap.graph.norm_match import (
    NormMatch,
    canonical_dims,
    constant_number,
    follow_affine,
    kind_from_dims,
    param_operand,
    split_add_eps,
)
from normswap.graph.ops import CAST_OPS, op_name, rank, real_users, strip_casts


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


def find_norm_patterns(view: GraphView, root: nn.Module | None = None) -> list[NormMatch]:
    """Every hand-written normalization in the graph, in graph order.

    ``root``: the module the graph was captured from, whose parameters and buffers the graph's tensor
    placeholders stand for; it lets each candidate be confirmed numerically (see the module docstring).
    Without it, the tensors of ``get_attr`` nodes are read from the graph's owning module when it has them.
    """
    order = {n: i for i, n in enumerate(view.nodes)}
    values = TensorValues(view, root)
    found: dict[fx.Node, NormMatch] = {}
    for node in view.nodes:
        for hypothesis in norm_hypotheses(view, node):
            for match in _matches_from(view, node, hypothesis, order, values):
                best = found.get(match.output)
                # the same output reached from inside (an RMS of the centered value): keep the whole norm
                if best is None or len(match.nodes) > len(best.nodes):
                    found[match.output] = match
    for root_node in view.nodes:
        if op_name(root_node) not in ("rsqrt", "sqrt") or not root_node.args:
            continue
        split = split_add_eps(root_node.args[0]) if isinstance(root_node.args[0], fx.Node) else None
        if split is None or not view.is_param(strip_casts(split[0])):
            continue
        for norm_node, numerator in _normalizing_users(root_node):
            match = _match_batch(view, root_node, strip_casts(split[0]), split[1], norm_node, numerator)
            if match is not None and match.output not in found:
                found[match.output] = match
    return sorted(found.values(), key=lambda m: order[m.output])


# ---------------------------------------------------------------------------------------------------
# From readings to matches


@dataclass
class _Found:
    """A value that reads as a norm, with the stored tensors it applies."""

    form: NormForm
    weight: tuple | None  # (parameter node, reshape nodes) of the weight
    bias: tuple | None
    offset: float


def _as_norm(view: GraphView, reading: NormReading, node: fx.Node) -> _Found | None:
    form = norm_form(reading(node))
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
        if constant_number(a) is not None:
            offset, node = constant_number(a), b  # type: ignore[assignment]
        elif constant_number(b) is not None:
            offset, node = constant_number(b), a  # type: ignore[assignment]
        else:
            return None
    found = param_operand(view, node, dims, input_rank)
    return None if found is None else (found[0], found[1], float(offset or 0.0))


def _matches_from(
    view: GraphView,
    reduction: fx.Node,
    hypothesis: NormHypothesis,
    order: dict[fx.Node, int],
    values: TensorValues,
) -> list[NormMatch]:
    """The norms of ``hypothesis.x`` that read the statistics ``reduction`` computes."""
    x = hypothesis.x
    input_rank = rank(x)
    dims = dims_of(reduction, input_rank)
    if dims is False:
        return []
    if dims is None:
        if input_rank is None:
            return []
        dims = tuple(range(-input_rank, 0))
    reading = NormReading(view, x, dims, order)  # type: ignore[arg-type]
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


def _match(view: GraphView, reading: NormReading, output: fx.Node, values: TensorValues) -> NormMatch | None:
    """The match ending at ``output``, or None when running it shows it is not the norm it reads as."""
    found = _as_norm(view, reading, output)
    cone = _cone(view, reading, output)
    if found is None or cone is None:
        return None
    x, dims = reading.x, reading.dims
    centered = found.form.centered
    kind = kind_from_dims(dims, reading.rank) if centered else "rms"
    weight = found.weight[0] if found.weight else None
    bias = found.bias[0] if found.bias else None
    match = NormMatch(
        kind=kind,
        input=x,
        output=output,
        nodes=[n for n in cone if not view.is_param(n)],
        dims=canonical_dims(dims, reading.rank),
        eps=found.form.eps,
        weight=weight,
        bias=bias,
        weight_offset=found.offset,
        casting=_casting(reading, cone, found),
    )
    clamped = any(a[0] == "max" for mono in reading(output) or {} for a, _ in mono)
    if confirm_norm(view, values, match, cone, centered, clamped) is False:
        return None
    return match


def _cone(view: GraphView, reading: NormReading, output: fx.Node) -> list[fx.Node] | None:
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


def _casting(reading: NormReading, cone: list[fx.Node], found: _Found) -> str:
    """``llama`` when the normalized value is cast before the weight multiply, ``gemma`` for an offset
    weight applied without such a cast, else ``none`` (see normswap.kernels.reference)."""
    if found.form.weight is not None:
        weight = norm_atom(found.form.weight)
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


def _cast_after_statistics(reading: NormReading, node: fx.Node) -> bool:
    cast = False
    while op_name(node) in CAST_OPS and node.args and isinstance(node.args[0], fx.Node):
        cast = cast or op_name(node) == "to"
        node = node.args[0]
    p = reading(node)
    return cast and p is not None and any(a[0] in ("v", "root", "max") for mono in p for a, _ in mono)


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
    output, weight, bias, offset, cast_before_weight = follow_affine(
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
