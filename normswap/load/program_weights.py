"""A torch.export archive (.pt2) read without its weights: the program rebuilt on the meta device, and
where in the archive each weight's bytes lie, so that a process can later read exactly its rows.

Why: under torchrun every process would otherwise read the whole archive (``torch.export.load`` reads
every weight member into memory) before FSDP2 shards the model, so each process's peak memory is the
whole student however many processes share it. A .pt2 archive is a zip whose members torch writes
uncompressed; each weight is a member (``data/weights/weight_N``) described in
``data/weights/model_weights_config.json`` by dtype, size, stride and storage offset. The program is
deserialized here exactly as torch's loader does it (:func:`torch.export.load`, in
``torch.export.pt2_archive._package``) but with meta tensors of those layouts in place of the bytes; the
small constants (computed buffers, lifted tensor constants) are read for real.

Only the layout torch writes today is read this way: one program named "model", no pickled weight, every
weight a contiguous run of a member stored once and uncompressed. Anything else, including an archive
this reader fails on (an older layout torch still reads), is loaded whole by the caller.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from normswap.load.safetensors_io import NAMES, TensorEntry


@dataclass(frozen=True)
class ProgramWeights:
    """Where each weight of a program lies: by the program's state-dict name, the (file, byte range)."""

    path: Path
    entries: dict[str, TensorEntry]


class NotReadable(Exception):
    """The archive's layout is not the one read here; the caller loads it whole (never shown to users)."""


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a tensor of this layout is one run of its storage in row-major order (a size-1 dimension's
    stride does not matter)."""
    step = 1
    for size, given in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and given != step:
            return False
        step *= size
    return True


def _check_stored_plainly(path: Path, records: set[str]) -> None:
    """Each weight member is stored once and as is (not compressed): its bytes in the file are the
    tensor's. torch never compresses them, but another writer of the format may, and a compressed member
    read by range would be garbage, not an error; a name stored twice could be resolved by torch's reader
    to another entry than the one checked here (:mod:`normswap.load.archive` says why)."""
    seen: dict[str, int] = {}
    compressed = set()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name = info.filename.split("/", 1)[-1]
            seen[name] = seen.get(name, 0) + 1
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                compressed.add(name)
    unreadable = sorted(r for r in records if seen.get(r) != 1 or r in compressed)
    if unreadable:
        raise NotReadable(f"weight members stored twice, compressed or missing: {unreadable[:3]}")


def read_program_on_meta(
    file: IO[bytes], path: Path
) -> tuple[torch.export.ExportedProgram, ProgramWeights, dict[str, Any]]:
    """The program of the open archive ``file`` with its weights on the meta device, where each weight
    lies in the file, and the meta tensors by name (the objects the program's module will hold). Raises :class:`NotReadable` for a layout other than torch's current one."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import (
        ExportedProgramDeserializer,
        _bytes_to_dataclass,
        deserialize_scalar_type,
        deserialize_size,
        deserialize_storage_offset,
        deserialize_stride,
    )
    from torch.export.pt2_archive import _package as package
    from torch.export.pt2_archive import constants as names

    reader = package.PT2ArchiveReader(file)
    if reader.read_string(names.ARCHIVE_VERSION_PATH) != names.ARCHIVE_VERSION_VALUE:
        raise NotReadable("archive version")
    programs = [f for f in reader.get_file_names() if f.startswith(names.MODELS_DIR)]
    config_name = names.WEIGHTS_CONFIG_FILENAME_FORMAT.format("model")
    if (
        programs != [names.MODELS_FILENAME_FORMAT.format("model")]
        or config_name not in reader.get_file_names()
    ):
        raise NotReadable("not one program named model with a weights config")
    archive = reader.archive_file
    config = package._load_payload_config(reader, config_name)
    flat: dict[str, torch.Tensor] = {}  # one meta tensor per member: tied weights stay views of one base
    state: dict[str, Any] = {}
    entries: dict[str, TensorEntry] = {}
    for name, payload in config.config.items():
        meta = payload.tensor_meta
        if payload.use_pickle or meta is None:
            raise NotReadable("a pickled weight")
        dtype = deserialize_scalar_type(meta.dtype)
        shape = tuple(deserialize_size(meta.sizes))
        stride, offset = (
            tuple(deserialize_stride(meta.strides)),
            deserialize_storage_offset(meta.storage_offset),
        )
        record = os.path.join(names.WEIGHTS_DIR, payload.path_name)
        size, element = archive.get_record_size(record), torch._utils._element_size(dtype)
        if dtype not in NAMES or size % element or not _is_contiguous(shape, stride):
            raise NotReadable(f"{name}: a layout read whole")
        count = 1
        for dim in shape:
            count *= dim
        if (offset + count) * element > size:
            raise NotReadable(f"{name} lies past its member")
        if payload.path_name not in flat:
            flat[payload.path_name] = torch.empty(size // element, dtype=dtype, device="meta")
        tensor = torch.as_strided(flat[payload.path_name], shape, stride, offset)
        state[name] = (
            torch.nn.Parameter(tensor, requires_grad=meta.requires_grad) if payload.is_param else tensor
        )
        start = archive.get_record_offset(record) + offset * element
        entries[name] = TensorEntry(NAMES[dtype], shape, start, start + count * element)
    _check_stored_plainly(
        path, {os.path.join(names.WEIGHTS_DIR, p.path_name) for p in config.config.values()}
    )
    constants = package._load_constants(reader, "model")
    serialized = _bytes_to_dataclass(schema.ExportedProgram, reader.read_bytes(programs[0]))
    samples = reader.read_bytes(names.SAMPLE_INPUTS_FILENAME_FORMAT.format("model"))
    program = ExportedProgramDeserializer(None).deserialize(serialized, state, constants, samples)
    return program, ProgramWeights(path, entries), state


def weights_of_module(
    module: torch.nn.Module, program_state: dict[str, Any], stored: ProgramWeights
) -> ProgramWeights | None:
    """``stored`` keyed by ``module``'s own state-dict names, or None when a tensor of the module is not
    one of the program's stored weights (then nothing can be read into it). A tensor is the program's
    own object (the flat graph module holds them, under names the norm lifting may change), or, in
    ``torch.export.unflatten``'s module, which wraps them anew, one of the same name, shape and dtype."""
    by_identity = {id(tensor): name for name, tensor in program_state.items()}
    entries = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_meta:
            continue  # a constant the archive stored and the loader read
        source = by_identity.get(id(tensor))
        if source is None and name in program_state:
            same = program_state[name]
            source = name if (same.shape, same.dtype) == (tensor.shape, tensor.dtype) else None
        if source is None or source not in stored.entries:
            return None
        entries[name] = stored.entries[source]
    return ProgramWeights(stored.path, entries)
