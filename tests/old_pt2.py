"""A ``.pt2`` in the layout torch wrote before its PT2 archive format (a zip of serialized members)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import torch


def write_old_layout(path: Path, program: torch.export.ExportedProgram, example_inputs: tuple) -> Path:
    """``program`` and its ``example_inputs`` (an ``(args, kwargs)`` pair) as torch once saved them."""
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch._export.serde.serialize import serialize

    artifact = serialize(program)
    inputs = io.BytesIO()
    torch.save(example_inputs, inputs)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
        archive.writestr("serialized_exported_program.json", artifact.exported_program)
        archive.writestr("serialized_state_dict.pt", artifact.state_dict)
        archive.writestr("serialized_constants.pt", artifact.constants)
        archive.writestr("serialized_example_inputs.pt", inputs.getvalue())
    return path
