"""What every command does the same way: turn errors into exit codes, load a model, refuse an output
that is an input, read data, write a JSON report and a trained model."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from normswap_cli import render

F = TypeVar("F", bound=Callable[..., Any])


def handles_errors(fn: F) -> F:
    """Turn normswap's own errors into one line on stderr and their exit code (2 bad input, 1 check)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from normswap.errors import NormswapError

        try:
            return fn(*args, **kwargs)
        except NormswapError as exc:
            render.error(str(exc))
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


def write_json(path: Path, data: Any) -> None:
    """Write a report as strict JSON (non-finite floats as strings), atomically."""
    from normswap.api import to_json
    from normswap.load import atomic_write

    text = to_json(data)
    atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))


def load(model: str, weights: Path | None, trust_pickle: bool, structure_only: bool = False) -> Any:
    """Load MODEL (see MODEL_HELP) in inference mode: BatchNorm uses its running statistics.
    ``structure_only``: a model directory is built on the meta device, no weight read (for ``inspect``)."""
    from normswap.load import load_model
    from normswap.load.model_file import load_model_structure
    from normswap.util.modes import set_inference_mode

    loader = load_model_structure if structure_only else load_model
    loaded = loader(model, weights=weights, trust_pickle=trust_pickle)
    set_inference_mode(loaded.model)
    return loaded


def check_paths(reads: dict[str, Any], writes: dict[str, Any], overwrite: bool = False) -> None:
    """Refuse, before any work, an output that is an input or another output (keys name the options), or
    that breaks the output rule (:func:`normswap.load.paths.check_output`): an existing path without
    ``--overwrite``, a symlink, a folder that is missing or not writable.

    A key in capitals (MODEL, ORIGINAL, CONVERTED) or a data option (--data, --calibrate, --holdout) holds a
    spec: the file or folder it names, or the source file of its factory, is what it reads. -o without a
    suffix (a model directory) or with .dcp is a folder; --checkpoint-dir is a working folder, read and
    written across runs, and no output.
    """
    from normswap.load.paths import check_outputs, source_paths

    spec_labels = {"MODEL", "ORIGINAL", "CONVERTED", "--data", "--calibrate", "--holdout"}
    paths: dict[str, Any] = {}
    for label, value in reads.items():
        if label in spec_labels:
            paths.update(source_paths(label, value))
        else:
            paths[label] = value
    outputs = {label: value for label, value in writes.items() if label != "--checkpoint-dir"}
    output = outputs.get("-o")
    folders = ["-o"] if output is not None and Path(output).suffix in ("", ".dcp") else []
    working = {"--checkpoint-dir": writes.get("--checkpoint-dir")}
    check_outputs(paths, outputs, overwrite=overwrite, directories=folders, working=working)


def check_inputs_fit(model: Any, args: Any, kwargs: Any, what: str = "the model") -> None:
    """One run of the user's model on the example inputs, so inputs that do not fit fail in one line."""
    from normswap.load.inputs import check_inputs_fit as check

    check(model, args, kwargs, what=what)


def existing(spec: str) -> Path | None:
    """MODEL as a file that must never be overwritten, or None for a factory."""
    return Path(spec) if Path(spec).exists() else None


def data_and_holdout(
    data: str,
    holdout: str | None,
    args: Any,
    kwargs: Any,
    batch_size: int | None,
    normalize: str | None,
    model: Any = None,
) -> tuple[Any, Any]:
    """The batches of --data, and the first batch of --holdout when given (read with the same options);
    ``model``'s token ids checked against its vocabulary as they are read."""
    from normswap.calibrate import load_calibration_data
    from normswap.errors import BadInputError

    options: dict[str, Any] = {
        "example_args": args,
        "example_kwargs": kwargs,
        "batch_size": batch_size,
        "normalize": normalize,
        "model": model,
    }
    source = load_calibration_data(data, **options)
    held_out = None
    if holdout is not None:
        held_out = next(iter(load_calibration_data(holdout, **options, ignore_inapplicable=True)), None)
        if held_out is None:
            raise BadInputError(f"--holdout {holdout} yields no batch")
    return source, held_out


def check_output_format(output: Path) -> None:
    from normswap.errors import BadInputError
    from normswap.load import SAVE_FORMATS

    if output.suffix not in SAVE_FORMATS:
        raise BadInputError(f"-o {output}: unknown output format; use one of {', '.join(SAVE_FORMATS)}")


def check_output_before_work(model: Any, output: Path, args: Any, kwargs: Any, quiet: bool) -> None:
    """Before minutes of training: can ``output``'s format be written? A .pt2 or .onnx is an export,
    tried on the example inputs when they are known; a .pt must pickle."""
    from normswap.graph.capture import capture_graph
    from normswap.load import SAVE_FORMATS, check_writable

    captured = None
    if SAVE_FORMATS.get(output.suffix.lower()) != "pickle" and (args is not None or kwargs):
        with render.status("checking that the model can be exported", quiet):
            captured = capture_graph(model, args, kwargs)
    check_writable(model, output, args, kwargs, captured=captured)


def save_trained(
    model: Any,
    output: Path,
    args: Any,
    kwargs: Any,
    data: Any,
    inputs_known: bool,
    source: str,
    overwrite: bool = False,
) -> None:
    """Write a model whose parameters were re-estimated from DATA (never over its input file), as convert
    writes: a .onnx checked in onnxruntime, an existing -o replaced only with ``overwrite``."""
    from normswap.api import save

    if not inputs_known and data.first is not None:
        # No example inputs given: a data batch shows export what the model takes.
        args, kwargs = data.first.args, data.first.kwargs
    with render.stdout_kept(output.suffix.lower() == ".onnx"):
        saved = save(model, output, args or (), kwargs, refuse_path=existing(source), overwrite=overwrite)
    render.out.print(f"wrote {output} ({saved.format})", soft_wrap=True)
