"""Write a rewritten model so that a failed command leaves nothing behind and never touches its input.

Every output goes to a temp file (or folder) next to the destination and takes its name only once
complete; a rename within one directory is atomic, so readers see the old output or the new one, never
half. Without ``overwrite`` nothing is renamed over an existing path (:func:`place`); the output rule
itself (refused before the work) is :func:`normswap.load.paths.check_output`.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import importlib.util
import os
import pickle
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from normswap.errors import BadInputError, OutputExistsError, describe, failed_write, write_error
from normswap.load.file_modes import apply_output_modes
from normswap.load.paths import ONNX_DATA_SUFFIX, check_output, check_paths
from normswap.load.pt2_file import captured_pt2_problem, pt2_refusal, write_pt2
from normswap.util.dtypes import floating_dtype, onnx_check_problem

if TYPE_CHECKING:
    from normswap.graph.capture import CapturedGraph

# Output suffix -> short label of what gets written there.
SAVE_FORMATS: dict[str, str] = {".pt2": "pt2", ".pt": "pickle", ".pth": "pickle", ".onnx": "onnx"}


# Temp files are named ``.{name}.normswap-tmp-{host}-{pid}-{token}{suffix}``: a run killed mid-write
# (SIGKILL, OOM killer) leaves one behind, and the next write of the same destination on the same host
# removes it once its pid is gone. The ONNX writer may add ``.data`` beside its file.
_TEMP_MARK = ".normswap-tmp-"
_TOKEN = re.compile(r"[0-9a-f]{8}")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:32] or "host"


def _temp_stem(path: Path) -> str:
    """``.{name}.normswap-tmp-`` for ``path``, with a long name shortened so the temp name stays valid."""
    name = path.name
    if len(name.encode()) > 120:  # file names are limited to 255 bytes
        digest = hashlib.sha1(name.encode()).hexdigest()[:12]
        name = name.encode()[:100].decode(errors="ignore") + "~" + digest
    return f".{name}{_TEMP_MARK}"


def _temp_path(path: Path, host: str, pid: int, token: str) -> Path:
    return path.with_name(f"{_temp_stem(path)}{host}-{pid}-{token}{path.suffix}")


def _pid_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive under another user (EPERM), or not ours to ask about
        return False
    return False


def remove_stale_temps(path: Path, directory: bool = False) -> None:
    """Remove what killed earlier runs on this host left for ``path``: temp files, or folders when
    ``directory`` (every temp and spill folder normswap makes is named by :func:`_temp_path`)."""
    if os.name != "posix":  # os.kill(pid, 0) probes a process only on POSIX
        return
    stem, host = _temp_stem(path), _host()
    endings = (path.suffix, path.suffix + ".data") if path.suffix.lower() == ".onnx" else (path.suffix,)
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(stem):
            continue
        rest = name[len(stem) :]
        ending = next((e for e in endings[::-1] if rest.endswith(e)), None)
        if ending is None:
            continue
        fields = rest[: len(rest) - len(ending)].rsplit("-", 2)
        if (
            len(fields) != 3
            or fields[0] != host
            or not fields[1].isdigit()
            or not _TOKEN.fullmatch(fields[2])
        ):
            continue
        pid = int(fields[1])
        if pid == os.getpid() or not _pid_is_gone(pid):
            continue
        candidate = path.parent / name
        try:
            mode = os.lstat(candidate).st_mode
            if directory and stat.S_ISDIR(mode):
                shutil.rmtree(candidate)
            elif not directory and stat.S_ISREG(mode):
                candidate.unlink()
        except OSError:  # gone already, or a read-only directory: nothing to clean
            pass


def _reserve_temp_path(path: Path) -> Path:
    # The temp file keeps the final suffix: torch.export.save and ONNX writers act on it. Created with
    # O_EXCL and mode 0o666 so the umask applies, as it would to a file written directly.
    host, pid = _host(), os.getpid()
    for _ in range(100):
        candidate = _temp_path(path, host, pid, secrets.token_hex(4))
        try:
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return candidate
    raise BadInputError(f"cannot create a temporary file next to {path}")


# renameat2(2) flags (Linux): a rename that fails instead of replacing, and one that swaps two names.
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(source: Path, target: Path, flags: int) -> bool:
    """renameat2 with ``flags``; False where the system or file system has no such call (then the
    caller falls back to plain renames)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    done = call(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), ctypes.c_uint(flags))
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(target))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def place(temp: Path, path: Path, *, overwrite: bool = False, label: str = "-o") -> None:
    """Give the complete file or folder ``temp`` (beside ``path``) its name ``path``.

    Without ``overwrite`` an existing path is never replaced: one that appeared while the output was
    written is refused (:class:`~normswap.errors.OutputExistsError`; ``label`` names it). With
    ``overwrite`` it is replaced atomically: a file by a rename over it, a folder by swapping the two names
    (then the old one is removed), so the path holds the old output or the new one, never a half of
    either. A symlink is never written through. Every file and folder in it first gets the modes the
    umask gives (:func:`normswap.load.file_modes.apply_output_modes`), whichever writer made it."""
    if path.is_symlink():
        raise BadInputError(f"{label} {path} is a symlink: normswap never writes through one")
    apply_output_modes(temp)
    if not overwrite:
        try:
            if _renameat2(temp, path, _RENAME_NOREPLACE):
                return
        except FileExistsError:
            pass
        if path.exists():
            raise OutputExistsError(label, path, appeared=True)
        os.rename(temp, path)
        return
    if not path.exists() or (not temp.is_dir() and not path.is_dir()):
        os.replace(temp, path)  # a file over a file (or nothing): atomic
        return
    if _renameat2(temp, path, _RENAME_EXCHANGE):
        _remove(temp)  # temp now holds the old output
        return
    # No exchange here: the old output is moved aside under a temp name (a killed run leaves it for the
    # next run to remove, as any temp), then the new one takes the name.
    aside = _temp_path(path, _host(), os.getpid(), secrets.token_hex(4))
    os.rename(path, aside)
    try:
        os.rename(temp, path)
    except BaseException:
        os.rename(aside, path)
        raise
    _remove(aside)


