"""Activations of a block-by-block calibration, kept in memory up to a budget and on disk past it.

A sequential calibration carries each calibration batch's hidden states from block to block in three
streams (the original model's, the converted one's as calibrated so far, and the converted one's
without calibration, for the "before" figures). Each stream holds one tensor per batch, replaced as
the block moves on. While the tensors held in memory stay within ``budget`` bytes they stay there;
a tensor that would exceed it goes into a safetensors file of its own in ``folder`` (plain tensors, no
pickle) and is read back when it is asked for. So memory is the budget plus the tensors a block is
working on, whatever the number of batches.

The spill folder is a temp folder of normswap's one kind (:func:`normswap.load.save.reserve_temp_dir`:
``.NAME.activations.normswap-tmp-HOST-PID-TOKEN`` beside the output): a run killed with SIGKILL leaves
it behind, and the next run on this host removes it once that pid is gone. A write that fails there (a
full disk) is one line, not a safetensors traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Hashable
from pathlib import Path

import torch

from normswap.errors import BadInputError, os_error_in
from normswap.load.save import remove_stale_temps, reserve_temp_dir

# the spill folder of a run without an output path (a library call): named as if for this path
_NO_DESTINATION = "normswap"


def spill_destination(destination: Path | None) -> Path:
    """The path a spill folder is named for: ``OUT.activations`` beside the output, or one in the
    system's temporary folder; temp folders are reserved (and stale ones removed) by this name."""
    if destination is None:
        return Path(tempfile.gettempdir()) / f"{_NO_DESTINATION}.activations"
    return destination.with_name(destination.name + ".activations")


def _spill_error(folder: Path, exc: Exception) -> BadInputError:
    failed = os_error_in(exc)
    if failed is not None and failed.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left on device"
    elif failed is not None:
        reason = failed.strerror or os.strerror(failed.errno or 0)
    else:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return BadInputError(
        f"cannot spill activations to {folder}: {reason}; free some space there or raise --activation-memory"
    )


class ActivationStore:
    """Tensors by key, in memory up to ``budget`` bytes, the others in files of a temporary folder made
    on first need beside ``destination`` (the output; default: the system's temporary folder), named so
    that a later run removes it if this one is killed. :meth:`close` removes it."""

    def __init__(self, budget: int, destination: Path | None = None) -> None:
        self.budget = budget
        self._name = spill_destination(destination)
        # what a killed earlier run left, removed whether or not this run spills
        remove_stale_temps(self._name, directory=True)
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
            self._folder = reserve_temp_dir(self._name)
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
        try:
            save_file({"t": tensor}, str(path))
        except Exception as exc:  # OSError, or safetensors' own SafetensorError around one
            path.unlink(missing_ok=True)
            raise _spill_error(path.parent, exc) from None
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
