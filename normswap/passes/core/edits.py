"""Exact rewrites as per-tensor edits, for checkpoints streamed from disk instead of held in memory.

The passes analyze a model and apply their plans to its modules. A checkpoint larger than memory is
analyzed the same way, on a model built on the meta device (shapes, no values): the same pass decides
every site on its graph (``Pass.decide``), with the same refusals. Instead of applying a plan, each
family turns it into :class:`TensorEdit` groups: the tensors a group reads (by state-dict name) and a
function computing the tensors it writes, in float64, cast back to each tensor's dtype. A streaming
writer opens only a group's inputs, computes it, writes it and forgets it, so memory is one group.

The groups of each rewrite are its family's ``stream.py`` (``affine``, ``recenter``, ``batchnorm``,
``weightnorm``, ``layerscale``), and :func:`normswap.passes.streaming.plan_edits` picks the one a
conversion asks for. Where a family states its groups once for both routes (the LayerScale and affine
folds), its in-memory pass runs the same groups on the model's own tensors (:func:`apply_in_memory`).
Which rewrites stream is said once, in :mod:`normswap.rewrites`; :func:`normswap.api.checkpoint.stream_problem`
says why a conversion does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from normswap.passes.core.base import Pass, PassContext, PassReport, Skip, SkipCause

if TYPE_CHECKING:
    from normswap.verify.metrics import TensorComparison

Tensors = dict[str, torch.Tensor]


@dataclass
class TensorEdit:
    """One group: ``compute`` maps the tensors named in ``reads`` to the tensors it writes (name ->
    value, each in the dtype it is stored in); it may reuse the memory of the tensors it reads. ``new``
    names tensors the input does not store, each with the stored tensor whose dtype and shape it takes
    (an untied copy); those in ``copies`` take that stored tensor's input bytes as they are (the writer
    copies them from the input file: they never pass through memory), the others are computed."""

    label: str
    reads: tuple[str, ...]
    compute: Callable[[Tensors], Tensors]
    writes: tuple[str, ...]
    new: dict[str, str] = field(default_factory=dict)
    copies: dict[str, str] = field(default_factory=dict)
    # computed tensors the input does not store, of a shape of their own: name -> (the stored tensor after
    # which it is written and whose dtype it takes, its shape); a folded BN's layer gaining a bias
    creates: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    # stored tensors the output does not keep (a folded BN's statistics and affine)
    drops: tuple[str, ...] = ()


class LayerCheck(Protocol):
    """A rewritten layer that checks itself: its function as written against what it replaces, each read
    by stored name, on a random input."""

    def check(
        self, read_original: Callable[[str], torch.Tensor], read_written: Callable[[str], torch.Tensor]
    ) -> TensorComparison: ...


@dataclass
class EditPlan:
    """What streaming a conversion does: the edit groups, the modules whose class changes (path ->
    recipe), the config keys that change, and the pass's report (changes and refusals with reasons)."""

    edits: list[TensorEdit] = field(default_factory=list)
    recorded: dict[str, Any] = field(default_factory=dict)
    config_changes: dict[str, Any] = field(default_factory=dict)
    report: PassReport | None = None
    # the rewritten layers whose function is checked on the written output, where the rewrite is local
    # to a layer (a folded BatchNorm or LayerScale, weight norm added or removed)
    checks: list[LayerCheck] = field(default_factory=list)

    @property
    def writes(self) -> set[str]:
        """The tensors the edits compute."""
        return {name for edit in self.edits for name in edit.writes}

    @property
    def drops(self) -> set[str]:
        """Stored tensors the output does not keep."""
        return {name for edit in self.edits for name in edit.drops}

    @property
    def copies(self) -> dict[str, str]:
        """New tensor -> the stored tensor whose input bytes it takes."""
        return {new: source for edit in self.edits for new, source in edit.copies.items()}

    def decided(self, rewrite: Pass, ctx: PassContext, state: Any = None) -> Iterator[tuple[Any, Any]]:
        """The sites ``rewrite`` decides to change (its one driver, ``Pass.decide``), each with its plan;
        the sites it skips go into this plan's report with their reasons."""
        assert self.report is not None
        for site, checked in rewrite.decide(ctx, state):
            if isinstance(checked, Skip):
                self.report.skips.append(checked)
            else:
                yield site, checked

    def cannot_stream(
        self, rewrite: Pass, site: str, reason: str, cause: SkipCause | None = SkipCause.UNSUPPORTED
    ) -> None:
        """A site the pass would change that the stream cannot write: skipped, with the reason (and the
        cause the in-memory check gives the same reason, where the stream judges a value it reads)."""
        assert self.report is not None
        self.report.skips.append(Skip(rewrite.name, site, reason, cause))


def apply_in_memory(model: nn.Module, edit: TensorEdit) -> list[str]:
    """Run the group ``edit`` on ``model``'s own tensors, as the stream runs it on stored ones: each read
    by its state-dict name, the results written into the tensors of those names (a tensor the group
    ``creates`` becomes a parameter of the module its name names, on its anchor's device, in its dtype,
    trainable as its anchor is). Returns the names created. Dropping tensors and untied copies are the
    stream's: a module the pass replaces takes its tensors with it."""
    if edit.new or edit.drops:
        raise ValueError(f"{edit.label}: untied copies and dropped tensors are written by a stream only")
    tensors = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    with torch.no_grad():
        outputs = edit.compute({name: tensors[name].detach() for name in edit.reads})
        for name, value in outputs.items():
            if name in edit.creates:
                anchor = tensors[edit.creates[name][0]]
                owner, _, attr = name.rpartition(".")
                created = value.to(device=anchor.device, dtype=anchor.dtype)
                setattr(model.get_submodule(owner), attr, nn.Parameter(created, anchor.requires_grad))
            elif value.data_ptr() != tensors[name].data_ptr():
                tensors[name].copy_(value)
    return list(edit.creates)


def plan_for(rewrite: Pass) -> EditPlan:
    """An empty plan whose report is ``rewrite``'s."""
    return EditPlan(report=rewrite.new_report())
