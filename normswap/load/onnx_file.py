"""An ONNX file on disk: one ``.onnx``, or for a large model the ``.onnx`` plus its external data file.

A protobuf message cannot exceed 2 GiB, and an ``.onnx`` holds its weights inside that message unless
they go to an external data file (ONNX's own answer, which every large-model exporter writes).
torch.onnx goes external above 1.5 GiB of initializers (its ``_LARGE_MODEL_THRESHOLD``), not at 2 GB:
a 1.72 GB model crosses it. normswap decides with the same threshold, :data:`EXTERNAL_DATA_BYTES`,
and names the data file ``OUT.onnx.data`` beside ``OUT.onnx`` (the reference inside the .onnx is that
bare name, so the two must stay in one folder and are published together:
:func:`normswap.load.save.atomic_write_onnx`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from normswap.load.paths import ONNX_DATA_SUFFIX

# Initializer bytes above which the weights go to the external data file (torch.onnx's threshold).
EXTERNAL_DATA_BYTES = 1536 * 1024 * 1024


def data_file(path: Path) -> Path:
    """The external data file of the .onnx ``path``."""
    return path.with_name(path.name + ONNX_DATA_SUFFIX)


def _threshold(threshold: int | None) -> int:
    return EXTERNAL_DATA_BYTES if threshold is None else threshold


def save_program(program: Any, path: Path, threshold: int | None = None) -> bool:
    """Save an ``ONNXProgram`` (torch.onnx.export's result) to ``path``; its weights go to
    :func:`data_file` when they exceed ``threshold`` bytes (default :data:`EXTERNAL_DATA_BYTES`).
    Returns whether they did."""
    size = sum(
        v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None
    )
    external = size > _threshold(threshold)
    program.save(str(path), external_data=external)
    return external


def save_proto(proto: Any, path: Path, threshold: int | None = None) -> bool:
    """Save a ``ModelProto`` (loaded with its external data, if any) to ``path``, as
    :func:`save_program` does: external data when the initializers exceed ``threshold`` bytes."""
    import onnx

    size = sum(len(t.raw_data) for t in proto.graph.initializer)
    external = size > _threshold(threshold)
    data = data_file(path)
    if data.exists():
        os.unlink(data)  # onnx appends to an existing data file; its tensors are in memory by now
    if external:
        onnx.save_model(
            proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name
        )
    else:
        onnx.save_model(proto, str(path))
    return external
