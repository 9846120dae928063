"""Capture a graph of a model for analysis: torch.export (non-strict) first, fx tracing as fallback.

The graph is only read, never run: every edit is applied to the user's module (DESIGN.md, "Analyze on a
graph, edit the module"). Nodes of both capture methods carry ``nn_module_stack``, which maps each op
back to the module path that ran it.

A model's own settings can make it uncapturable while its computation is not: a Hugging Face model built
with a default config returns a ``DynamicCache`` (``config.use_cache=True``), a Python object torch.export
cannot carry out of a graph (GPT2LMHeadModel and LlamaForCausalLM fail with "Found <class DynamicCache>
in output"; fx tracing fails on them too). :func:`capture_friendly` turns such settings off for the time
of a capture and puts them back; the capture says so in its ``notes``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from normswap.errors import shorten
from normswap.graph.fx_capture import faithful_trace, trace_graph
from normswap.util.modes import modes_restored
from normswap.util.shapes import format_shapes, input_shapes


@dataclass
class CapturedGraph:
    """A graph of the model, or the reasons none could be captured."""

    graph: fx.Graph | None
    method: str | None  # "export" or "fx"
    errors: list[str] = field(default_factory=list)
    # Placeholder name -> qualified name of the parameter/buffer it stands for (export lifts them).
    param_names: dict[str, str] = field(default_factory=dict)
    # Settings turned off for the capture (see :func:`capture_friendly`), e.g. "use_cache=False".
    notes: list[str] = field(default_factory=list)
    # An fx graph that ran on the example inputs: its nodes carry shapes, and it computed the model's
    # outputs exactly (normswap.graph.fx_capture); False for a trace without inputs.
    ran: bool = False
    # The graph's index (a GraphView), built once by normswap.graph.analysis.view_of for everyone who
    # reads this capture: discovery and every pass the capture is handed to.
    index: Any = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.graph is not None

    @property
    def reason(self) -> str:
        return "; ".join(self.errors) if self.errors else ""

    @property
    def advice(self) -> str:
        """What a user can do about a missing or shape-less graph, as one clause."""
        if self.method == "export" or self.ran:
            return ""
        if any(e.startswith("torch.export skipped") for e in self.errors):
            return "give example inputs (--inputs or --input-shape) so that torch.export can capture it"
        return "make the forward traceable by torch.export on these inputs (e.g. no Python branch on a tensor's value)"


def first_sentence(text: str, limit: int = 240) -> str:
    """The first sentence of the first non-empty line of ``text``; when longer than ``limit``, cut at
    a word boundary and marked with "...", never inside a word."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    end = re.search(r"[.!?](?=\s|$)", line)
    if end is not None:
        line = line[: end.end()]
    return shorten(line, limit)


def _short_error(exc: BaseException) -> str:
    first = first_sentence(str(exc)).rstrip(".")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# Settings that make a model return what torch.export cannot carry out of a graph, and the value that
# turns each off. Read from ``module.config`` of any submodule (Hugging Face, diffusers style), so a
# wrapped or unpickled model is handled like one built by its library.
CAPTURE_HOSTILE = {"use_cache": False}


def _given_names(model: nn.Module, example_args: tuple | None, example_kwargs: dict | None) -> set[str]:
    """Names of the forward parameters the example inputs set (a setting the user gives is kept)."""
    names = set(example_kwargs or {})
    if example_args:
        try:
            bound = inspect.signature(model.forward).bind_partial(*example_args, **(example_kwargs or {}))
        except (TypeError, ValueError):  # no signature, or inputs that do not bind: kwargs only
            return names
        names |= set(bound.arguments)
    return names


