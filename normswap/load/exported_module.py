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
    """Runs ``program`` (a ``torch.export.ExportedProgram``); pickles as the program's ``.pt2`` bytes."""

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        super().__init__()
        self.program = program
        self.graph_module = program.module()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.graph_module(*args, **kwargs)

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
