"""Compose passes, checking each one's effect on the outputs as it goes.

Each pass is validated on its own (outputs right before it vs right after it), so an exact pass in a
pipeline that also holds an architectural one is still held to the exact tolerance.

"Exact" is a claim about the function, not about one input: an exact pass is checked on the example
inputs and on variants of them along the dims the original model accepts freely (batch, sequence length,
spatial size; :mod:`normswap.validate.variants`), and every tensor output is compared, integer and bool
ones by equality. A rewritten model that raises on a variant the original accepts is not silently wrong:
the pass's validation says which shapes it was proven on and which it does not accept.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.graph.capture import CapturedGraph
from normswap.modules.copying import copy_model
from normswap.passes.base import Pass, PassReport, RewriteKind, usable_capture
from normswap.validate.compare import ModelComparison, compare_models, compare_outputs, run_model
from normswap.validate.metrics import TensorComparison, flatten_outputs
from normswap.validate.variants import (
    InputVariant,
    accepted_variants,
    candidate_variants,
    describe_error,
    format_shapes,
)


@dataclass
class PipelineReport:
    passes: list[PassReport] = field(default_factory=list)
    # Whole-model comparison of the final model against the input model.
    overall: ModelComparison | None = None
    # Exact passes whose outputs moved beyond the tolerance: a bug, and a reason not to write anything.
    exact_failures: list[str] = field(default_factory=list)
    # The inputs beyond the example that exact passes are checked on: those the original model accepts,
    # and those it rejects (not free sizes of the model) with its reason. None when not probed.
    input_variants: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.exact_failures

    @property
    def changed(self) -> bool:
        return any(p.changes for p in self.passes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exact_failures": self.exact_failures,
            "passes": [p.to_dict() for p in self.passes],
            "overall": self.overall.to_dict() if self.overall else None,
            "input_variants": self.input_variants,
        }


class ExactOnlyError(ValueError):
    """A pipeline restricted to exact rewrites was given a pass that is not exact."""


class Pipeline:
    """Run passes in order, each on the model the previous one returned, validating each as it goes.

    Every pass is a :class:`~normswap.passes.base.Pass` (the one protocol), so the pipeline needs no
    knowledge of any pass: it runs each in place on its own working copy, and hands a graph the caller
    already captured to the first pass when that pass :attr:`~normswap.passes.base.Pass.reuses_capture`.
    """

    def __init__(self, passes: list[Pass], *, validate: bool = True, exact_only: bool = False) -> None:
        if exact_only:
            for p in passes:
                if p.kind is not RewriteKind.EXACT:
                    raise ExactOnlyError(f"{p.name} is {p.kind.value}, not exact")
        self.passes = passes
        self.validate = validate

    def __call__(
        self,
        model: nn.Module,
        example_args: tuple | None = None,
        example_kwargs: dict[str, Any] | None = None,
        *,
        inplace: bool = False,
        captured: CapturedGraph | None = None,
        on_step: Callable[[str], None] | None = None,
    ) -> tuple[nn.Module, PipelineReport]:
        """``captured``: a graph of ``model`` on these inputs already captured, used instead of capturing
        it again by every pass that needs one while it still describes the model. ``on_step`` hears what is being done ("fold_batchnorm: rewriting"),
        for a progress display."""
        step = on_step or (lambda _what: None)
        has_inputs = example_args is not None or bool(example_kwargs)
        check = self.validate and has_inputs
        # Not in place, the passes edit a copy and ``model`` itself stays the original: the reference of
        # the whole-model comparison needs no copy of its own (in place, there is no such comparison).
        original = model
        current = model if inplace else copy_model(model)
        report = PipelineReport()
        inputs = [InputVariant("example", tuple(example_args or ()), dict(example_kwargs or {}))]
        # outputs of `current` on inputs[i]; valid while `current` is unchanged (passes without changes
        # keep it), so each input runs once per change, not twice per pass
        outputs: dict[int, Any] = {}
        if check and any(p.kind is RewriteKind.EXACT for p in self.passes):
            # the original decides which variants are free sizes; its outputs are the first reference
            step("running the model on input variants")
            probe = accepted_variants(current, candidate_variants(example_args, example_kwargs))
            report.input_variants = probe.to_dict()
            inputs += probe.accepted
            outputs.update({i: _kept(out) for i, out in enumerate(probe.outputs, start=1)})
        live = list(range(len(inputs)))  # the inputs the current model still accepts
        original_output: Any = None
        dropped: list[dict[str, Any]] = []  # inputs an earlier (architectural) change made unusable
        only_exact_so_far = True  # every pass that changed the model so far was exact
        for p in self.passes:
            exact = p.kind is RewriteKind.EXACT
            for i in [i for i in live if exact or i == 0] if check else []:
                if i not in outputs:
                    try:
                        outputs[i] = _kept(_run(current, inputs[i]))
                    except Exception as exc:
                        if i == 0:
                            raise
                        live.remove(i)
                        dropped.append({**inputs[i].to_dict(), "error": describe_error(exc)})
            if check and original_output is None:
                original_output = outputs[0]  # the input model's, before any pass: the overall reference
            wanted = [i for i in live if exact or i == 0] if check else []
            # The model an exact pass is judged against, in a wider dtype, when the outputs move beyond the
            # table: a half-precision model is kept as it was (judged in fp32); an fp32 one is judged
            # against the input model in fp64, which computes the same function while every change so
            # far was exact (no copy unless a check fails).
            snapshot = None
            if check and exact and _is_half(current):
                snapshot = copy_model(current)
            elif check and exact and not inplace and only_exact_so_far and _is_fp32(current):
                snapshot = original
            previous = current
            step(f"{p.name}: rewriting")
            # One capture per graph state: captured here when a pass needs one and the last is stale, and
            # handed on while the passes after it change nothing or keep it valid (Pass.keeps_capture).
            if p.reuses_capture and has_inputs:
                captured = usable_capture(
                    current, example_args, example_kwargs, captured, fx_first=p.fx_analysis
                )
                current, pass_report = p(
                    current, example_args, example_kwargs, inplace=True, captured=captured
                )
            else:
                current, pass_report = p(current, example_args, example_kwargs, inplace=True)
            if pass_report.changes and not (p.keeps_capture and current is previous):
                captured = None
            if pass_report.changes and not exact:
                only_exact_so_far = False
            if check and pass_report.changes:
                step(f"{p.name}: validating on {len(wanted)} input{'s' if len(wanted) != 1 else ''}")
                before = {i: outputs[i] for i in wanted}
                outputs.clear()
                check_run = _PassCheck(p, pass_report, current, snapshot)
                earlier = list(dropped)
                for i in wanted:
                    accepted, after = check_run.run(inputs[i], before[i], is_example=i == 0)
                    if not accepted:  # a limitation of this pass; later ones cannot use the input
                        live.remove(i)
                        dropped.append(check_run.not_accepted[-1])
                    else:
                        outputs[i] = after
                failure = check_run.finish(earlier)
                if failure is not None:
                    report.exact_failures.append(failure)
            elif current is not previous:
                outputs.clear()
            report.passes.append(pass_report)
        if check and not inplace:
            step("comparing the whole model with the original")
            # both outputs are at hand when the last pass that changed the model was checked on the
            # example: the whole-model comparison runs nothing again
            if original_output is None:
                report.overall = compare_models(
                    original, current, example_args, example_kwargs, floating_only=False
                )
            else:
                final = outputs[0] if 0 in outputs else _kept(_run(current, inputs[0]))
                report.overall = compare_outputs(original_output, final, floating_only=False)
        return current, report


def _run(model: nn.Module, variant: InputVariant) -> Any:
    return run_model(model, copy.deepcopy(variant.args), copy.deepcopy(variant.kwargs))


def _kept(output: Any) -> Any:
    """A model output kept as a reference: its tensors cloned, so that a pass editing a parameter in
    place cannot change an output that aliases it."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, output)