def capture_adjustments(
    model: nn.Module, example_args: tuple | None = None, example_kwargs: dict | None = None
) -> list[tuple[Any, str, Any]]:
    """``(config, setting, value for the capture)`` for each capture-hostile setting a config of
    ``model`` switches on and the example inputs leave to the config."""
    given = _given_names(model, example_args, example_kwargs)
    found: list[tuple[Any, str, Any]] = []
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or isinstance(config, (torch.Tensor, nn.Module)) or id(config) in seen:
            continue
        seen.add(id(config))
        for name, off in CAPTURE_HOSTILE.items():
            if name not in given and getattr(config, name, None) not in (None, off):
                found.append((config, name, off))
    return found


def capture_notes(
    model: nn.Module, example_args: tuple | None = None, example_kwargs: dict | None = None
) -> list[str]:
    """What :func:`capture_friendly` would turn off for this model and inputs: ``["use_cache=False"]``."""
    return _notes(capture_adjustments(model, example_args, example_kwargs))


def _notes(adjustments: list[tuple[Any, str, Any]]) -> list[str]:
    return list(dict.fromkeys(f"{name}={off}" for _, name, off in adjustments))


@contextlib.contextmanager
def capture_friendly(
    model: nn.Module, example_args: tuple | None = None, example_kwargs: dict | None = None
) -> Iterator[list[str]]:
    """Turn off, for the time of a capture, the settings of :data:`CAPTURE_HOSTILE` that ``model``'s
    configs switch on and the example inputs do not set; yields a note per setting ("use_cache=False")
    and puts every value back on exit, also on error: the user's model keeps its config."""
    changed = capture_adjustments(model, example_args, example_kwargs)
    saved = [(config, name, getattr(config, name)) for config, name, _ in changed]
    try:
        for config, name, off in changed:
            setattr(config, name, off)
        yield _notes(changed)
    finally:
        for config, name, value in reversed(saved):
            setattr(config, name, value)


def capture_graph(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    leaf_modules: tuple[type[nn.Module], ...] = (),
    fx_first: bool = False,
) -> CapturedGraph:
    """Capture an analysis graph of ``model``; never raises for an uncapturable model.

    torch.export needs example inputs; fx symbolic tracing does not, but fails on data-dependent
    control flow. ``leaf_modules`` are kept opaque by the fx fallback. ``fx_first``: for a reader of
    module-level facts only (see :mod:`normswap.graph.fx_capture`), an fx graph that ran on the example
    inputs with the model's outputs and holds no op a norm pattern reads, before trying torch.export.
    """
    with capture_friendly(model, example_args, example_kwargs) as notes:
        return _capture(model, example_args, example_kwargs, leaf_modules, notes, fx_first)


def _capture(
    model: nn.Module,
    example_args: tuple | None,
    example_kwargs: dict[str, Any] | None,
    leaf_modules: tuple[type[nn.Module], ...],
    notes: list[str],
    fx_first: bool,
) -> CapturedGraph:
    errors: list[str] = []
    # why the faithful fx graph was not taken: said when export fails and the shape-less trace below
    # serves instead (it explains the missing shapes); when that trace fails too, its own error says it
    fx_declined = ""
    if (
        fx_first
        and (example_args is not None or example_kwargs)
        and not any(m.training for m in model.modules())
    ):
        fx_graph = _fx_with_shapes(model, tuple(example_args or ()), dict(example_kwargs or {}), leaf_modules)
        if isinstance(fx_graph, fx.Graph):
            return CapturedGraph(fx_graph, "fx", errors, notes=notes, ran=True)
        fx_declined = fx_graph
    if example_args is not None or example_kwargs:
        try:
            with modes_restored(model), _quiet_export(), _no_stack_traces():
                exported = torch.export.export(
                    model, tuple(example_args or ()), kwargs=dict(example_kwargs or {}), strict=False
                )
            param_names = {}
            sig = exported.graph_signature
            param_names.update(sig.inputs_to_parameters)
            param_names.update(sig.inputs_to_buffers)
            param_names.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
            return CapturedGraph(exported.graph, "export", errors, param_names, notes)
        except Exception as exc:  # export failures come in many types; we only report them
            errors.append(f"torch.export failed: {_short_error(exc)}")
    else:
        errors.append("torch.export skipped: no example inputs")

    try:
        graph = trace_graph(model, leaf_modules)
        return CapturedGraph(graph, "fx", [*errors, *([fx_declined] if fx_declined else [])], notes=notes)
    except Exception as exc:
        errors.append(f"fx tracing failed: {_short_error(exc)}")
    return CapturedGraph(None, None, errors, notes=notes)


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
    """Which input dims export may make dynamic for a graph to analyze: the batch dim of every input, and
    every dim of an integer input (token ids and masks: the sequence length). Image sizes stay static:
    symbolic heights and widths make export reason about every pooling and unfold (timm's MobileViT took
    35 s instead of 1), which the analysis of every pass would pay."""
    free = dim == 0 or not (tensor.is_floating_point() or tensor.is_complex())
    return torch.export.Dim.AUTO if free else torch.export.Dim.STATIC


