"""Numerical confirmation of a norm read off a graph (see :mod:`normswap.graph.patterns`): the subgraph
from ``x`` to the candidate output is evaluated in float64 on three draws and compared with the norm it
was read as, with the eps read; a candidate that fails is not a norm."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx, nn

from normswap.graph.analysis import GraphView
from normswap.graph.norm_algebra import RELATIVE_TOLERANCE
from normswap.graph.norm_match import NormMatch, node_shape
from normswap.graph.ops import (
    CAST_OPS,
    op_name,
)


class TensorValues:
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


def confirm_norm(
    view: GraphView,
    values: TensorValues,
    match: NormMatch,
    cone: list[fx.Node],
    centered: bool,
    clamped: bool,
) -> bool | None:
    """Whether the cone computes ``match`` on random inputs (see the module docstring); None when it
    cannot be run (no input shape, a tensor without a value)."""
    shape = node_shape(match.input)
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
        got = evaluate_nodes(cone, match.input, x, env)
        if got is None:
            return None
        want = _reference(
            x, dims, centered, eps, env.get(match.weight), match.weight_offset, env.get(match.bias)
        )
        if want is None or got.shape != want.shape:
            return False
        error = float((got - want).abs().max())
        if not error <= RELATIVE_TOLERANCE * float(want.abs().max()):  # NaN fails too
            return False
    return True


def evaluate_nodes(
    cone: list[fx.Node], x_node: fx.Node, x: torch.Tensor, tensors: dict
) -> torch.Tensor | None:
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
