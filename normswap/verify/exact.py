"""The one rule that says whether a rewrite is exact: ``convert``'s verification of every exact pass and
``validate --exact`` both call :func:`judge_exact` (DESIGN.md, "One rule per promise").

Two fp32 runs of two equal functions differ by their rounding, and on a deep or ill-conditioned model
that rounding can exceed the table's 1e-5 x max|output| (pesto-pitch's encoder: 7e-05 from fp64 for
the original itself). The rule then compares the rewrite's distance from the same function computed in a
wider dtype with the original's own distance from it. That comparison is made on error *norms* pooled
over every value of every input, never on one row's largest error: a max over a handful of values
fluctuates (a correct fused LayerNorm measured 2.6x the original's max error on one row while the
median ratio over 300 rows was 1.00), a norm over many values does not.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.util.tolerance import within_exact_tolerance
from normswap.verify.metrics import TensorComparison, compare_tensors, flatten_outputs, nonfinite_where

# The rewrite may be at most this many times further from the wider-dtype function than the original is
# (error norms over all inputs). 2: two independent roundings of the same size can differ by a little;
# a genuine error (a weight moved by 1e-3) is orders of magnitude further.
ROUNDING_FACTOR = 2.0


@dataclass
class ExactRun:
    """One input's outputs: the original's (``reference``) and the rewritten model's (``output``)."""

    label: str  # where, as a failure names it: "on the example inputs 1x3x8x8", "on batch 2"
    reference: Any
    output: Any
    args: tuple = ()  # the inputs, for the wider-dtype run
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExactVerdict:
    passed: bool
    reason: str | None = None  # one sentence when not passed, naming the output (and its input)
    outputs: list[TensorComparison] = field(default_factory=list)  # per output, worst input's figures
    rounding: dict[str, Any] | None = None  # the wider-dtype figures, when the table did not decide
    failed_labels: list[str] = field(default_factory=list)  # inputs outside the table

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "reason": self.reason,
            "rounding": self.rounding,
            "failed_inputs": self.failed_labels,
        }


