"""Write a converted model: the suffix picks the format (.pt2 torch.export, .pt/.pth pickle, .onnx checked
in onnxruntime against PyTorch). Nothing is written when a check fails, and never over the input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normswap.errors import BadInputError, CheckFailedError
from normswap.util.dtypes import cast_floating, floating_dtype
from normswap.verify.size import ModelSize, model_size, stored_size
from normswap.verify.variants import InputVariant
from normswap.verify.written import WrittenShapes, shapes_taken

if TYPE_CHECKING:
    from normswap.api.convert import ConversionResult
    from normswap.export.onnx import OnnxExport
    from normswap.load.checkpoint_dir import CheckpointDirectory
    from normswap.load.checkpoint_write import WrittenDirectory


@dataclass
class SavedOutput:
    """What was written where: ``format`` is "pt2", "pickle", "onnx" or "directory"; ``onnx`` the
    onnxruntime check of an ONNX file; ``directory`` what a model directory holds and how it reloaded;
    ``notes`` the settings turned off to export the model (e.g. "use_cache=False")."""

    path: Path
    format: str
    onnx: OnnxExport | None = None
    notes: list[str] = field(default_factory=list)
    directory: WrittenDirectory | None = None
    # sentences about the written file: what loading it needs, a program fixed at the example's shapes
    messages: list[str] = field(default_factory=list)
    # a written program (.pt2, a graph's .pt) run on the shapes its conversion was verified on
    shapes: WrittenShapes | None = None

    def to_dict(self) -> dict[str, Any]:
        """The keys ``normswap convert --report`` adds for a written output."""
        if self.directory is not None:
            return {"directory": self.directory.to_dict()}
        data: dict[str, Any] = {}
        if self.onnx is not None:
            data["onnx"] = {**self.onnx.to_dict(), "capture_notes": self.notes}
        if self.format == "pt2":
            data["output_notes"] = self.notes
        if self.messages:
            data["output_messages"] = self.messages
        if self.shapes is not None:
            data["written_shapes"] = self.shapes.to_dict()
        return data


def save(
    result: ConversionResult | nn.Module,
    path: str | Path | None = None,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    opset: int | None = None,
    static_shapes: bool | None = None,
    refuse_path: str | Path | None = None,
    source: CheckpointDirectory | None = None,
    target: str = "standard",
    overwrite: bool | None = None,
    portable: bool | None = None,
    dtype: torch.dtype | None = None,
) -> SavedOutput:
    """Save a conversion's model (or any model) to ``path``, atomically, in the format its suffix names.

    ``result``: a :class:`~normswap.api.convert.ConversionResult` (refused with
    :class:`~normswap.errors.CheckFailedError` unless ``result.ok``; ``path`` defaults to its config's
    ``output``, the inputs to those it was checked on; the result records what was written), or a
    module with ``example_args``/``example_kwargs`` (a .pt2 or .onnx is an export on them). ``opset``
    (default: the conversion's ``ConvertConfig.opset``) applies to .onnx, which is checked in onnxruntime before it is kept; ``portable`` to .pt2: a program
    that ``torch.export.load`` reads with torch alone (plain output containers, normswap's fused ops as
    torch's own), where by default the note says what loading it needs.

    A written program (.pt2, .onnx, a graph's .pt) takes any batch and sequence length the model leaves
    free, unless ``static_shapes`` (default: the conversion's ``ConvertConfig.static_shapes``) fixes it
    at the example's; it is loaded back and run on the shapes the conversion was verified on (a module:
    the example and the variants it accepts, :mod:`normswap.verify.variants`), an ONNX file compared with
    the model on each; :attr:`SavedOutput.shapes` says which it takes. An exact conversion's program that
    rejects a verified batch or length is refused, unless ``static_shapes``.

    ``dtype`` (default: the conversion's ``ConvertConfig.dtype``, else the model's): a copy of the model
    and of the example inputs cast to it is written and checked.
    ``refuse_path``: the input model's file, never to be overwritten.

    A path without a suffix is a Hugging Face model directory (a transformers model only), loaded back
    and compared with the model before it takes its name; ``source``, the directory the model came from
    (``LoadedModel.checkpoint``), gives its shard size and the files to copy (tokenizer, ...).

    An existing ``path`` is refused unless ``overwrite`` (default: the conversion's
    ``ConvertConfig.overwrite``, else False), and a symlink always is
    (:func:`normswap.load.paths.check_output`); with it the output is replaced atomically.
    """
    from normswap.api.convert import ConversionResult

    conversion = result if isinstance(result, ConversionResult) else None
    if conversion is not None:
        if not conversion.ok:
            raise CheckFailedError(conversion.refusal or "the conversion was refused; nothing written")
        if conversion.model is None:
            raise BadInputError(
                f"this conversion ran {conversion.route} and wrote {conversion.config.output_path} as it went: "
                "there is no model in memory to save"
            )
        model: nn.Module = conversion.model
        # the model's own file is never written over; its directory shapes a directory output
        refuse_path = refuse_path if refuse_path is not None else conversion.source_path
        source = source if source is not None else conversion.source_checkpoint
        # the config's output options go with its output (or any, when it named none), not with another
        # path the caller saves to
        named = conversion.config.output_path
        own_output = path is None or named is None or Path(path) == named
        path = path if path is not None else conversion.config.output_path
        if example_args is None and example_kwargs is None:
            example_args, example_kwargs = conversion.example_args, conversion.example_kwargs
        if overwrite is None:
            overwrite = conversion.config.overwrite
        if portable is None and own_output:
            portable = conversion.config.portable
        if static_shapes is None and own_output:
            static_shapes = conversion.config.static_shapes
        if opset is None and own_output:
            opset = conversion.config.opset
        if dtype is None:
            dtype = conversion.config.output_dtype
    else:
        assert not isinstance(result, ConversionResult)  # narrows the union for the type checker
        model = result
    if path is None:
        raise BadInputError("save needs a path (or a ConvertConfig with output)")
    from normswap.load.output_options import check_output_options

    # the one rule for output options the output does not use, before anything is cast or written
    check_output_options(path, opset=opset, static_shapes=bool(static_shapes), portable=bool(portable))
    if dtype is not None and floating_dtype(model) not in (None, dtype):
        from normswap.modules.copying import copy_model

        # the user's model stays as it is: a copy is cast, and checked against the file written from it
        model = copy_model(model).to(dtype)
        example_args, example_kwargs = cast_floating((example_args, example_kwargs), dtype)
        refuse_overflowing_cast(model, example_args, example_kwargs, dtype)
    from normswap.load.checkpoint_write import is_directory_output
    from normswap.load.paths import check_output

    replace = bool(overwrite)
    directory = is_directory_output(path)
    check_output("-o", path, overwrite=replace, directory=directory)
    if directory:
        saved = _write_directory(
            model, Path(path), example_args, example_kwargs, refuse_path, source, replace
        )
    else:
        saved = _write(
            model,
            Path(path),
            example_args,
            example_kwargs,
            opset,
            refuse_path,
            target,
            replace,
            bool(portable),
            static_shapes=bool(static_shapes),
            conversion=conversion,
        )
    if conversion is not None:
        conversion.saved = saved
        if conversion.size is not None:
            # what the output stores, as the streamed routes report it: a directory's shards (a folded
            # norm keeps neutral weights there, a weightless class in memory), the model as cast to dtype
            conversion.size = (conversion.size[0], written_size(model, saved))
    return saved


def written_size(model: nn.Module, saved: SavedOutput) -> ModelSize:
    """What an output stores (values, bytes): a model directory's shards as written, else ``model``'s
    tensors (the model the file was written from)."""
    if saved.directory is None:
        return model_size(model)
    from normswap.load.checkpoint_dir import read_checkpoint_directory

    return stored_size(read_checkpoint_directory(saved.path))


def refuse_overflowing_cast(
    model: nn.Module, args: tuple | None, kwargs: dict[str, Any] | None, dtype: torch.dtype
) -> None:
    """The cast copy computes finite outputs on the example, for every output kind and command (an ONNX
    file and a directory compare theirs with it; a .pt2 or .pt is written from it as it is): a weight or
    an activation past the dtype's range (1e5 in float16) is refused, not written. What normswap cast is
    its own: a failed check (exit 1), never the user's model called broken."""
    from normswap.verify.compare import run_model
    from normswap.verify.metrics import flatten_outputs

    if args is None and kwargs is None:
        return
    with torch.no_grad():
        outputs = flatten_outputs(run_model(model, args, kwargs))
    for output, values in outputs:
        bad = ~torch.isfinite(values) if values.is_floating_point() else None
        if bad is not None and bool(bad.any()):
            name, first = str(dtype).removeprefix("torch."), [int(i) for i in bad.nonzero()[0]]
            raise CheckFailedError(
                f"--dtype {name}: the model cast to {name} computes {int(bad.sum())} NaN/Inf in {output} (the "
                f"first at {first}): a weight or an activation is past {name}'s range; nothing written"
            )


def _write(
    model: nn.Module,
    path: Path,
    args: tuple | None,
    kwargs: dict[str, Any] | None,
    opset: int | None,
    refuse_path: str | Path | None,
    target: str = "standard",
    overwrite: bool = False,
    portable: bool = False,
    *,
    static_shapes: bool = False,
    conversion: ConversionResult | None = None,
) -> SavedOutput:
    """Write ``model`` as ``path``'s format. A program (``.pt2``, ``.onnx``, a graph's ``.pt``) is loaded
    back and run on the shapes to check (:func:`_shapes_to_check`) before it takes its name: an exact
    conversion's that rejects a verified batch or length is refused (unless ``static_shapes``), else the
    output records which it takes."""
    from normswap.graph.capture import capture_notes
    from normswap.load import SAVE_FORMATS, save_model
    from normswap.verify.written import refuse_untaken

    refuse = None if refuse_path is None else Path(refuse_path)
    label = SAVE_FORMATS.get(path.suffix.lower())
    if label != "pickle" and args is None and kwargs is None:
        raise BadInputError(f"writing {path} exports the model: give example inputs")
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    exact = bool(conversion is not None and conversion.config.exact)
    is_program = label in ("pt2", "onnx") or isinstance(model, torch.fx.GraphModule)
    variants = _shapes_to_check(model, args, kwargs, conversion) if is_program else []
    if label == "onnx":
        from normswap.export.onnx import export_onnx

        checked = export_onnx(
            model,
            path,
            args,
            kwargs,
            opset=opset,
            static_shapes=static_shapes,
            check_shapes=variants,
            exact=exact,
            refuse_path=refuse,
            target=target,
            overwrite=overwrite,
        )
        return SavedOutput(
            path=path,
            format="onnx",
            onnx=checked,
            notes=capture_notes(model, args, kwargs),
            messages=_shape_messages(path, checked.shapes, checked.fallbacks, variants),
            shapes=checked.shapes,
        )
    needs: list[str] = []
    fallbacks: list[str] = []
    taken: list[WrittenShapes] = []

    def check(temp: Path, written_as: str) -> None:
        if not is_program:
            return
        shapes = shapes_taken(_loaded_program(temp, written_as), variants)
        if exact and not static_shapes:
            refuse_untaken(path, shapes, fallbacks)
        taken.append(shapes)

    label = save_model(
        model,
        path,
        args,
        kwargs,
        refuse_path=refuse,
        overwrite=overwrite,
        portable=portable,
        static_shapes=static_shapes,
        needs=needs,
        fallbacks=fallbacks,
        check=check,
    )
    notes = capture_notes(model, args, kwargs) if label == "pt2" else []
    shapes = taken[0] if taken else None
    messages = _shape_messages(path, shapes, fallbacks, variants)
    if needs:
        imports = " and ".join(f"import {name}" for name in needs)
        messages.append(
            f"{path} loads with torch.export.load after {imports} (its operators or its output classes); "
            "--portable writes one that needs torch alone"
        )
    return SavedOutput(path=path, format=label, notes=notes, messages=messages, shapes=shapes)


def _shapes_to_check(
    model: nn.Module, args: tuple, kwargs: dict[str, Any], conversion: ConversionResult | None
) -> list[InputVariant]:
    """The shapes a written program is run on: those the conversion was verified on, or for a module
    saved as it is (or converted with the example only), the example and the variants the module accepts
    (:mod:`normswap.verify.variants`)."""
    from normswap.verify.variants import accepted_variants, candidate_variants
    from normswap.verify.written import verified_variants

    if (
        conversion is not None
        and conversion.report is not None
        and conversion.report.input_variants is not None
    ):
        return verified_variants(args, kwargs, conversion.report.input_variants)
    # a module saved as it is, or a conversion that checked the example only (an architectural swap): the
    # variants the module accepts, on which the written program is run (and an ONNX file compared)
    probe = accepted_variants(model, candidate_variants(args, kwargs))
    return [InputVariant("example", args, kwargs), *probe.accepted]


def _shape_messages(
    path: Path, shapes: WrittenShapes | None, fallbacks: list[str], variants: list[InputVariant]
) -> list[str]:
    """What the terminal and the report say of the shapes a written program takes, and why one is fixed:
    a fallback of normswap's says so (an export with free sizes that failed or ran past its budget);
    without one, a size rejected while the batch and lengths are free is one torch.export bounded or fixed
    because the model's code ties it to the example's (Swin pads to its window; a ResNet's pooling bounds
    it by the example's): an image size, or the length of
    a 3-d input (``variants``, the shapes checked, say which)."""
    messages = [f"{path}: {reason}" for reason in fallbacks]
    if shapes is not None:
        why = ""
        if shapes.rejected and not shapes.rejected_free and not fallbacks:
            fixed = _sizes_rejected(shapes, variants)
            why = f" (torch.export bounded or fixed {fixed} where the model's code ties it to the example's)"
        messages.append(f"{path} {shapes.summary()}{why}")
    return messages


def _sizes_rejected(shapes: WrittenShapes, variants: list[InputVariant]) -> str:
    """What the rejected variants change: "the image size", "the length" (a 3-d input's) or both."""
    rejected = {r["shapes"] for r in shapes.rejected}
    example = variants[0].shapes if variants else []
    ranks = {
        len(new)
        for variant in variants
        if variant.describe() in rejected
        for new, old in zip(variant.shapes, example, strict=False)
        if new != old
    }
    words = (("the image size", bool(ranks - {3}) or not ranks), ("the length", 3 in ranks))
    return " and ".join(word for word, changed in words if changed)


def _loaded_program(temp: Path, written_as: str) -> Callable[[tuple, dict[str, Any]], Any]:
    """The program just written to ``temp``, loaded back as a user would, as a call on (args, kwargs)."""
    # a .pt here is normswap's own file, written a moment ago (a graph's program pickled: ExportedModule)
    module = torch.export.load(temp).module() if written_as == "pt2" else torch.load(temp, weights_only=False)
    return lambda args, kwargs: module(*args, **kwargs)


def _write_directory(
    model: nn.Module,
    path: Path,
    args: tuple | None,
    kwargs: dict[str, Any] | None,
    refuse_path: str | Path | None,
    source: CheckpointDirectory | None,
    overwrite: bool = False,
) -> SavedOutput:
    from normswap.load.checkpoint_dir import load_checkpoint_directory, read_checkpoint_directory
    from normswap.load.checkpoint_write import write_checkpoint_directory
    from normswap.load.paths import check_paths
    from normswap.verify.compare import compare_models

    check_paths({"the input model": refuse_path}, {"-o": path})  # never it, nor a folder that holds it
    if args is None and kwargs is None:
        raise BadInputError(
            f"writing {path} loads it back and compares it with the model: give example inputs"
        )

    def verify(written: Path) -> float:
        # What a user will load, compared with what was converted: a directory that reloads into anything
        # else (a tensor not written, a class rebuilt wrong) is not kept.
        reloaded = load_checkpoint_directory(read_checkpoint_directory(written))
        comparison = compare_models(model, reloaded, args, kwargs, floating_only=False)
        if not comparison.within_tolerance:
            worst = max(comparison.outputs, key=lambda o: o.max_rel, default=None)
            what = comparison.nonfinite or (
                "no output was compared" if worst is None else f"{worst.name}: {worst.max_rel:.3g} x max|ref|"
            )
            raise CheckFailedError(
                f"the written directory reloads into another model ({what}); nothing written"
            )
        return comparison.worst_rel

    written = write_checkpoint_directory(model, path, source=source, verify=verify, overwrite=overwrite)
    return SavedOutput(path=path, format="directory", directory=written)
