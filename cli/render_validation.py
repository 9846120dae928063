"""Rendering of ``normswap validate``'s layer-wise comparison: outputs, norm sites, first divergence."""

from __future__ import annotations

from typing import Any

from normswap_cli.render import fmt_float, out
from rich.markup import escape
from rich.table import Table


def print_validation(result: Any) -> None:
    """A :class:`normswap.verify.layerwise` result: outputs, norm sites, first divergence (the command
    prints the verdict, one line for every route)."""
    table = Table(title=f"Outputs ({result.batches} batch{'es' if result.batches != 1 else ''})")
    for column in ("output", "shape", "max abs", "max rel", "SQNR dB", "cosine", "top-1", "top-5"):
        table.add_column(column, overflow="fold")
    for figures in result.outputs:
        o = figures.comparison
        table.add_row(
            o.name,
            "x".join(map(str, o.shape)),
            fmt_float(o.max_abs),
            fmt_float(o.max_rel),
            fmt_float(o.sqnr_db),
            fmt_float(o.cosine, 6),
            "" if o.top1_agreement is None else f"{o.top1_agreement:.1%}",
            "" if figures.top5_agreement is None else f"{figures.top5_agreement:.1%}",
        )
    out.print(table)
    for figures in result.outputs:
        if figures.comparison.nonfinite:
            out.print(f"[bold red]FAIL[/]: {escape(figures.comparison.nonfinite)}", soft_wrap=True)
    norms = Table(title="Norm sites, in execution order (SQNR of each site's output vs the original)")
    for column in ("site", "original", "converted", "SQNR dB", "max rel"):
        norms.add_column(column, overflow="fold")
    for layer in result.norm_sites:
        norms.add_row(
            layer.path,
            layer.original_class,
            layer.converted_class,
            fmt_float(layer.sqnr_db),
            fmt_float(layer.max_rel),
        )
    if norms.row_count:
        out.print(norms)
    rule = "the exact tolerance" if result.exact else f"{result.min_sqnr_db:g} dB"
    if result.first_divergent is None:
        out.print(f"{result.shared_modules} shared modules compared; none diverges past {rule}")
    else:
        layer = next(x for x in result.layers if x.path == result.first_divergent)
        how = escape(layer.note) if layer.note else f"SQNR {fmt_float(layer.sqnr_db)} dB"
        out.print(
            f"{result.shared_modules} shared modules compared; first divergent past {rule}: "
            f"{layer.path} ({layer.original_class} -> {layer.converted_class}, {how})",
            soft_wrap=True,
        )
    for skipped in getattr(result, "skipped_layers", []):
        out.print(f"not compared: {skipped['path']}: {escape(skipped['reason'])}", soft_wrap=True)
    if result.failure and result.exact:
        out.print(f"  {escape(result.failure)}", soft_wrap=True)
