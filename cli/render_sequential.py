"""Rendering of a block-by-block calibration (``convert DIR --calibrate DATA --sequential``)."""

from __future__ import annotations

from typing import Any

from normswap_cli.render import final, fmt_float, how_it_loads, out, print_directory_pass


def print_sequential(result: Any) -> None:
    """A :class:`normswap.api.checkpoint_sequential.SequentialConversion`: the swap, each block's hidden
    states against the original's before and after calibration, the model's, and how it was written."""
    fit = result.calibration
    print_directory_pass(result.report, "architectural, block by block")
    if fit is None:  # no norm to swap: the model was written as it was, its tensors copied as bytes
        out.print(f"{result.copied_tensors} tensors copied as bytes into {len(result.shards)} shards")
        out.print(f"  {how_it_loads(result.recorded_modules, result.stock_refused)}", soft_wrap=True)
        final(f"wrote {result.path} (directory)")
        return
    out.print(
        f"calibrated on {fit.batches} batches, {fit.blocks_path}; after each block, SQNR vs the original:"
    )
    for block in fit.blocks:
        out.print(
            f"  block {block.block}: {fmt_float(block.sqnr_before_db)} dB -> {fmt_float(block.sqnr_after_db)} dB"
        )
    out.print(
        f"calibration: whole model on the calibration data SQNR {fmt_float(fit.model_sqnr_before_db)} dB -> "
        f"{fmt_float(fit.model_sqnr_after_db)} dB",
        soft_wrap=True,
    )
    if fit.example is not None:
        out.print(
            f"after calibration, whole model vs original on the example inputs: SQNR {fmt_float(fit.example.sqnr_db)} dB"
        )
    for note in fit.notes:  # how the batches were fed, as the in-memory calibration says it
        out.print(f"note: {note}", soft_wrap=True)
    where = (
        f", {fit.activations_spilled / 1e6:.1f} MB of them spilled to disk" if fit.activations_spilled else ""
    )
    out.print(
        f"activations: at most {fit.activations_peak_held / 1e6:.1f} MB held in memory{where}; "
        f"{result.written_tensors} tensors written, {result.copied_tensors} copied as bytes, into "
        f"{len(result.shards)} shards",
        soft_wrap=True,
    )
    out.print(f"  {how_it_loads(result.recorded_modules, result.stock_refused)}", soft_wrap=True)
    final(f"wrote {result.path} (directory)")
