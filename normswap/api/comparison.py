"""Comparison as a library call, the counterpart of :func:`normswap.api.convert`: what
``normswap validate ORIGINAL CONVERTED`` does, as one function returning one typed result with a verdict.

::

    result = normswap.api.validate("model.pt2", "converted.pt2", exact=True)
    if not result.ok:
        print(result.refusal)

Whole-model and per-layer figures come from :func:`normswap.verify.layerwise.validate_models`; "exact"
is judged by the one exact rule (:func:`normswap.verify.exact.judge_exact`), the rule ``convert``
applies. ``blockwise`` compares block by block (:mod:`normswap.verify.blockwise`): two model directories
without holding either model, on the inputs their config gives; other models held, on the inputs the
whole-model comparison uses. Both routes are judged by what was asked, the whole model by its outputs,
block by block by :mod:`normswap.verify.block_verdict` (the same rule); every option is checked first,
on every route, and one a route cannot honour is refused (:func:`_check_options`).
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
    # how many of the first ``blockwise`` reports are on the inputs the whole-model comparison would use:
    # the output SQNR is judged (and reported as ``output_sqnr_db``) on those alone
    blockwise_judged: int = 0
    # the PNG of the per-layer SQNR, when one was asked for and written
    plot: Path | None = None
    # how the inputs were fitted to the two models (a key one of them does not take, use_cache turned off)
    notes: list[str] = field(default_factory=list)
    # what was asked: the exact tolerance, an SQNR threshold (dB), or neither (figures only)
    exact: bool = False
    min_sqnr: float | None = None

    @property
    def ok(self) -> bool:
        return self.verdict is not ComparisonVerdict.FAILED

    def to_dict(self) -> dict[str, Any]:
        head = {"original": self.original, "converted": self.converted}
        if self.layerwise is None:
            from normswap.verify.block_verdict import output_sqnr_db

            # None (null) where the converted model was not run end to end: no --min-sqnr asked for it
            judged_db = output_sqnr_db(self.blockwise[: self.blockwise_judged])
            return {
                **head,
                "exact": self.exact,
                "min_sqnr_db": self.min_sqnr,
                "verdict": self.verdict.value,
                "failure": self.refusal,
                "output_sqnr_db": judged_db,
                "output_sqnr_inputs": None
                if judged_db is None
                else self.blockwise_shapes[: self.blockwise_judged],
                "blockwise": [r.to_dict() for r in self.blockwise],
                "notes": self.notes,
            }
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
    plot: str | Path | None = None,
    overwrite: bool = False,
    on_step: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int | None, str], None] | None = None,
) -> Validation:
    """Compare ``converted`` with ``original`` (each a model spec, loaded in inference mode) on the same
    inputs: the example inputs, or the first ``batches`` batches of ``data``.

    ``exact``: fail unless every output is within the exact tolerance; ``min_sqnr``: fail below this
    many dB (also the per-layer threshold of the first divergent layer); neither: figures only, failed
    only by a NaN or Inf in an output. ``blockwise`` (``centered``: CONVERTED carries the residual stream
    centred) compares block by block under the same verdict (``min_sqnr``: the converted model's output
    run through its own blocks, on the inputs the whole-model comparison uses; run only then); two model
    directories are then compared on the inputs their config gives (1x16, judged, and 2x5), so ``data``,
    ``inputs``, ``input_shapes`` and ``weights`` are refused there, and ``plot`` (a per-layer figure)
    with any ``blockwise``. ``plot``: write a PNG of the per-layer SQNR there (an
    existing file only with ``overwrite``, refused before any model is read). ``on_step``
    hears the phase, ``on_progress`` (done, total, "comparing") the batches compared. Bad options and
    inputs raise :class:`~normswap.errors.BadInputError`; a failed comparison is returned (``ok`` False).
    """
    from normswap.verify.layerwise import DEFAULT_MIN_SQNR_DB, validate_models

    plot = None if plot is None else Path(plot)  # a str, as every path parameter takes one
    directories = blockwise and Path(original).is_dir() and Path(converted).is_dir()
    # every option is checked before any model is read, on every route (block by block included)
    _check_options(
        {"ORIGINAL": original, "CONVERTED": converted, "--data": data, "--inputs": inputs}
        | {"--weights": weights, "--converted-weights": converted_weights},
        exact=exact,
        min_sqnr=min_sqnr,
        batches=batches,
        batch_size=batch_size,
        input_shapes=input_shapes,
        blockwise=blockwise,
        centered=centered,
        directories=directories,
        plot=plot,
        overwrite=overwrite,
    )
    if directories:
        return _blockwise(original, converted, centered, (exact, min_sqnr), on_step)
    reference = _load("ORIGINAL", original, weights, trust_pickle)
    candidate = _load("CONVERTED", converted, converted_weights, trust_pickle)
    notes: list[str] = []
    pairs = _compared_inputs(reference, candidate, data, batches, batch_size, inputs, input_shapes, notes)
    if blockwise:
        held = (reference.model, candidate.model, pairs, notes)
        return _blockwise(original, converted, centered, (exact, min_sqnr), on_step, held)
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
    judged = exact or min_sqnr is not None
    nonfinite = any(o.comparison.nonfinite for o in report.outputs)
    failure = report.failure if judged or nonfinite else None  # a NaN or Inf fails whatever was asked
    result = Validation(original, converted, _verdict(failure, judged), layerwise=report, notes=notes)
    result.exact, result.min_sqnr = exact, min_sqnr
    result.refusal = _refusal(report, exact, min_sqnr) if not result.ok else None
    if plot is not None:
        _plot(result, plot, overwrite)
    return result


def _check_options(
    reads: dict[str, Any],
    *,
    exact: bool,
    min_sqnr: float | None,
    batches: int | None,
    batch_size: int | None,
    input_shapes: list[str] | None,
    blockwise: bool,
    centered: bool,
    directories: bool,
    plot: Path | None,
    overwrite: bool,
) -> None:
    """Every option of ``validate``, checked before any model is read, whatever the route
    (``directories``: two model directories compared block by block, holding neither model); an option
    a route cannot honour is refused with what to do instead, never ignored."""
    if plot is not None:  # the output rule every command checks first, as the CLI does
        check_run_paths(reads, {"--plot": plot}, overwrite)
    if centered and not blockwise:
        raise BadInputError("--centered applies to --blockwise")
    if exact and min_sqnr is not None:
        raise BadInputError("--exact and --min-sqnr are two different checks: give one")
    if reads["--data"] is None:
        given = [
            name
            for name, value in (("--batches", batches), ("--batch-size", batch_size))
            if value is not None
        ]
        if given:
            raise BadInputError(f"{given[0]} applies to --data: give the data to compare on, or drop it")
    if blockwise and plot is not None:
        raise BadInputError(
            "--plot draws the per-layer SQNR of a whole-model comparison, and --blockwise compares block "
            "by block: drop --plot (--report FILE holds every block's SQNR), or compare without --blockwise"
        )
    if directories:
        for role, option in (("ORIGINAL", "--weights"), ("CONVERTED", "--converted-weights")):
            if reads[option] is not None:
                raise BadInputError(
                    f"{option} only applies to a factory; {role} {reads[role]} is a model directory"
                )
        fixed = {"--data": reads["--data"], "--inputs": reads["--inputs"], "--input-shape": input_shapes}
        for option, value in fixed.items():
            if value:
                raise BadInputError(
                    f"{option}: two model directories are compared block by block on the inputs their "
                    "config gives (those a streamed conversion is verified on), not on inputs of yours: "
                    f"drop {option}, or compare without --blockwise (both models are loaded)"
                )
    if plot is not None and plot.suffix.lower() != ".png":
        raise BadInputError(f"--plot {plot}: the plot is a PNG file")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise BadInputError("--plot needs matplotlib: pip install 'normswap[plot]'")


def _compared_inputs(
    reference: LoadedModel,
    candidate: LoadedModel,
    data: str | None,
    batches: int | None,
    batch_size: int | None,
    inputs: str | Path | None,
    input_shapes: list[str] | None,
    notes: list[str],
) -> list[tuple[tuple, dict]]:
    """The inputs both models are compared on, whole or block by block: every batch of ``data`` (its
    first ``batches``) or the example inputs, as both models take them (what is changed said in
    ``notes``)."""
    if data is None:
        pairs = [require_inputs(reference, inputs_file=inputs, input_shapes=input_shapes)]
        return _as_both_take_them(reference.model, candidate.model, pairs, notes)
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
    return _as_both_take_them(reference.model, candidate.model, pairs, notes)


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


def _verdict(failure: str | None, judged: bool) -> ComparisonVerdict:
    """The verdict of every route, whole model or block by block: ``failure`` is what fails the
    comparison (outside what was asked, or a NaN or Inf whatever was asked); ``judged``: a threshold
    (``exact`` or ``min_sqnr``) was asked."""
    if failure is not None:
        return ComparisonVerdict.FAILED
    return ComparisonVerdict.PASSED if judged else ComparisonVerdict.NOT_JUDGED


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
    asked: tuple[bool, float | None],
    on_step: Callable[[str], None] | None,
    in_memory: tuple[Any, Any, list, list[str]] | None = None,
) -> Validation:
    """Two models compared block by block, judged by what was ``asked`` (exact, min_sqnr) as the whole
    model is (:mod:`normswap.verify.block_verdict`). Two model directories are compared holding neither
    model, on the inputs a streamed conversion is verified on; other models (``in_memory``: both models,
    the inputs both are compared on and the notes on them) are held and compared on those inputs."""
    from normswap.api.checkpoint_checks import VERIFY_SHAPES
    from normswap.load.checkpoint_dir import build_on_meta, read_checkpoint_directory
    from normswap.load.config_inputs import example_inputs as config_inputs
    from normswap.load.config_inputs import same_inputs
    from normswap.verify import blockwise
    from normswap.verify.block_verdict import blockwise_failure

    exact, min_sqnr = asked
    relate = blockwise.centered if centered else blockwise.identity
    say = on_step if on_step is not None else (lambda _text: None)
    say("comparing block by block")
    # The converted model runs end to end (every block a second time) only for the verdict that reads
    # its output: --min-sqnr.
    end_to_end = min_sqnr is not None
    notes: list[str] = []
    named: list[str] = []
    if in_memory is not None:
        reference, candidate, pairs, notes = in_memory
        shapes = [_shape_of(pair) for pair in pairs]
        judged = len(pairs)  # the whole-model comparison's own inputs
        results = blockwise.verify_blockwise_models(
            reference, candidate, pairs, relate, on_block=say, end_to_end=end_to_end
        )
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
        config = checkpoints["ORIGINAL"].config
        inputs = [config_inputs(meta, config, batch=b, length=n, device="cpu") for b, n in VERIFY_SHAPES]
        shapes = [f"{b}x{n}" for b, n in VERIFY_SHAPES]
        # The SQNR verdict is judged on the whole-model route's inputs for a directory, its config's
        # example (normswap.load.model_file), or a threshold between that figure and one pooled with the
        # second shape passes one route and fails the other. The first fixed shape is that example; were
        # it not, the example is compared first.
        whole = config_inputs(meta, config, device="cpu")
        if not same_inputs(whole, inputs[0]):
            inputs, shapes = [whole, *inputs], [_shape_of(whole), *shapes]
        judged, named = 1, shapes
        results = blockwise.verify_blockwise(
            checkpoints["ORIGINAL"],
            checkpoints["CONVERTED"],
            inputs,
            relate,
            on_block=say,
            user_names=(f"ORIGINAL {original}", f"CONVERTED {converted}"),
            end_to_end=end_to_end,
        )
    failure = blockwise_failure(results, exact=exact, min_sqnr_db=min_sqnr, judged=judged, shapes=named)
    return Validation(
        original,
        converted,
        _verdict(failure, exact or min_sqnr is not None),
        refusal=failure,
        blockwise=results,
        blockwise_shapes=shapes,
        blockwise_judged=judged,
        notes=notes,
        exact=exact,
        min_sqnr=min_sqnr,
    )


def _shape_of(pair: tuple) -> str:
    """The example inputs' shapes, as the report names them (``1x16``)."""
    args, kwargs = pair
    tensors = [t for t in (*args, *kwargs.values()) if hasattr(t, "shape")]
    return ", ".join("x".join(str(d) for d in t.shape) for t in tensors) or "the example inputs"
