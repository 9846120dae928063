"""The dtype a written model is cast to (``--dtype``), and the one rule for which an ONNX file can be
checked here: onnxruntime's CPU build has no bf16 kernels ("Could not find an implementation for
Mul(14)"), so a bf16 file is refused before the export rather than after it."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from normswap.errors import BadInputError

OUTPUT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def output_dtype(name: str | torch.dtype) -> torch.dtype:
    """The dtype ``--dtype NAME`` names (from Python, also a torch.dtype among them); BadInputError for
    any other."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    found = OUTPUT_DTYPES.get(name.lower()) if isinstance(name, str) else None
    if found is None:
        raise BadInputError(
            f"--dtype must be one of float32, float16, bfloat16 (fp32, fp16, bf16), got {name!r}"
        )
    return found


def floating_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter or buffer (None: it has none)."""
    tensors = [*model.parameters(), *model.buffers()]
    return next((t.dtype for t in tensors if t.is_floating_point()), None)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` (inputs: tensors in tuples, lists, dicts) with every floating tensor cast to ``dtype``;
    token ids and masks stay as they are."""
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value
    )


def onnx_check_problem(dtype: torch.dtype | None) -> str | None:
    """Why an ONNX file computing in ``dtype`` cannot be checked in this onnxruntime (None: it can)."""
    if dtype is torch.bfloat16:
        return (
            "onnxruntime's CPU build has no bf16 kernels, so a bf16 ONNX file cannot be checked here: give "
            "--dtype float32 (the bf16 weights widen exactly) or --dtype float16"
        )
    return None


__all__ = ["OUTPUT_DTYPES", "cast_floating", "floating_dtype", "onnx_check_problem", "output_dtype"]
