"""The modules a converted model directory records in ``normswap.json``, put back into the model its
config builds (:func:`replace_recorded`), keeping the ties the config made."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError
from normswap.load.checkpoint_dir import RECORD_FILE, CheckpointDirectory


def replace_recorded(
    model: nn.Module,
    checkpoint: CheckpointDirectory,
    device: torch.device | str,
    only: dict[str, Any] | None = None,
) -> None:
    """Put the modules ``normswap.json`` records into ``model`` (built from the config), with fresh
    tensors on ``device`` in the dtype of the modules they replace; ``only``: these recipes (path ->
    recipe) instead of all. BadInputError for a recipe that is not one."""
    from normswap.modules.recipes import build_from_recipe

    recipes = checkpoint.replaced_modules if only is None else only
    for path, recipe in recipes.items():
        try:
            old = model.get_submodule(path) if path else None
        except AttributeError:
            old = None
        if old is None:
            raise BadInputError(
                f"{checkpoint.path / RECORD_FILE} replaces {path!r:.120}, which the model does not have"
            )
        dtype = next((t.dtype for t in old.parameters() if t.is_floating_point()), None)
        try:
            new = build_from_recipe(recipe, device=device, dtype=dtype)
        except (ValueError, TypeError) as exc:
            raise BadInputError(f"{checkpoint.path / RECORD_FILE}: module {path}: {exc}") from None
        _keep_shared(model, old, new)
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, new)


def _keep_shared(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the tensors of ``old`` that another module of ``model`` shares (a token embedding
    tied to the output head), where name and shape agree, so the tie the config built survives."""
    holders: dict[int, int] = {}
    for _, tensor in model.named_parameters(remove_duplicate=False):
        holders[id(tensor)] = holders.get(id(tensor), 0) + 1
    for name, tensor in old.named_parameters(recurse=False):
        mine = new._parameters.get(name)
        same = mine is not None and (mine.shape, mine.device) == (tensor.shape, tensor.device)
        if holders.get(id(tensor), 0) > 1 and same:
            new._parameters[name] = tensor
