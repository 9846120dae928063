"""A model sharded over a torchrun job, written as a model directory one tensor at a time: no process
ever holds it whole.

Every process gathers each stored tensor in turn (``DTensor.full_tensor``, a collective: all take part,
in the same order), process 0 writes it into its place in the output's shards and lets it go, so the
most any process holds beyond its shards is one whole tensor. The layout is the one of the directory the
model was read from (the same files, names and dtypes: training changes values, not structure). The
directory is finished as a streamed conversion finishes one (index, config, ``normswap.json`` and the
naming of its weight files, :func:`~normswap.load.checkpoint_write.finish_from_source`), checked against
the model its config describes, its values checked finite, and published atomically; nothing is left on
failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.calibrate.distill_checkpoint import write_shared_folder
from normswap.calibrate.parallel import DataParallel
from normswap.errors import BadInputError, CheckFailedError, describe
from normswap.load.checkpoint_dir import CheckpointDirectory, read_checkpoint_directory
from normswap.load.checkpoint_write import (
    WrittenDirectory,
    copy_side_files,
    finish_from_source,
    stored_headers,
)
from normswap.load.safetensors_io import DTYPES, ShardWriter


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU: gathered from every process for a shard (a collective), else as is."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu()


def save_directory_sharded(
    path: Path, model: nn.Module, source: CheckpointDirectory, parallel: DataParallel, overwrite: bool = False
) -> WrittenDirectory:
    """Write ``model`` (sharded by ``parallel``, read from the directory ``source``) as a model directory at
    ``path``; every process calls it. CheckFailedError for a non-finite value (nothing written)."""
    from normswap.load.paths import check_output

    if not source.stored_as_loaded:
        raise BadInputError(
            f"-o {path}: transformers renames {source.path}'s stored tensors as it loads them, so its "
            "trained model cannot be written into that layout shard by shard: give -o a .dcp folder"
        )
    check_output("-o", path, overwrite=overwrite, directory=True)
    state = model.state_dict()
    headers = stored_headers(source)
    layout = {
        shard: [
            (name, entry.dtype, entry.shape)
            for name, entry in sorted(entries.items(), key=lambda kv: kv[1].start)
            if source.weight_map.get(name) == shard
        ]
        for shard, (entries, _) in headers.items()
    }
    missing = [name for rows in layout.values() for name, _, _ in rows if name not in state]
    if missing:
        raise BadInputError(f"-o {path}: the trained model has no {missing[0]}, which {source.path} stores")
    found: dict[str, Any] = {}

    def write(temp: Path) -> None:
        # Every process takes part in every gather, in the same order, whatever happens on process 0: a
        # failure there (a full disk) is carried to the end of the loop and then told to all, so none
        # waits for a gather that never comes.
        main = parallel.is_main
        failed: str | None = None
        writers: dict[str, ShardWriter] = {}
        if main:
            try:
                writers = {
                    shard: ShardWriter(temp / shard, rows, headers[shard][1] or {"format": "pt"})
                    for shard, rows in layout.items()
                }
            except OSError as exc:
                failed = f"-o {path}: {describe(exc)}"
        non_finite = []
        for shard, rows in layout.items():
            for name, dtype, _ in rows:
                whole = _whole(state[name])  # every process: a collective for a sharded tensor
                if whole.is_floating_point() and not bool(torch.isfinite(whole).all()):
                    non_finite.append(name)  # every process sees the whole tensor: all decide alike
                if main and failed is None:
                    try:
                        writers[shard].write(name, whole.to(DTYPES[dtype]))
                    except (OSError, ValueError) as exc:
                        failed = f"-o {path}: {name}: {describe(exc)}"
                del whole
        if main and failed is None:
            try:
                for writer in writers.values():
                    writer.close()
                if not non_finite:
                    found["refused"] = finish_from_source(
                        source, temp, sorted(layout), config_changes={}, recorded={}
                    )
                    # the model its config describes is what the files hold
                    found["shards"] = list(read_checkpoint_directory(temp).shards)
                    found["copied"] = copy_side_files(source, temp)
            except Exception as exc:  # anything: the others wait for the word below
                failed = f"-o {path}: {describe(exc)}"
        for writer in writers.values():
            writer.abandon()  # closed already where all went well
        failed = parallel.from_main(failed)  # every process stops on process 0's failure, none waits
        if non_finite:
            raise CheckFailedError(
                f"the trained model holds non-finite values ({non_finite[0]}, {len(non_finite)} tensors in "
                "all); nothing written"
            )
        if failed is not None:
            raise BadInputError(failed)

    write_shared_folder(path, parallel, write, overwrite=overwrite)
    if not parallel.is_main:
        return WrittenDirectory(path=path, shards=[], stock=False)
    copied, not_copied = found["copied"]
    return WrittenDirectory(
        path=path,
        shards=found["shards"],
        stock=found["refused"] is None,
        recorded_modules=dict(source.replaced_modules),
        copied_files=copied,
        not_copied=not_copied,
        stock_refused=found["refused"],
    )
