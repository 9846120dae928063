"""Compose passes, checking each one's effect on the outputs as it goes.

Each pass is validated on its own (outputs right before it vs right after it), so an exact pass in a
pipeline that also holds an architectural one is still held to the exact tolerance.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.modules.copying import copy_model
from normswap.passes.base import Pass, PassReport, RewriteKind
from normswap.validate.compare import ModelComparison, compare_models, compare_outputs, run_model
from normswap.validate.metrics import flatten_outputs


@dataclass
class PipelineReport:
    passes: list[PassReport] = field(default_factory=list)
    # Whole-model comparison of the final model against the input model.
    overall: ModelComparison | None = None
    # Exact passes whose outputs moved beyond the tolerance: a bug, and a reason not to write anything.
    exact_failures: list[str] = field(default_factory=list)

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
        }


class ExactOnlyError(ValueError):
    """A pipeline restricted to exact rewrites was given a pass that is not exact."""


class Pipeline:
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
    ) -> tuple[nn.Module, PipelineReport]:
        has_inputs = example_args is not None or bool(example_kwargs)
        check = self.validate and has_inputs
        original = model if inplace or not check else copy_model(model)
        current = model if inplace else copy_model(model)
        report = PipelineReport()
        for p in self.passes:
            before = (
                run_model(current, copy.deepcopy(example_args), copy.deepcopy(example_kwargs))
                if check
                else None
            )
            # a half-precision model is kept as it was, to judge an exact pass against fp32 if need be
            snapshot = (
                copy_model(current) if check and p.kind is RewriteKind.EXACT and _is_half(current) else None
            )
            current, pass_report = p(current, example_args, example_kwargs, inplace=True)
            if check and pass_report.changes:
                after = run_model(current, copy.deepcopy(example_args), copy.deepcopy(example_kwargs))
                comparison = compare_outputs(before, after)
                pass_report.validation = comparison.to_dict()
                if snapshot is not None and not comparison.within_tolerance:
                    verdict = rounding_verdict(snapshot, before, after, example_args, example_kwargs)
                    pass_report.validation["half_precision"] = verdict
                    exact_ok = verdict["within_rounding"]
                else:
                    exact_ok = comparison.within_tolerance
                if p.kind is RewriteKind.EXACT and not exact_ok:
                    worst = max(comparison.outputs, key=lambda o: o.max_rel)
                    report.exact_failures.append(
                        f"{p.name}: {worst.name} moved by {worst.max_abs:.3g} "
                        f"({worst.max_rel:.3g} x max|ref|, tolerance {worst.tolerance:g})"
                    )
            report.passes.append(pass_report)
        if check and not inplace:
            report.overall = compare_models(original, current, example_args, example_kwargs)
        return current, report


_HALF = (torch.float16, torch.bfloat16)


def _is_half(model: nn.Module) -> bool:
    return any(t.dtype in _HALF for t in (*model.parameters(), *model.buffers()))


def _to_fp32(value: Any) -> Any:
    return pytree.tree_map(
        lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALF else t, value
    )


def rounding_verdict(
    before_model: nn.Module, before: Any, after: Any, args: tuple | None, kwargs: dict | None
) -> dict[str, Any]:
    """Judge an exact rewrite of a half-precision model against the same model computed in fp32.

    Two half-precision runs of two equal functions differ by their rounding, which on a deep net can
    exceed the half-precision table (resnet18 in bf16 at 64x64: the unfolded model is itself 1.3e-2 x
    max|out| from fp32). The rewrite is exact when it moves the outputs no further from the fp32 function
    than twice the distance the original half-precision model already has.
    """
    try:
        reference = run_model(copy_model(before_model).float(), _to_fp32(args), _to_fp32(kwargs))
    except Exception as exc:  # e.g. an exported GraphModule asserts its half-precision dtypes
        return {
            "reference": f"none: the model before the pass does not run in fp32 ({type(exc).__name__})",
            "within_rounding": False,
        }
    worst_before, worst_after = 0.0, 0.0
    for (_, ref), (_, old), (_, new) in zip(
        flatten_outputs(reference), flatten_outputs(before), flatten_outputs(after), strict=True
    ):
        scale = float(ref.double().abs().max()) or 1.0
        worst_before = max(worst_before, float((old.double() - ref.double()).abs().max()) / scale)
        worst_after = max(worst_after, float((new.double() - ref.double()).abs().max()) / scale)
    return {
        "reference": "the model before the pass, in fp32",
        "original_rel_error": worst_before,
        "rewritten_rel_error": worst_after,
        "within_rounding": worst_after <= 2 * worst_before,
    }
