"""Everything the command line prints: the consoles, progress, and one renderer per kind of result.

Output goes to ``out`` (stdout, the report a user reads or pipes); progress and errors to ``err``
(stderr, shown only on a terminal). Renderers read typed results and print; they decide nothing.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Piped output (logs, CI, tests) gets 120 columns instead of rich's 80, so tables stay readable.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, highlight=False)

# What turning a setting off for the analysis capture means for the user.
ANALYSIS_ONLY = "for the capture only: torch.export cannot return a cache; the model keeps its config"
NO_CACHE = "it returns no cache; the model's own config is unchanged"


def fmt_float(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isnan(value):  # not measured (a NaN/Inf in a comparison is said where, on its own line)
        return "n/a"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"


def debugging() -> bool:
    """``normswap --debug`` (or ``NORMSWAP_DEBUG=1``): a crash shows its traceback."""
    return os.environ.get("NORMSWAP_DEBUG", "") not in ("", "0")


def final(message: str) -> None:
    """A line that a ``--quiet`` run still prints on stdout: what was written where."""
    quiet, out.quiet = out.quiet, False
    try:
        out.print(message, soft_wrap=True)
    finally:
        out.quiet = quiet


def error(message: str) -> None:
    # escaped: a path or an input like data[1].pt is text, not rich markup
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def progress(disable: bool = False) -> Any:
    """A progress bar on stderr, shown only on a terminal, so piped output and logs stay clean."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=err, transient=True, disable=disable or not err.is_terminal)


