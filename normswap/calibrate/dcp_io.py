"""What torch.distributed.checkpoint (DCP) reads and writes for normswap, screened: DCP pickles every
non-tensor value it saves and reads a checkpoint's ``.metadata`` and those values back with plain
``pickle``, which runs whatever a pickle names. normswap gives DCP tensors only, and
:func:`screened_metadata` is the one reader of a checkpoint's structure: a restricted unpickler for
``.metadata``, data files that are plain files of the checkpoint folder, tensors only. DCP is then handed
that screened metadata, never the file again. DCP's failures come out as one line naming the folder."""

from __future__ import annotations

import contextlib
import os
import pickle
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from normswap.calibrate.parallel import DataParallel
from normswap.errors import BadInputError


@contextlib.contextmanager
def _one_process_quietly(parallel: DataParallel | None) -> Iterator[None]:
    # DCP warns that it "assumes the intent" of one process even when told so with no_dist.
    with warnings.catch_warnings():
        if parallel is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _dcp_failure(exc: BaseException) -> BaseException:
    """The first error DCP wrapped in its CheckpointException (which derives from BaseException)."""
    for failure in getattr(exc, "failures", {}).values():
        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
            return failure[0]
    return exc


@contextlib.contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """DCP's failures as one line naming ``what``: its CheckpointException is caught by type (it is a
    BaseException, but not a KeyboardInterrupt or SystemExit, which go through)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except BadInputError:
        raise
    except (Exception, CheckpointException) as exc:
        cause = _dcp_failure(exc)
        if isinstance(cause, BadInputError):  # raised by normswap's own reader inside DCP
            raise cause from None
        text = next((line for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
        raise BadInputError(f"{what}: {text}") from None


def dcp_save(state: dict[str, Any], folder: Path, parallel: DataParallel | None) -> None:
    import torch.distributed.checkpoint as dcp

    with _one_process_quietly(parallel), _dcp_errors(f"cannot write {folder}"):
        dcp.save(state, checkpoint_id=str(folder), no_dist=parallel is None)


# What DCP's ``.metadata`` pickle may name (found by loading what DCP writes): its own metadata classes,
# the file system reader's storage record, torch sizes, dtypes and layouts, and paths. DCP reads that file
# with plain ``pickle.load``, which runs whatever a pickle names: a checkpoint folder from elsewhere is
# checked with this list first, as normswap checks every other file it is given.
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import importlib

        # nothing is imported for a name outside the list: an import runs the module's code
        known = module in (_DCP_METADATA_MODULE, "torch") or (module, name) in _DCP_ALLOWED
        found = getattr(importlib.import_module(module), name, None) if known else None
        own_class = module == _DCP_METADATA_MODULE and isinstance(found, type) and found.__module__ == module
        dtype = module == "torch" and isinstance(found, torch.dtype)
        if found is None or not (own_class or dtype or (module, name) in _DCP_ALLOWED):
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which a checkpoint's metadata does not hold"
            )
        return found


def _refuse(file: Path, reason: str) -> BadInputError:
    return BadInputError(f"--resume: {file} is refused: {reason}")


def _plain_file_in(folder: Path, name: object, file: Path) -> None:
    """``name`` (from ``file``) must be a plain file name of ``folder``, and that file a regular file."""
    # a name, not a path: no separator of either kind, no '..', nothing absolute
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or os.path.basename(name) != name
        or "\\" in name
        or os.path.isabs(name)
    ):
        raise _refuse(file, f"its storage file {name!r} is not a file name inside the folder")
    try:
        mode = os.lstat(folder / name).st_mode
    except OSError as exc:
        raise _refuse(file, f"its storage file {name!r} cannot be read: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise _refuse(file, f"its storage file {name!r} is a symlink (never followed out of the folder)")
    if not stat.S_ISREG(mode):
        raise _refuse(file, f"its storage file {name!r} is not a regular file")


def screened_metadata(folder: Path) -> Any:
    """The checkpoint's DCP metadata, read the one way normswap reads it: ``.metadata`` itself a regular
    file, unpickled by the restricted unpickler above; every data file it names a plain file of ``folder``
    (no path, no '..', no symlink), with no storage transform; and every item a tensor. A non-tensor item
    is what DCP would unpickle without restriction (``torch.load(weights_only=False)``), and normswap
    writes none: refused, whatever its bytes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    file = folder / ".metadata"
    try:
        if stat.S_ISLNK(os.lstat(file).st_mode):
            raise _refuse(file, "it is a symlink")
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise _refuse(file, str(exc)) from None
    items = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(items, dict) or not isinstance(storage, dict):
        raise _refuse(file, "it is not DCP's metadata of a checkpoint")
    for info in storage.values():
        if not isinstance(info, _StorageInfo):
            raise _refuse(file, f"its storage record is a {type(info).__name__}")
        _plain_file_in(folder, info.relative_path, file)
        if info.transform_descriptors:
            raise _refuse(file, f"its storage file {info.relative_path!r} is stored through a transform")
    for key, item in items.items():
        if not isinstance(item, TensorStorageMetadata):
            raise _refuse(
                file,
                f"it declares {key!s:.120} as a pickled object, which DCP would unpickle: a normswap "
                "checkpoint holds tensors only",
            )
    return metadata


def dcp_load(state: dict[str, Any], folder: Path, parallel: DataParallel | None) -> None:
    """DCP reads ``folder``'s tensors into ``state`` (tensors only), given the screened metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = screened_metadata(folder)

    class ScreenedReader(FileSystemReader):
        # DCP's own read_metadata is a plain pickle.load of the file: it gets the screened copy instead,
        # so a file changed after the screening is never read as metadata.
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:  # never reached: screened above
            raise _refuse(folder / ".metadata", f"it declares {read_item.dest_index.fqn} as a pickled object")

    reader = ScreenedReader(str(folder))
    with (
        _one_process_quietly(parallel),
        _dcp_errors(f"--resume: {folder} cannot be loaded into the converted model"),
    ):
        dcp.load(state, storage_reader=reader, planner=TensorsOnly(), no_dist=parallel is None)
