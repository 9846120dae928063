"""Find cosine-normalized layers on a captured graph, however they are written, and confirm each by running it.

A cosine layer (Luo et al. 2017) computes ``y_j = s_j cos(x, w_j) (+ t_j)``: the dot product of a
Linear/Conv divided by the norm of the input and of each weight row. It can be written as
``F.normalize(x) @ F.normalize(W).T``, ``x @ W.T / (x.norm(-1, keepdim=True) * W.norm(dim=1))``,
``F.cosine_similarity(x[:, None], W[None], -1)``, with or without eps, with a learned scale, or as
normswap's own :class:`~normswap.modules.cosine.CosineLinear` (the bias inside the cosine).

*Reading.* Every product op (``linear``, ``matmul``, ``mm``, ``addmm``, ``bmm``, ``cosine_similarity``,
a convolution) one of whose operands is a stored weight (reached through transposes, views and the
normalizing ops themselves) is a candidate; its candidate outputs are the product and the values after
it along a chain of ``div``/``mul``/``clamp``/view ops (where a division by the norms and a scale go);
its candidate inputs ``x`` are the other operand and the values it was normalized from (``div``'s
numerator, ``mul``'s full-size operand, unsqueezes).

*Confirmation.* The subgraph from ``x`` to a candidate output must be closed (it reads nothing else but
stored tensors and constants) and contain a reduction (a norm cannot be computed without one); it is
then evaluated in float64 on random inputs with their own row scales and must equal ``s * cos + t``
per output, with ``s``, ``t`` least-squares fitted on those draws (at least three rows per output, or any
conv followed by a per-channel affine would fit), within 1e-5 relative (``_REL``), either for
plain cosines or for the augmented ones ``cos([x, 1], [w, b])`` with the stored bias. So a Linear
followed by an RMSNorm (``Wx / rms(Wx)`` is scale-invariant in ``x`` but not a cosine) is not taken.
The latest output that confirms wins (the scale multiply included).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from normswap.graph.analysis import GraphView
from normswap.graph.norm_confirm import TensorValues, evaluate_nodes
from normswap.graph.ops import arg, op_name, real_users, tensor_meta

_PRODUCTS = frozenset({"linear", "matmul", "mm", "addmm", "bmm", "cosine_similarity", "convolution", "conv1d", "conv2d", "conv3d"})  # fmt: skip
_CONVS = frozenset({"convolution", "conv1d", "conv2d", "conv3d"})
_WEIGHT_LAST = _CONVS | {"linear", "addmm"}  # products whose weight is never the first operand
# between the stored weight and the product: layout changes and the weight's own normalization
_WEIGHT_SIDE = frozenset({"t", "numpy_T", "transpose", "permute", "view", "reshape", "unsqueeze", "div", "mul", "expand", "expand_as", "to", "contiguous", "clone", "alias", "detach", "clamp_min", "clamp", "linalg_vector_norm", "norm", "sqrt", "rsqrt", "sum", "pow", "square", "add", "reciprocal"})  # fmt: skip
# after the product: the division by the norms and the scale
_AFTER = frozenset({"div", "mul", "clamp", "clamp_min", "view", "reshape", "squeeze", "unsqueeze", "to", "contiguous", "clone", "alias", "add", "expand"})  # fmt: skip
_REDUCTIONS = frozenset({"linalg_vector_norm", "norm", "sum", "mean", "cosine_similarity", "rsqrt", "sqrt"})
# relative: loose enough for an eps added to the squares (1e-8 .. 1e-5 on rows of norm >= 1), tight
# enough that a layer followed by an RMSNorm (an O(1) misfit) is never taken
_REL = 1e-5


@dataclass
class CosineMatch:
    """A cosine layer read off a graph and confirmed: ``input`` to ``output`` computes
    ``scale * cos([x, 1] if augmented else x, rows of weight) + shift``."""

    input: fx.Node
    output: fx.Node
    nodes: list[fx.Node]
    weight: str  # the stored weight's qualified name
    conv: bool
    augmented: bool  # the bias inside the cosine (normswap's CosineLinear/CosineConv)
    scale: torch.Tensor  # (out,) fitted
    shift: torch.Tensor  # (out,) fitted, ~0 when there is none

    @property
    def out_features(self) -> int:
        return int(self.scale.numel())


def _weight_params(view: GraphView, start: object) -> list[fx.Node]:
    """Stored tensors reached from ``start`` through weight-side ops only."""
    found, todo, seen = [], [start], set()
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if view.is_param(node):
            found.append(node)
        elif op_name(node) in _WEIGHT_SIDE:
            todo.extend(node.all_input_nodes)
    return found


def _input_chain(node: object) -> list[fx.Node]:
    """``node`` and the values it was normalized from, nearest first."""
    chain: list[fx.Node] = []
    while isinstance(node, fx.Node) and node not in chain:
        chain.append(node)
        name = op_name(node)
        if name in ("unsqueeze", "expand", "to", "contiguous", "clone", "div") and node.args:
            node = node.args[0]
        elif name == "mul":
            sizes = [
                (tensor_meta(a)[0] if isinstance(a, fx.Node) and tensor_meta(a) else ())
                for a in node.args[:2]
            ]
            node = (
                node.args[0]
                if len(sizes[0]) >= len(sizes[1]) and sum(sizes[0]) >= sum(sizes[1])
                else node.args[1]
            )
        else:
            break
    return chain


def _cone(view: GraphView, x: fx.Node, out: fx.Node) -> list[fx.Node] | None:
    """The nodes from ``x`` to ``out`` in graph order, or None when the subgraph reads an activation
    that does not come from ``x``."""
    cone: set[fx.Node] = set()
    todo = deque([out])
    while todo:
        node = todo.popleft()
        if node is x or node in cone:
            continue
        if node.op == "placeholder" or node.op == "get_attr":
            if view.is_param(node) or node.op == "get_attr":
                continue
            return None
        cone.add(node)
        todo.extend(node.all_input_nodes)
    return [n for n in view.nodes if n in cone]


def _reference(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, node: fx.Node
) -> torch.Tensor | None:
    """Plain or augmented (``b`` given) cosines of ``x`` against the rows of ``w``: (rows, out)."""
    if node is not None and op_name(node) in _CONVS:
        stride, padding, dilation = (
            arg(node, 3, "stride", 1),
            arg(node, 4, "padding", 0),
            arg(node, 5, "dilation", 1),
        )
        groups = arg(node, 8, "groups", 1) if op_name(node) == "convolution" else arg(node, 6, "groups", 1)
        if groups != 1 or w.ndim != x.ndim or (b is not None and b.numel() != w.shape[0]):
            return None  # not a weight and bias of this conv (a frozen BatchNorm's scale read as a bias)
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.ndim]
        try:
            dot = conv(x, w, b, stride, padding, dilation)
        except RuntimeError:  # the candidate's tensors do not make this conv: not a cosine layer
            return None
        ones = torch.ones(1, *w.shape[1:], dtype=x.dtype)
        xn = conv(x * x, ones, None, stride, padding, dilation) + (1.0 if b is not None else 0.0)
        wn = w.flatten(1).square().sum(1) + (b.square() if b is not None else 0.0)
        cos = dot / xn.sqrt() / wn.sqrt().reshape(1, -1, *([1] * (x.ndim - 2)))
        return cos.movedim(1, -1).reshape(-1, w.shape[0])
    if w.ndim != 2:
        return None
    if w.shape[1] != x.shape[-1] and w.shape[0] == x.shape[-1]:
        w = w.T  # stored (in, out)
    if w.shape[1] != x.shape[-1]:
        return None
    rows = x.reshape(-1, x.shape[-1])
    if b is not None:
        if b.numel() != w.shape[0]:
            return None
        rows, w = torch.cat([rows, torch.ones_like(rows[:, :1])], 1), torch.cat([w, b[:, None]], 1)
    return F.normalize(rows, dim=1) @ F.normalize(w, dim=1).T


def _rows(out: torch.Tensor, features: int, conv: bool) -> torch.Tensor:
    """(rows, features) view of an output (features at dim 1 for a conv); empty when it does not divide."""
    if conv:
        return (
            out.movedim(1, -1).reshape(-1, features) if out.ndim > 1 and out.shape[1] == features else out[:0]
        )
    return out.reshape(-1, features) if out.numel() % features == 0 else out[:0].reshape(0, features)


# Random inputs drawn per candidate, and the rows (positions over all draws) a fit of a scale and a shift
# per output needs to mean anything: on a 1x1 feature map, two draws gave two rows, which any conv
# followed by a per-channel affine fits (timm's mobilenetv3 with frozen BatchNorms listed 6 such layers)
_DRAWS = 4
_MIN_ROWS = 3


def _fit(cos: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-output least squares ``out ~ s cos + t``: s, t and the worst residual relative to max|out|."""
    mc, mo = cos.mean(0), out.mean(0)
    dc, do = cos - mc, out - mo
    s = (dc * do).sum(0) / (dc * dc).sum(0).clamp_min(1e-300)
    t = mo - s * mc
    residual = float((s * cos + t - out).abs().max()) / max(float(out.abs().max()), 1e-300)
    return s, t, residual