def judge_exact(runs: Sequence[ExactRun], wide: Callable[[], list[Any] | str] | None = None) -> ExactVerdict:
    """Whether the rewritten model's outputs are those of the original, over all ``runs`` together.

    THE RULE (the README states it as written here). On the inputs checked (``convert``: the example and
    its variants; ``validate``: every batch), for every tensor the model returns:

    1. every value of both models' outputs is finite: a NaN or Inf anywhere fails, naming the output and
       the index (a NaN in the original's output is the original broken: nothing was compared there);
    2. integer and bool outputs are equal; floating outputs pass when either
       a. **the table**: ``max|converted - original| <= tol * max|original|`` over all inputs, ``tol``
          by dtype (fp32 1e-5, fp16 2e-3, bf16 1.6e-2; ``normswap.util.tolerance``); or, when that fails
          and the original runs in a wider dtype (fp64 for an fp32 model, fp32 for a half one: ``wide``
          returns those outputs),
       b. **rounding**: ``||converted - wide|| <= 2 * ||original - wide||``, each the error norm over
          every value of that output on every input (integer outputs: the fraction of values that differ
          from the wider run's, under the same factor): the rewrite is no further from the exact function
          than twice the original's own rounding.

    ``wide`` is called only when the table fails; it returns the wider-dtype outputs run by run, or a
    sentence saying why there are none (then the table's verdict stands).
    """
    verdict = ExactVerdict(passed=True)
    table_fails: dict[str, str] = {}  # output name -> its reason, for each output outside the table
    worst: dict[str, tuple[TensorComparison, str]] = {}  # name -> (worst input's figures, its label)
    pooled: dict[str, list[float]] = {}  # name -> [max_abs, max_ref] over every input
    for run in runs:
        refs = flatten_outputs(run.reference, floating_only=False)
        outs = dict(flatten_outputs(run.output, floating_only=False))
        if not refs:
            return ExactVerdict(
                False, f"the model returns no tensor to compare {run.label}", failed_labels=[run.label]
            )
        for name, ref in refs:
            if name not in outs:
                return ExactVerdict(
                    False,
                    f"the converted model has no output {name!r} {run.label}",
                    failed_labels=[run.label],
                )
            try:
                c = compare_tensors(name, ref, outs[name])
            except ValueError as exc:  # an output changed shape
                return ExactVerdict(False, f"{exc} {run.label}", failed_labels=[run.label])
            if c.nonfinite:
                return ExactVerdict(False, f"{c.nonfinite} {run.label}", [c], failed_labels=[run.label])
            if not c.within_tolerance and run.label not in verdict.failed_labels:
                verdict.failed_labels.append(run.label)
            if c.mismatched is not None:
                if c.mismatched:
                    table_fails.setdefault(name, f"{_moved(c)} {run.label}")
            else:
                so_far = pooled.setdefault(name, [0.0, 0.0])
                so_far[0], so_far[1] = max(so_far[0], c.max_abs), max(so_far[1], c.max_ref)
            if name not in worst or c.max_abs > worst[name][0].max_abs:
                worst[name] = (c, run.label)
    verdict.outputs = [c for c, _ in worst.values()]
    for name, (max_abs, max_ref) in pooled.items():
        c, label = worst[name]
        if not within_exact_tolerance(max_abs, max_ref, _dtype(c.dtype)):
            # the pooled figures: the largest error against the largest reference value of all inputs
            rel = max_abs / max_ref if max_ref > 0 else math.inf
            table_fails[name] = f"{_moved(c, max_abs, rel)} {label}"
    if not table_fails:
        return verdict
    first = next(iter(table_fails.values()))
    if wide is None:
        return _failed(verdict, first)
    wide_outputs = wide()
    if isinstance(wide_outputs, str):
        verdict.rounding = {"reference": f"none: {wide_outputs}", "within_rounding": False}
        return _failed(verdict, f"{first} (no wider-dtype run to judge its rounding: {wide_outputs})")
    verdict.rounding = r = _rounding(runs, wide_outputs, set(table_fails))
    if r["within_rounding"]:
        verdict.failed_labels = []
        return verdict
    if "nonfinite" in r:
        return _failed(verdict, f"{first}; {r['nonfinite']}")
    first = table_fails.get(r["output"], first)  # the output furthest beyond its rounding
    inputs = f"{len(runs)} input{'s' if len(runs) != 1 else ''}"
    return _failed(
        verdict,
        f"{first}; against the model in {r['dtype']}, its error norm over {inputs} is {_ratio(r)} "
        f"the original's own (allowed: {ROUNDING_FACTOR:g}x)",
    )


def _failed(verdict: ExactVerdict, reason: str) -> ExactVerdict:
    verdict.passed, verdict.reason = False, reason
    return verdict


def _ratio(r: dict[str, Any]) -> str:
    if r["original_rel_error"] == 0:
        return f"{r['rewritten_rel_error']:.3g} (x the reference's norm) while 0 is"
    return f"{r['rewritten_rel_error'] / r['original_rel_error']:.3g}x"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, torch.float32)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _moved(c: TensorComparison, max_abs: float | None = None, max_rel: float | None = None) -> str:
    if c.mismatched is not None:
        total = math.prod(c.shape)
        return f"{c.name} ({c.dtype}, compared for equality) differs in {c.mismatched} of {total} values"
    max_abs = c.max_abs if max_abs is None else max_abs
    max_rel = c.max_rel if max_rel is None else max_rel
    return f"{c.name} moved by {max_abs:.3g} ({max_rel:.3g} x max|ref|, tolerance {c.tolerance:g})"


