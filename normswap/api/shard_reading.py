"""Models built without their weights, to be read straight into FSDP2 shards under torchrun: a model
directory, a .pt2 or a factory with a weights file, each with the way its rows are read later
(:func:`~normswap.calibrate.parallel_load.load_rows_sharded`), so that no process holds the model whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from normswap.api.sources import load_for_inference
from normswap.errors import BadInputError

if TYPE_CHECKING:
    from normswap.load.model_file import LoadedModel


@dataclasses.dataclass
class UnfilledModel:
    """A model built without its weights (on the meta device) and how each process reads its rows later."""

    loaded: LoadedModel
    fill: Callable[[nn.Module, Any, bool, bool], str]  # (model, parallel, trained, mixed precision)
    stored_bytes: int
    # the module a single-file output is written from, when it is not ``loaded.model`` (a .pt2 trains
    # unflattened and is written as the flat program it is loaded as): the checks before the work use it
    written_as: nn.Module | None = None


def unfilled_model(
    spec: str, weights: str | Path | None, trust_pickle: bool, written: bool = False
) -> UnfilledModel | None:
    """MODEL built on the meta device, to be read straight into its shards under torchrun: a model
    directory (:func:`~normswap.calibrate.parallel_load.load_directory_sharded`) or a .pt2
    (:func:`~normswap.calibrate.parallel_load.load_rows_sharded`), or a factory given --weights
    (:func:`unfilled_factory`). None for what is loaded whole: a .pt or a factory without --weights
    (their weights come from running code), a directory whose tensors transformers renames as it loads
    (rows are read by stored name), a .pt2 of a layout other than torch writes today. ``written``: the
    model is the one an output is written from (``written_as`` is then filled where it differs)."""
    from normswap.calibrate import parallel_load
    from normswap.load.checkpoint_dir import is_checkpoint_directory
    from normswap.load.model_file import LoadedModel, ModelFormat, detect_format
    from normswap.load.program import load_program_on_meta
    from normswap.util.modes import set_inference_mode

    path = Path(spec)
    if weights is not None:
        return unfilled_factory(spec, weights) if ":" in spec and not path.exists() else None
    if is_checkpoint_directory(spec):
        structure = load_for_inference(spec, None, trust_pickle, structure_only=True)
        checkpoint = structure.checkpoint
        assert checkpoint is not None  # a model directory's structure carries its description
        if not checkpoint.stored_as_loaded:
            return None
        return UnfilledModel(
            structure,
            lambda model, parallel, trained, mp: parallel_load.load_directory_sharded(
                model, checkpoint, parallel, trained=trained, mixed_precision=mp
            ),
            checkpoint.total_bytes,
        )
    if not path.is_file() or detect_format(path) is not ModelFormat.EXPORTED_PROGRAM:
        return None
    # unflattened: its blocks are called as modules, so FSDP2 gathers one block at a time (the flat graph
    # would be one unit, gathered whole for every forward and backward)
    read = load_program_on_meta(path, trust_pickle=trust_pickle, unflattened=True)
    if read is None:
        return None
    model, args, kwargs, located = read
    # the flat program a single-file output is written from, read apart: lifting its norms edits what an
    # unflattened module of the same ExportedProgram shares with it (tried: the unflattened teacher then
    # refused a batch of 5 for a program exported at any batch; a deep copy of the program fails on its
    # fake tensors). The second read costs a deserialization, no weight bytes.
    flat = load_program_on_meta(path, trust_pickle=trust_pickle) if written else None
    stored = {name: (located.path, entry) for name, entry in located.entries.items()}
    set_inference_mode(model)
    computed = real_buffers_to_meta(model)  # the archive's constants, read
    return UnfilledModel(
        LoadedModel(model, args, kwargs, source=spec, format="pt2"),
        lambda model, parallel, trained, mp: parallel_load.load_rows_sharded(
            model, stored, computed, str(path), parallel, trained=trained, mixed_precision=mp
        ),
        # a member that tied weights share is counted once
        sum({(e.start, e.end): e.nbytes for e in located.entries.values()}.values()),
        written_as=None if flat is None else flat[0],
    )


def real_buffers_to_meta(model: nn.Module) -> dict[str, Any]:
    """The model's buffers that hold values (computed when it was built), cloned, and the model holding
    them on the meta device instead, so that the checks before training run on one device; they are put
    back once the model is filled."""
    computed = {name: buffer.detach().clone() for name, buffer in model.named_buffers() if not buffer.is_meta}
    for name in computed:
        owner, _, attribute = name.rpartition(".")
        buffers = model.get_submodule(owner)._buffers
        buffers[attribute] = buffers[attribute].to("meta")  # type: ignore[union-attr]
    return computed


def unfilled_factory(spec: str, weights: str | Path) -> UnfilledModel | None:
    """A factory's model with its parameters on the meta device (buffers built as the factory builds
    them), filled later from the --weights file by rows; None for a weights file that can only be read
    whole, or a factory that cannot build this way (then it is loaded whole, with load_weights' checks).
    The file must cover the model's persistent tensors exactly, as load_weights requires."""
    from normswap.calibrate import parallel_load
    from normswap.load.factory import load_factory_without_weights
    from normswap.load.model_file import LoadedModel, weights_by_rows
    from normswap.util.modes import set_inference_mode

    stored = weights_by_rows(weights)
    if stored is None:
        return None
    try:
        model, args, kwargs = load_factory_without_weights(spec)
    except BadInputError:  # its code needs real parameters while it builds: loaded whole
        return None
    state = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(state.keys() - stored.keys()), sorted(stored.keys() - state.keys())
    if missing or unexpected:
        raise BadInputError(
            f"weights file {weights} does not match the model: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]}"
        )
    # persistent buffers (running statistics) come from the file with the parameters; a buffer the
    # factory computed from a parameter is on the meta device and in no file: nothing could fill it
    stored_buffers = {name for name, _ in model.named_buffers() if name in stored}
    if any(b.is_meta and name not in stored_buffers for name, b in model.named_buffers()):
        return None
    set_inference_mode(model)
    computed = {k: v for k, v in real_buffers_to_meta(model).items() if k not in stored_buffers}
    size = sum(v[1].nbytes if isinstance(v, tuple) else v.nbytes for v in stored.values())
    return UnfilledModel(
        LoadedModel(model, args, kwargs, source=spec, format="factory"),
        lambda model, parallel, trained, mp: parallel_load.load_rows_sharded(
            model, stored, computed, str(weights), parallel, trained=trained, mixed_precision=mp
        ),
        size,
    )
