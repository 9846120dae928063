"""Capture a graph of a model for analysis: torch.export (non-strict) first, fx tracing as fallback.

The graph is only read, never run: every edit is applied to the user's module (DESIGN.md, "Analyze on a
graph, edit the module"). Nodes of both capture methods carry ``nn_module_stack``, which maps each op
back to the module path that ran it.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from normswap.load.mode import modes_restored


@dataclass
class CapturedGraph:
    """A graph of the model, or the reasons none could be captured."""

    graph: fx.Graph | None
    method: str | None  # "export" or "fx"
    errors: list[str] = field(default_factory=list)
    # Placeholder name -> qualified name of the parameter/buffer it stands for (export lifts them).
    param_names: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.graph is not None

    @property
    def reason(self) -> str:
        return "; ".join(self.errors) if self.errors else ""


def _short_error(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}"


def capture_graph(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    leaf_modules: tuple[type[nn.Module], ...] = (),
) -> CapturedGraph:
    """Capture an analysis graph of ``model``; never raises for an uncapturable model.

    torch.export needs example inputs; fx symbolic tracing does not, but fails on data-dependent
    control flow. ``leaf_modules`` are kept opaque by the fx fallback.
    """
    errors: list[str] = []
    if example_args is not None or example_kwargs:
        try:
            with modes_restored(model), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exported = torch.export.export(
                    model, tuple(example_args or ()), kwargs=dict(example_kwargs or {}), strict=False
                )
            param_names = {}
            sig = exported.graph_signature
            param_names.update(sig.inputs_to_parameters)
            param_names.update(sig.inputs_to_buffers)
            param_names.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
            return CapturedGraph(exported.graph, "export", errors, param_names)
        except Exception as exc:  # export failures come in many types; we only report them
            errors.append(f"torch.export failed: {_short_error(exc)}")
    else:
        errors.append("torch.export skipped: no example inputs")

    try:
        tracer = _LeafTracer(leaf_modules)
        graph = tracer.trace(model)
        return CapturedGraph(graph, "fx", errors)
    except Exception as exc:
        errors.append(f"fx tracing failed: {_short_error(exc)}")
    return CapturedGraph(None, None, errors)


def input_dims(
    model: nn.Module, example_args: tuple, example_kwargs: dict[str, Any], dim: Any
) -> tuple[Any, ...] | dict[str, Any]:
    """``dynamic_shapes`` for torch.export giving every dim of every input tensor ``dim(tensor, i)``
    (a ``Dim``, ``Dim.AUTO`` or ``Dim.STATIC``)."""

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {i: dim(value, i) for i in range(value.ndim)} if value.ndim else None
        if isinstance(value, list | tuple):
            return type(value)(spec(v) for v in value)
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        return None

    if example_kwargs:
        # with keyword inputs, torch.export wants every input keyed by the forward's parameter names
        bound = inspect.signature(model.forward).bind(*example_args, **example_kwargs)
        return {name: spec(value) for name, value in bound.arguments.items()}
    return tuple(spec(a) for a in example_args)


def _free_dim(tensor: torch.Tensor, dim: int) -> Any:
    """Which input dims export may make dynamic: the batch dim of every input, and every dim of an
    integer input (token ids and masks: the sequence length). Image sizes stay static: symbolic heights
    and widths make export reason about every pooling and unfold (timm's MobileViT took minutes)."""
    if dim == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return torch.export.Dim.AUTO
    return torch.export.Dim.STATIC


def export_program(
    model: nn.Module, example_args: tuple | None, example_kwargs: dict[str, Any] | None
) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with the batch dim and the sequence dims of integer inputs dynamic where
    the model leaves them free (``Dim.AUTO``: export keeps a dim static where the code fixes it, see
    :func:`_free_dim`); a fully static export when that fails."""
    args, kwargs = tuple(example_args or ()), dict(example_kwargs or {})
    # Dim.AUTO on a size-1 dim makes export log that it stays static: expected here, not news
    quiet = logging.getLogger("torch._export.non_strict_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dynamic = input_dims(model, args, kwargs, _free_dim)
            return torch.export.export(model, args, kwargs=kwargs, dynamic_shapes=dynamic, strict=False)
        except Exception:  # data-dependent shapes and the like: the static program still serves
            return torch.export.export(model, args, kwargs=kwargs, strict=False)
        finally:
            quiet.setLevel(level)


def export_module(
    model: nn.Module, example_args: tuple | None, example_kwargs: dict[str, Any] | None
) -> fx.GraphModule | str:
    """:func:`export_program`'s program as a runnable GraphModule, for passes that rewrite a graph
    rather than the module tree; or why it could not be exported, in one line."""
    try:
        program = export_program(model, example_args, example_kwargs)
    except Exception as exc:  # export fails in many ways; the reason is what matters
        return f"torch.export failed: {_short_error(exc)}"
    return program.module()


class _LeafTracer(fx.Tracer):
    def __init__(self, leaf_modules: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self._extra_leaves = leaf_modules

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._extra_leaves and isinstance(m, self._extra_leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)
