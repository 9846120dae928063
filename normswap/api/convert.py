"""Conversion as a library call: what ``normswap convert`` does, as one function with a typed result.

::

    result = normswap.convert(model, normswap.ConvertConfig(to="rmsnorm", exact=True), (x,))
    if result.ok:
        normswap.save(result, "out.pt2")

The input model is never changed (nor its training flags); ``result.model`` is the converted copy, in
inference mode. A conversion whose check failed still returns its result (``result.ok`` is False and
``result.refusal`` says why, ending "nothing written"); :func:`normswap.save` refuses to write it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from normswap.api.config import ConvertConfig
from normswap.errors import BadInputError
from normswap.load.wrappers import unwrapped
from normswap.passes.core.base import Needs
from normswap.passes.core.pipeline import Pipeline, PipelineReport
from normswap.verify.operators import OperatorCost, operator_cost
from normswap.verify.size import ModelSize, model_size

if TYPE_CHECKING:
    from normswap.api.save import SavedOutput
    from normswap.calibrate.affine_fit import AffineCalibrationReport
    from normswap.verify.compare import ModelComparison


class Verdict(str, Enum):
    """Whether a conversion may be written, and if not, which check refused it."""

    OK = "ok"
    # an exact rewrite moved the outputs beyond the tolerance: a bug, never written
    EXACT_FAILURE = "exact_failure"
    # the exact policy: a norm that ``to`` asked for has no exact rewrite
    NOT_EXACT_UNDER_POLICY = "not_exact_under_policy"
    # to="rmsnorm": the exact route failed (not by architecture) and only the lossy swap changed the norm
    LOSSY_WITHOUT_CONSENT = "lossy_without_consent"


@dataclass
class Calibration:
    """The swapped norms fitted to the original's outputs on the calibration data."""

    fit: AffineCalibrationReport
    # the whole model against the original on the example inputs, after the fit
    overall: ModelComparison

    def to_dict(self) -> dict[str, Any]:
        return {"calibration": self.fit.to_dict(), "overall_after_calibration": self.overall.to_dict()}


@dataclass
class ConversionResult:
    """What one conversion did: the converted model, every pass's changes, skips and figures, and the
    verdict. :meth:`to_dict` is the JSON report of ``normswap convert --report`` (less its "model")."""

    # None where the route never held the model (streamed, block by block)
    model: nn.Module | None
    report: PipelineReport
    config: ConvertConfig
    verdict: Verdict = Verdict.OK
    # the sentence that refuses the result (None when ok); it ends "nothing written"
    refusal: str | None = None
    # how the input model's graph was captured ("export", "fx" or None) and what was turned off for it
    graph_method: str | None = None
    graph_notes: list[str] = field(default_factory=list)
    # with allow_lossy: the LayerNorms swapped lossily where the exact route failed (else None)
    lossy_by_consent: list[str] | None = None
    calibration: Calibration | None = None
    # sentences for the user beyond the report (what consent was used for)
    notes: list[str] = field(default_factory=list)
    # exact rewrites: outputs the model returns only when asked (output_hidden_states=True) that the
    # converted model does not keep (normswap.verify.inside_outputs); None when not measured (a route
    # that never holds the model, or a rewrite that is not exact): the passes' inside_changes say it then
    outputs_not_preserved: list[str] | None = None
    # the inputs the conversion was checked on: an exported output is captured on them
    example_args: tuple = ()
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    # set by normswap.save once the result is written
    saved: SavedOutput | None = None
    # what the model stores before and after (normswap.verify.size); None where not measured
    size: tuple[ModelSize, ModelSize] | None = None
    # the operators one forward runs before and after (normswap.verify.operators); None where not
    # measured (the streamed routes hold no model to run)
    operators: OperatorCost | None = None
    # which route ran: "in memory", "streamed" (a model directory rewritten tensor by tensor, written as
    # it goes) or "block by block" (swapped and calibrated one block at a time, written as it goes)
    route: str = "in memory"
    # what a streamed or block-by-block route wrote (normswap.api.checkpoint / checkpoint_sequential)
    written_directory: Any = None
    # where the model came from, when normswap loaded it: the model file (never written over) and the
    # model directory (its shard size and side files shape a directory output)
    source_path: Path | None = None
    source_checkpoint: Any = None

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK

    @property
    def changes(self) -> int:
        """How many sites the passes changed, all passes together."""
        return sum(len(p.changes) for p in self.report.passes)

    def pass_report(self, name: str) -> Any:
        """The report of the pass named ``name`` ("fold_batchnorm", "swap_norm", ...), or None."""
        return next((p for p in self.report.passes if p.pass_name == name), None)

    def to_dict(self) -> dict[str, Any]:
        output = self.config.output_path
        data: dict[str, Any] = {
            "output": None if output is None else str(output),
            "route": self.route,
            "written": self.saved is not None or self.written_directory is not None,
            **self.report.to_dict(),
            "ok": self.ok,  # the conversion's verdict, not only its exact checks' (the report's own "ok")
            "verdict": self.verdict.value,
            "refusal": self.refusal,
        }
        if self.lossy_by_consent is not None:
            data["lossy_by_consent"] = self.lossy_by_consent
        if self.calibration is not None:
            data.update(self.calibration.to_dict())
        if self.saved is not None:
            data.update(self.saved.to_dict())
        if self.written_directory is not None:
            written = self.written_directory.to_dict()
            written.pop("report", None)  # the pass's report is the "passes" above, as on every route
            written.pop("route", None)
            if "calibration" in written:  # where the in-memory route's calibration is
                data["calibration"] = written.pop("calibration")
                data.setdefault("overall_after_calibration", None)  # no whole model ran: null, as "overall"
            data["directory"] = written  # what was written, under one key whichever route wrote it
        if self.size is not None:
            data["size"] = {"before": self.size[0].to_dict(), "after": self.size[1].to_dict()}
        data["operators"] = None if self.operators is None else self.operators.to_dict()
        data["graph_notes"] = self.graph_notes
        data["outputs_not_preserved"] = self.outputs_not_preserved
        data["notes"] = self.notes
        return data


