"""safetensors files read and written one tensor at a time, for checkpoints larger than memory.

The format is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape, byte
range of the data; ``__metadata__``), and the tensors' bytes back to back. Because edits keep every
tensor's dtype and shape, an output shard's header is known before any tensor is computed: the writer
lays the file out first, then fills each tensor's range when it is ready, in any order. An untouched
tensor is copied as bytes from its input range (byte for byte, never decoded); an edited one is written
from its tensor. Memory is one tensor (or one copy buffer), never a shard.

Headers of input files are untrusted: sizes, dtypes and ranges are checked against the file before any
byte is read through them.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from normswap.errors import BadInputError
from normswap.load.json_io import parse_json
from normswap.util.finite import first_nonfinite, refuse_nonfinite_tensor

_MAX_HEADER = 100 * 1024 * 1024
_COPY_CHUNK = 64 * 1024 * 1024
_CHECKED_CHUNK = 16 * 1024 * 1024  # floating tensors are copied through memory, checked for NaN/Inf

# safetensors dtype names <-> torch dtypes (the ones a checkpoint of normswap's models holds)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file: dtype name, shape, and its absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def read_header(path: str | Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors of a safetensors file (name -> :class:`TensorEntry`, absolute ranges) and its metadata,
    from its header alone; BadInputError for a header that does not describe this file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise BadInputError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise BadInputError(
                f"{path} is not a safetensors file (header length {length} of a {size}-byte file)"
            )
        header = parse_json(handle.read(length), str(path), "safetensors file header")
    if not isinstance(header, dict):
        raise BadInputError(f"{path} is not a safetensors file (its header is not an object)")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if isinstance(dtype, str) and dtype not in DTYPES:
            # the one dtype table: a tensor in another (F8_E4M3, a quantized format) is named, not misread
            raise BadInputError(
                f"{path}: {name!r:.80} is stored as {dtype:.20}, a dtype normswap does not read "
                f"({', '.join(DTYPES)})"
            )
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = dtype in DTYPES and all(type(d) is int and d >= 0 for d in shape)
            ok = ok and type(start) is int and type(end) is int and 0 <= start <= end <= size - base
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise BadInputError(
                f"{path}: the header's entry for {name!r:.80} does not describe a tensor in the file"
            )
        count = 1
        for d in shape:
            count *= d
        if end - start != count * _element_size(dtype):
            raise BadInputError(f"{path}: {name} has {end - start} bytes for shape {list(shape)} of {dtype}")
        entries[name] = TensorEntry(dtype, shape, base + start, base + end)
    return entries, {str(k): str(v) for k, v in metadata.items()}


def read_tensor(path: str | Path, entry: TensorEntry, out: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor of a file, read from its byte range (nothing else of the file) straight into the memory
    of a fresh CPU tensor, or of ``out`` (contiguous, on the CPU, of the entry's dtype and shape): one
    copy from the page cache, no intermediate buffer."""
    dtype = DTYPES[entry.dtype]
    if out is None:
        out = torch.empty(entry.shape, dtype=dtype)
    elif out.dtype != dtype or tuple(out.shape) != entry.shape or not out.is_contiguous() or out.is_meta:
        raise ValueError(
            f"cannot read {entry.dtype} {list(entry.shape)} into {out.dtype} {list(out.shape)}"
            f"{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    if entry.nbytes == 0:
        return out
    view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    with open(path, "rb", buffering=0) as handle:
        handle.seek(entry.start)
        while done < entry.nbytes:
            count = handle.readinto(view[done:])
            if not count:
                raise BadInputError(f"{path} ends inside a tensor")
            done += count
    return out


def read_model_tensor(
    path: str | Path, name: str, entry: TensorEntry, out: torch.Tensor | None = None, *, buffer: bool = True
) -> torch.Tensor:
    """:func:`read_tensor` for a model's stored tensor ``name``, refused as the model broken when it holds
    NaN, or Inf where it is not a ``buffer`` (:mod:`normswap.util.finite`), on every route that reads it,
    as the byte copies of :meth:`ShardWriter.copy_bytes` refuse it. A reader that does not know which
    stored names are parameters holds every tensor to the buffer rule."""
    tensor = read_tensor(path, entry, out=out)
    refuse_nonfinite_tensor(name, tensor, buffer=buffer)
    return tensor


def fill_tensor(
    path: str | Path,
    name: str,
    entry: TensorEntry,
    target: torch.Tensor,
    *,
    checked: bool | str | None = True,
) -> torch.Tensor:
    """Load one stored tensor into ``target`` (a model's parameter or buffer) and return it: read
    straight into its memory when its layout allows, else read and copied (cast) in; BadInputError for
    a shape that differs from the stored one, BrokenModelError for NaN/Inf (``checked``: a model the
    user gave, or what the refusal calls it; a directory normswap wrote is judged by the comparison that
    reads it, not refused)."""
    if tuple(target.shape) != entry.shape:
        raise BadInputError(f"{path}: {name} has shape {list(entry.shape)}, the model {list(target.shape)}")
    with torch.no_grad():
        direct = target.is_contiguous() and target.dtype == DTYPES[entry.dtype]
        value = read_tensor(path, entry, out=target if direct else None)
        if checked:
            model = checked if isinstance(checked, str) else "the model"
            refuse_nonfinite_tensor(name, value, model, buffer=not isinstance(target, torch.nn.Parameter))
        return value if direct else target.copy_(value)


def read_rows(path: str | Path, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of dim 0 of one stored tensor, read from their byte range only (a process's
    shard of a weight: nothing else of the tensor is read)."""
    if not 0 <= start <= stop <= (entry.shape[0] if entry.shape else 0):
        raise ValueError(f"rows {start}:{stop} of a tensor of shape {list(entry.shape)}")
    row = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    part = TensorEntry(
        entry.dtype, (stop - start, *entry.shape[1:]), entry.start + start * row, entry.start + stop * row
    )
    return read_tensor(path, part)


class ShardWriter:
    """A safetensors file laid out in advance: ``layout`` lists (name, dtype name, shape) in file order.

    :meth:`write` and :meth:`copy_bytes` fill one tensor's range each, in any order; :meth:`close`
    refuses a file with a range never filled (a check that every tensor was written, not a guess)."""

    def __init__(
        self,
        path: Path,
        layout: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str],
        parameters: frozenset[str] = frozenset(),
    ) -> None:
        """``parameters``: the stored names that are the model's parameters, held to the parameter rule of
        :mod:`normswap.util.finite` as they are copied (the others to the buffer rule)."""
        self.parameters = parameters
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        self.entries: dict[str, TensorEntry] = {}
        for name, dtype, shape in layout:
            count = 1
            for d in shape:
                count *= d
            nbytes = count * _element_size(dtype)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.entries[name] = TensorEntry(dtype, tuple(shape), offset, offset + nbytes)
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.base = 8 + len(text)
        self.path = path
        self.pending = set(self.entries)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        os.pwrite(self._fd, struct.pack("<Q", len(text)) + text, 0)
        os.ftruncate(self._fd, self.base + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.entries[name]
        if tensor.dtype != DTYPES[entry.dtype] or tuple(tensor.shape) != entry.shape:
            raise ValueError(
                f"{name}: the layout says {entry.dtype} {list(entry.shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        data = memoryview(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(data):  # pwrite may write less than asked (a signal, a large count)
            done += os.pwrite(self._fd, data[done:], self.base + entry.start + done)
        self.pending.discard(name)

    def copy_bytes(self, name: str, source: Path, entry: TensorEntry) -> None:
        """Copy a tensor's bytes from ``source`` (its range ``entry``), chunk by chunk."""
        target = self.entries[name]
        if (entry.dtype, entry.shape) != (target.dtype, target.shape):
            raise ValueError(
                f"{name}: the layout says {target.dtype} {list(target.shape)}, the source has another"
            )
        dtype = DTYPES.get(entry.dtype)
        floating = dtype is not None and dtype.is_floating_point
        with open(source, "rb") as handle:
            done = 0
            while done < entry.nbytes:
                count = min(_COPY_CHUNK, entry.nbytes - done)
                if floating:  # through memory, so a NaN/Inf is refused, never copied into a model
                    moved = self._copy_finite(handle, name, source, entry, done, count)
                else:
                    moved = self._copy_range(
                        handle, entry.start + done, self.base + target.start + done, count
                    )
                if not moved:
                    raise BadInputError(f"{source} ends inside {name}")
                done += moved
        self.pending.discard(name)

    def _copy_finite(
        self, handle: Any, name: str, source: Path, entry: TensorEntry, done: int, count: int
    ) -> int:
        """Copy up to ``count`` bytes of a floating tensor from offset ``done`` through this process,
        refusing the model (:mod:`normswap.util.finite`) when they hold NaN or Inf; the sentence is the
        whole tensor's. At most ``_CHECKED_CHUNK`` bytes at a time (a multiple of every element size),
        read into one buffer, checked in one pass and written from it."""
        count = min(count, _CHECKED_CHUNK)
        buffer = bytearray(count)
        handle.seek(entry.start + done)
        moved = 0
        while moved < count:  # a read may return less than asked; only the file's end stops it
            got = handle.readinto(memoryview(buffer)[moved:])
            if not got:
                break
            moved += got
        whole = moved // _element_size(entry.dtype)  # a file ending inside an element: refused by the caller
        values = torch.frombuffer(buffer, dtype=DTYPES[entry.dtype], count=whole) if whole else None
        buffer_rule = name not in self.parameters
        # the whole tensor is read again only to word a refusal (a mask's legitimate -Inf reads nothing)
        if values is not None and first_nonfinite(values, nan_only=buffer_rule) is not None:
            refuse_nonfinite_tensor(name, read_tensor(source, entry), buffer=buffer_rule)
        view, target, written = memoryview(buffer)[:moved], self.base + self.entries[name].start + done, 0
        while written < moved:  # pwrite may write less than asked
            written += os.pwrite(self._fd, view[written:], target + written)
        return moved

    def _copy_range(self, handle: Any, source_offset: int, target_offset: int, count: int) -> int:
        """Copy up to ``count`` bytes between the files; the kernel copies them where it can
        (``copy_file_range``: no trip through this process's memory), else a read and a write."""
        if hasattr(os, "copy_file_range"):
            try:
                return os.copy_file_range(handle.fileno(), self._fd, count, source_offset, target_offset)
            except OSError:  # another file system, or a kernel without it: copy through memory
                pass
        handle.seek(source_offset)
        chunk = handle.read(count)
        os.pwrite(self._fd, chunk, target_offset)
        return len(chunk)

    def close(self) -> None:
        """Flush the file to disk and close it; RuntimeError when a tensor's range was never filled."""
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        if self.pending:
            raise RuntimeError(
                f"{self.path.name}: {len(self.pending)} tensors never written (e.g. {min(self.pending)})"
            )

    def abandon(self) -> None:
        """Close the file without a check (the caller removes it): after a failure, or more than once."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def shard_writers(
    folder: Path,
    layout: Mapping[str, list[tuple[str, str, tuple[int, ...]]]],
    metadata: Mapping[str, dict[str, str]],
    parameters: frozenset[str] = frozenset(),
) -> Iterator[dict[str, ShardWriter]]:
    """A :class:`ShardWriter` for each shard of ``layout`` (file name -> rows) in ``folder``, with that
    shard's ``metadata`` (``format: pt`` where it has none): each closed, and so checked complete, when the
    block ends; all abandoned when it raises (the caller removes the folder)."""
    writers: dict[str, ShardWriter] = {}
    try:
        for shard, rows in layout.items():
            writers[shard] = ShardWriter(
                folder / shard, rows, dict(metadata.get(shard) or {"format": "pt"}), parameters
            )
        yield writers
        for writer in writers.values():
            writer.close()
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise


def stored_dtype(config: Any, where: str | Path = "config.json") -> torch.dtype | None:
    """The floating dtype a config says its weights are stored in (None: transformers' default);
    BadInputError for one outside normswap's dtype table (float8: a quantized format)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return None
    if dtype not in DTYPES.values():
        known = ", ".join(str(d).removeprefix("torch.") for d in DTYPES.values() if d.is_floating_point)
        raise BadInputError(
            f"{where}: dtype {str(dtype).removeprefix('torch.')} is not one normswap rewrites ({known})"
        )
    return dtype
