"""Activation checkpointing for a training run: each block recomputes its activations in the backward.

A training step keeps every activation its backward needs; for a model of many blocks at long lengths
those outweigh the weights. With checkpointing each block of the model's largest list of blocks (the one
FSDP2 shards per block) keeps only its inputs, and its forward runs again when the backward reaches it
(``torch.utils.checkpoint``, non-reentrant, which takes keyword inputs and works under FSDP2): memory for
about one more forward. The blocks are changed for the run only: the forward each had is put back
afterwards, so the model that is saved is the model as it was.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # a forward with no backward to come (the held-out batch)
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def recomputed_blocks(model: nn.Module) -> Iterator[str]:
    """Within the context, every block of ``model``'s largest list of blocks recomputes its activations in
    the backward; yields what was done, for the report. BadInputError for a model with no such list."""
    from normswap.verify.blockwise import block_list, find_blocks

    try:
        path, count = find_blocks(model)
    except BadInputError as exc:
        raise BadInputError(
            f"--activation-checkpointing: the converted model has no list of blocks ({exc})"
        ) from None
    blocks = block_list(model.get_submodule(path))
    own = [block.__dict__.get("forward") for block in blocks]  # a forward set on the instance, if any
    for block in blocks:
        block.forward = functools.partial(_recomputed, block.forward)
    try:
        yield f"{count} blocks ({path}) recompute their activations in the backward"
    finally:
        for block, forward in zip(blocks, own, strict=True):
            if forward is None:
                del block.forward
            else:
                block.forward = forward