def _saved_free_dim(tensor: torch.Tensor, dim: int, lengths: dict[int, set[int]] | None = None) -> Any:
    """Which input dims a program to save may keep free: :func:`_free_dim`'s, the height and width of a
    floating image ``N x C x H x W`` (or a clip's ``N x C x T x H x W``), so a CNN's program takes any image
    size, and the ``lengths`` of 3-d floating inputs :func:`_length_dims` found. Export keeps a dim static
    wherever the model's code fixes it (a ViT's patch grid): ``Dim.AUTO``. Paid once, when written."""
    image = dim >= 2 and tensor.ndim in (4, 5) and tensor.is_floating_point()
    if image or (_is_3d(tensor) and tensor.shape[dim] in (lengths or {}).get(dim, ())):
        return torch.export.Dim.AUTO
    return _free_dim(tensor, dim)


def _length_dims(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Callable[[torch.Tensor, int], Any]:
    """:func:`_saved_free_dim` with the lengths of 3-d floating inputs, found as the conversion's variants
    find them (normswap.verify.variants), not guessed: dim 1 (``N x T x D``) or 2 (``N x C x L``) is free if
    the model runs with it cut to a quarter or doubled (in each such input of the first one's size)."""
    first = next((t for t in pytree.tree_leaves((args, kwargs)) if _is_3d(t)), None)
    lengths: dict[int, set[int]] = {}  # dim -> the example's size (and the 2 a size 1 is grown to)
    for dim, size in [(d, first.shape[d]) for d in (1, 2)] if first is not None else []:
        for new in sorted({max(1, size // 4), 2 * size} - {size}):

            def resize(t: Any, dim: int = dim, size: int = size, new: int = new) -> Any:
                # cut to its first ``new`` or doubled; the others copied (a forward may write into them)
                if _is_3d(t) and t.shape[dim] == size:
                    return torch.cat([t, t], dim).narrow(dim, 0, new)
                return t.clone() if isinstance(t, torch.Tensor) else t

            if _runs(model, *pytree.tree_map(resize, (args, kwargs))):
                lengths[dim] = {size, 2} if size == 1 else {size}
                break
    return partial(_saved_free_dim, lengths=lengths)


def _is_3d(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 3 and value.is_floating_point()


def _runs(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``model`` runs on these inputs; its mode, attributes and buffers are put back."""
    saved = [(d, dict(d)) for m in model.modules() for d in (vars(m), m._buffers)]
    try:
        with modes_restored(model, inference=True), torch.no_grad(), _quiet_export():
            model(*args, **kwargs)
    except Exception:  # a shape the model rejects, in whatever way it rejects it
        return False
    finally:
        for attrs, before in saved:
            attrs.clear()
            attrs.update(before)
    return True


def _unit_dims_grown(value: Any, free: Callable[[torch.Tensor, int], Any] = _free_dim) -> Any:
    """``value`` with every dim of size 1 that ``free`` leaves free repeated to size 2: torch.export
    specializes a size-1 dim to 1 (HF directories' example inputs are 1 x 16 token ids), so a program
    exported from them would take batches of one only. Only the dims the export leaves free are grown:
    a fixed dim keeps the example's size."""
    if isinstance(value, torch.Tensor):
        repeats = [
            2 if size == 1 and free(value, i) is torch.export.Dim.AUTO else 1
            for i, size in enumerate(value.shape)
        ]
        return value.repeat(*repeats) if any(r > 1 for r in repeats) else value
    if isinstance(value, list | tuple):
        return type(value)(_unit_dims_grown(v, free) for v in value)
    if isinstance(value, dict):
        return {k: _unit_dims_grown(v, free) for k, v in value.items()}
    return value


def export_program(
    model: nn.Module,
    example_args: tuple | None,
    example_kwargs: dict[str, Any] | None,
    *,
    friendly: bool = True,
    grow_unit_dims: bool = False,
    fallbacks: list[str] | None = None,
    dynamic: bool = True,
) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with the batch dim and the sequence dims of integer inputs dynamic where
    the model leaves them free (``Dim.AUTO``: export keeps a dim static where the code fixes it, see
    :func:`_free_dim`), and in a program to save (``grow_unit_dims``) image sizes and 3-d inputs' lengths
    too (:func:`_length_dims`, within a time budget: :data:`IMAGE_SIZE_BUDGET`), traced on inputs whose
    free dims of size 1 are repeated to 2, so they stay dynamic (:func:`_unit_dims_grown`). Captured under
    :func:`capture_friendly` unless ``friendly`` is False (the program of a Hugging Face model built with a
    default config then returns no cache). ``fallbacks`` hears why, when a dynamic export failed and the
    program is fixed at the example's shapes: never a silent fallback (a saved program must say which
    shapes it takes). ``dynamic=False``: fixed at the example's shapes, as the user asked."""
    args, kwargs = tuple(example_args or ()), dict(example_kwargs or {})
    settings = capture_friendly(model, args, kwargs) if friendly else contextlib.nullcontext()
    with settings, _quiet_export():
        if not dynamic:
            return torch.export.export(model, args, kwargs=kwargs, strict=False)
        traced_args, traced_kwargs = (
            (_unit_dims_grown(args), _unit_dims_grown(kwargs)) if grow_unit_dims else (args, kwargs)
        )
        try:
            free_dims = input_dims(model, traced_args, traced_kwargs, _free_dim)
            start = time.perf_counter()
            program = torch.export.export(
                model, traced_args, kwargs=traced_kwargs, dynamic_shapes=free_dims, strict=False
            )
            took = time.perf_counter() - start
        except Exception as exc:  # data-dependent shapes and the like: the static program still serves
            program = torch.export.export(model, args, kwargs=kwargs, strict=False)
            if fallbacks is not None:
                fallbacks.append(
                    f"the export with free batch and sequence dims failed ({_short_error(exc)}), so the "
                    f"program is fixed at the example's shapes {format_shapes(input_shapes(args, kwargs))}"
                )
            return program
        free = _length_dims(model, args, kwargs) if grow_unit_dims else _free_dim
        leaves = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        found = {t.ndim == 3 for t in leaves for d in range(t.ndim) if free(t, d) is not _free_dim(t, d)}
        if not found:  # nothing beyond the batch and token lengths to free
            return program
        freed = " and ".join(("image sizes", "lengths")[i] for i in sorted(found))
        # Free image sizes make export reason about every pooling, window and unfold: seconds for a CNN,
        # minutes for Swin's padding. They are tried within a budget relative to the export just done.
        budget = max(IMAGE_SIZE_BUDGET[0], IMAGE_SIZE_BUDGET[1] * took)
        image_args, image_kwargs = (_unit_dims_grown(v, free) for v in (args, kwargs))
        try:
            with _time_limit(budget):
                free_dims = input_dims(model, image_args, image_kwargs, free)
                return torch.export.export(
                    model, image_args, kwargs=image_kwargs, dynamic_shapes=free_dims, strict=False
                )
        except _OutOfTime:
            why = f"took over {budget:.0f} s (the export with them fixed took {took:.1f} s)"
        except Exception as exc:  # the image sizes alone may be what export cannot leave free
            why = f"failed ({_short_error(exc)})"
        if fallbacks is not None:
            fallbacks.append(f"the export with free {freed} {why}, so they are fixed at the example's")
        return program


# (at least this many seconds, this many times the export with the image sizes fixed) for freeing them
IMAGE_SIZE_BUDGET = (10.0, 10.0)


class _OutOfTime(BaseException):
    """An export that ran past its time limit (:func:`_time_limit`); a BaseException, so that no
    ``except Exception`` inside the export takes it for one of its own errors."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`_OutOfTime` in the block after ``seconds``, then each second until it ends (a timer
    signal: on the main thread, never over a timer the caller set; else no limit), then put the old back."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _OutOfTime

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


# Loggers through which a failing or dynamic export talks to the user: the failure is reported by
# normswap in one line instead. Dim.AUTO on a size-1 dim makes non_strict_utils log that the dim stays
# static (expected here, not news); a data-dependent branch makes symbolic_shapes warn.
_EXPORT_CHATTER = ("torch._export.non_strict_utils", "torch.fx.experimental.symbolic_shapes")


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """No Python stack trace recorded on each node, for a graph that is only read: collecting them is
    5-15% of an export of a transformer (GPT-2, 48 layers: 2.35 s instead of 2.5-2.8 s). A program that is
    saved keeps them (they are its users' debugging information)."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", None)
    if before is None:  # a torch without the setting records them
        yield
        return
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Warnings, torch's export chatter and the partial graph torch.export prints to stderr when it
    fails (hundreds of lines for a transformer) are kept from the user; the exception still comes."""
    loggers = [logging.getLogger(name) for name in _EXPORT_CHATTER]
    levels = [log.level for log in loggers]
    try:
        for log in loggers:
            log.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def export_module(
    model: nn.Module,
    example_args: tuple | None,
    example_kwargs: dict[str, Any] | None,
    fallbacks: list[str] | None = None,
) -> fx.GraphModule | str:
    """:func:`export_program`'s program as a runnable GraphModule, for passes that rewrite a graph
    rather than the module tree; or why it could not be exported, in one line.

    The module replaces the model, so it must return what the model returns: no setting is turned off
    for this export (a GraphModule exported with ``use_cache=False`` would drop the model's cache).
    ``fallbacks`` hears why the module is fixed at the example's shapes, if it is."""
    try:
        # size-1 free dims grown: a graph exported from a batch-1 example would take batch 1 only
        program = export_program(
            model, example_args, example_kwargs, friendly=False, grow_unit_dims=True, fallbacks=fallbacks
        )
    except Exception as exc:  # export fails in many ways; the reason is what matters
        reason = f"torch.export failed: {_short_error(exc)}"
        adjustments = capture_adjustments(model, example_args, example_kwargs)
        if adjustments:
            on = ", ".join(
                dict.fromkeys(f"{name}={getattr(config, name)}" for config, name, _ in adjustments)
            )
            reason += (
                f"; the model's config sets {on} and a graph rewrite must keep every output: give "
                f"{', '.join(_notes(adjustments))} in the example inputs to allow it"
            )
        return reason
    return program.module()


def _fx_with_shapes(
    model: nn.Module, args: tuple, kwargs: dict[str, Any], leaf_modules: tuple[type[nn.Module], ...]
) -> fx.Graph | str:
    """:func:`faithful_trace` of ``model``, judged against the model's own run on the inputs."""

    def reference() -> Any:
        with torch.no_grad():
            return model(*args, **kwargs)

    graph, why = faithful_trace(model, args, kwargs, reference, leaf_modules)
    return graph if graph is not None else why