def reserve_temp_dir(path: Path) -> Path:
    """A new hidden folder beside ``path`` (``.NAME.normswap-tmp-HOST-PID-TOKEN``) to build a model
    directory in before it is renamed to ``path``; folders a killed earlier run on this host left for the
    same destination are removed first."""
    if not path.parent.is_dir():
        raise BadInputError(f"output directory does not exist: {path.parent}")
    remove_stale_temps(path, directory=True)
    temp = _temp_path(path, _host(), os.getpid(), secrets.token_hex(4))
    try:
        temp.mkdir()
    except OSError as exc:
        raise BadInputError(
            f"cannot write to output directory {path.parent}: {exc.strerror or describe(exc)}"
        ) from None
    return temp


@contextmanager
def directory_output(path: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """A model directory written whole or not at all: yields a new folder beside ``path``
    (:func:`reserve_temp_dir`) to build it in, which becomes ``path`` when the block ends (:func:`place`:
    replaced atomically with ``overwrite``, refused if it appeared meanwhile without). On any error the
    folder is removed, and an OSError (a full disk, permissions) is the one line of :func:`write_error`."""
    temp = reserve_temp_dir(path)
    try:
        yield temp
        place(temp, path, overwrite=overwrite)
    except BaseException as exc:
        shutil.rmtree(temp, ignore_errors=True)
        said = failed_write(path, exc)
        if said is not None:
            raise said from None
        raise


def atomic_write(path: Path, write: Callable[[Path], object], *, overwrite: bool = True) -> None:
    """Call ``write(temp_path)`` and move the result to ``path``; on any error remove the temp file.

    ``overwrite``: replace an existing ``path`` (False: refuse one that appeared meanwhile; the output
    rule is checked before the work by :func:`normswap.load.paths.check_output`). Temp files that a
    killed earlier write of ``path`` left behind (same host, dead pid) are removed first.
    """
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        raise BadInputError(f"output directory does not exist: {parent}")
    if path.is_dir():
        raise BadInputError(f"output path is a directory: {path}")
    remove_stale_temps(path)
    try:
        temp = _reserve_temp_path(path)
    except PermissionError:
        raise BadInputError(f"cannot write to output directory {parent}: permission denied") from None
    except OSError as exc:  # a read-only file system, a full disk, a name too long
        raise BadInputError(
            f"cannot write to output directory {parent}: {exc.strerror or describe(exc)}"
        ) from None
    try:
        write(temp)
        place(temp, path, overwrite=overwrite)
    except OSError as exc:
        # Disk full, permissions, a read-only mount: the user's environment, not a normswap bug.
        temp.unlink(missing_ok=True)
        raise write_error(path, exc) from None
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def atomic_write_onnx(path: Path, write: Callable[[Path], None], *, overwrite: bool = True) -> None:
    """An ONNX output, which is one file or two (``OUT.onnx`` and its external data ``OUT.onnx.data``):
    ``write(file)`` writes ``file``, named ``OUT.onnx`` inside a hidden temp folder beside ``path`` (so
    the reference to the data file names its final name), and may check it there; then the data file is
    published first and the .onnx after it. A stale data file of an earlier output is removed when
    the new .onnx has none. On any error the temp folder is removed."""
    path = Path(path)
    data = path.with_name(path.name + ONNX_DATA_SUFFIX)
    remove_stale_temps(path)
    folder = reserve_temp_dir(path)
    temp = folder / path.name
    temp_data = folder / data.name
    try:
        write(temp)
        if temp_data.exists():
            place(temp_data, data, overwrite=overwrite)
        place(temp, path, overwrite=overwrite)
        if not temp_data.exists() and overwrite and data.exists() and not data.is_symlink():
            data.unlink()  # the data file of the output just replaced
    except OSError as exc:
        raise write_error(path, exc) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _StructurePickler(pickle.Pickler):
    """Pickles a model's structure only: each tensor becomes a reference, so no tensor data is copied
    and checking a large model costs what pickling its Python objects costs."""

    def persistent_id(self, obj: object) -> int | None:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return id(obj)
        return None


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def pickle_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot be pickled to a .pt file (a lambda, a local class, an open handle inside
    it), in one line; None when it can."""
    try:
        _StructurePickler(_Discard(), protocol=2).dump(model)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        return describe(exc)
    return None


def _pickled_as_program(model: nn.Module) -> bool:
    """Whether a .pt of ``model`` holds its program rather than the module: an exported graph (a graph
    rewrite's result, a .pt2 loaded as a module) carries export's guard hooks, which do not pickle, so
    normswap.load.exported_module.ExportedModule pickles it as its program. Whether that program
    exports is judged when it is written."""
    return isinstance(model, torch.fx.GraphModule) and pickle_problem(model) is not None


# What writing each format needs besides torch, by importable name.
_FORMAT_PACKAGES = {"onnx": ("onnx", "onnxscript", "onnxruntime")}


def check_output_format(output: Path) -> None:
    """Refuse an -o whose suffix names no format normswap writes (.pt2, .pt, .onnx ...); a name without a
    file extension is a model directory, as in every Hugging Face tool."""
    from normswap.load.checkpoint_write import is_directory_output

    if not is_directory_output(output) and output.suffix not in SAVE_FORMATS:
        raise BadInputError(f"-o {output}: unknown output format; use one of {', '.join(SAVE_FORMATS)}")


def check_writable(
    model: nn.Module,
    path: Path,
    example_args: tuple | None,
    example_kwargs: dict | None = None,
    *,
    captured: CapturedGraph | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Refuse, before any work, an output that the model could not be written to: a .onnx without the
    ONNX packages or in a dtype onnxruntime cannot check here (``dtype``: the one the output is cast to,
    default the model's), a .pt2 or .onnx of a model torch.export cannot capture, a .pt of a model that
    does not pickle. ``captured`` is a :class:`~normswap.graph.capture.CapturedGraph` of the model on the
    example inputs (a .pt2 or .onnx output is not judged without one: the caller captures it once and
    reuses it)."""
    path = Path(path)
    label = SAVE_FORMATS.get(path.suffix.lower())
    if label is None:
        accepted = ", ".join(SAVE_FORMATS)
        raise BadInputError(f"cannot save to {path}: unknown suffix {path.suffix!r} (accepted: {accepted})")
    missing = [name for name in _FORMAT_PACKAGES.get(label, ()) if importlib.util.find_spec(name) is None]
    if missing:
        raise BadInputError(
            f"-o {path}: writing {label} needs {', '.join(missing)}, which is not installed: "
            f"pip install {' '.join(missing)}, or save as .pt2 or .pt"
        )
    if label == "onnx" and (problem := onnx_check_problem(dtype or floating_dtype(model))) is not None:
        raise BadInputError(f"-o {path}: {problem}")
    if label == "pickle":
        problem = None if _pickled_as_program(model) else pickle_problem(model)
        if problem is not None:
            raise BadInputError(f"-o {path}: the model cannot be pickled ({problem}); save as .pt2 instead")
    elif (
        label == "pt2" and captured is not None and captured.method == "export" and captured.graph is not None
    ):
        problem = captured_pt2_problem(captured.graph)
        if problem is not None:
            raise pt2_refusal(path, problem)
    elif captured is not None and captured.method != "export" and not captured.ran:
        # (an fx graph that ran on the inputs says nothing of export either way: the program is
        # exported when it is written, and an export that fails there writes nothing)
        raise BadInputError(
            f"-o {path}: a {label} file is written from a torch.export capture, and the model cannot be "
            f"captured ({captured.reason}): {captured.advice}, or save as .pt"
        )


def _write_pickle(
    model: nn.Module,
    temp: Path,
    example_args: tuple,
    example_kwargs: dict | None,
    fallbacks: list[str] | None = None,
    static_shapes: bool = False,
) -> None:
    if _pickled_as_program(model):
        # an exported graph (a graph rewrite's result): its module holds export's guard hooks, which do
        # not pickle; the .pt holds the program instead (normswap.load.exported_module)
        from normswap.graph.capture import export_program
        from normswap.load.exported_module import ExportedModule

        try:
            program = export_program(
                model,
                example_args,
                example_kwargs,
                grow_unit_dims=True,
                fallbacks=fallbacks,
                dynamic=not static_shapes,
            )
            model = ExportedModule(program)
        except Exception as exc:
            raise BadInputError(
                f"torch.export could not trace the graph for .pt output ({describe(exc)})"
            ) from None
    try:
        torch.save(model, temp)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        # e.g. a lambda or a local class inside the model: pickle cannot name it.
        raise BadInputError(
            f"cannot pickle the model for .pt output ({describe(exc)}); save as .pt2 instead"
        ) from None


def save_model(
    model: nn.Module,
    path: Path,
    example_args: tuple,
    example_kwargs: dict | None = None,
    *,
    refuse_path: Path | None = None,
    overwrite: bool = False,
    portable: bool = False,
    static_shapes: bool = False,
    needs: list[str] | None = None,
    fallbacks: list[str] | None = None,
    check: Callable[[Path, str], None] | None = None,
) -> str:
    """Save ``model`` in the format its suffix names (.pt2, .pt/.pth) and return that format's label. An
    .onnx is written by :func:`normswap.save`, which checks it in onnxruntime before it is kept.

    A .pt2's program: ``portable`` writes one that loads with torch alone
    (:func:`normswap.load.pt2_file.portable_program`); ``needs``, when given, receives what loading the
    written one needs imported besides torch (:func:`normswap.load.pt2_file.program_needs`).

    A program takes the batch and sequence lengths the model leaves free, or only the example's with
    ``static_shapes``; ``fallbacks`` hears why it is fixed at the example's shapes, if it is; ``check``
    (temp path, format label) runs on the written file before it takes its name, and refuses it by
    raising (then nothing is written).

    ``refuse_path`` is the input model file: writing over it would destroy the only copy of the original.
    An existing ``path`` is refused unless ``overwrite`` (:func:`normswap.load.paths.check_output`).
    """
    path = Path(path)
    label = SAVE_FORMATS.get(path.suffix.lower())
    if label is None:
        accepted = ", ".join(SAVE_FORMATS)
        raise BadInputError(f"cannot save to {path}: unknown suffix {path.suffix!r} (accepted: {accepted})")
    if label == "onnx":
        raise BadInputError(
            f"{path}: an ONNX file is written by normswap.save, which checks it in onnxruntime first"
        )
    check_paths({"the input model": refuse_path}, {"-o": path})  # never it, nor a folder that holds it
    check_output("-o", path, overwrite=overwrite)

    def write(temp: Path) -> None:
        if label == "pt2":
            found = write_pt2(
                model,
                example_args,
                example_kwargs,
                temp,
                path,
                portable=portable,
                fallbacks=fallbacks,
                static_shapes=static_shapes,
            )
            if needs is not None:
                needs[:] = found
        else:
            _write_pickle(model, temp, example_args, example_kwargs, fallbacks, static_shapes)
        if check is not None:
            check(temp, label)

    atomic_write(path, write, overwrite=overwrite)
    return label