def _rounding(runs: Sequence[ExactRun], wide_outputs: list[Any], names: set[str]) -> dict[str, Any]:
    """Rule 2b for the outputs ``names`` (those outside the table): per output, the two models' error
    norms from the wider run, pooled over the runs; the figures of the output with the largest ratio."""
    sums: dict[str, list[float]] = {}  # name -> [||orig - W||^2, ||conv - W||^2, ||W||^2 or count]
    integer: set[str] = set()
    dtype_name = "a wider dtype"
    for run, wide in zip(runs, wide_outputs, strict=True):
        outs = dict(flatten_outputs(run.output, floating_only=False))
        refs = dict(flatten_outputs(run.reference, floating_only=False))
        for name, w in flatten_outputs(wide, floating_only=False):
            if name not in names or name not in refs or w.numel() == 0:
                continue
            ref, out = refs[name], outs[name]
            where = nonfinite_where(name, w, w, reference_label="the wider-dtype run's")
            if where is not None:
                return {
                    "reference": "the model in a wider dtype",
                    "within_rounding": False,
                    "nonfinite": where,
                }
            s = sums.setdefault(name, [0.0, 0.0, 0.0])
            if not (w.is_floating_point() or w.is_complex()):
                integer.add(name)
                s[0] += float((ref != w).sum())
                s[1] += float((out != w).sum())
                s[2] += w.numel()
                continue
            dtype_name = {torch.float64: "fp64", torch.float32: "fp32"}.get(w.dtype, str(w.dtype))
            w, ref, out = (torch.view_as_real(t) if t.is_complex() else t for t in (w, ref, out))
            wd = w.detach().double()
            s[0] += float(((ref.detach().double() - wd) ** 2).sum())
            s[1] += float(((out.detach().double() - wd) ** 2).sum())
            s[2] += float((wd**2).sum())
    worst: tuple[float, str, float, float] | None = None
    # an output the wider run does not return (or returns empty) cannot be judged by it
    within = all(name in sums for name in names)
    for name, (orig_sq, conv_sq, scale) in sums.items():
        if name in integer:
            orig, conv = orig_sq / max(scale, 1.0), conv_sq / max(scale, 1.0)
        else:
            norm = math.sqrt(scale) or 1.0
            orig, conv = math.sqrt(orig_sq) / norm, math.sqrt(conv_sq) / norm
        ok = conv <= ROUNDING_FACTOR * orig
        within = within and ok
        ratio = conv / orig if orig > 0 else (math.inf if conv > 0 else 0.0)
        if worst is None or ratio > worst[0]:
            worst = (ratio, name, orig, conv)
    _, name, orig, conv = worst if worst is not None else (0.0, "", 0.0, 0.0)
    return {
        "reference": f"the model in {dtype_name}",
        "dtype": dtype_name,
        "output": name,
        # error norms relative to the wider run's norm, pooled over every input
        "original_rel_error": orig,
        "rewritten_rel_error": conv,
        "factor": ROUNDING_FACTOR,
        "within_rounding": within,
    }


# ---------------------------------------------------------------------------------------------------
# The wider-dtype run


_HALF = (torch.float16, torch.bfloat16)


def wider_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a model's rounding is judged in: fp32 for a half-precision model, fp64 for an fp32 one;
    None for a model already in fp64 (or with no floating tensor)."""
    floats = [t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    if any(d in _HALF for d in floats):
        return torch.float32
    if floats and all(d == torch.float32 for d in floats):
        return torch.float64
    return None


def widened(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors narrower than ``dtype`` cast to it (inputs for the model in the wider dtype)."""
    width = torch.finfo(dtype).bits

    def widen(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and torch.finfo(t.dtype).bits < width:
            return t.to(dtype)
        return t

    return pytree.tree_map(widen, value)


def widened_model(model: nn.Module) -> nn.Module | str:
    """A copy of ``model`` in its wider dtype (:func:`wider_dtype`), or why there is none."""
    from normswap.modules.copying import copy_model

    dtype = wider_dtype(model)
    if dtype is None:
        return "the model is not in fp32 or a half dtype"
    try:
        return copy_model(model).to(dtype)
    except Exception as exc:  # a module that has no wider dtype (an exported program asserts dtypes)
        return f"the model does not convert to a wider dtype ({type(exc).__name__})"


def run_widened(wide: nn.Module | str, inputs: Sequence[tuple[tuple, dict[str, Any]]]) -> list[Any] | str:
    """``wide`` (from :func:`widened_model`) run on each of ``inputs``, widened; or why it cannot be."""
    from normswap.verify.compare import run_model

    if isinstance(wide, str):
        return wide
    dtype = next((t.dtype for t in wide.parameters() if t.is_floating_point()), torch.float64)
    try:
        return [
            run_model(wide, widened(copy.deepcopy(args), dtype), widened(copy.deepcopy(kwargs), dtype))
            for args, kwargs in inputs
        ]
    except Exception as exc:  # e.g. an exported GraphModule asserts its dtypes
        name = {torch.float32: "fp32", torch.float64: "fp64"}.get(dtype, str(dtype))
        return f"the model does not run in {name} ({type(exc).__name__})"
