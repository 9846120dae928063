"""What a model stores, before and after a rewrite: the values of its tensors and their bytes.

A model's parameters and persistent buffers (its ``state_dict``), each tensor once however many names
it has (a tied embedding and LM head count once, as a model directory stores them); a model directory's
stored tensors, read from its shards' headers. The same model measured either way gives the same
figures, so the in-memory and streamed routes report the same sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from normswap.load.checkpoint_dir import CheckpointDirectory, stored_entries


@dataclass(frozen=True)
class ModelSize:
    """Values (elements) and bytes of the tensors a model stores."""

    values: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"values": self.values, "bytes": self.bytes}


def model_size(model: nn.Module) -> ModelSize:
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    return ModelSize(sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors))


def stored_size(directory: CheckpointDirectory) -> ModelSize:
    """What a model directory's shards store, from their headers (no tensor read)."""
    values = size = 0
    for _name, _shard, entry in stored_entries(directory):
        count = 1
        for dim in entry.shape:
            count *= dim
        values, size = values + count, size + entry.nbytes
    return ModelSize(values, size)
