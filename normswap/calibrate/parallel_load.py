"""A model read straight into FSDP2 shards: no process ever holds the whole model.

Why: under torchrun every process would otherwise load the model whole and shard it afterwards, so each
process's peak memory is the whole model however many processes share it. Here the model is built
without its weights (on the meta device: a model directory from its config, a .pt2 from its program, a
factory with its parameters moved to meta as they are registered), sharded there (``fully_shard`` per
block, then the root), given memory for its shards only (``to_empty``), and each process reads exactly
the rows of each weight that its shard holds (FSDP2 shards dim 0, ``torch.chunk``-wise): from a
safetensors file's or a .pt2 member's byte range, or from a memory-mapped ``torch.save`` archive.

Buffers that the model computes when it is built and does not store (rotary frequencies) are kept from a
real build: for a model directory a second build on the CPU whose weights are allocated but never
initialized nor read, so their memory is never touched; a .pt2 stores them as constants, a factory builds
them. As when a model is loaded whole, the files must cover the model exactly: a missing, unexpected or
wrongly shaped tensor is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from normswap.calibrate.parallel import DataParallel
from normswap.errors import BadInputError
from normswap.util.finite import refuse_nonfinite_tensor


def _computed_buffers(checkpoint: Any) -> dict[str, torch.Tensor]:
    """The non-persistent buffers (computed when the model is built, never stored), by name."""
    from normswap.load.checkpoint_dir import build_to_load
    from normswap.load.recorded import replace_recorded

    model = build_to_load(checkpoint)
    if checkpoint.replaced_modules:
        replace_recorded(model, checkpoint, device="cpu")
    found = {}
    for path, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None:
                found[f"{path}.{name}" if path else name] = buffer.detach().clone()
    return found


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """The state-dict names of each distinct tensor (a tied weight has several)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _check_covered(model: nn.Module, checkpoint: Any, stored: set[str]) -> None:
    # state_dict holds persistent tensors only (computed buffers are not in it): each must be stored,
    # under one of its tied names
    groups = _tied_groups(model)
    missing = [g[0] for g in groups if not any(n in stored for n in g)]
    names = {n for g in groups for n in g}
    unexpected = sorted(stored - names)
    if missing or unexpected:
        raise BadInputError(
            f"{checkpoint.path}: the weights do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def _rows(source: Any, start: int, stop: int | None) -> torch.Tensor:
    """Rows ``start:stop`` of a stored tensor (all of it when ``stop`` is None): ``source`` is a (file,
    byte range) pair, read from its range only, or a memory-mapped tensor, of which only the rows' pages
    are read."""
    from normswap.load.safetensors_io import read_rows, read_tensor

    if isinstance(source, torch.Tensor):
        return source if stop is None or not source.ndim else source[start:stop]
    path, entry = source
    return (
        read_tensor(path, entry) if stop is None or not entry.shape else read_rows(path, entry, start, stop)
    )


def _fill(target: torch.Tensor, name: str, source: Any, where: str, device: torch.device) -> None:
    """This process's part of one stored tensor (``source``, see :func:`_rows`), read into ``target`` (a
    DTensor's shard, or whole)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(source.shape) if isinstance(source, torch.Tensor) else source[1].shape
    if tuple(target.shape) != shape:
        raise BadInputError(f"{where}: {name} has shape {list(shape)}, the model {list(target.shape)}")
    buffer = not isinstance(target, nn.Parameter)  # the NaN/Inf rule of normswap.util.finite
    with torch.no_grad():
        if isinstance(target, DTensor):
            local = target.to_local()
            local_shape, offset = compute_local_shape_and_global_offset(
                target.shape, target.device_mesh, target.placements
            )
            if local.numel():
                rows = _rows(source, offset[0], offset[0] + local_shape[0])
                refuse_nonfinite_tensor(name, rows, buffer=buffer, first_row=int(offset[0]))
                local.copy_(rows.reshape(local.shape).to(device))
        else:
            whole = _rows(source, 0, None)
            refuse_nonfinite_tensor(name, whole, buffer=buffer)
            target.copy_(whole.to(device))


def load_directory_sharded(
    model: nn.Module, checkpoint: Any, parallel: DataParallel, trained: bool, mixed_precision: bool = False
) -> str:
    """Shard ``model`` (the directory's model built on the meta device, recorded modules in place) and
    fill each process's shards from the directory's files; returns what was sharded, for the report."""
    from normswap.load.checkpoint_dir import quiet_transformers, stored_entries

    if hasattr(model, "tie_weights"):
        with quiet_transformers():
            model.tie_weights()  # as the whole-model build does: a tied head is the embedding, stored once
    computed = _computed_buffers(checkpoint)
    _check_covered(model, checkpoint, set(checkpoint.weight_map))
    stored = {name: (shard_path, entry) for name, shard_path, entry in stored_entries(checkpoint)}
    return load_rows_sharded(
        model, stored, computed, str(checkpoint.path), parallel, trained, mixed_precision
    )


def load_rows_sharded(
    model: nn.Module,
    stored: dict[str, Any],
    computed: dict[str, torch.Tensor],
    source: str,
    parallel: DataParallel,
    trained: bool,
    mixed_precision: bool = False,
) -> str:
    """Shard ``model`` (its stored tensors on the meta device) and fill each process's shards from
    ``stored`` (by state-dict name, see :func:`_rows`: a .pt2's members, :func:`~normswap.load.program.
    load_program_on_meta`, or a factory's weights file, :func:`~normswap.load.model_file.weights_by_rows`)
    and the buffers that hold values outside those files from ``computed``; returns what was sharded,
    for the report."""
    placement = parallel.shard(model, trained=trained, mixed_precision=mixed_precision)
    model.to_empty(device=parallel.device)  # memory for its shards only
    targets = model.state_dict(keep_vars=True)
    failed: Exception | None = None
    for name, stored_tensor in stored.items():
        if name in targets and failed is None:
            try:
                _fill(targets[name], name, stored_tensor, source, parallel.device)
            except Exception as exc:  # each process reads its own rows: stop reading, then agree
                failed = exc
    # Every process must hear of a failure one of them met (a NaN in its rows, a truncated shard), or
    # the others would wait in the next collective; and with its reason, since torchrun stops the others
    # as soon as one exits, and the one whose output the user reads may not be the one that found it.
    reported = [
        f for f in parallel.gather(failed and _portable(failed, parallel.rank, source)) if f is not None
    ]
    if reported:
        raise failed or reported[0]
    with torch.no_grad():
        for name, value in computed.items():
            model.get_buffer(name).copy_(value.to(parallel.device))
    return f"{placement}, read shard by shard from {source}"


def _portable(exc: Exception, rank: int, source: str) -> Exception:
    """``exc`` as an exception another process can unpickle with its reason: normswap's own errors as
    they are (their exit code follows); a failed read (a truncated shard, a file error) as the input's
    fault, naming the process that met it."""
    from normswap.errors import NormswapError, describe

    if isinstance(exc, NormswapError) and type(exc).__module__ == "normswap.errors":
        return exc
    return BadInputError(f"process {rank} could not read its part of {source}: {describe(exc)}")
