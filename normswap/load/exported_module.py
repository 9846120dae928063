"""A ``.pt`` of a model that is an exported graph: the program, pickled as its own ``.pt2`` bytes.

Rewrites that need the graph (``--to crmsnorm``, ``--fuse-add``, ``--fuse-inline``, ``--defer-rms``) give
the module torch.export makes of a program, whose guard hooks are local functions that pickle cannot
name. A ``.pt`` asked of such a result holds an :class:`ExportedModule` instead: a module that runs the
program and pickles as the program's ``.pt2`` serialization, so ``torch.load(path, weights_only=False)``
gives a module that computes what the ``.pt2`` computes, guards included. Loading it needs what the
program names installed: normswap (this class; its fused ops for ``--to fused``) and, for a Hugging Face
model, transformers (its output classes), which the unpickling imports itself.
"""

from __future__ import annotations

import importlib
import io
from typing import Any

import torch
from torch import nn


class ExportedModule(nn.Module):
    """Runs ``program`` (a ``torch.export.ExportedProgram``); pickles as the program's ``.pt2`` bytes.

    It is the program's module as a ``.pt2`` loads it, seen through one more class: the same submodules,
    parameters and buffers under the same names (its ``_modules``, ``_parameters`` and ``_buffers`` are
    that module's), so the original's state_dict loads into it and ``torch.func.functional_call`` finds
    the original's names, and its forward's signature is the program's (``inputs_of`` names it: the
    feeding rule fits keyword batches to it as to the ``.pt2``). normswap's own commands read such a
    ``.pt`` as the program's ``.pt2`` (``normswap.load.model_file``). ``train()`` is the program's (torch
    refuses it: an exported program is traced in one mode).
    """

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        super().__init__()
        self.program = program
        runs = program.module()
        # not registered as a child (its names would gain a prefix): its members are this module's
        object.__setattr__(self, "runs", runs)
        self._modules, self._parameters, self._buffers = runs._modules, runs._parameters, runs._buffers

    @property
    def inputs_of(self) -> Any:
        """The callable whose signature the program takes (what ``inspect.signature`` should read)."""
        return self.runs.forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.runs(*args, **kwargs)

    def train(self, mode: bool = True) -> ExportedModule:
        self.runs.train(mode)  # torch's verdict for an exported program (it raises for a change)
        return super().train(mode)

    def __reduce__(self) -> tuple[Any, tuple[bytes, list[str]]]:
        from normswap.load.pt2_file import program_needs

        buffer = io.BytesIO()
        torch.export.save(self.program, buffer)
        return _from_pt2_bytes, (buffer.getvalue(), program_needs(self.program))


def _from_pt2_bytes(data: bytes, needs: list[str]) -> ExportedModule:
    """What unpickling an :class:`ExportedModule` calls: the modules its program names imported (its
    operators, its output classes), then the program loaded back from its bytes."""
    for name in needs:
        importlib.import_module(name)
    return ExportedModule(torch.export.load(io.BytesIO(data)))
