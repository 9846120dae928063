"""How :func:`normswap.convert` runs for a model it reads itself: the route follows from the source, the
config and the output, never from the caller.

- A model directory converted into a model directory streams (:mod:`normswap.api.checkpoint`) when its
  one rewrite streams (:func:`~normswap.api.checkpoint.stream_problem`): decided on the meta device,
  written tensor by tensor, verified against the source before it takes its name.
- With an architectural ``to`` and calibration data it is swapped and calibrated block by block
  (:mod:`normswap.api.checkpoint_sequential`) when asked (``sequential``) or when the model does not fit
  in memory.
- Everything else is loaded and converted in memory (:func:`normswap.api.convert.convert_model`), a
  directory that could not stream saying why.

Every route returns the same :class:`~normswap.api.convert.ConversionResult`: the pass reports, one
verdict from :func:`~normswap.api.convert.judge`, the same notes; the streamed and block-by-block
routes have written their output when the verdict allows it (``result.written_directory``), the
in-memory one leaves that to :func:`normswap.save`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from normswap.api.config import ConvertConfig
from normswap.api.convert import ConversionResult, Verdict, convert_model, judge
from normswap.api.sources import check_run_paths, load_for_inference, never_written
from normswap.errors import BadInputError, CheckFailedError
from normswap.load.inputs import require_inputs
from normswap.passes.core.pipeline import PipelineReport


def _directory_to_directory(source: str | Path, output: Path | None) -> bool:
    from normswap.load.checkpoint_dir import is_checkpoint_directory
    from normswap.load.checkpoint_write import is_directory_output

    return output is not None and is_checkpoint_directory(source) and is_directory_output(output)


def convert_source(
    source: str | Path,
    config: ConvertConfig,
    example_args: tuple | None,
    example_kwargs: dict[str, Any] | None,
    *,
    weights: str | Path | None,
    trust_pickle: bool,
    inputs: str | Path | None,
    input_shapes: list[str] | None,
    on_step: Callable[[str], None] | None,
) -> ConversionResult:
    """:func:`normswap.convert` for a model file, factory or directory: choose the route, run it."""
    say = on_step or (lambda _what: None)
    config.validate()  # option mistakes are said before the model is read
    if config.output is not None:  # the rule every command checks first, for a library call too
        data = config.calibration_data  # a path, or batches given as objects (nothing read from a path)
        data = data if isinstance(data, str | os.PathLike) else None
        reads = {"MODEL": source, "--weights": weights, "--inputs": inputs, "--calibrate": data}
        check_run_paths(reads, {"-o": config.output_path}, config.overwrite)
    custom = (
        example_args is not None or example_kwargs is not None or inputs is not None or bool(input_shapes)
    )
    notes: list[str] = []
    if _directory_to_directory(source, config.output_path):
        from normswap.api.checkpoint import directory_route
        from normswap.api.checkpoint_sequential import sequential_route

        if config.sequential or config.calibration_data is not None:
            note = sequential_route(source, config, asked=config.sequential, custom_inputs=custom)
            if note is not None:
                return _block_by_block(source, config, note, say)
        elif config.activation_memory is not None:
            raise BadInputError(
                "--activation-memory applies to the block-by-block calibration of a model directory"
            )
        fallback, checkpoint = directory_route(source, config, custom_inputs=custom)
        streamed = _streamed(source, checkpoint, config, say) if fallback is None else fallback
        if isinstance(streamed, ConversionResult):
            return streamed
        notes.append(streamed)
    elif config.sequential or config.activation_memory is not None:
        raise BadInputError(
            "--sequential and --activation-memory convert a model directory into a model directory "
            "(-o with no suffix) block by block"
        )
    if (example_args is not None or example_kwargs is not None) and (inputs is not None or input_shapes):
        raise BadInputError(
            "give example inputs once: as example_args/example_kwargs, or as inputs/input_shapes"
        )
    # in memory: the model read as every command reads it, then the in-memory route itself
    loaded = load_for_inference(str(source), weights, trust_pickle)
    if example_args is None and example_kwargs is None:
        example_args, example_kwargs = require_inputs(loaded, inputs_file=inputs, input_shapes=input_shapes)
        if inputs is None and not input_shapes:
            notes += loaded.notes  # the inputs normswap made
    result = convert_model(loaded.model, config, example_args, example_kwargs, on_step=say)
    result.notes[:0] = notes
    result.source_path = never_written(str(source))
    result.source_checkpoint = loaded.checkpoint
    return result


def _streamed(
    source: str | Path, checkpoint: Any, config: ConvertConfig, say: Callable[[str], None]
) -> ConversionResult | str:
    """The streamed route's result, or the note saying why the directory converts in memory instead
    (a plan whose result the stream cannot verify)."""
    from normswap.api.checkpoint import in_memory_instead, plan_checkpoint, unverifiable, write_checkpoint

    planned = plan_checkpoint(checkpoint, config, say)
    why = unverifiable(planned)
    if why is not None:
        return in_memory_instead(source, checkpoint, why)
    result = ConversionResult(
        model=None,
        report=PipelineReport(passes=[planned.report]),
        config=config,
        route="streamed",
        notes=list(planned.notes),
    )
    judge(result)
    if not result.ok:
        return result
    try:
        result.written_directory = write_checkpoint(planned, config, say)
    except CheckFailedError as exc:  # the verification against the source: what exact failures are
        result.verdict, result.refusal = Verdict.EXACT_FAILURE, str(exc)
        return result
    result.size = _stored_sizes(source, result.written_directory.path)
    return result


def _block_by_block(
    source: str | Path, config: ConvertConfig, note: str, say: Callable[[str], None]
) -> ConversionResult:
    from normswap.api.checkpoint_sequential import convert_checkpoint_sequential

    budget = None if config.activation_memory is None else int(config.activation_memory * 1e9)
    written = convert_checkpoint_sequential(source, config, activation_memory=budget, on_step=say)
    result = ConversionResult(
        model=None,
        report=PipelineReport(passes=[written.report]),
        config=config,
        route="block by block",
        written_directory=written,
        notes=[note, *written.notes],
    )
    judge(result)
    result.size = _stored_sizes(source, written.path)
    return result


def _stored_sizes(source: str | Path, written: Path) -> tuple[Any, Any]:
    """What the source directory and the written one store (values, bytes), read from their files."""
    from normswap.load.checkpoint_dir import read_checkpoint_directory
    from normswap.verify.size import stored_size

    return stored_size(read_checkpoint_directory(source)), stored_size(read_checkpoint_directory(written))
