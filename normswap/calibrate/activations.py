"""Activations of a block-by-block calibration, kept in memory up to a budget and on disk past it.

A sequential calibration carries each calibration batch's hidden states from block to block in three
streams (the original model's, the converted one's as calibrated so far, and the converted one's
without calibration, for the "before" figures). Each stream holds one tensor per batch, replaced as
the block moves on. While the tensors held in memory stay within ``budget`` bytes they stay there;
a tensor that would exceed it goes into a safetensors file of its own in ``folder`` (plain tensors, no
pickle) and is read back when it is asked for. So memory is the budget plus the tensors a block is
working on, whatever the number of batches.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Hashable
from pathlib import Path

import torch


class ActivationStore:
    """Tensors by key, in memory up to ``budget`` bytes, the others in files of a temporary folder made
    on first need inside ``parent`` (default: the system's temporary folder). :meth:`close` removes it."""

    def __init__(self, budget: int, parent: Path | None = None) -> None:
        self.budget = budget
        self.parent = parent
        self._held: dict[Hashable, torch.Tensor] = {}
        self._files: dict[Hashable, Path] = {}
        self._folder: Path | None = None
        self._written = 0
        self.held_bytes = 0
        # the most bytes held in memory at once, and the bytes ever written to disk
        self.peak_held_bytes = 0
        self.spilled_bytes = 0

    def _file_for(self, key: Hashable) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix=".normswap-activations-", dir=self.parent))
        self._written += 1
        return self._folder / f"{self._written}.safetensors"

    def put(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (detached; contiguous) under ``key``, replacing what was there."""
        from safetensors.torch import save_file

        self.drop(key)
        tensor = tensor.detach().contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.held_bytes + size <= self.budget:
            self._held[key] = tensor
            self.held_bytes += size
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            return
        path = self._file_for(key)
        save_file({"t": tensor}, str(path))
        self._files[key] = path
        self.spilled_bytes += size

    def get(self, key: Hashable) -> torch.Tensor:
        """The tensor under ``key`` (read back from its file when it was spilled)."""
        if key in self._held:
            return self._held[key]
        from safetensors.torch import load_file

        return load_file(str(self._files[key]))["t"]

    def drop(self, key: Hashable) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.held_bytes -= held.numel() * held.element_size()
        path = self._files.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    @property
    def spilled(self) -> bool:
        return self.spilled_bytes > 0

    def close(self) -> None:
        """Forget every tensor and remove the folder of spilled ones (also after a failure)."""
        self._held.clear()
        self._files.clear()
        self.held_bytes = 0
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
