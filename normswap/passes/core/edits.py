"""Exact rewrites as per-tensor edits, for checkpoints streamed from disk instead of held in memory.

The passes analyze a model and apply their plans to its modules. A checkpoint larger than memory is
analyzed the same way, on a model built on the meta device (shapes, no values): the same pass checks
run on its graph and give the same plans, with the same refusals. Instead of applying a plan, this
module turns it into :class:`TensorEdit` groups: the tensors a group reads (by state-dict name) and a
function computing the tensors it writes, in float64, cast back to each tensor's dtype. A streaming
writer opens only a group's inputs, computes it, writes it and forgets it, so memory is one group.

Groups, per rewrite:

- ``--fold-norm-affine`` (:class:`~normswap.passes.affine.fold.FoldNormAffine`): one norm with the
  linears that read it: ``W' = W diag(g)``, ``c' = c + W b``; the norm keeps its class, its weight
  stored as the neutral value (1, or 0 for a ``(1 + w)`` norm) and its bias as 0, so the stock loader
  reads the result. A reader without a bias that would need one is refused (the config builds none).
- ``--to rmsnorm --exact`` (:class:`~normswap.passes.recenter.layernorm.RecenterLayerNorm`): one
  residual-stream writer: ``W - mean_out(W)`` (a LayerScale folded first); a writer tied to a reader
  outside the stream (GPT-2's LM head) is untied: the reader's name gets the original values as a new
  tensor and ``tie_word_embeddings`` becomes false. Each LayerNorm becomes normswap's RMSNorm with the
  same eps, weight and bias, recorded as a module recipe.

- ``--fold-bn`` (:class:`~normswap.passes.batchnorm.fold.FoldBatchNorm`): one BatchNorm with the Conv or
  Linear it folds into (:mod:`normswap.passes.batchnorm.stream`); the BN's tensors leave the
  output and both modules are recorded as recipes.
- ``--add-weight-norm`` / ``--remove-weight-norm``: one layer's weight, as ``g`` and ``v`` or back
  (:mod:`normswap.passes.weightnorm.stream`); the layer is recorded as a recipe.

Which rewrites stream is said once, in :mod:`normswap.rewrites`; :func:`normswap.api.checkpoint.stream_problem`
says why a conversion does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.modules.recipes import module_recipe
from normswap.passes.affine.fold import AffinePlan, FoldNormAffine, fold_affine_into_linear
from normswap.passes.batchnorm.stream import FoldedGroup, plan_batchnorm_folds
from normswap.passes.core.base import Change, PassReport, Skip, SkipCause, build_context
from normswap.passes.recenter.layernorm import RecenterLayerNorm, center_along
from normswap.passes.swap.swap_norm import build_norm
from normswap.passes.weightnorm.layers import AddWeightNorm, RemoveWeightNorm
from normswap.passes.weightnorm.stream import WeightNormGroup, plan_weight_norm

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


@dataclass
class EditPlan:
    """What streaming a conversion does: the edit groups, the modules whose class changes (path ->
    recipe), the config keys that change, and the pass's report (changes and refusals with reasons)."""

    edits: list[TensorEdit] = field(default_factory=list)
    recorded: dict[str, Any] = field(default_factory=dict)
    config_changes: dict[str, Any] = field(default_factory=dict)
    report: PassReport | None = None
    # --fold-bn: each group's function, checked on the written output (tensor_edits_batchnorm.check_folds)
    folds: list[FoldedGroup] = field(default_factory=list)
    # weight norm added or removed: each layer, checked on the written output (check_layers)
    layers: list[WeightNormGroup] = field(default_factory=list)

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


def _stored_name(names: list[str], stored: set[str]) -> str | None:
    return next((n for n in names if n in stored), None)