def _returned(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _moved(worst: TensorComparison) -> str:
    if worst.mismatched is not None:
        return (
            f"{worst.name} ({worst.dtype}, compared for equality) differs in {worst.mismatched} of "
            f"{math.prod(worst.shape)} values"
        )
    return (
        f"{worst.name} moved by {worst.max_abs:.3g} "
        f"({worst.max_rel:.3g} x max|ref|, tolerance {worst.tolerance:g})"
    )


class _PassCheck:
    """The check of one pass that made changes: outputs before vs after on each input, collected into
    the pass's ``validation`` dict and, for an exact pass, into at most one failure sentence."""

    def __init__(self, p: Pass, pass_report: PassReport, model: nn.Module, snapshot: nn.Module | None):
        self.name = p.name
        self.exact = p.kind is RewriteKind.EXACT
        self.report = pass_report
        self.model = model
        self.snapshot = snapshot
        self.wide: nn.Module | None = None  # the snapshot in the wider dtype, made at the first need
        self.verified: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.not_accepted: list[dict[str, Any]] = []
        self.reasons: list[str] = []  # one per failed input, example first

    def run(self, variant: InputVariant, before: Any, *, is_example: bool) -> tuple[bool, Any]:
        """Run the rewritten model on ``variant`` and judge it; ``(True, its output)``, or
        ``(False, None)`` when it raises on an input the model before the pass accepted (then it is a
        limitation, not a failure)."""
        try:
            after = _run(self.model, variant)
        except Exception as exc:
            if is_example:
                raise
            self.not_accepted.append({**variant.to_dict(), "error": describe_error(exc)})
            return False, None
        shapes = variant.describe()
        where = f"on the example inputs {shapes}" if is_example else f"on inputs {shapes} ({variant.label})"
        try:
            comparison = compare_outputs(before, after, floating_only=not self.exact)
        except ValueError as exc:  # an output changed shape or went missing
            if not self.exact:
                raise
            if is_example:
                self.report.validation = {**ModelComparison().to_dict(), "error": str(exc)}
            self.failed.append({**variant.to_dict(), "error": str(exc)})
            self.reasons.append(f"{self.name}: {exc} {where}")
            return True, _kept(after)
        if is_example:
            self.report.validation = comparison.to_dict()
        if not self.exact:
            return True, _kept(after)
        entry = {
            **variant.to_dict(),
            "compared": len(comparison.outputs),
            "within_tolerance": comparison.within_tolerance,
            "worst_rel": comparison.worst_rel,
        }
        passed = comparison.within_tolerance
        if not comparison.outputs:
            if self.failed and not self.failed[0]["compared"]:
                return True, _kept(after)  # the example compared nothing already: said once
            reason = (
                f"{self.name}: the model returns no tensor to compare (returned {_returned(before)}) {where}: "
                "an exact change cannot be verified"
            )
        else:
            if not passed and self.snapshot is not None:
                verdict = self._rounding_verdict(before, after, variant)
                entry["rounding"] = verdict
                if is_example:
                    self.report.validation["rounding"] = verdict
                passed = verdict["within_rounding"]
            failing = [o for o in comparison.outputs if not o.within_tolerance] or comparison.outputs
            reason = f"{self.name}: {_moved(max(failing, key=lambda o: o.max_rel))} {where}"
        if passed:
            self.verified.append(entry)
        else:
            self.failed.append(entry)
            self.reasons.append(reason)
        return True, _kept(after)

    def _rounding_verdict(self, before: Any, after: Any, variant: InputVariant) -> dict[str, Any]:
        if self.wide is None:
            assert self.snapshot is not None
            try:
                self.wide = copy_model(self.snapshot).to(_wider(self.snapshot))
            except Exception as exc:  # a module that has no wider dtype: the table's verdict stands
                return {
                    "reference": f"none: the model does not convert to a wider dtype ({type(exc).__name__})",
                    "within_rounding": False,
                }
        return rounding_verdict(
            self.snapshot,
            before,
            after,
            copy.deepcopy(variant.args),
            copy.deepcopy(variant.kwargs),
            reference_model=self.wide,
        )

    def finish(self, dropped: list[dict[str, Any]]) -> str | None:
        """Record what was verified where; the failure sentence of an exact pass, or None."""
        if self.report.validation is None:
            self.report.validation = ModelComparison().to_dict()
        if not self.exact:
            return None
        shapes = ", ".join(format_shapes(v["shapes"]) for v in self.verified) or "none"
        limitations = [
            f"verified on shapes {shapes}; the converted model does not accept {format_shapes(v['shapes'])}, "
            f"which the original does ({v['error']})"
            for v in self.not_accepted
        ] + [
            f"not verified on {format_shapes(v['shapes'])}: the model before this pass (after the earlier "
            f"passes) does not accept it ({v['error']})"
            for v in dropped
        ]
        self.report.validation.update(
            verified_inputs=self.verified,
            failed_inputs=self.failed,
            not_accepted=self.not_accepted + dropped,
            limitations=limitations,
        )
        if not self.reasons:
            return None
        more = len(self.reasons) - 1
        also = [format_shapes(v["shapes"]) for v in self.failed[1:]]
        return self.reasons[0] + (f" (also fails on {more} more: {', '.join(also)})" if more else "")


_HALF = (torch.float16, torch.bfloat16)


def _is_half(model: nn.Module) -> bool:
    return any(t.dtype in _HALF for t in (*model.parameters(), *model.buffers()))


def _is_fp32(model: nn.Module) -> bool:
    floats = [t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    return bool(floats) and all(d == torch.float32 for d in floats)


def _wider(model: nn.Module) -> torch.dtype:
    """The dtype a model's rounding is judged in: fp32 for a half-precision model, fp64 for an fp32 one."""
    return torch.float32 if _is_half(model) else torch.float64


def _widened(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors narrower than ``dtype`` cast to it (inputs for the model in the wider dtype)."""
    width = torch.finfo(dtype).bits

    def widen(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and torch.finfo(t.dtype).bits < width:
            return t.to(dtype)
        return t

    return pytree.tree_map(widen, value)


def rounding_verdict(
    before_model: nn.Module,
    before: Any,
    after: Any,
    args: tuple | None,
    kwargs: dict | None,
    *,
    reference_model: nn.Module | None = None,
) -> dict[str, Any]:
    """Judge an exact rewrite against the same function computed in a wider dtype: fp32 for a
    half-precision model, fp64 for an fp32 one.

    Two runs of two equal functions differ by their rounding, which on a deep net can exceed the table
    (resnet18 in bf16 at 64x64: the unfolded model is itself 1.3e-2 x max|out| from fp32; timm's
    tresnet_l in fp32 with random weights, 1.5e-5 x max|out| from fp64 at 128x128, more at 224). The
    rewrite is exact when it moves the outputs no further from the wider function than twice the distance
    the original model already has. Integer and bool outputs (argmax, ids) count the fraction of their
    values that differ from the wider model's, under the same rule. ``reference_model`` is
    ``before_model`` (or a model computing its function) already in the wider dtype, when the caller has
    one.
    """
    dtype = _wider(before_model)
    name = {torch.float32: "fp32", torch.float64: "fp64"}[dtype]
    try:
        wide = reference_model if reference_model is not None else copy_model(before_model).to(dtype)
        reference = run_model(wide, _widened(args, dtype), _widened(kwargs, dtype))
    except Exception as exc:  # e.g. an exported GraphModule asserts its half-precision dtypes
        return {
            "reference": f"none: the model before the pass does not run in {name} ({type(exc).__name__})",
            "within_rounding": False,
        }
    worst_before, worst_after = 0.0, 0.0
    for (_, ref), (_, old), (_, new) in zip(
        flatten_outputs(reference, floating_only=False),
        flatten_outputs(before, floating_only=False),
        flatten_outputs(after, floating_only=False),
        strict=True,
    ):
        if ref.numel() == 0:
            continue
        if not (ref.is_floating_point() or ref.is_complex()):
            worst_before = max(worst_before, float((old != ref).double().mean()))
            worst_after = max(worst_after, float((new != ref).double().mean()))
            continue
        ref, old, new = (torch.view_as_real(t) if t.is_complex() else t for t in (ref, old, new))
        scale = float(ref.double().abs().max()) or 1.0
        worst_before = max(worst_before, float((old.double() - ref.double()).abs().max()) / scale)
        worst_after = max(worst_after, float((new.double() - ref.double()).abs().max()) / scale)
    return {
        "reference": f"the model in {name}",
        "dtype": name,
        "original_rel_error": worst_before,
        "rewritten_rel_error": worst_after,
        "within_rounding": worst_after <= 2 * worst_before,
    }