def _confirm(view: GraphView, values: TensorValues, product: fx.Node, x: fx.Node, out: fx.Node, weight: fx.Node, bias: fx.Node | None) -> CosineMatch | None:  # fmt: skip
    cone = _cone(view, x, out)
    if not cone or not any(op_name(n) in _REDUCTIONS for n in cone):
        return None
    meta = tensor_meta(x)
    w = values(weight)
    if meta is None or w is None:
        return None
    g = torch.Generator().manual_seed(0)
    shape = meta[0]
    draws = []
    for _ in range(_DRAWS):
        row = 1 + torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) * 4 if shape else 1.0
        draws.append(torch.randn(shape, generator=g, dtype=torch.float64) * row)
    tensors = {n: values(n) for n in cone for n in n.all_input_nodes if view.is_param(n)}
    if any(v is None for v in tensors.values()):
        return None
    outs = [evaluate_nodes(cone, x, d, tensors) for d in draws]
    if any(o is None for o in outs):
        return None
    b = values(bias) if bias is not None else None
    for augmented in (False, True) if b is not None else (False,):
        refs = [_reference(d, w, b if augmented else None, product) for d in draws]
        if any(r is None for r in refs):
            return None
        cos = torch.cat(refs)  # type: ignore[arg-type]
        conv = op_name(product) in _CONVS
        got = torch.cat([_rows(o, cos.shape[1], conv) for o in outs])  # type: ignore[arg-type]
        if got.shape != cos.shape or cos.shape[0] < _MIN_ROWS:
            return None  # too few rows to tell: two points fit any scale and shift
        s, t, residual = _fit(cos, got)
        if residual <= _REL and bool((s.abs() > 1e-12).all()):
            name = view.param_name(weight) or ""
            return CosineMatch(x, out, cone, name, op_name(product) in _CONVS, augmented, s, t)
    return None


