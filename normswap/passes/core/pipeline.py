"""Compose passes, checking each one's effect on the outputs as it goes.

Each pass is validated on its own (outputs right before it vs right after it), so an exact pass in a
pipeline that also holds an architectural one is still held to the exact tolerance.

"Exact" is a claim about the function, not about one input: an exact pass is checked on the example
inputs and on variants of them along the dims the original model accepts freely (batch, sequence length,
spatial size; :mod:`normswap.verify.variants`), and every tensor output is compared, integer and bool
ones by equality. A rewritten model that raises on a variant the original accepts is not silently wrong:
the pass's validation says which shapes it was proven on and which it does not accept. Whether an exact
pass kept the outputs is decided over all those inputs together by the one exact rule,
:func:`normswap.verify.exact.judge_exact`, the rule ``validate --exact`` applies too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.graph.capture import CapturedGraph
from normswap.modules.copying import copy_model
from normswap.passes.core.base import Pass, PassReport, RewriteKind, usable_capture
from normswap.util.finite import refuse_broken_model
from normswap.verify.compare import ModelComparison, compare_models, compare_outputs, run_model
from normswap.verify.exact import ExactRun, judge_exact, run_widened, widened_model
from normswap.verify.finite import refuse_nonfinite_outputs
from normswap.verify.variants import (
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

    Every pass is a :class:`~normswap.passes.core.base.Pass` (the one protocol), so the pipeline needs no
    knowledge of any pass: it runs each in place on its own working copy, and hands a graph the caller
    already captured to the first pass when that pass :attr:`~normswap.passes.core.base.Pass.reuses_capture`.
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
        if check:  # a model holding NaN/Inf is refused before any work, as on every route
            refuse_broken_model(original)
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
                refuse_nonfinite_outputs(original_output, f"the example inputs {inputs[0].describe()}")
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


class _PassCheck:
    """The check of one pass that made changes: outputs before vs after on each input, collected into
    the pass's ``validation`` dict and, for an exact pass, into at most one failure sentence."""

    def __init__(self, p: Pass, pass_report: PassReport, model: nn.Module, snapshot: nn.Module | None):
        self.name = p.name
        self.exact = p.kind is RewriteKind.EXACT
        self.report = pass_report
        self.model = model
        self.snapshot = snapshot
        self.runs: list[tuple[dict[str, Any], ExactRun]] = []  # inputs to judge together
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
            # a NaN or Inf fails every comparison (normswap.verify.metrics.nonfinite_where)
            if comparison.nonfinite:
                self.reasons.append(f"{self.name}: {comparison.nonfinite} {where}")
            return True, _kept(after)
        entry = {
            **variant.to_dict(),
            "compared": len(comparison.outputs),
            "within_tolerance": comparison.within_tolerance,
            "worst_rel": comparison.worst_rel,
        }
        if comparison.nonfinite:  # said where, as the failure of this input
            entry["error"] = comparison.nonfinite
        if not comparison.outputs:
            if self.failed and not self.failed[0]["compared"]:
                return True, _kept(after)  # the example compared nothing already: said once
            self.failed.append(entry)
            self.reasons.append(
                f"{self.name}: the model returns no tensor to compare (returned {_returned(before)}) {where}: "
                "an exact change cannot be verified"
            )
            return True, _kept(after)
        # judged in finish(), over every input together (normswap.verify.exact.judge_exact)
        self.runs.append((entry, ExactRun(where, before, after, variant.args, variant.kwargs)))
        return True, _kept(after)

    def _wide_outputs(self) -> list[Any] | str:
        """The model before the pass in its wider dtype, run on every input judged."""
        assert self.snapshot is not None
        return run_widened(widened_model(self.snapshot), [(r.args, r.kwargs) for _, r in self.runs])

    def _judge(self) -> None:
        """The one exact rule over every input this pass was checked on."""
        if not self.runs:
            return
        wide = self._wide_outputs if self.snapshot is not None else None
        verdict = judge_exact([run for _, run in self.runs], wide)
        if self.report.validation is not None:
            self.report.validation["exact_passed"] = verdict.passed
            if verdict.rounding is not None:
                self.report.validation["rounding"] = verdict.rounding
        for entry, run in self.runs:
            if verdict.passed or run.label not in verdict.failed_labels:
                self.verified.append(entry)
            else:
                self.failed.append(entry)
        if not verdict.passed:
            self.reasons.append(f"{self.name}: {verdict.reason}")
        self.runs = []

    def finish(self, dropped: list[dict[str, Any]]) -> str | None:
        """Record what was verified where; the failure sentence of an exact pass (or of any pass whose
        comparison holds a NaN or Inf), or None."""
        if self.report.validation is None:
            self.report.validation = ModelComparison().to_dict()
        if not self.exact:
            return self.reasons[0] if self.reasons else None
        self._judge()
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
