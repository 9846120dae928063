"""Comparison as a library call, the counterpart of :func:`normswap.api.convert`: what
``normswap validate ORIGINAL CONVERTED`` does, as one function returning one typed result with a verdict.

::

    result = normswap.api.validate("model.pt2", "converted.pt2", exact=True)
    if not result.ok:
        print(result.refusal)

Whole-model and per-layer figures come from :func:`normswap.verify.layerwise.validate_models`; "exact"
is judged by the one exact rule (:func:`normswap.verify.exact.judge_exact`), the rule ``convert``
applies. ``blockwise`` compares block by block (:mod:`normswap.verify.blockwise`): two model directories
without holding either model, other models held and compared on the example inputs.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normswap.api.sources import check_run_paths, load_for_inference, read_data
from normswap.errors import BadInputError, BrokenModelError
from normswap.load.inputs import require_inputs, resolve_inputs

if TYPE_CHECKING:
    from torch import nn

    from normswap.load.model_file import LoadedModel
    from normswap.verify.blockwise import BlockwiseReport
    from normswap.verify.layerwise import ValidationReport


class ComparisonVerdict(str, Enum):
    """What a comparison concluded: within what was asked, outside it, or figures only (no threshold
    was asked and no output held a NaN or Inf)."""

    PASSED = "passed"
    FAILED = "failed"
    NOT_JUDGED = "not_judged"


@dataclass
class Validation:
    """One comparison of CONVERTED with ORIGINAL: the per-output and per-layer figures (``layerwise``) or
    the block-by-block reports (``blockwise``, one per input shape in ``blockwise_shapes``), the
    verdict, and the sentence that fails it (``refusal``). :meth:`to_dict` is ``validate --report``."""

    original: str
    converted: str
    verdict: ComparisonVerdict
    refusal: str | None = None
    layerwise: ValidationReport | None = None
    blockwise: list[BlockwiseReport] = field(default_factory=list)
    blockwise_shapes: list[str] = field(default_factory=list)
    # the PNG of the per-layer SQNR, when one was asked for and written
    plot: Path | None = None
    # how the inputs were fitted to the two models (a key one of them does not take, use_cache turned off)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verdict is not ComparisonVerdict.FAILED

    def to_dict(self) -> dict[str, Any]:
        head = {"original": self.original, "converted": self.converted}
        if self.layerwise is None:
            return {**head, "blockwise": [r.to_dict() for r in self.blockwise]}
        return {**head, **self.layerwise.to_dict(), "notes": self.notes}


def validate(
    original: str,
    converted: str,
    *,
    exact: bool = False,
    min_sqnr: float | None = None,
    data: str | None = None,
    batches: int | None = None,
    batch_size: int | None = None,
    weights: str | Path | None = None,
    converted_weights: str | Path | None = None,
    trust_pickle: bool = False,
    inputs: str | Path | None = None,
    input_shapes: list[str] | None = None,
    blockwise: bool = False,
    centered: bool = False,
    plot: Path | None = None,
    overwrite: bool = False,
    on_step: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int | None, str], None] | None = None,
) -> Validation:
    """Compare ``converted`` with ``original`` (each a model spec, loaded in inference mode) on the same
    inputs: the example inputs, or the first ``batches`` batches of ``data``.

    ``exact``: fail unless every output is within the exact tolerance; ``min_sqnr``: fail below this
    many dB (also the per-layer threshold of the first divergent layer); neither: figures only, failed
    only by a NaN or Inf in an output. ``blockwise`` (``centered``: CONVERTED carries the residual stream
    centred) compares block by block. ``plot``: write a PNG of the per-layer SQNR there (an existing
    file only with ``overwrite``, refused before any model is read). ``on_step``
    hears the phase, ``on_progress`` (done, total, "comparing") the batches compared. Bad options and inputs raise
    :class:`~normswap.errors.BadInputError`; a failed comparison is returned (``ok`` False).
    """
    from normswap.verify.layerwise import DEFAULT_MIN_SQNR_DB, validate_models

    if plot is not None:  # the output rule every command checks first, as the CLI does
        reads = {"ORIGINAL": original, "CONVERTED": converted, "--data": data, "--inputs": inputs}
        reads |= {"--weights": weights, "--converted-weights": converted_weights}
        check_run_paths(reads, {"--plot": plot}, overwrite)
    if blockwise and Path(original).is_dir() and Path(converted).is_dir():
        return _blockwise(original, converted, centered, on_step)
    if centered and not blockwise:
        raise BadInputError("--centered applies to --blockwise")
    if exact and min_sqnr is not None:
        raise BadInputError("--exact and --min-sqnr are two different checks: give one")
    if plot is not None and plot.suffix.lower() != ".png":
        raise BadInputError(f"--plot {plot}: the plot is a PNG file")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise BadInputError("--plot needs matplotlib: pip install 'normswap[plot]'")
    reference = _load("ORIGINAL", original, weights, trust_pickle)
    candidate = _load("CONVERTED", converted, converted_weights, trust_pickle)
    if blockwise:
        pair = require_inputs(reference, inputs_file=inputs, input_shapes=input_shapes)
        return _blockwise(original, converted, centered, on_step, (reference.model, candidate.model, pair))
    notes: list[str] = []
    if data is not None:
        resolved = resolve_inputs(reference, inputs_file=inputs, input_shapes=input_shapes)
        args, kwargs = resolved if resolved is not None else (None, None)
        from normswap.calibrate.feeding import fed

        source, _ = read_data(data, None, args, kwargs, batch_size, None, model=reference.model)
        # fed as every command feeds data: as both models take it, on ORIGINAL's device, in its dtype
        pairs = [
            (b.args, b.kwargs)
            for b in (
                fed(reference.model, b, notes, compared_with=(candidate.model,))
                for b in itertools.islice(source, batches)
            )
        ]
        if not pairs:
            raise BadInputError(f"--data {data} yields no batch")
        if batches is not None and len(pairs) < batches:
            notes.append(
                f"{batches} batches were asked for (--batches); --data {data} holds {len(pairs)}, and all "
                "of them were compared"
            )
    else:
        pairs = [require_inputs(reference, inputs_file=inputs, input_shapes=input_shapes)]
    pairs = _as_both_take_them(reference.model, candidate.model, pairs, notes)
    if on_step is not None:
        on_step("finding the norm sites of ORIGINAL")
    norm_paths = _norm_paths(reference.model, pairs[0])
    if on_progress is not None:
        on_progress(0, len(pairs), "comparing")
    from normswap.graph.capture import capture_friendly

    args, kwargs = pairs[0]
    try:
        # a model's config that turns the key/value cache on runs with it off, as its program would
        with (
            capture_friendly(reference.model, args, kwargs) as off,
            capture_friendly(candidate.model, args, kwargs) as off_too,
        ):
            report = validate_models(
                reference.model,
                candidate.model,
                pairs,
                exact=exact,
                min_sqnr_db=DEFAULT_MIN_SQNR_DB if min_sqnr is None else min_sqnr,
                norm_paths=norm_paths,
                on_batch=None
                if on_progress is None
                else lambda i: on_progress(i + 1, len(pairs), "comparing"),
            )
    except ValueError as exc:
        raise BadInputError(f"cannot compare: {exc}") from None
    except BrokenModelError as exc:  # named as a broken model it reads is named (_load)
        raise BrokenModelError(str(exc).replace("the original model", f"ORIGINAL {original}", 1)) from None
    for setting in dict.fromkeys([*off, *off_too]):
        notes.append(
            f"compared with {setting}: a written program returns no cache, so caches are not compared"
        )
    result = Validation(original, converted, _verdict(report, exact, min_sqnr), layerwise=report, notes=notes)
    result.refusal = _refusal(report, exact, min_sqnr) if not result.ok else None
    if plot is not None:
        _plot(result, plot, overwrite)
    return result


def _as_both_take_them(reference: nn.Module, candidate: nn.Module, pairs: list, notes: list[str]) -> list:
    """The inputs as both models take them (:func:`~normswap.calibrate.feeding.fit_to_models`, what it
    changes said in ``notes``): a model directory and its ``.pt2`` are compared on the same inputs, with
    the same verdict."""
    from normswap.calibrate.data import ModelInputs
    from normswap.calibrate.feeding import fit_to_models

    fitted = []
    for args, kwargs in pairs:
        inputs = fit_to_models((reference, candidate), ModelInputs(tuple(args), dict(kwargs)), notes)
        fitted.append((inputs.args, inputs.kwargs))
    return fitted


def _load(role: str, spec: str, weights: str | Path | None, trust_pickle: bool) -> LoadedModel:
    """One of the two models, a broken one named by its role: validate reads two."""
    try:
        return load_for_inference(spec, weights, trust_pickle)
    except BrokenModelError as exc:
        raise BrokenModelError(
            str(exc).replace("the model is broken", f"{role} {spec} is broken", 1)
        ) from None


def _verdict(report: ValidationReport, exact: bool, min_sqnr: float | None) -> ComparisonVerdict:
    """A NaN or Inf in an output fails the comparison whatever was asked (nothing was compared there)."""
    nonfinite = any(o.comparison.nonfinite for o in report.outputs)
    if (exact or min_sqnr is not None or nonfinite) and not report.passed:
        return ComparisonVerdict.FAILED
    return ComparisonVerdict.PASSED if exact or min_sqnr is not None else ComparisonVerdict.NOT_JUDGED


def _refusal(report: ValidationReport, exact: bool, min_sqnr: float | None) -> str:
    where = f"; first divergent layer: {report.first_divergent}" if report.first_divergent else ""
    if not (exact or min_sqnr is not None):
        return f"{report.failure}{where}"
    what = "exact tolerance" if exact else f"{min_sqnr:g} dB"
    return f"outputs are not within the {what}: {report.failure}{where}"


def _plot(result: Validation, path: Path, overwrite: bool) -> None:
    """The per-layer SQNR as a PNG, norm sites marked, written atomically over what the caller's path
    check let through (:func:`normswap.api.check_run_paths`)."""
    from normswap.load import atomic_write
    from normswap.verify.layerwise import plot_norm_sites

    report = result.layerwise
    assert report is not None  # a block-by-block comparison has no per-layer SQNR
    title = f"{result.converted} vs {result.original}"
    try:
        atomic_write(path, lambda tmp: plot_norm_sites(report, str(tmp), title=title), overwrite=overwrite)
    except ImportError:
        raise BadInputError("--plot needs matplotlib: pip install 'normswap[plot]'") from None
    result.plot = path


def _norm_paths(model: nn.Module, pair: tuple) -> list[str]:
    from normswap.discover import find_norms

    inventory = find_norms(model, *pair)
    return [site.path for site in inventory if site.is_module]


def _blockwise(
    original: str,
    converted: str,
    centered: bool,
    on_step: Callable[[str], None] | None,
    in_memory: tuple[Any, Any, tuple] | None = None,
) -> Validation:
    """Two models compared block by block; failed when a stage is outside the exact tolerance. Two model
    directories are compared holding neither model, on the inputs a streamed conversion is verified on;
    other models (``in_memory``: both models and the example inputs) are held and compared on the
    example inputs."""
    from normswap.api.checkpoint_checks import VERIFY_SHAPES
    from normswap.load.checkpoint_dir import build_on_meta, read_checkpoint_directory
    from normswap.load.config_inputs import example_inputs as config_inputs
    from normswap.verify import blockwise

    relate = blockwise.centered if centered else blockwise.identity
    say = on_step if on_step is not None else (lambda _text: None)
    say("comparing block by block")
    if in_memory is not None:
        reference, candidate, pair = in_memory
        shapes = [_shape_of(pair)]
        results = blockwise.verify_blockwise_models(reference, candidate, [pair], relate, on_block=say)
    else:
        checkpoints = {
            label: read_checkpoint_directory(path)
            for label, path in (("ORIGINAL", original), ("CONVERTED", converted))
        }
        meta = build_on_meta(checkpoints["ORIGINAL"])
        problem = blockwise.blockwise_problem(meta)  # the same rule as the stream's own verification
        if problem is not None:
            raise BadInputError(
                f"--blockwise cannot compare {original}: {problem}; compare without --blockwise"
            )
        inputs = [
            config_inputs(meta, checkpoints["ORIGINAL"].config, batch=b, length=n, device="cpu")
            for b, n in VERIFY_SHAPES
        ]
        shapes = [f"{b}x{n}" for b, n in VERIFY_SHAPES]
        results = blockwise.verify_blockwise(
            checkpoints["ORIGINAL"],
            checkpoints["CONVERTED"],
            inputs,
            relate,
            on_block=say,
            user_names=(f"ORIGINAL {original}", f"CONVERTED {converted}"),
        )
    failed = [r for r in results if not r.ok]
    return Validation(
        original,
        converted,
        ComparisonVerdict.FAILED if failed else ComparisonVerdict.PASSED,
        refusal=f"outside the exact tolerance: {failed[0].failure}" if failed else None,
        blockwise=results,
        blockwise_shapes=shapes,
    )


def _shape_of(pair: tuple) -> str:
    """The example inputs' shapes, as the report names them (``1x16``)."""
    args, kwargs = pair
    tensors = [t for t in (*args, *kwargs.values()) if hasattr(t, "shape")]
    return ", ".join("x".join(str(d) for d in t.shape) for t in tensors) or "the example inputs"