def find_cosine_layers(view: GraphView, root: nn.Module | None = None) -> list[CosineMatch]:
    """Every confirmed cosine layer in ``view``'s graph (see the module doc), in graph order."""
    values = TensorValues(view, root)
    matches: list[CosineMatch] = []
    taken: set[fx.Node] = set()
    for product in view.nodes:
        if op_name(product) not in _PRODUCTS or product in taken:
            continue
        operands = [a for a in product.args[:3] if isinstance(a, fx.Node)]
        for i, operand in enumerate(operands):
            weights = [
                p for p in _weight_params(view, operand) if (values(p) is not None and values(p).ndim >= 2)
            ]  # type: ignore[union-attr]
            if len(weights) != 1 or (i == 0 and op_name(product) in _WEIGHT_LAST):
                continue  # the weight of linear/addmm/conv is never its first operand
            # the other operand may carry a scalar parameter (a temperature multiplied before the
            # product: CLIP's logit_scale * x_n @ w_n.T), but not a stored matrix of its own
            others = [
                a
                for j, a in enumerate(operands)
                if j != i
                and not any(values(p) is not None and values(p).ndim >= 2 for p in _weight_params(view, a))
            ]
            if not others:
                continue
            biases = [
                p
                for o in operands
                for p in _weight_params(view, o)
                if values(p) is not None and values(p).ndim == 1
            ]  # type: ignore[union-attr]
            found = _best(view, values, product, others[0], weights[0], biases[0] if biases else None)
            if found is not None:
                matches.append(found)
                taken.update(found.nodes)
                break
    return matches


def _best(view: GraphView, values: TensorValues, product: fx.Node, operand: fx.Node, weight: fx.Node, bias: fx.Node | None) -> CosineMatch | None:  # fmt: skip
    """The latest output after ``product`` that confirms, over the candidate inputs."""
    outputs = [product]
    while len(outputs) < 8:
        users = real_users(outputs[-1])
        if len(users) != 1 or op_name(users[0]) not in _AFTER:
            break
        outputs.append(users[0])
    inputs = _input_chain(operand)
    for out in reversed(outputs):
        for x in reversed(inputs):
            found = _confirm(view, values, product, x, out, weight, bias)
            if found is not None:
                return found
    return None
