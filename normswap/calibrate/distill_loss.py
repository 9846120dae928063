"""What distillation compares and how: the two models' outputs matched by name and shape, the outputs the
loss reads (an HF output's logits alone), and the loss (mean squared error, or KL divergence at a
temperature over the last dim), in float32 whatever the models compute in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from normswap.errors import BadInputError
from normswap.verify.metrics import flatten_outputs


def _describe_outputs(items: list[tuple[str, torch.Tensor]]) -> str:
    return ", ".join(f"{name} {tuple(t.shape)}" for name, t in items) or "no floating-point output"


def check_same_structure(teacher_out: Any, student_out: Any, what: str) -> None:
    """The two models must return the same floating outputs (names and shapes) to be compared."""
    mine, theirs = flatten_outputs(student_out), flatten_outputs(teacher_out)
    if not theirs:
        raise BadInputError(
            f"the original model returns no floating-point output on {what}: nothing to distil"
        )
    layout = [(n, tuple(t.shape)) for n, t in theirs]
    if [(n, tuple(t.shape)) for n, t in mine] != layout:
        raise BadInputError(
            f"the two models' outputs differ on {what}: the original returns {_describe_outputs(theirs)}; "
            f"the converted model returns {_describe_outputs(mine)}"
        )


def loss_targets(output: Any) -> list[tuple[str, torch.Tensor]]:
    """The outputs the loss compares: a mapping's ``logits`` when it has them, else every floating output."""
    if isinstance(output, Mapping):
        logits = output.get("logits")
        if isinstance(logits, torch.Tensor) and logits.is_floating_point():
            return [("output.logits", logits)]
    return flatten_outputs(output)


def check_kl_targets(targets: list[tuple[str, torch.Tensor]]) -> None:
    for name, t in targets:
        if t.ndim < 1 or t.shape[-1] < 2:
            raise BadInputError(
                f"--loss kl reads the last dim as classes, but output {name} has shape {tuple(t.shape)}: "
                "use --loss mse"
            )


def distillation_loss(
    student: list[tuple[str, torch.Tensor]],
    teacher: list[tuple[str, torch.Tensor]],
    loss: str,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The module doc's loss between matching (name, tensor) lists; a 0-d fp32 tensor."""
    pairs = [
        (s.float(), t.detach().to(s.device).float()) for (_, s), (_, t) in zip(student, teacher, strict=True)
    ]
    if loss == "mse":
        diff = torch.cat([(s - t).reshape(-1) for s, t in pairs])
        return diff.pow(2).mean()
    terms = []
    for s, t in pairs:
        log_p_student = F.log_softmax(s / temperature, dim=-1)
        log_p_teacher = F.log_softmax(t / temperature, dim=-1)
        kl = F.kl_div(log_p_student, log_p_teacher, reduction="none", log_target=True).sum(-1)
        terms.append(kl.mean() * temperature**2)
    return torch.stack(terms).mean()
