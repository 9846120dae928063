"""The checks a streamed checkpoint passes before it takes its name: block by block against the original
(:func:`verify_blocks`), or layer by layer where the rewrite is local to a layer (:func:`check_rewritten_layers`:
a folded BatchNorm, weight norm added or removed)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from normswap.errors import CheckFailedError
from normswap.load.checkpoint_dir import CheckpointDirectory, stored_tensor_reader
from normswap.load.config_inputs import example_inputs
from normswap.passes.core.edits import EditPlan
from normswap.verify.blockwise import BlockwiseReport, centered, identity, verify_blockwise
from normswap.verify.metrics import TensorComparison

# The inputs a streamed result is verified on: (batch, length) of token ids, two shapes so that a
# rewrite right on one sequence length only is caught.
VERIFY_SHAPES = ((1, 16), (2, 5))


def verify_blocks(
    checkpoint: CheckpointDirectory,
    written: CheckpointDirectory,
    model: torch.nn.Module,
    to: str | None,
    say: Callable[[str], None],
    changed: list[str] | None = None,
) -> list[BlockwiseReport]:
    """The written directory against the original, block by block, on :data:`VERIFY_SHAPES` token ids;
    ``changed`` (the rewritten modules) lets a change that reaches past the last block be checked
    through the head (:func:`normswap.verify.blockwise.verify_blockwise`)."""
    relate = centered if to is not None else identity
    inputs = [
        example_inputs(model, checkpoint.config, batch=batch, length=length, device="cpu")
        for batch, length in VERIFY_SHAPES
    ]
    verification = verify_blockwise(checkpoint, written, inputs, relate, on_block=say, changed=changed)
    for report, (batch, length) in zip(verification, VERIFY_SHAPES, strict=True):
        if not report.ok:
            # report.failure names the stage and how far, or where a NaN or Inf sits
            raise CheckFailedError(
                f"verification: {report.first_divergent} of the written model is outside the exact "
                f"tolerance on inputs {batch}x{length} ({report.failure}); nothing written"
            )
    return verification


def check_rewritten_layers(
    checkpoint: CheckpointDirectory, written: CheckpointDirectory, plan: EditPlan
) -> list[TensorComparison]:
    """Each rewritten layer as written against what it replaces in the input (a folded BatchNorm or
    LayerScale and its layer; a layer before weight norm was added or removed), on random inputs."""
    # both judged by the comparison: the input's tensors were checked as the stream read them, and the
    # output is normswap's own, whose NaN is a failed check (exit 1), not the user's model broken
    original = stored_tensor_reader(checkpoint, checked=False)
    output = stored_tensor_reader(written, checked=False)
    checks = [layer.check(original, output) for layer in plan.checks]
    for check in checks:
        if not check.within_tolerance:
            raise CheckFailedError(
                f"verification: {check.name} as written is outside the exact tolerance ({check.max_rel:.3g} x "
                f"max|ref|, tolerance {check.tolerance:g}); nothing written"
            )
    return checks
