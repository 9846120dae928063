"""What every command reads and writes the same way, as library calls: a model loaded in inference mode,
its example inputs checked on it (found by :func:`normswap.load.resolve_inputs`, which every command
calls), the paths of a run checked before any work, the data and held-out batch of a data-driven
command, a JSON report, and a trained model written as ``convert`` writes.

Heavy modules (torch, the loaders) are imported inside the functions: ``normswap.api`` re-exports these
names and the command line must start without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from normswap.api.save import SavedOutput
    from normswap.calibrate.data import CalibrationData, ModelInputs
    from normswap.load.model_file import LoadedModel

# A spec (MODEL, ORIGINAL, CONVERTED, or data) names what it reads: its file, folder or factory's source.
SPEC_LABELS = frozenset({"MODEL", "ORIGINAL", "CONVERTED", "--data", "--calibrate", "--holdout"})

Step = Callable[[str], None]


def _say(on_step: Step | None, text: str) -> None:
    if on_step is not None:
        on_step(text)


def load_for_inference(
    spec: str,
    weights: str | Path | None = None,
    trust_pickle: bool = False,
    structure_only: bool = False,
    statistics_replaced: bool = False,
) -> LoadedModel:
    """MODEL (a .pt2, a model directory, a factory, or a .pt with ``trust_pickle``) in inference mode:
    BatchNorm uses its running statistics. ``structure_only``: a model directory is built on the meta
    device, no weight read (what ``inspect`` needs). A model whose parameters hold NaN or Inf is refused
    as broken, whatever the command (:mod:`normswap.util.finite`), but for BatchNorm statistics a command
    re-estimates without reading them (``statistics_replaced``: ``recalibrate``)."""
    from normswap.load import load_model
    from normswap.load.model_file import load_model_structure
    from normswap.util.finite import refuse_broken_model
    from normswap.util.modes import set_inference_mode

    loader = load_model_structure if structure_only else load_model
    loaded = loader(spec, weights=weights, trust_pickle=trust_pickle)
    # a structure built on the meta device holds no values to refuse
    refuse_broken_model(loaded.model, statistics_replaced=statistics_replaced)
    set_inference_mode(loaded.model)
    return loaded


def check_run_paths(reads: Mapping[str, Any], writes: Mapping[str, Any], overwrite: bool = False) -> None:
    """Refuse, before any work, an output that is an input or another output (keys name the options), or
    that breaks the output rule (:func:`normswap.load.paths.check_output`): an existing path without
    ``overwrite``, a symlink, a folder that is missing or not writable.

    A key in :data:`SPEC_LABELS` holds a spec: the file or folder it names, or the source file of its
    factory, is what it reads. -o without a file extension (a model directory) or with .dcp is a folder;
    --checkpoint-dir is a working folder, read and written across runs, and no output.
    """
    from normswap.load.checkpoint_write import is_directory_output
    from normswap.load.paths import check_outputs, source_paths

    paths: dict[str, Any] = {}
    for label, value in reads.items():
        if label in SPEC_LABELS:
            paths.update(source_paths(label, value))
        else:
            paths[label] = value
    outputs = {label: value for label, value in writes.items() if label != "--checkpoint-dir"}
    output = outputs.get("-o")
    folders = (
        ["-o"]
        if output is not None and (is_directory_output(output) or Path(output).suffix == ".dcp")
        else []
    )
    working = {"--checkpoint-dir": writes.get("--checkpoint-dir")}
    check_outputs(paths, outputs, overwrite=overwrite, directories=folders, working=working)


def write_report(path: Path, data: Any) -> None:
    """Write a report as strict JSON (non-finite floats as strings), atomically."""
    from normswap.api.report import to_json
    from normswap.load import atomic_write

    text = to_json(data)
    atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))


def check_inputs_fit(
    model: nn.Module, args: Any, kwargs: Any, what: str = "the model", *, outputs_judged: bool = True
) -> None:
    """One run of the user's model on the example inputs, so inputs that do not fit fail in one line,
    and a model that computes NaN/Inf there is refused as broken (:mod:`normswap.util.finite`) where
    its outputs are ``outputs_judged``: not by ``inspect``, which compares nothing (masked logits hold
    -Inf), nor ``recalibrate``, whose statistics are replaced before the model computes anything."""
    from normswap.load.inputs import check_inputs_fit as check
    from normswap.util.shapes import format_shapes, input_shapes
    from normswap.verify.finite import refuse_nonfinite_outputs

    output = check(model, args, kwargs, what=what)
    if not outputs_judged:
        return
    shapes = format_shapes(input_shapes(tuple(args or ()), dict(kwargs or {})))
    refuse_nonfinite_outputs(output, f"the example inputs {shapes}", what)


def never_written(spec: str) -> Path | None:
    """A model spec as a file that must never be written over, or None for a factory."""
    return Path(spec) if Path(spec).exists() else None


def read_data(
    data: str,
    holdout: str | None,
    args: Any,
    kwargs: Any,
    batch_size: int | None,
    normalize: str | None,
    model: nn.Module | None = None,
) -> tuple[CalibrationData, ModelInputs | None]:
    """The batches of ``data``, and the first batch of ``holdout`` when given (read with the same
    options); ``model``'s token ids checked against its vocabulary as they are read."""
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
        holdout_data = load_calibration_data(holdout, **options, ignore_inapplicable=True)
        batches = iter(holdout_data)
        held_out = next(batches, None)
        if held_out is None:
            raise BadInputError(f"--holdout {holdout} yields no batch")
        # one batch is compared: a source holding more is said so (its count, or one batch read ahead)
        more = holdout_data.num_batches - 1 if holdout_data.num_batches is not None else None
        if more is None:
            more = 1 if next(batches, None) is not None else 0
        if more:
            source.notes.append(
                f"--holdout {holdout}: its first batch is compared; it holds more, which are not read"
            )
    return source, held_out