class Activity:
    """What a long library call says it is doing, on stderr: a spinner naming the phase (:meth:`step`),
    a bar once the work counts (:meth:`count`, from ``least`` items on). Nothing is shown before the
    first phase, off a terminal, or in ``quiet`` (--report) runs."""

    def __init__(self, quiet: bool, least: int = 0) -> None:
        self.shown, self.least = not quiet and err.is_terminal, least
        self._live: Any = None
        self._bar: Any = None

    def step(self, text: str) -> None:
        if not self.shown:
            return
        self._stop_bar()
        if self._live is None:
            from rich.live import Live
            from rich.spinner import Spinner

            self._spinner = Spinner("dots", style="status.spinner")
            self._live = Live(self._spinner, console=err, transient=True, refresh_per_second=12.5)
            self._live.start()
        self._spinner.update(text=text)
        self._live.refresh()  # shown at once: a phase may end before the next timed refresh

    def count(self, done: int, total: int | None, text: str) -> None:
        if not self.shown or (total is not None and total < self.least):
            return
        if self._bar is None:
            self.close()
            self._bar = progress()
            self._bar.start()
            self._task = self._bar.add_task(text, total=total)
        self._bar.update(self._task, completed=done, total=total, description=text)

    def _stop_bar(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def close(self) -> None:
        self._stop_bar()
        if self._live is not None:
            self._live.stop()
            self._live = None


@contextlib.contextmanager
def activity(quiet: bool = False, least: int = 0) -> Iterator[Activity]:
    """An :class:`Activity` for one library call, taken down on the way out (also on error)."""
    shown = Activity(quiet, least)
    try:
        yield shown
    finally:
        shown.close()


@contextlib.contextmanager
def status(text: str, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr saying what is being done, for phases that take long (a capture, a pass, a
    validation, an export); yields a function that changes the text. Shown only on a terminal and not in
    ``quiet`` (--report) runs, so pipes, logs and scripted runs stay clean; it leaves no line behind. The
    spinner of an :class:`Activity` that never counts."""
    with activity(quiet) as shown:
        shown.step(text)
        yield shown.step


@contextlib.contextmanager
def stdout_kept(exporting_onnx: bool = True) -> Iterator[None]:
    """torch.onnx prints progress lines to stdout: send them to stderr, keeping stdout for the report."""
    redirect = exporting_onnx and not err.is_terminal
    with contextlib.redirect_stdout(sys.stderr) if redirect else contextlib.nullcontext():
        yield


def print_capture_notes(notes: list[str], what: str, consequence: str) -> None:
    """Say which settings were turned off to capture the model (see normswap.graph.capture)."""
    if notes:
        out.print(f"note: {what} with {', '.join(notes)} ({consequence})", soft_wrap=True)


def captured_what(method: str | None) -> str:
    return f"graph captured ({method})" if method else "graph capture tried"


def print_inventory(inventory: Any, model: str) -> None:
    table = Table(title=f"Norms in {model}", show_lines=False)
    for column in ("path", "kind", "class", "shape", "eps", "affine", "producer -> consumers"):
        table.add_column(column, overflow="fold")
    for site in inventory:
        cls = (site.class_name or site.source).rsplit(".", 1)[-1]
        if site.source != "module":
            cls = f"{cls} ({site.source})"
        affine = ("w" if site.affine else "-") + ("+b" if site.bias else "")
        flow = f"{site.producer or '?'} -> {', '.join(site.consumers) or '?'}"
        shape = "x".join(str(d) for d in site.normalized_shape) if site.normalized_shape else "?"
        table.add_row(
            site.path,
            str(getattr(site.kind, "value", site.kind)),
            cls,
            shape,
            fmt_float(site.eps),
            affine,
            flow,
        )
    out.print(table)
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(inventory.counts().items())) or "none"
    capture = inventory.capture
    graph = (
        f"graph captured with {inventory.graph_method}"
        if inventory.graph_method
        else f"no graph ({capture.reason}): {capture.advice}"
    )
    out.print(f"{len(inventory)} norm sites: {counts}; {escape(graph)}", soft_wrap=True)
    if inventory.graph_method == "fx" and capture.errors:
        out.print(f"[dim]{capture.reason}[/]", soft_wrap=True)
    print_capture_notes(capture.notes, captured_what(capture.method if capture.ok else None), ANALYSIS_ONLY)


def print_conversion(result: Any, saved_next: bool = False) -> None:
    """A :class:`normswap.ConversionResult`, whichever route ran: changes, skips, figures, notes and
    calibration; for a directory written as it went, what was written and how it was verified.
    ``saved_next``: its model is written next, and :func:`print_size` says the size after that (what the
    output stores)."""
    if result.route == "streamed":
        print_streamed(result.report.passes[0], result.written_directory)
    elif result.route == "block by block":
        from normswap_cli.render_sequential import print_sequential

        print_sequential(result.written_directory)
    else:
        print_pipeline(result.report)
        print_capture_notes(result.graph_notes, captured_what(result.graph_method), ANALYSIS_ONLY)
    if not saved_next:
        print_size(result)
    if result.operators is not None:
        out.print(result.operators.summary(), soft_wrap=True)
    for note in result.notes:
        out.print(f"note: {note}", soft_wrap=True)
    if result.calibration is not None:
        print_calibration(result.calibration)


def print_calibration(calibration: Any) -> None:
    fitted = calibration.fit
    table = Table(title=f"Calibration on {fitted.batches} batches (site SQNR dB vs the original norm)")
    for column in ("site", "new norm", "before", "after", "note"):
        table.add_column(column, overflow="fold")
    for site in fitted.sites:
        note = site.note or ("statistics re-estimated" if site.statistics else "")
        if site.alpha is not None:
            note = f"alpha {site.alpha:.3g}"
        table.add_row(
            site.site, site.module_class, fmt_float(site.sqnr_before_db), fmt_float(site.sqnr_after_db), note
        )
    out.print(table)
    out.print(
        f"calibration: whole model on the calibration data SQNR {fmt_float(fitted.model_sqnr_before_db)} dB "
        f"-> {fmt_float(fitted.model_sqnr_after_db)} dB"
    )
    out.print(
        "after calibration, whole model vs original on the example inputs: SQNR "
        f"{fmt_float(calibration.overall.worst_sqnr_db)} dB"
    )
    for note in fitted.notes:
        out.print(f"note: {note}")


def print_size(result: Any) -> None:
    """What a conversion's model stored before and what its output stores after."""
    if result.size is not None:
        (v0, b0), (v1, b1) = ((s.values, s.bytes) for s in result.size)
        out.print(f"size: {v0:,} -> {v1:,} values, {b0 / 1e6:,.2f} -> {b1 / 1e6:,.2f} MB stored")


def print_saved(saved: Any) -> None:
    """A :class:`normswap.api.SavedOutput`: what was written, and the onnxruntime check of an ONNX file."""
    if saved.onnx is not None:
        from normswap.api import onnx_tolerance

        result = saved.onnx
        ops = ", ".join(f"{name} {count}" for name, count in result.op_counts.items())
        out.print(f"ONNX opset {result.opset}: {sum(result.op_counts.values())} nodes ({ops})")
        if getattr(result, "external_data", None):
            out.print(
                f"weights in {result.external_data} beside the .onnx (ONNX external data: keep the two together)"
            )
        if result.target == "onnxruntime":
            fused = result.onnxruntime_fusion.get("fused", {})
            done = ", ".join(f"{name} {count}" for name, count in fused.items()) or "none"
            out.print(f"onnxruntime's fused norm ops: {done}")
            for reason in result.onnxruntime_fusion.get("left", []):
                out.print(f"  left in standard ops: {reason}")
        worst = max(result.outputs, key=lambda o: o.max_rel)
        axes = "; ".join(f"{name}: {', '.join(dims.values())}" for name, dims in result.dynamic_axes.items())
        out.print(f"dynamic axes: {axes or 'none (fixed at the example shapes)'}", soft_wrap=True)
        out.print(
            f"onnxruntime vs PyTorch on {', '.join(result.shapes.accepted)}: max abs "
            f"{fmt_float(worst.max_abs)} = {fmt_float(worst.max_rel)} x max|ref| (tolerance "
            f"{onnx_tolerance(worst.dtype):g}) [green]PASS[/]",
            soft_wrap=True,
        )
    if saved.directory is not None:
        _print_directory(saved.directory)
    final(f"wrote {saved.path} ({saved.format})")
    if saved.format not in ("pickle", "directory"):
        print_capture_notes(saved.notes, f"{saved.path} exported", NO_CACHE)
    for message in saved.messages:  # what loading it needs, the shapes the written program takes
        out.print(f"note: {message}", soft_wrap=True)


def print_streamed(report: Any, result: Any) -> None:
    """A streamed conversion: its pass's ``report`` (what changed, what was refused and why) and, when it
    was written, the :class:`normswap.api.checkpoint.StreamedConversion`: how the tensors were written,
    and the verification against the source."""
    print_directory_pass(report, "exact, streamed")
    print_inside_changes(report)
    if result is None:
        return
    out.print(
        f"{result.edited_tensors} tensors computed in float64 (largest group {result.largest_group_bytes / 1e6:.1f} MB), "
        f"{result.copied_tensors} copied as bytes, into {len(result.shards)} shards",
        soft_wrap=True,
    )
    for check in result.verification:
        stages = len(check.stages)
        out.print(
            f"verified block by block ({check.blocks_path}): {stages} stages within tolerance, worst "
            f"{fmt_float(check.worst_rel)} x max|ref| [green]PASS[/]",
            soft_wrap=True,
        )
    if result.fold_checks:
        worst = max(check.max_rel for check in result.fold_checks)
        out.print(
            f"verified {len(result.fold_checks)} rewritten layers against the originals on random inputs, worst "
            f"{fmt_float(worst)} x max|ref| [green]PASS[/]",
            soft_wrap=True,
        )
    if result.recorded_modules or result.stock_refused:
        out.print(f"  {how_it_loads(result.recorded_modules, result.stock_refused)}", soft_wrap=True)
    if result.config_changes:
        out.print(f"  config.json: {', '.join(f'{k}={v}' for k, v in result.config_changes.items())}")
    final(f"wrote {result.path} (directory)")


def print_directory_pass(report: Any, how: str) -> None:
    """A pass run on a model directory as it is written (streamed, block by block): its counts, and its
    skipped sites under each reason, the same on both routes."""
    out.print(
        f"{report.pass_name} ({how}): {len(report.changes)} changed, {len(report.skips)} skipped",
        soft_wrap=True,
    )
    for reason, sites in _by_reason(report.skips).items():
        listed = f"{', '.join(sites[:3])}{', ...' if len(sites) > 3 else ''}"
        # escaped: a reason or a site name is text (a module path may hold [0]), not rich markup
        out.print(f"  skipped {len(sites)}: {escape(reason)} ({escape(listed)})", soft_wrap=True)


def how_it_loads(recorded: dict[str, Any], stock_refused: str | None) -> str:
    """How a written model directory loads, said the same by every route that writes one."""
    modules = f"{len(recorded)} modules recorded in normswap.json"
    if stock_refused is None and not recorded:
        return "loads with transformers' from_pretrained"
    if stock_refused is None:
        return (
            f"{modules} (normswap.load_model builds them; transformers' from_pretrained builds the original "
            "classes, which compute the same function)"
        )
    return (
        f"{modules}: load it with normswap.load_model. Its weights are stored as normswap-* files, which "
        f"transformers' from_pretrained does not read: it would build another model ({stock_refused})"
    )


def _print_directory(written: Any) -> None:
    """A model directory: how it loads, what it holds beyond the stock files, and its reload check."""
    shards = len(written.shards)
    how = how_it_loads(written.recorded_modules, written.stock_refused)
    out.print(
        f"model directory: {shards} safetensors file{'s' if shards != 1 else ''}; {how}", soft_wrap=True
    )
    if written.neutral_affine:
        out.print(
            f"  {len(written.neutral_affine)} folded norm tensors stored as their neutral values (1 or 0)"
        )
    if written.config_changes:
        changes = ", ".join(f"{k}={v}" for k, v in written.config_changes.items())
        out.print(f"  config.json: {changes}")
    if written.copied_files:
        out.print(f"  copied from the input: {', '.join(written.copied_files)}", soft_wrap=True)
    if written.not_copied:
        out.print(
            f"  not copied (weights of the unconverted model, folders): {', '.join(written.not_copied)}"
        )
    if written.reload_max_rel is not None:
        out.print(
            f"  loaded back and compared: max abs {fmt_float(written.reload_max_rel)} x max|ref| [green]PASS[/]"
        )


def _by_reason(skips: list[Any]) -> dict[str, list[str]]:
    """The skipped sites under each reason, in order of first appearance."""
    grouped: dict[str, list[str]] = {}
    for skip in skips:
        grouped.setdefault(skip.reason, []).append(skip.site)
    return grouped


def _site_list(sites: list[str], shown: int = 3) -> str:
    if len(sites) <= shown:
        return ", ".join(sites)
    return f"{len(sites)} sites: {', '.join(sites[: shown - 1])}, ..., {sites[-1]}"


def print_pipeline(result: Any) -> None:
    """A :class:`normswap.PipelineReport`: a table of changes, one of skips, a line of figures per pass."""
    table = Table(title="Changes", show_lines=False)
    for column in ("pass", "site", "kind", "what"):
        table.add_column(column, overflow="fold")
    # one row per pass and reason: a cause shared by many sites (no graph captured) is said once; the
    # JSON report keeps every site
    skips = Table(title="Skipped", show_lines=False)
    for column in ("pass", "sites", "reason"):
        skips.add_column(column, overflow="fold")
    for p in result.passes:
        for c in p.changes:
            what = c.description
            if "site_sqnr_db" in c.details:
                what += f" (site SQNR {fmt_float(c.details['site_sqnr_db'])} dB)"
            table.add_row(p.pass_name, c.site, c.kind.value, what)
        for reason, sites in _by_reason(p.skips).items():
            skips.add_row(p.pass_name, _site_list(sites), escape(reason))
    out.print(table)
    if skips.row_count:
        out.print(skips)
    for p in result.passes:
        _print_pass_figures(p)
        print_inside_changes(p)
    if result.overall is not None and not result.overall.outputs:
        out.print("whole model vs original: the model returns no tensor to compare")
    elif result.overall is not None and result.overall.nonfinite:
        out.print(
            f"whole model vs original: [bold red]FAIL[/]: {escape(result.overall.nonfinite)}", soft_wrap=True
        )
    elif result.overall is not None:
        out.print(
            f"whole model vs original: SQNR {fmt_float(result.overall.worst_sqnr_db)} dB, "
            f"max abs / max|ref| {fmt_float(result.overall.worst_rel)}"
        )


def print_inside_changes(p: Any) -> None:
    """What an exact pass changed inside the model while keeping its outputs (the same on every route)."""
    if p.changes and p.inside_changes:
        out.print(f"note: {p.pass_name}: {p.inside_changes}", soft_wrap=True)


def _print_pass_figures(p: Any) -> None:
    counts = f"{len(p.changes)} changed, {len(p.skips)} skipped"
    if p.validation is None:
        note = "no change" if not p.changes else "not validated (no example inputs)"
        out.print(f"{p.pass_name}: {counts}; {note}")
        return
    # a model that returns no tensor compares nothing: no worst output, and never a PASS
    worst = max(p.validation["outputs"], key=lambda o: o["max_rel"], default=None)
    if p.kind.value == "exact":
        _print_exact_figures(p, worst, counts)
    elif worst is None:
        out.print(
            f"{p.pass_name} ({p.kind.value}): {counts}; the model returns no floating-point output to compare"
        )
    else:
        out.print(
            f"{p.pass_name} ({p.kind.value}): {counts}; SQNR {fmt_float(p.validation['worst_sqnr_db'])} dB, "
            f"cosine {fmt_float(worst['cosine'], 6)}, max abs {fmt_float(worst['max_abs'])}"
        )


def _print_exact_figures(p: Any, worst: dict[str, Any] | None, counts: str) -> None:
    from normswap.api import format_shapes

    half = p.validation.get("rounding")
    failed = p.validation.get("failed_inputs", [])
    # the verdict of the one exact rule (normswap.verify.exact), over every input checked
    passed = p.validation.get("exact_passed", p.validation["within_tolerance"]) and not failed
    verdict = "[green]PASS[/]" if passed else "[bold red]FAIL[/]"
    nonfinite = p.validation.get("nonfinite")
    figures = (
        escape(nonfinite)
        if nonfinite
        else f"max abs {fmt_float(worst['max_abs'])} = {fmt_float(worst['max_rel'])} x max|ref| "
        f"(tolerance {worst['tolerance']:g})"
        if worst is not None
        else "the model returns no tensor to compare"
    )
    out.print(f"{p.pass_name} (exact): {counts}; {figures} {verdict}", soft_wrap=True)
    if half and "rewritten_rel_error" in half:
        out.print(
            f"  judged against the model in {half.get('dtype', 'a wider dtype')} (its own rounding exceeds "
            f"the table): error norm {fmt_float(half['rewritten_rel_error'])} x the reference's norm over "
            f"every input, vs the original's own {fmt_float(half['original_rel_error'])} (allowed: twice that)"
        )
    verified = p.validation.get("verified_inputs", [])
    if verified:
        out.print(
            f"  verified on {len(verified)} input shape{'s' if len(verified) != 1 else ''}: "
            + ", ".join(format_shapes(v["shapes"]) for v in verified),
            soft_wrap=True,
        )
    for f in failed:
        what = f.get("error") or (
            f"{fmt_float(f['worst_rel'])} x max|ref|" if f.get("compared") else "no tensor compared"
        )
        out.print(
            f"  [bold red]FAIL[/] on {format_shapes(f['shapes'])} ({f['label']}): {what}", soft_wrap=True
        )
    for limitation in p.validation.get("limitations", []):
        out.print(f"  limited: {limitation}", soft_wrap=True)
