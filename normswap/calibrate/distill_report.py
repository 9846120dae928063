"""What a distillation run did: :class:`DistillReport`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from normswap.passes.core.base import RewriteKind
from normswap.verify import ModelComparison

PASS_NAME = "distill"


@dataclass
class DistillReport:
    """What :func:`distill` did. ``before``/``after`` compare the student to the teacher on the held-out
    batch; ``losses`` holds each step's training loss, measured before that step's update."""

    steps: int
    lr: float
    loss: str
    temperature: float | None
    train: str
    trained_tensors: int = 0
    trained_elements: int = 0
    total_elements: int = 0  # floating-point parameter elements of the student
    trained_modules: list[str] = field(default_factory=list)  # --train norms: the norm modules trained
    batches: int = 0  # distinct training batches (cycled)
    samples: int = 0  # samples in those batches
    loss_outputs: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    holdout_samples: int = 0
    holdout_source: str = ""
    holdout_loss_before: float | None = None
    holdout_loss_after: float | None = None
    before: ModelComparison | None = None
    after: ModelComparison | None = None
    seconds: float = 0.0
    processes: int = 1  # torchrun processes the global batches were split over
    placement: str = ""  # how the student and the teacher were laid out over them
    resumed_from_step: int | None = None  # --resume: the checkpoint's step
    checkpoint: str | None = None  # the last checkpoint written
    notes: list[str] = field(default_factory=list)
    pass_name: str = PASS_NAME
    kind: RewriteKind = RewriteKind.DATA_DRIVEN

    @property
    def loss_first(self) -> float | None:
        return self.losses[0] if self.losses else None

    @property
    def loss_last(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def loss_min(self) -> float | None:
        finite = [v for v in self.losses if math.isfinite(v)]
        return min(finite) if finite else None

    @property
    def steps_done(self) -> int:
        return len(self.losses)

    def _worst_target_sqnr(self, comparison: ModelComparison | None) -> float | None:
        if comparison is None:
            return None
        values = [o.sqnr_db for o in comparison.outputs if o.name in self.loss_outputs]
        return min(values) if values else None

    @property
    def sqnr_before_db(self) -> float | None:
        """Worst held-out SQNR over the loss targets, student vs teacher, before training."""
        return self._worst_target_sqnr(self.before)

    @property
    def sqnr_after_db(self) -> float | None:
        return self._worst_target_sqnr(self.after)

    @property
    def ok(self) -> bool:
        """False when a loss or a held-out output is not finite: the model must not be shipped."""
        losses_finite = all(math.isfinite(v) for v in self.losses) and self.steps_done == self.steps
        after_finite = self.after is None or all(math.isfinite(o.max_abs) for o in self.after.outputs)
        return losses_finite and after_finite

    def to_dict(self) -> dict[str, Any]:
        return {
            "pass_name": self.pass_name,
            "kind": self.kind.value,
            "ok": self.ok,
            "steps": self.steps,
            "steps_done": self.steps_done,
            "lr": self.lr,
            "loss": self.loss,
            "temperature": self.temperature,
            "train": self.train,
            "trained_tensors": self.trained_tensors,
            "trained_elements": self.trained_elements,
            "total_elements": self.total_elements,
            "trained_modules": list(self.trained_modules),
            "batches": self.batches,
            "samples": self.samples,
            "loss_outputs": list(self.loss_outputs),
            "loss_curve": {"first": self.loss_first, "last": self.loss_last, "min": self.loss_min},
            "losses": list(self.losses),
            "holdout_samples": self.holdout_samples,
            "holdout_source": self.holdout_source,
            "holdout_loss_before": self.holdout_loss_before,
            "holdout_loss_after": self.holdout_loss_after,
            "sqnr_before_db": self.sqnr_before_db,
            "sqnr_after_db": self.sqnr_after_db,
            "before": self.before.to_dict() if self.before is not None else None,
            "after": self.after.to_dict() if self.after is not None else None,
            "seconds": self.seconds,
            "processes": self.processes,
            "placement": self.placement,
            "resumed_from_step": self.resumed_from_step,
            "checkpoint": self.checkpoint,
            "notes": list(self.notes),
        }