def check_output_before_work(
    model: nn.Module,
    output: Path,
    args: Any,
    kwargs: Any,
    on_step: Step | None = None,
    dtype: str | None = None,
) -> None:
    """Before minutes of training: can ``output``'s format be written (in ``dtype``, default the
    model's)? A .pt2 or .onnx is an export, tried on the example inputs when they are known; a .pt must
    pickle."""
    from normswap.graph.capture import capture_graph
    from normswap.load import SAVE_FORMATS, check_writable
    from normswap.load.checkpoint_write import (
        check_directory_output,
        check_directory_plan,
        is_directory_output,
    )
    from normswap.util.dtypes import output_dtype
    from normswap.util.fake_weights import fake_weights

    if is_directory_output(output):  # written with save_pretrained and loaded back: no export to try
        check_directory_output(model, output)
        # training changes no module's class: a student a directory cannot hold is refused now, as convert
        # refuses it (a student still on the meta device, read into shards later, is judged when written)
        if not any(t.is_meta for t in model.parameters()):
            check_directory_plan(model)
        return
    captured = None
    if SAVE_FORMATS.get(output.suffix.lower()) != "pickle" and (args is not None or kwargs):
        _say(on_step, "checking that the model can be exported")
        with fake_weights(model, args, kwargs):  # a model to be read into shards later: no weights yet
            captured = capture_graph(model, args, kwargs)
    check_writable(
        model, output, args, kwargs, captured=captured, dtype=None if dtype is None else output_dtype(dtype)
    )


def save_trained(
    model: nn.Module,
    output: Path,
    args: Any,
    kwargs: Any,
    data: CalibrationData,
    inputs_known: bool,
    source: str,
    overwrite: bool = False,
    *,
    opset: int | None = None,
    static_shapes: bool = False,
    dtype: str | None = None,
) -> SavedOutput:
    """Write a model whose parameters were re-estimated from ``data`` (never over its input file
    ``source``), as convert writes: a .onnx checked in onnxruntime (at ``opset``), a program that takes
    the free batch and lengths unless ``static_shapes``, in ``dtype`` (default the model's), an existing
    -o replaced only with ``overwrite``. Without example inputs, the first data batch shows an export
    what the model takes."""
    from normswap.api.save import save
    from normswap.load.checkpoint_dir import is_checkpoint_directory, read_checkpoint_directory
    from normswap.util.dtypes import output_dtype

    if not inputs_known and data.first is not None:
        args, kwargs = data.first.args, data.first.kwargs
    # a model directory written from one: its shard size and side files (tokenizer, ...) are kept
    directory = read_checkpoint_directory(source) if is_checkpoint_directory(source) else None
    return save(
        model,
        output,
        args or (),
        kwargs,
        source=directory,
        refuse_path=never_written(source),
        overwrite=overwrite,
        opset=opset,
        static_shapes=static_shapes,
        dtype=None if dtype is None else output_dtype(dtype),
    )