def convert(
    source: nn.Module | str | Path,
    config: ConvertConfig,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    weights: str | Path | None = None,
    trust_pickle: bool = False,
    inputs: str | Path | None = None,
    input_shapes: list[str] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> ConversionResult:
    """Rewrite the norms of ``source`` as ``config`` asks, checking each pass against the model before it.

    ``source`` is a model in memory, a model file or factory spec (``.pt2``, ``pkg.module:fn``, a
    pickled module with ``trust_pickle``; ``weights`` loads a state dict into it) or a Hugging Face model
    directory. The route follows from the source, the config and the output (normswap.api.routes): a
    directory converted into a directory is streamed tensor by tensor when its rewrite streams, swapped
    and calibrated block by block when it does not fit in memory, else converted in memory like any
    model. Whatever the route, the result has the same report, the same verdict and the same rules.

    ``example_args``/``example_kwargs`` are inputs the model runs on (for a file: else ``inputs``, a
    tensor file, or ``input_shapes``, else its recorded or config-made inputs): the graph is captured
    and every pass validated on them (and, for exact passes, on variants along the model's free dims).
    ``on_step`` hears what is being done ("capturing a graph of the model", "fold_batchnorm:
    rewriting"), for a progress display. Raises :class:`~normswap.errors.BadInputError` for a config or
    inputs that cannot work and :class:`~normswap.errors.CheckFailedError` for a config the exact
    policy refuses outright; every check that needs the conversion itself is in the result's verdict.
    """
    if not isinstance(config, ConvertConfig):  # a dict of options: ConvertConfig(**options)
        raise BadInputError(f"config must be a normswap.ConvertConfig, not a {type(config).__name__}")
    if not isinstance(source, nn.Module):
        from normswap.api.routes import convert_source

        return convert_source(
            source,
            config,
            example_args,
            example_kwargs,
            weights=weights,
            trust_pickle=trust_pickle,
            inputs=inputs,
            input_shapes=input_shapes,
            on_step=on_step,
        )
    if weights is not None or inputs is not None or input_shapes:
        raise BadInputError("weights, inputs and input_shapes apply to a model read from a file or folder")
    return convert_model(source, config, example_args, example_kwargs, on_step=on_step)


def convert_model(
    model: nn.Module,
    config: ConvertConfig,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    on_step: Callable[[str], None] | None = None,
) -> ConversionResult:
    """The in-memory route of :func:`convert`: ``model`` itself, checked on the example inputs."""
    from normswap.graph.capture import capture_graph
    from normswap.load.inputs import check_inputs_fit
    from normswap.util.modes import modes_restored

    say = on_step or (lambda _what: None)
    passes = config.passes()
    if example_args is None and example_kwargs is None:
        raise BadInputError(
            "normswap.convert needs example inputs (example_args and/or example_kwargs): the model is "
            "captured and every rewrite checked on them"
        )
    if not isinstance(example_args, tuple | list | None) or not isinstance(example_kwargs, dict | None):
        raise BadInputError("example inputs are a tuple (positional) and a dict (keyword): pass (x,), not x")
    args, kwargs = tuple(example_args or ()), dict(example_kwargs or {})
    model, wrapped = unwrapped(model)  # torch.compile's, DataParallel's: what computes is inside
    notes: list[str] = [wrapped] if wrapped else []
    if _written_as_a_program(config) and any(p.needs is Needs.EXPORTED_GRAPH for p in passes):
        kwargs, notes[len(notes) :] = _as_a_program_runs(model, args, kwargs)  # appended to the notes
    # conversion is about inference (BatchNorm on its running statistics); the caller's flags come back
    with modes_restored(model, inference=True):
        check_inputs_fit(model, args, kwargs)
        batches = None
        if config.calibration_data is not None:  # before the work: data that cannot be fed is refused now
            from normswap.calibrate.feeding import check_batch_fits

            batches = calibration_batches(config, model, args, kwargs)
            if batches:
                check_batch_fits(model, batches[0], "calibration batch 0")
        # Captured once, before the work: it tells whether the output format can be written at all (a
        # .pt2 or .onnx is an export), and the first pass analyzes this same graph.
        say("capturing a graph of the model")
        # fx where every pass reads only module-level facts (normswap.graph.fx_capture), else torch.export
        captured = capture_graph(
            model, args, kwargs, fx_first=bool(passes) and all(p.fx_analysis for p in passes)
        )
        if config.output_path is not None:
            _check_writable(model, config, args, kwargs, captured)
        converted, report = Pipeline(passes, exact_only=config.exact)(
            model, args, kwargs, captured=captured, on_step=say
        )
        if report.ok and report.changed and _directory_output(config):  # before calibrating it
            from normswap.load.checkpoint_write import check_directory_plan

            check_directory_plan(converted)
        result = ConversionResult(
            model=converted,
            report=report,
            config=config,
            notes=notes,
            graph_method=captured.method if captured.ok else None,
            graph_notes=list(captured.notes),
            example_args=args,
            example_kwargs=kwargs,
            size=(model_size(model), model_size(converted)),
        )
        if report.ok and report.changed:
            say("counting the operators of one forward, before and after")
            result.operators = operator_cost(model, converted, args, kwargs)
        if report.ok and _only_exact_changes(report):
            say("asking both models for the outputs they return only when asked")
            _record_outputs_not_preserved(model, result)
        lossy = None if config.allow_lossy or config.exact else _lossy_without_consent(report, config.to)
        if config.allow_lossy:
            _record_consent(result)
        for done in report.passes:  # a graph rewrite's export fixed at the example: said, never silent
            result.notes += [f"{done.pass_name}: {reason}" for reason in done.graph_fallbacks]
        if batches is not None and lossy is None:
            result.calibration = _calibrate(model, result, batches, say)
    judge(result, lossy)
    return result


def _written_as_a_program(config: ConvertConfig) -> bool:
    """Whether the output is a .pt2 or .onnx: exported, so without the settings of capture_friendly (a
    .pt holds the eager model when a graph rewrite changed nothing, and that one keeps its cache)."""
    from normswap.load.save import SAVE_FORMATS

    output = config.output_path
    return output is not None and SAVE_FORMATS.get(output.suffix.lower()) in ("pt2", "onnx")


def _as_a_program_runs(
    model: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """A .pt2 or .onnx runs without the settings torch.export cannot carry (an HF model's ``use_cache``: no
    cache returned), so a graph rewrite written as one is exported and checked that way too, as a model
    directory's config-made inputs are; otherwise (no output, a .pt) the rewritten model must keep every
    output the model returns, so nothing is turned off (the pass says how)."""
    import inspect

    from normswap.graph.capture import capture_adjustments

    try:
        takes = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return kwargs, []
    off = {name: value for _, name, value in capture_adjustments(model, args, kwargs) if name in takes}
    if not off:
        return kwargs, []
    given = ", ".join(f"{name}={value}" for name, value in off.items())
    return {**kwargs, **off}, [f"the example inputs run with {given}: the written program returns no cache"]


def judge(result: ConversionResult, lossy: str | None = None) -> None:
    """The verdict of a conversion from its report, the same on every route: an exact rewrite that moved
    the outputs, then the exact policy (a norm ``--to`` asked for with no exact rewrite), then a lossy
    swap without consent (``lossy``, in memory only: the other routes take no lossy fallback). A run that
    changed nothing is done, and says so."""
    report, config = result.report, result.config
    not_exact = _not_exact_under_policy(report, config.to) if config.exact else None
    if not report.ok:
        result.verdict = Verdict.EXACT_FAILURE
        result.refusal = (
            "exact rewrite changed the outputs: " + "; ".join(report.exact_failures) + "; nothing written"
        )
    elif not_exact is not None:
        result.verdict, result.refusal = Verdict.NOT_EXACT_UNDER_POLICY, not_exact
    elif lossy is not None:
        result.verdict, result.refusal = Verdict.LOSSY_WITHOUT_CONSENT, lossy
    elif not report.changed:
        skipped = sum(len(p.skips) for p in report.passes)
        why = (
            f"all {skipped} candidate sites were skipped, each for the reason given"
            if skipped
            else "no site to rewrite"
        )
        result.notes.append(f"nothing to change: {why}; the output is the model as it was")


def _directory_output(config: ConvertConfig) -> bool:
    from normswap.load.checkpoint_write import is_directory_output

    return config.output_path is not None and is_directory_output(config.output_path)


def _check_writable(
    model: nn.Module, config: ConvertConfig, args: tuple, kwargs: dict, captured: Any
) -> None:
    """Refuse, before the work, an output that the converted model could not be written to."""
    from normswap.load import SAVE_FORMATS, check_writable
    from normswap.load.checkpoint_write import check_directory_output, is_directory_output
    from normswap.passes import RemoveWeightNorm

    output = config.output_path
    assert output is not None  # only called for a conversion with an output
    if is_directory_output(output):
        check_directory_output(model, output)
        return
    writable = model
    if SAVE_FORMATS[output.suffix] == "pickle" and config.remove_weight_norm:
        # a weight-norm parametrization does not pickle, and what is written is the model without it:
        # judge that model, so that anything else in it that does not pickle still fails before the work
        writable, _ = RemoveWeightNorm()(model)
    check_writable(writable, output, args, kwargs, captured=captured, dtype=config.output_dtype)


def _only_exact_changes(report: PipelineReport) -> bool:
    from normswap.passes.core.base import RewriteKind

    changed = [p for p in report.passes if p.changes]
    return bool(changed) and all(p.kind is RewriteKind.EXACT for p in changed)


def _record_outputs_not_preserved(original: nn.Module, result: ConversionResult) -> None:
    """Exact means the outputs of the example; say which outputs a caller could still ask for that the
    rewrite changed (the example itself asking for them is refused by the pass, with the reason)."""
    from normswap.verify.inside_outputs import outputs_not_preserved, summarize_names

    assert result.model is not None  # an in-memory result
    moved = outputs_not_preserved(original, result.model, result.example_args, result.example_kwargs)
    result.outputs_not_preserved = moved
    if moved:
        result.notes.append(
            f"outputs not preserved when asked for with output_hidden_states=True: {summarize_names(moved)}"
        )


def _record_consent(result: ConversionResult) -> None:
    from normswap.passes.recenter.layernorm import lossy_after_failure

    consented = [skip.site for skip in lossy_after_failure(result.report.passes)]
    result.lossy_by_consent = consented
    if consented:
        result.notes.append(
            f"--allow-lossy: {len(consented)} LayerNorm(s) swapped lossily where the exact route failed "
            "(see Skipped)"
        )


def calibration_batches(config: ConvertConfig, model: nn.Module, args: tuple, kwargs: dict) -> list[Any]:
    """The calibration batches, read through the one data loader whatever their source: a file, a
    folder or a factory named by ``config``, or batches handed over as Python objects, are held to the
    same data rule, and token ids to ``model``'s vocabulary."""
    from normswap.calibrate import CalibrationData, load_calibration_data
    from normswap.calibrate.data import token_vocabulary

    data = config.calibration_data
    if isinstance(data, (str, Path)):
        data = load_calibration_data(
            data, example_args=args, example_kwargs=kwargs, batch_size=config.batch_size, model=model
        )
    elif config.batch_size is not None:
        raise BadInputError("batch_size splits calibration data read from a file or folder, not batches")
    elif not isinstance(data, CalibrationData):
        assert data is not None  # called when the config has calibration data
        given = data
        data = CalibrationData(
            lambda: given,
            description="calibration_data",
            num_batches=None,
            example_args=args,
            example_kwargs=kwargs,
        )
        data.vocabulary = token_vocabulary(model)
    return data.take(config.calibration_batches)


def _calibrate(
    original: nn.Module, result: ConversionResult, batches: list[Any], say: Callable[[str], None]
) -> Calibration:
    """Fit the swapped norms to the original's outputs on the calibration ``batches``."""
    from normswap.calibrate.affine_fit import calibrate_swapped_norms
    from normswap.verify.compare import compare_models

    assert result.model is not None  # calibration runs in memory
    sites = [c.site for p in result.report.passes if p.pass_name == "swap_norm" for c in p.changes]
    fit_sites = calibrate_swapped_norms
    cosine = result.pass_report("cosine_layers")
    if cosine is not None:  # --to cosine: the layers' scales, refitted on the data the same way
        from normswap.calibrate.cosine_fit import calibrate_cosine_layers

        fit_sites, sites = calibrate_cosine_layers, [c.site for c in cosine.changes]
    done = iter(range(1, len(sites) + 1))
    fit = fit_sites(
        original,
        result.model,
        sites,
        batches,
        on_site=lambda site: say(f"calibrating {site} ({next(done)} of {len(sites)})"),
    )
    say("comparing the calibrated model with the original")
    overall = compare_models(original, result.model, result.example_args, result.example_kwargs)
    return Calibration(fit=fit, overall=overall)


def _not_exact_under_policy(report: PipelineReport, to: str | None) -> str | None:
    """Under the exact policy, a norm that ``to`` asked for but that has no exact rewrite fails."""
    exact_pass = {"rmsnorm": "recenter_layernorm", "crmsnorm": "compress_stream"}.get(to or "")
    skipped = [s for p in report.passes if p.pass_name == exact_pass for s in p.skips]
    if skipped:
        first = skipped[0]
        target = "RMSNorm" if to == "rmsnorm" else "RMSNorm on a narrower stream"
        return (
            f"--exact: {len(skipped)} LayerNorm(s) cannot become {target} exactly "
            f"({first.site}: {first.reason}); nothing written"
        )
    return None


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.3g}"


def _lossy_without_consent(report: PipelineReport, to: str | None) -> str | None:
    """to="rmsnorm": the LayerNorms that the exact route (recentering) skipped for a failure, a missing
    graph or a form normswap does not handle, and that the architectural swap then changed. Their lossy
    result needs consent; a post-LN LayerNorm (skipped for the architecture) has no exact route."""
    from normswap.passes.recenter.layernorm import lossy_after_failure

    lossy = lossy_after_failure(report.passes) if to == "rmsnorm" else []
    if not lossy:
        return None
    reasons = list(dict.fromkeys(skip.reason for skip in lossy))
    why = reasons[0] if len(reasons) == 1 else f"{reasons[0]}; and {len(reasons) - 1} other reason(s)"
    swap = next((p for p in report.passes if p.pass_name == "swap_norm"), None)
    figures = swap.validation if swap is not None and swap.validation else {}
    sqnr = (
        f" (whole model SQNR {_fmt(figures['worst_sqnr_db'])} dB)"
        if figures.get("worst_sqnr_db") is not None
        else ""
    )
    return (
        f"--to rmsnorm: the exact route failed for {len(lossy)} LayerNorm(s), not because of the model's "
        f"architecture: {why}. Only the lossy swap changed them{sqnr}: fix the cause, or pass --allow-lossy "
        "to accept the lossy swap; nothing written"
    )
