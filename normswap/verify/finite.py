"""The broken-model rule (:mod:`normswap.util.finite`) applied to a model's outputs on its inputs."""

from __future__ import annotations

from typing import Any

from normswap.errors import BrokenModelError
from normswap.util.finite import NOTHING_COMPARED, first_nonfinite, holds
from normswap.verify.metrics import flatten_outputs


def refuse_nonfinite_outputs(
    outputs: Any, inputs: str, model: str = "the model", *, prefix: str = "output"
) -> None:
    """Refuse ``model`` when its outputs on ``inputs`` (said in the sentence: "the example inputs
    2x3x16x16") hold NaN or Inf; ``prefix`` names them ("block 3 output": one block's, streamed)."""
    for name, tensor in flatten_outputs(outputs, prefix):
        found = first_nonfinite(tensor)
        if found is not None:
            raise BrokenModelError(
                f"{model} is broken: its {name} holds {holds(found)} on {inputs}; {NOTHING_COMPARED}"
            )


__all__ = ["refuse_nonfinite_outputs"]