def _tensor_names(model: nn.Module) -> dict[int, list[str]]:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in named:
        by_tensor.setdefault(id(tensor), []).append(name)
    return by_tensor


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every tensor name -> all names of that same tensor (tied weights have several)."""
    return {name: names for names in _tensor_names(model).values() for name in names}


# --- fold norm affine ----------------------------------------------------------------------------------


def _fold_in_slices(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gain: torch.Tensor | None,
    shift: torch.Tensor | None,
    in_dim: int,
    slice_elements: int = 1 << 19,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`fold_affine_into_linear` on slices of output features, written over ``weight`` itself, so
    that the group holds the weight once and float64 temporaries of a slice (4 MB, which stay in the
    CPU's cache), not of the weight: an LM head of 32000 x 4096 would need 2 GB of them at once. Each
    output feature's row is computed whole from its own values, read before they are written, so the
    result is the same as on the whole weight."""
    out_dim = 1 - in_dim
    rows = weight.shape[out_dim]
    step = max(1, slice_elements // max(1, weight.numel() // max(1, rows)))
    new_b: torch.Tensor | None = None
    for start in range(0, rows, step):
        end = min(rows, start + step)
        part_b = bias[start:end] if bias is not None else None
        part_w = weight.narrow(out_dim, start, end - start)
        w, b = fold_affine_into_linear(part_w, part_b, gain, shift, in_dim)
        part_w.copy_(w)
        if b is not None:
            if new_b is None:
                new_b = torch.empty(rows, dtype=b.dtype)
            new_b[start:end] = b
    return weight, new_b


def _fold_edit(plan: AffinePlan, stored: set[str]) -> TensorEdit | str:
    site = plan.site
    norm_w = f"{site.path}.{plan.weight_name}" if plan.weight_name else None
    norm_b = f"{site.path}.{plan.bias_name}" if plan.bias_name else None
    offset = float(site.weight_offset)
    readers = [(f"{r.path}.{r.weight_name}", f"{r.path}.{r.bias_name}", r.in_dim) for r in plan.readers]
    for weight, bias, _ in readers:
        if weight not in stored:
            return f"{weight} is not in the checkpoint's files"
        if norm_b is not None and bias not in stored:
            return f"folding the norm's bias needs a bias in {weight.rpartition('.')[0]}, which the config does not build"
    reads = tuple(n for n in (norm_w, norm_b) if n) + tuple(
        n for w, b, _ in readers for n in (w, b) if n in stored
    )

    def compute(t: Tensors) -> Tensors:
        gain = t[norm_w].double() + offset if norm_w else None
        shift = t[norm_b] if norm_b else None
        out: Tensors = {}
        for weight, bias, in_dim in readers:
            new_w, new_b = _fold_in_slices(t[weight], t.get(bias), gain, shift, in_dim)
            out[weight] = new_w
            if new_b is not None:
                out[bias] = new_b
        if norm_w:  # neutral: the stored w with which the norm's own multiply is the identity
            out[norm_w] = torch.full_like(t[norm_w], 1.0 - offset)
        if norm_b:
            out[norm_b] = torch.zeros_like(t[norm_b])
        return out

    writes = reads
    return TensorEdit(f"fold {site.path}", reads, compute, writes)


def _plan_fold(model: nn.Module, ctx: Any, stored: set[str]) -> EditPlan:
    rewrite = FoldNormAffine()
    report = rewrite.new_report()
    plan = EditPlan(report=report)
    state = rewrite.prepare(ctx)
    for site, checked in rewrite.decide(ctx, state):
        if isinstance(checked, Skip):
            report.skips.append(checked)
            continue
        edit = _fold_edit(checked, stored)
        if isinstance(edit, str):
            report.skips.append(Skip(rewrite.name, site.path, edit, SkipCause.UNSUPPORTED))
            continue
        plan.edits.append(edit)
        into = ", ".join(r.path for r in checked.readers)
        report.changes.append(
            Change(rewrite.name, site.path, rewrite.kind, f"affine folded into {into}; stored neutral")
        )
    return plan


# --- recenter -------------------------------------------------------------------------------------------


def _center_edit(name: str, dim: int, scale: str | None, untie: list[str], stored_name: str) -> TensorEdit:
    reads = (stored_name,) + ((scale,) if scale else ())

    def compute(t: Tensors) -> Tensors:
        # in place: the group's memory is the one tensor (the untied copies are the input's bytes)
        original = t[stored_name]
        return {stored_name: center_along(original, dim, t[scale] if scale else None, out=original)}

    untied = {other: stored_name for other in untie}
    return TensorEdit(f"center {name}", reads, compute, (stored_name,), new=untied, copies=untied)


def _plan_recenter(model: nn.Module, ctx: Any, stored: set[str]) -> EditPlan:
    rewrite = RecenterLayerNorm()
    report = rewrite.new_report()
    plan = EditPlan(report=report)
    streams = rewrite.prepare(ctx)
    aliases = _aliases(model)
    done: set[str] = set()
    for site, checked in rewrite.decide(ctx, streams):
        if isinstance(checked, Skip):
            report.skips.append(checked)
            continue
        assert streams is not None
        for i in checked.streams:
            stream = streams.streams[i]
            for param in stream.params:
                if param.name in done:
                    continue
                done.add(param.name)
                names = aliases.get(param.name, [param.name])
                readers = stream.shared.get(param.name, set()) - {""}
                others = [n for n in names if any(n.startswith(r + ".") for r in readers)]
                keep = [n for n in names if n not in others]
                stored_name = _stored_name(keep, stored) or _stored_name(names, stored)
                if stored_name is None:
                    raise ValueError(
                        f"{param.name} is written into the stream but is not in the checkpoint's files"
                    )
                scale = None
                if param.scale:
                    scale = _stored_name(aliases.get(param.scale, [param.scale]), stored)
                plan.edits.append(_center_edit(param.name, param.dim, scale, others, stored_name))
                if others:
                    plan.config_changes["tie_word_embeddings"] = False
            for name in stream.folded_scales:
                if name in done:
                    continue
                done.add(name)
                stored_scale = _stored_name(aliases.get(name, [name]), stored)
                if stored_scale is None:
                    raise ValueError(f"{name} is not in the checkpoint's files")
                plan.edits.append(
                    TensorEdit(
                        f"ones {name}",
                        (stored_scale,),
                        lambda t, n=stored_scale: {n: torch.ones_like(t[n])},
                        (stored_scale,),
                    )
                )
        old = site.module
        assert old is not None
        recipe = module_recipe(build_norm("rms", site, old))
        assert recipe is not None  # normswap's RMSNorm always has one
        plan.recorded[site.path] = recipe
        report.changes.append(
            Change(
                rewrite.name,
                site.path,
                rewrite.kind,
                f"{type(old).__name__} -> RMSNorm, exact on the recentered stream",
            )
        )
    return plan


def plan_edits(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: dict[str, Any],
    stored: set[str],
    *,
    fold_norm_affine: bool = False,
    recenter: bool = False,
    fold_bn: bool = False,
    read: Callable[[str], torch.Tensor] | None = None,
    weight_norm: AddWeightNorm | RemoveWeightNorm | None = None,
) -> EditPlan:
    """The edit groups of one exact rewrite of ``model`` (on the meta device), whose checkpoint stores the
    tensors named in ``stored``. The pass's own checks decide every site, on the captured graph; ``read``
    gives a stored tensor by name, for the checks that need values (BatchNorm statistics)."""
    if [fold_norm_affine, recenter, fold_bn, weight_norm is not None].count(True) != 1:
        raise ValueError("plan one rewrite: fold_norm_affine, recenter, fold_bn or weight_norm")
    if weight_norm is not None:  # a parameters pass: no graph
        edits, layers, recorded, report = plan_weight_norm(model, weight_norm, stored, _make_edit)
        return EditPlan(edits=edits, recorded=recorded, report=report, layers=layers)
    ctx = build_context(model, example_args, example_kwargs)
    if fold_norm_affine:
        return _plan_fold(model, ctx, stored)
    if fold_bn:
        if read is None:
            raise ValueError("fold_bn reads the stored BatchNorm statistics: give read")
        return _plan_fold_bn(model, ctx, stored, read)
    return _plan_recenter(model, ctx, stored)


def _make_edit(
    label: str,
    reads: tuple[str, ...],
    compute: Callable[[Tensors], Tensors],
    writes: tuple[str, ...],
    creates: dict[str, tuple[str, tuple[int, ...]]],
    drops: tuple[str, ...],
) -> TensorEdit:
    return TensorEdit(label, reads, compute, writes, creates=creates, drops=drops)


def _plan_fold_bn(
    model: nn.Module, ctx: Any, stored: set[str], read: Callable[[str], torch.Tensor]
) -> EditPlan:
    edits, groups, recorded, report = plan_batchnorm_folds(model, ctx, stored, _make_edit, read)
    return EditPlan(edits=edits, recorded=recorded, report=report, folds=groups)
