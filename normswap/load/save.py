"""Write a rewritten model so that a failed command leaves nothing behind and never touches its input.

Every output goes to a temp file next to the destination and is renamed over it only once complete;
``os.replace`` within one directory is atomic, so readers see the old file or the new one, never half.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from normswap.errors import BadInputError, describe
from normswap.load.paths import same_path

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


def _remove_stale_temps(path: Path, directory: bool = False) -> None:
    """Remove temp files (or folders, for a model directory) that an earlier, killed run on this host
    left for this same destination."""
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


def publish_directory(temp: Path, path: Path, label: str = "-o") -> None:
    """Give the complete directory built in ``temp`` (from :func:`reserve_temp_dir`) its name ``path``;
    refused if something took that name meanwhile: normswap never writes over a path. ``label`` names
    the path in that refusal."""
    if path.exists() or path.is_symlink():
        raise BadInputError(
            f"{label} {path} appeared while it was written; normswap never writes over a path"
        )
    os.rename(temp, path)


def reserve_temp_dir(path: Path) -> Path:
    """A new hidden folder beside ``path`` (``.NAME.normswap-tmp-HOST-PID-TOKEN``) to build a model
    directory in before it is renamed to ``path``; folders a killed earlier run on this host left for the
    same destination are removed first."""
    if not path.parent.is_dir():
        raise BadInputError(f"output directory does not exist: {path.parent}")
    _remove_stale_temps(path, directory=True)
    temp = _temp_path(path, _host(), os.getpid(), secrets.token_hex(4))
    try:
        temp.mkdir()
    except OSError as exc:
        raise BadInputError(
            f"cannot write to output directory {path.parent}: {exc.strerror or describe(exc)}"
        ) from None
    return temp


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(temp_path)`` and move the result to ``path``; on any error remove the temp file.

    Temp files that a killed earlier write of ``path`` left behind (same host, dead pid) are removed first.
    """
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        raise BadInputError(f"output directory does not exist: {parent}")
    if path.is_dir():
        raise BadInputError(f"output path is a directory: {path}")
    _remove_stale_temps(path)
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
        os.replace(temp, path)
    except OSError as exc:
        # Disk full, permissions, a read-only mount: the user's environment, not a normswap bug.
        temp.unlink(missing_ok=True)
        raise BadInputError(f"cannot write {path}: {exc.strerror or describe(exc)}") from None
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _write_pt2(model: nn.Module, example_args: tuple, example_kwargs: dict | None, temp: Path) -> None:
    from normswap.graph.capture import export_program

    try:
        ep = export_program(model, example_args, example_kwargs, grow_unit_dims=True)
    except Exception as exc:
        raise BadInputError(
            f"torch.export could not trace the model for .pt2 output ({describe(exc)}); save as .pt instead"
        ) from None
    torch.export.save(ep, temp)


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


# What writing each format needs besides torch, by importable name.
_FORMAT_PACKAGES = {"onnx": ("onnx", "onnxscript", "onnxruntime")}


def check_writable(
    model: nn.Module,
    path: Path,
    example_args: tuple | None,
    example_kwargs: dict | None = None,
    *,
    captured: CapturedGraph | None = None,
) -> None:
    """Refuse, before any work, an output that the model could not be written to: a .onnx without the
    ONNX packages, a .pt2 or .onnx of a model torch.export cannot capture, a .pt of a model that does
    not pickle. ``captured`` is a :class:`~normswap.graph.capture.CapturedGraph` of the model on the
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
    if label == "pickle":
        problem = pickle_problem(model)
        if problem is not None:
            raise BadInputError(f"-o {path}: the model cannot be pickled ({problem}); save as .pt2 instead")
    elif captured is not None and captured.method != "export" and not captured.ran:
        # (an fx graph that ran on the inputs says nothing of export either way: the program is
        # exported when it is written, and an export that fails there writes nothing)
        raise BadInputError(
            f"-o {path}: a {label} file is written from a torch.export capture, and the model cannot be "
            f"captured ({captured.reason}): {captured.advice}, or save as .pt"
        )


def _write_pickle(model: nn.Module, temp: Path) -> None:
    try:
        torch.save(model, temp)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        # e.g. a lambda or a local class inside the model: pickle cannot name it.
        raise BadInputError(
            f"cannot pickle the model for .pt output ({describe(exc)}); save as .pt2 instead"
        ) from None


def _write_onnx(
    model: nn.Module, example_args: tuple, example_kwargs: dict | None, temp: Path, opset: int | None
) -> None:
    from normswap.graph.capture import capture_friendly
    from normswap.kernels.onnx_translation import LAYER_NORMALIZATION_OPSET, translation_table

    # normswap's fused-norm ops become standard ONNX ops (LayerNormalization, RMSNormalization); the
    # table only adds translations, so models without fused norms export as before.
    table = translation_table(opset) if opset is None or opset >= LAYER_NORMALIZATION_OPSET else None
    try:
        # the ONNX exporter captures with torch.export: the same settings as any capture (no HF cache)
        with capture_friendly(model, tuple(example_args), example_kwargs):
            program = torch.onnx.export(
                model,
                tuple(example_args),
                kwargs=example_kwargs or None,
                dynamo=True,
                opset_version=opset,
                custom_translation_table=table,
            )
    except Exception as exc:
        raise BadInputError(f"ONNX export of the model failed: {describe(exc)}") from None
    if program is None:
        raise BadInputError("ONNX export of the model produced no program")
    # Initializers must stay inside the file: an external data file would be named after the temp file,
    # and the reference to it would break on rename. The writer still goes external above 2 GB.
    program.save(str(temp), external_data=False)
    side_file = temp.with_name(temp.name + ".data")
    if side_file.exists():
        side_file.unlink()
        raise BadInputError(
            "the model's weights exceed the 2 GB limit of a single .onnx file; save as .pt2 instead"
        )


def save_model(
    model: nn.Module,
    path: Path,
    example_args: tuple,
    example_kwargs: dict | None = None,
    *,
    refuse_path: Path | None = None,
    opset: int | None = None,
) -> str:
    """Save ``model`` in the format its suffix names (.pt2, .pt/.pth, .onnx) and return that format's label.

    ``refuse_path`` is the input model file: writing over it would destroy the only copy of the original.
    ``opset`` is the ONNX opset for .onnx outputs (None: the exporter's default); other formats ignore it.
    """
    path = Path(path)
    label = SAVE_FORMATS.get(path.suffix.lower())
    if label is None:
        accepted = ", ".join(SAVE_FORMATS)
        raise BadInputError(f"cannot save to {path}: unknown suffix {path.suffix!r} (accepted: {accepted})")
    if refuse_path is not None and same_path(path, refuse_path):
        raise BadInputError(
            f"refusing to overwrite the input model {refuse_path}: choose another output path"
        )

    def write(temp: Path) -> None:
        if label == "pt2":
            _write_pt2(model, example_args, example_kwargs, temp)
        elif label == "onnx":
            _write_onnx(model, example_args, example_kwargs, temp, opset)
        else:
            _write_pickle(model, temp)

    atomic_write(path, write)
    return label
