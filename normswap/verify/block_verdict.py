"""The verdict of a block-by-block comparison (``validate --blockwise``), by the whole-model comparison's
rule (:attr:`normswap.verify.layerwise.ValidationReport.failure`), so that the same models and options
get the same verdict on both routes:

- a NaN or Inf in any stage, or in the output (when run end to end), fails whatever was asked: nothing
  was compared there;
- ``exact``: every stage within the exact tolerance of its dtype (each block runs on the original's
  activation, so the first block outside is named and its error does not carry over);
- ``min_sqnr_db``: the converted model's output, run end to end through its own blocks
  (``end_to_end``, run only for this verdict), at least that many dB from the original's, its signal and
  noise pooled over the inputs the whole-model comparison would use (``judged``: the first reports; two
  model directories are also compared on a second shape, reported but not judged, or a threshold
  between the two figures would pass one route and fail the other), as it pools batches; outputs
  decide there, so they decide here, and the first stage below the threshold on those inputs is named
  as the first divergent layer is;
- neither: figures only.
"""

from __future__ import annotations

from collections.abc import Sequence

from normswap.verify.blockwise import BlockwiseReport
from normswap.verify.metrics import PooledSqnr


def output_sqnr_db(reports: Sequence[BlockwiseReport]) -> float | None:
    """The converted model's end-to-end output SQNR over every input together (None when it was not run
    end to end; NaN when an output holds a NaN or Inf)."""
    parts = [r.output_sqnr for r in reports if r.output_sqnr is not None]
    if not parts:
        return None
    return PooledSqnr.of(parts).db


def first_below(reports: Sequence[BlockwiseReport], min_sqnr_db: float) -> tuple[str, float] | None:
    """The earliest stage (in model order, over every input) whose SQNR is below ``min_sqnr_db``, and
    that SQNR; None when none is."""
    found: tuple[int, str, float] | None = None
    for report in reports:
        for position, (stage, c) in enumerate(report.stages):
            if not c.sqnr_db >= min_sqnr_db:  # NaN counts as below
                if found is None or position < found[0]:
                    found = (position, stage, c.sqnr_db)
                break
    return None if found is None else (found[1], found[2])


def blockwise_failure(
    reports: Sequence[BlockwiseReport],
    *,
    exact: bool,
    min_sqnr_db: float | None,
    judged: int | None = None,
    shapes: Sequence[str] = (),
) -> str | None:
    """Why the comparison fails what was asked, in one sentence (see the module doc); None when it
    passes, or when nothing was asked and every value is finite. ``judged``: how many of the first
    ``reports`` are on the whole-model comparison's inputs, those the SQNR verdict is judged on (None:
    all); ``shapes`` (one per report) names them in the sentence."""
    if not reports or not any(r.stages for r in reports):
        return "no stage was compared"
    for report in reports:
        nonfinite = next((c.nonfinite for _, c in report.stages if c.nonfinite), None)
        if nonfinite is None and report.output is not None:
            nonfinite = report.output.nonfinite
        if nonfinite is not None:
            return nonfinite
    if exact:
        failed = next((r.failure for r in reports if not r.ok), None)
        return None if failed is None else f"outside the exact tolerance: {failed}"
    if min_sqnr_db is None:
        return None
    on = list(reports if judged is None else reports[:judged])
    db = output_sqnr_db(on)
    if db is None:
        raise ValueError("an SQNR verdict needs the reports of an end-to-end comparison (end_to_end=True)")
    if db >= min_sqnr_db:
        return None
    below = first_below(on, min_sqnr_db)
    where = f"; first stage below it: {below[0]} (SQNR {below[1]:.3g} dB)" if below is not None else ""
    named = list(shapes if judged is None else shapes[:judged])
    inputs = f" on inputs {', '.join(named)}" if named else ""
    return (
        f"the output is not within {min_sqnr_db:g} dB: SQNR {db:.3g} dB end to end{inputs}, below "
        f"{min_sqnr_db:g} dB{where}"
    )
