"""The cheap capture: torch.fx symbolic tracing, trusted only where it computes what the model computes.

torch.export traces every op with fake tensors through export's own dispatch layers; on torchvision's
resnet50 that is 0.5-0.9 s where fx tracing takes 0.02 s (the fold call on either route, over 51 models:
``benchmarks/sweep_fx_capture.py``). fx tracing has two gaps that an analysis graph cannot have, and both are closed here before
the graph is used:

- **It records no shapes.** The traced GraphModule runs once on the example inputs and every node gets a
  ``val`` of its result's shape and dtype (a tensor on the meta device: no activation is kept), which is
  what export records and what the analysis reads (:func:`normswap.graph.ops.tensor_meta`).
- **It can take another path than the model.** A forward parameter left at its default becomes a proxy
  (``mask is not None`` then holds in the trace), and Python code that inspects a proxy
  (``isinstance(x, torch.Tensor)``) sees no tensor. Parameters the example inputs leave to their default
  are traced as those constants, and the trace is accepted only when its run gives the model's own
  outputs on the example inputs, bit for bit: a graph that computes something else never reaches a pass.

A third gap is the reading of ops: the hand-written norm patterns (:mod:`normswap.graph.patterns`) and
the residual-stream analysis read export's aten graph, and on an fx graph they see less (a
``F.layer_norm(x, self.weight.shape)`` has no constant dims there). So the fx graph is used only where
nothing in it is for them to read: no reduction, root or power outside a module fx keeps whole, and no
functional norm but ``F.batch_norm`` (:func:`pattern_free`). Every norm of such a graph is a module or a
batch-norm call, which is what module-level passes (BatchNorm folding) read.

Anything else (tracing raises, a run that fails, outputs that differ, a forward taking ``*args``, an op
a pattern could read) means no fx graph, and the caller uses torch.export.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from normswap.graph.ops import op_name

# Ops a hand-written norm is made of (its reduction, root or power) and functional norms whose reading
# on an fx graph is partial: a graph holding one of them is analyzed on torch.export's graph instead.
_PATTERN_OPS = frozenset(
    {
        *("mean", "var", "std", "var_mean", "std_mean", "sum", "norm", "linalg_vector_norm", "amax"),
        *("rsqrt", "sqrt", "pow", "square", "reciprocal"),
        *("layer_norm", "group_norm", "instance_norm", "rms_norm", "normalize"),
    }
)


class _LeafTracer(fx.Tracer):
    """fx's tracer, with extra module classes kept as single ``call_module`` nodes."""

    def __init__(self, leaf_modules: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self._extra_leaves = leaf_modules
        # a buffer as a graph input, as export has it: by default fx computes with buffers eagerly, so
        # ``torch.rsqrt(self.running_var + eps)`` becomes a constant and the computation leaves the graph
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._extra_leaves and isinstance(m, self._extra_leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def trace_graph(
    model: nn.Module,
    leaf_modules: tuple[type[nn.Module], ...] = (),
    concrete_args: dict[str, Any] | None = None,
) -> fx.Graph:
    """fx symbolic trace of ``model``; raises what the tracer raises."""
    return _LeafTracer(leaf_modules).trace(model, concrete_args=concrete_args)


def _defaults_left(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The forward's parameters the inputs leave to their defaults, with those defaults; None when the
    signature cannot be bound or takes ``*args``/``**kwargs`` (fx cannot make those placeholders)."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    left: dict[str, Any] = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            return None
        if name not in bound.arguments:
            left[name] = parameter.default
    return left


class _ShapeRecorder(fx.Interpreter):
    """Runs a traced module and records each node's result as a meta-device ``val``."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        n.meta["val"] = pytree.tree_map(
            lambda v: (
                torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
            ),
            result,
        )
        return result


def _same(a: Any, b: Any) -> bool:
    """Bitwise the same outputs: one structure, equal tensors (NaNs where they were), equal values. Any
    comparison that cannot be made (a leaf whose ``!=`` is no bool) counts as different."""
    try:
        return _same_leaves(a, b)
    except Exception:  # e.g. an array-valued comparison: not judged, so not trusted
        return False


def _same_leaves(a: Any, b: Any) -> bool:
    flat_a, spec_a = pytree.tree_flatten(a)
    flat_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b or len(flat_a) != len(flat_b):
        return False
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.is_meta or y.is_meta:
                return False  # a model on the meta device computes no values to compare: export's graph
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if not x.is_floating_point():
                if not torch.equal(x, y):
                    return False
            elif not (
                torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))
            ):
                return False
        elif bool(x != y):
            return False
    return True


def faithful_trace(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: dict[str, Any],
    reference: Callable[[], Any],
    leaf_modules: tuple[type[nn.Module], ...] = (),
) -> tuple[fx.Graph | None, str]:
    """An fx graph of ``model`` with shapes recorded, that computes what ``reference()`` returns (the
    model's output on the example inputs) exactly; or ``(None, why not)``. The model runs only once the
    trace has passed the cheaper checks."""
    defaults = _defaults_left(model, example_args, example_kwargs)
    if defaults is None:
        return (
            None,
            "fx tracing not used: the forward's signature does not bind the inputs as named parameters",
        )
    try:
        graph = trace_graph(model, leaf_modules, concrete_args=defaults or None)
    except Exception as exc:  # tracing fails in many ways; export is the answer to all
        return None, f"fx tracing not used: {type(exc).__name__}"
    pattern_op = pattern_free(graph)
    if pattern_op is not None:
        return None, f"fx tracing not used: the forward computes {pattern_op} outside a module"
    try:
        traced = fx.GraphModule(model, graph)
        with torch.no_grad():
            output = _ShapeRecorder(traced).run(
                *_placeholder_values(graph, model, example_args, example_kwargs)
            )
    except Exception as exc:  # the trace took a path the inputs do not run
        return (
            None,
            f"fx tracing not used: its graph does not run on the example inputs ({type(exc).__name__})",
        )
    try:
        expected = reference()
    except Exception as exc:  # the model itself does not run: no graph of it is judged
        return (
            None,
            f"fx tracing not used: the model does not run on the example inputs ({type(exc).__name__})",
        )
    if not _same(expected, output):
        return (
            None,
            "fx tracing not used: its graph does not compute the model's outputs on the example inputs",
        )
    return graph, ""


def pattern_free(graph: fx.Graph) -> str | None:
    """None when no op of ``graph`` is one a norm pattern reads; else the first such op's name."""
    for node in graph.nodes:
        name = op_name(node)
        if name in _PATTERN_OPS:
            return name
    return None


def _placeholder_values(graph: fx.Graph, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """The values of the graph's placeholders, in order: the bound inputs, and the default of each
    parameter traced as a constant (fx keeps a placeholder for it and checks the value it is given)."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        name = str(node.target).lstrip("*")
        values.append(
            bound.arguments[name] if name in bound.arguments else node.args[0] if node.args else None
        )
    return values
