"""``--to rmsnorm --exact`` as per-tensor edits for a streamed checkpoint.

The streams and their edits are :class:`~normswap.passes.recenter.layernorm.RecenterLayerNorm`'s own
(:func:`~normswap.passes.recenter.writers.stream_edits`), decided on the model built on the meta device.
Each writer is one group, centred in place (``W - mean_out(W)``, a folded LayerScale first). A tied token
embedding (GPT-2's, read by its LM head) is no group: its matrix is copied as stored and its module is
recorded as a ``CenteredEmbedding``. The names any other shared writer keeps for readers outside the
stream are written as new tensors that take the input's bytes as they are, and ``tie_word_embeddings``
becomes false. A folded LayerScale is a group
that writes ones. Each LayerNorm becomes normswap's RMSNorm with the same eps, weight and bias, recorded
as a module recipe.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from normswap.modules.centered import CenteredEmbedding
from normswap.modules.recipes import module_recipe
from normswap.passes.core.base import Change
from normswap.passes.core.edits import EditPlan, TensorEdit, Tensors, plan_for
from normswap.passes.recenter.layernorm import RecenterLayerNorm
from normswap.passes.recenter.writers import WriterEdit, center_along, stream_edits
from normswap.passes.swap.swap_norm import build_norm


def stored_name(names: tuple[str, ...] | list[str], stored: set[str]) -> str | None:
    """The first of a tensor's ``names`` that the checkpoint stores."""
    return next((n for n in names if n in stored), None)


def _tensor_edit(edit: WriterEdit, aliases: dict[str, list[str]], stored: set[str]) -> TensorEdit:
    """One writer's group on the stored tensors: centred in place (the group's memory is the one tensor),
    the names kept for other readers copied from the input's bytes."""
    name = stored_name(edit.rewritten, stored) or stored_name(edit.names, stored)
    if name is None:
        raise ValueError(f"{edit.name} is written into the stream but is not in the checkpoint's files")
    param = edit.param
    if param is None:
        return TensorEdit(f"ones {edit.name}", (name,), lambda t: {name: torch.ones_like(t[name])}, (name,))
    scale = stored_name(aliases.get(param.scale, [param.scale]), stored) if param.scale else None
    reads = (name,) + ((scale,) if scale else ())

    def compute(t: Tensors) -> Tensors:
        return {name: center_along(t[name], param.dim, t[scale] if scale else None, out=t[name])}

    untied = {other: name for other in edit.keep_original}
    return TensorEdit(f"center {edit.name}", reads, compute, (name,), new=untied, copies=untied)


def plan_recenter(model: nn.Module, ctx: Any, stored: set[str]) -> EditPlan:
    """The groups of ``--to rmsnorm --exact`` on ``model`` (meta device), whose files store ``stored``."""
    rewrite = RecenterLayerNorm()
    plan = plan_for(rewrite)
    streams = rewrite.prepare(ctx)
    for site, checked in plan.decided(rewrite, ctx, streams):
        assert streams is not None
        for i in checked.streams:
            stream = streams.streams[i]
            for edit in stream_edits(stream, streams.aliases, streams.centered, streams.center_outputs):
                if edit.center_output:  # the matrix stays as stored, still tied; its module centres rows
                    assert edit.param is not None
                    path = edit.param.module_path
                    plan.recorded[path] = module_recipe(CenteredEmbedding.sharing(model.get_submodule(path)))
                    continue
                plan.edits.append(_tensor_edit(edit, streams.aliases, stored))
                if edit.keep_original:
                    plan.config_changes["tie_word_embeddings"] = False
        old = site.module
        assert old is not None
        recipe = module_recipe(build_norm("rms", site, old))
        assert recipe is not None  # normswap's RMSNorm always has one
        plan.recorded[site.path] = recipe
        plan.report.changes.append(
            Change(
                rewrite.name,
                site.path,
                rewrite.kind,
                f"{type(old).__name__} -> RMSNorm, exact on the recentered stream",
            )
        )
    return plan
