"""Rendering of the training commands' results: BatchNorm recalibration and distillation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from normswap_cli.render import final, fmt_float, out
from rich.table import Table


def print_training(run: Any, print_report: Callable[[Any, list[str]], None]) -> None:
    """A :class:`normswap.api.TrainingRun`: the data as read, its report (``print_report``), and what
    was written."""
    out.print(run.data_description, soft_wrap=True)
    print_report(run.report, run.notes)
    if run.saved is not None:  # as convert prints what it wrote: the onnxruntime check, the shapes
        from normswap_cli.render import print_saved

        print_saved(run.saved)
    elif run.wrote is not None:
        final(f"wrote {run.output} ({run.wrote})")


def print_recalibration(result: Any, notes: list[str]) -> None:
    table = Table(title="BatchNorm statistics, new vs old", show_lines=False)
    for column in ("layer", "class", "channels", "mean shift (σ)", "var ratio"):
        table.add_column(column, overflow="fold")
    for layer in result.layers:
        table.add_row(
            layer.path,
            layer.class_name,
            str(layer.num_features),
            fmt_float(layer.mean_shift),
            f"{fmt_float(layer.var_ratio_min)}..{fmt_float(layer.var_ratio_max)}",
        )
    out.print(table)
    if result.skips:
        skips = Table(title="Skipped", show_lines=False)
        for column in ("site", "reason"):
            skips.add_column(column, overflow="fold")
        for skip in result.skips:
            skips.add_row(skip.site, skip.reason)
        out.print(skips)
    for note in notes:
        out.print(f"note: {note}", soft_wrap=True)
    out.print(
        f"recalibrate_batchnorm ({result.kind.value}): {len(result.layers)} BatchNorm layers re-estimated "
        f"on {result.batches} batches ({result.samples} samples), {len(result.skips)} skipped",
        soft_wrap=True,
    )
    if result.holdout is None:
        out.print("held-out batch: none, no comparison")
        return
    worst = min(result.holdout.outputs, key=lambda o: o.sqnr_db, default=None)
    if worst is None:
        out.print("held-out batch: the model returns no floating-point output to compare")
        return
    top1 = f", top-1 agreement {worst.top1_agreement:.1%}" if worst.top1_agreement is not None else ""
    out.print(
        f"held-out batch ({result.holdout_samples} samples, {result.holdout_source}), outputs after vs "
        f"before: SQNR {fmt_float(worst.sqnr_db)} dB, cosine {fmt_float(worst.cosine, 6)}, max abs "
        f"{fmt_float(worst.max_abs)} ({fmt_float(worst.max_rel)} x max|before|){top1}",
        soft_wrap=True,
    )


def print_distillation(result: Any, notes: list[str]) -> None:
    for note in notes:
        out.print(f"note: {note}", soft_wrap=True)
    what = f"{result.loss}" + (f" at T={result.temperature:g}" if result.temperature is not None else "")
    trained = (
        (f"{len(result.trained_modules)} norm modules, " if result.train == "norms" else "")
        + f"{result.trained_tensors} tensors, {result.trained_elements:,} of {result.total_elements:,} parameters"
    )
    out.print(
        f"distill ({result.kind.value}): {result.steps_done} AdamW steps, lr {result.lr:g}, {what} loss on "
        f"{', '.join(result.loss_outputs)}; {result.batches} training batches ({result.samples} samples); "
        f"trained {trained}; {result.seconds:.1f} s",
        soft_wrap=True,
    )
    out.print(
        f"training loss: first {fmt_float(result.loss_first)}, last {fmt_float(result.loss_last)}, "
        f"min {fmt_float(result.loss_min)}",
        soft_wrap=True,
    )
    if result.before is None or result.after is None:
        out.print("held-out batch: none, no comparison")
        return
    table = Table(
        title=f"Held-out batch ({result.holdout_samples} samples, {result.holdout_source}): converted vs "
        "original, before -> after"
    )
    for column in ("output", "SQNR dB", "cosine", "max abs", "top-1"):
        table.add_column(column, overflow="fold")
    others = 0
    for before, after in zip(result.before.outputs, result.after.outputs, strict=True):
        if before.name not in result.loss_outputs:
            others += 1  # an HF model's caches and hidden states: not what was distilled
            continue
        top1 = (
            f"{before.top1_agreement:.1%} -> {after.top1_agreement:.1%}"
            if before.top1_agreement is not None and after.top1_agreement is not None
            else ""
        )
        table.add_row(
            before.name,
            f"{fmt_float(before.sqnr_db)} -> {fmt_float(after.sqnr_db)}",
            f"{fmt_float(before.cosine, 4)} -> {fmt_float(after.cosine, 4)}",
            f"{fmt_float(before.max_abs)} -> {fmt_float(after.max_abs)}",
            top1,
        )
    out.print(table)
    if others:
        out.print(f"{others} other outputs, not in the loss, are compared in --report", soft_wrap=True)
    out.print(
        f"held-out {result.loss} loss {fmt_float(result.holdout_loss_before)} -> "
        f"{fmt_float(result.holdout_loss_after)}; SQNR {fmt_float(result.sqnr_before_db)} dB -> "
        f"{fmt_float(result.sqnr_after_db)} dB",
        soft_wrap=True,
    )
