"""Read the model a user points normswap at, without ever running code they did not ask us to run.

A model arrives as a file or as a factory (``package.module:callable`` or ``path/to/file.py:callable``).
Files are told apart by their bytes, not their suffix, because ``.pt`` alone can hold a pickled module, a
state dict, a torch.export archive or a TorchScript archive, and each needs a different answer.

Safety rule: nothing is unpickled with the full pickle machinery unless the user passed ``--trust-pickle``.
To decide between "state dict" and "pickled object" we use torch's ``weights_only`` unpickler, which
refuses any global outside its allowlist *before* calling it, so probing a malicious file runs nothing.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import io
import json
import logging
import os
import pickle
import pickletools
import re
import sys
import traceback
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from normswap.errors import BadInputError, shorten

# A safetensors header larger than this is not a header but a misread length from some other format.
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_IDENTIFIER_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class ModelFormat(enum.Enum):
    """What a model file holds, as decided from its content."""

    EXPORTED_PROGRAM = "exported_program"
    TORCHSCRIPT = "torchscript"
    STATE_DICT = "state_dict"
    PICKLED_OBJECT = "pickled_object"
    SAFETENSORS = "safetensors"


@dataclass
class LoadedModel:
    """A model ready to rewrite, plus the example inputs its source carried (if any).

    ``format`` is a short label for reports: "pt2", "factory" or "pickle".
    """

    model: nn.Module
    example_args: tuple | None
    example_kwargs: dict | None
    source: str
    format: str


class _Probe(NamedTuple):
    # format is None when the file is a valid weights-only torch.save file holding something other than
    # a mapping (a tensor, a tuple of tensors): readable as data, but neither a model nor a state dict.
    format: ModelFormat | None
    payload: Any


def _first_line(text: object, limit: int = 200) -> str:
    """The first non-empty line of an error text, so user-facing messages stay on one line; a longer
    one is cut after its last whole word that fits (never inside a word) and marked with "..."."""
    for line in str(text).splitlines():
        line = line.strip()
        if line:
            return shorten(line, limit)
    return ""


def _describe(exc: BaseException) -> str:
    detail = _first_line(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _unreadable(path: Path, reason: str, what: str) -> BadInputError:
    return BadInputError(f"not a {what} normswap can read: {path} ({reason})")


def _check_file(path: Path, what: str) -> None:
    if not path.exists():
        raise BadInputError(f"{what} not found: {path}")
    if path.is_dir():
        raise BadInputError(f"{what} is a directory, not a file: {path}")
    if path.stat().st_size == 0:
        raise BadInputError(f"{what} is empty: {path}")


def _is_safetensors(path: Path) -> bool:
    """A safetensors file starts with a little-endian u64 header length, then that many bytes of JSON."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return False
        n = int.from_bytes(head, "little")
        if n < 2 or n > size - 8 or n > _MAX_SAFETENSORS_HEADER:
            return False
        header = f.read(n)
    if not header.lstrip().startswith(b"{"):
        return False
    try:
        return isinstance(json.loads(header), dict)
    except (UnicodeDecodeError, ValueError):
        return False


def _is_pickle_stream(stream: io.BufferedIOBase) -> bool:
    """Whether the stream starts with one complete pickle; pickletools only decodes opcodes, runs nothing."""
    try:
        for _opcode, _arg, _pos in pickletools.genops(stream):
            pass
    except Exception:
        return False
    return True


def _zip_layout(names: list[str]) -> set[str]:
    """Archive members with their top folder removed (torch names that folder after the saved file)."""
    return {name.split("/", 1)[1] for name in names if "/" in name}


def _weights_only_load(path: Path, *, mmap: bool) -> Any:
    """torch.load with the allowlisting unpickler; memory-maps zip archives so probing a big file is cheap."""
    # torch.load picks its reader from a path's suffix (".safetensors"); an open file keeps the choice ours.
    source: Any = str(path) if mmap and path.suffix != ".safetensors" else None
    # torch warns about pickle protocols other than 2 while probing; that is noise for the user.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if source is not None:
            return torch.load(source, weights_only=True, map_location="cpu", mmap=True)
        with path.open("rb") as f:
            return torch.load(f, weights_only=True, map_location="cpu")


def _probe(path: Path, what: str) -> _Probe:
    """Classify a file by its bytes; the payload comes back when deciding already required loading it.

    Order matters: archive layouts and the safetensors header are checked before any unpickling, and
    the only unpickling done here is torch's weights-only one, which refuses unknown globals unrun.
    """
    _check_file(path, what)
    is_zip = zipfile.is_zipfile(path)
    if is_zip:
        try:
            with zipfile.ZipFile(path) as archive:
                members = _zip_layout(archive.namelist())
                # torch.export's pre-2.8 layout keeps its members at the zip's root
                legacy_export = "serialized_exported_program.json" in archive.namelist()
                if "archive_format" in members or legacy_export:
                    return _Probe(ModelFormat.EXPORTED_PROGRAM, None)
                if "constants.pkl" in members and any(m.startswith("code/") for m in members):
                    return _Probe(ModelFormat.TORCHSCRIPT, None)
                if "data.pkl" not in members:
                    raise _unreadable(
                        path,
                        "a zip archive, but not one written by torch.save, torch.export.save or torch.jit.save",
                        what,
                    )
                pkl_name = next(n for n in archive.namelist() if n.partition("/")[2] == "data.pkl")
                with archive.open(pkl_name) as pkl:
                    is_pickle = _is_pickle_stream(pkl)
        except zipfile.BadZipFile as exc:
            raise _unreadable(path, f"corrupt zip archive: {_first_line(exc)}", what) from None
        if not is_pickle:
            raise _unreadable(path, "corrupt torch.save archive: its data.pkl is not a valid pickle", what)
    else:
        if _is_safetensors(path):
            return _Probe(ModelFormat.SAFETENSORS, None)
        with path.open("rb") as f:
            if f.read(4) == b"PK\x03\x04":
                # Starts like a zip but has no readable central directory: cut off while copying.
                raise _unreadable(path, "a truncated or corrupt zip archive", what)
            f.seek(0)
            if not _is_pickle_stream(f):
                raise _unreadable(
                    path, "neither a torch.save/torch.export archive, a pickle nor a safetensors file", what
                )

    try:
        payload = _weights_only_load(path, mmap=is_zip)
    except pickle.UnpicklingError:
        # The stream is a well-formed pickle that the weights-only unpickler will not build: it names a
        # class or function outside torch's allowlist, so it can only be read by running arbitrary code.
        return _Probe(ModelFormat.PICKLED_OBJECT, None)
    except Exception as exc:
        raise _unreadable(path, f"truncated or corrupt: {_describe(exc)}", what) from None
    if isinstance(payload, Mapping):
        return _Probe(ModelFormat.STATE_DICT, payload)
    return _Probe(None, payload)


def detect_format(path: Path) -> ModelFormat:
    """Tell what a model file holds from its bytes, executing nothing in it.

    Raises BadInputError for missing, empty, corrupt files and for files that hold plain tensors.
    """
    path = Path(path)
    probe = _probe(path, "model file")
    if probe.format is None:
        raise _unreadable(
            path,
            f"it holds a {type(probe.payload).__name__} of tensors, not a model or a state dict",
            "model file",
        )
    return probe.format


def _tensors_from_probe(path: Path, probe: _Probe, what: str) -> Any:
    if probe.format is ModelFormat.SAFETENSORS:
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:
            raise _unreadable(path, f"corrupt safetensors file: {_describe(exc)}", what) from None
    if probe.format is ModelFormat.PICKLED_OBJECT:
        raise BadInputError(
            f"{what} {path} is a pickled Python object, not tensors: save only tensors (or tuples, lists, "
            "dicts of tensors) with torch.save, since loading anything else would run arbitrary code"
        )
    if probe.format in (ModelFormat.EXPORTED_PROGRAM, ModelFormat.TORCHSCRIPT):
        kind = "torch.export" if probe.format is ModelFormat.EXPORTED_PROGRAM else "TorchScript"
        raise BadInputError(f"{what} {path} is a {kind} model archive, not a file of tensors")
    return probe.payload


def read_tensor_file(path: str | Path, *, what: str = "tensor file") -> Any:
    """Load tensors (and tuples, lists, dicts of them) with the weights-only unpickler.

    Used for ``--inputs`` and ``--weights``: such files never need code to run, so we never run any.
    Safetensors files are recognized by content and read with safetensors. ``what`` names the file in
    messages ("inputs file", "weights file").
    """
    path = Path(path)
    return _tensors_from_probe(path, _probe(path, what), what)


# ---------------------------------------------------------------------------------------------------
# Factories


def _resolve_attribute(module: Any, attr_path: str, factory: str) -> Any:
    obj = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BadInputError(
                f"factory '{factory}': module '{module.__name__}' has no attribute '{attr_path}'"
            ) from None
    return obj


def _import_module_from_cwd(module_name: str, factory: str) -> Any:
    # The factory usually lives in the user's project, which is the working directory but is not on
    # sys.path when normswap runs as an installed script. The directory goes *last*, for the import
    # only: a stray torchvision.py in it must not shadow the installed package (and run in its place).
    # A user who wants their folder first says so with PYTHONPATH=. or names the file (models.py:build).
    saved_path = list(sys.path)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInputError(f"cannot import factory module '{module_name}': {_first_line(exc)}") from None
    except Exception as exc:
        raise BadInputError(
            f"factory module '{module_name}' failed while importing: {_describe(exc)}"
        ) from None
    finally:
        sys.path[:] = saved_path


def _module_name_for_file(path: Path) -> str:
    # Registering the file under its own stem lets modules it defines be pickled (torch.save of the
    # rewritten model) and reloaded later from the same folder; fall back to a private name on clashes.
    stem = path.stem
    if stem.isidentifier() and stem not in sys.modules:
        return stem
    safe = re.sub(r"\W", "_", stem)
    return f"_normswap_factory_{safe}_{abs(hash(str(path))):x}"


def _import_module_from_file(path: Path, factory: str) -> Any:
    if not path.is_file():
        raise BadInputError(f"factory file not found: {path} (in factory '{factory}')")
    name = _module_name_for_file(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BadInputError(f"cannot load factory file {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)
    # Sibling imports inside the factory file should work as they do when the user runs it directly.
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise BadInputError(f"factory file {path} failed while importing: {_describe(exc)}") from None
    finally:
        sys.path[:] = saved_path
    return module


def _as_example_inputs(value: Any, factory: str) -> tuple[tuple | None, dict | None]:
    """Normalize what a factory returned next to its model into (args, kwargs)."""
    if value is None:
        return None, None
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise BadInputError(f"factory '{factory}' returned example kwargs whose keys are not all strings")
        return (), dict(value)
    raise BadInputError(
        f"factory '{factory}' returned example inputs of type {type(value).__name__}: "
        "expected a tensor, a tuple/list of positional args or a dict of kwargs"
    )


def _unpack_model_and_inputs(result: Any, origin: str) -> tuple[nn.Module, tuple | None, dict | None]:
    """Accept ``module``, ``(module, inputs)`` or ``(module, args, kwargs)``."""
    if isinstance(result, nn.Module):
        return result, None, None
    if isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], nn.Module):
        if len(result) == 2:
            args, kwargs = _as_example_inputs(result[1], origin)
            return result[0], args, kwargs
        _, args, kwargs = result
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, Mapping):
            raise BadInputError(
                f"{origin} returned (module, args, kwargs) whose args is not a tuple or kwargs not a dict"
            )
        return result[0], tuple(args), dict(kwargs)
    raise BadInputError(
        f"{origin} gave a {type(result).__name__}, not a torch.nn.Module "
        "(expected a module, (module, example_inputs) or (module, args, kwargs))"
    )


def import_callable(spec: str, what: str = "factory", bad_spec: str | None = None) -> Any:
    """The callable named by ``package.module:attr`` or ``path/to/file.py:attr`` (a dotted attr path).

    ``what`` names it in messages ("factory", "data factory"); ``bad_spec`` replaces the message for a
    spec that is neither form.
    """
    target, _, attr_path = spec.rpartition(":")
    usage = bad_spec or f"bad {what} '{spec}': expected package.module:callable or path/to/file.py:callable"
    if not target or not _IDENTIFIER_PATH.match(attr_path):
        raise BadInputError(usage)
    looks_like_file = target.endswith(".py") or "/" in target or os.sep in target or Path(target).is_file()
    if looks_like_file:
        module = _import_module_from_file(Path(target), spec)
    elif _IDENTIFIER_PATH.match(target):
        module = _import_module_from_cwd(target, spec)
    else:
        raise BadInputError(usage)
    found = _resolve_attribute(module, attr_path, spec)
    if not callable(found):
        raise BadInputError(f"{what} '{spec}' is a {type(found).__name__}, not a callable")
    return found


def _load_factory(spec: str) -> tuple[nn.Module, tuple | None, dict | None]:
    factory = import_callable(spec)
    try:
        result = factory()
    except Exception as exc:
        raise BadInputError(f"factory '{spec}' raised {_describe(exc)}") from None
    return _unpack_model_and_inputs(result, f"factory '{spec}'")


def _unwrap_state_dict(payload: Any, path: Path) -> Mapping[str, Any]:
    """Accept a plain state dict or a training checkpoint that keeps one under "state_dict"/"model"."""
    if not isinstance(payload, Mapping):
        raise BadInputError(
            f"weights file {path} holds a {type(payload).__name__}, not a state dict "
            "(save it with torch.save(model.state_dict(), ...) or as safetensors)"
        )
    for key in ("state_dict", "model"):
        inner = payload.get(key)
        if isinstance(inner, Mapping):
            return inner
    return payload


def _key_list(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def load_weights(model: nn.Module, weights: str | Path) -> None:
    """Load a state dict file into ``model`` strictly; a partial load would silently change the model."""
    path = Path(weights)
    probe = _probe(path, "weights file")
    if probe.format is ModelFormat.PICKLED_OBJECT:
        raise BadInputError(
            f"weights file {path} is a pickled Python object, not a state dict: --weights must be a state "
            "dict of tensors (torch.save(model.state_dict(), ...)) or a safetensors file"
        )
    state = _tensors_from_probe(path, probe, "weights file")
    state_dict = _unwrap_state_dict(state, path)
    # A model built on the meta device (accelerate's init_empty_weights) takes the file's tensors as
    # they are; copying into a meta tensor would keep it without values.
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    try:
        result = model.load_state_dict(state_dict, strict=False, assign=on_meta)
    except RuntimeError as exc:
        # Shape mismatches raise even with strict=False; keep the first specific line torch gives.
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if ln.startswith("size mismatch")), _first_line(exc))
        raise BadInputError(f"weights file {path} does not fit the model: {_first_line(detail)}") from None
    problems = []
    if result.missing_keys:
        problems.append(f"missing keys: {_key_list(list(result.missing_keys))}")
    if result.unexpected_keys:
        problems.append(f"unexpected keys: {_key_list(list(result.unexpected_keys))}")
    if problems:
        raise BadInputError(f"weights file {path} does not match the model: {'; '.join(problems)}")


# ---------------------------------------------------------------------------------------------------
# Exported programs


def _concrete_size(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        # Without a recorded example size, 2 avoids the 0/1 values that export specializes on.
        return int(hint) if hint is not None else 2
    return int(size)


def _synthesize_example_inputs(ep: torch.export.ExportedProgram) -> tuple[tuple, dict] | None:
    """Build inputs matching the traced shapes/dtypes when the archive stored no example inputs."""
    from torch.utils import _pytree as pytree

    user_inputs = set(ep.graph_signature.user_inputs)
    generator = torch.Generator().manual_seed(0)
    leaves = []
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = [_concrete_size(s) for s in val.shape]
            if val.dtype.is_floating_point or val.dtype.is_complex:
                leaves.append(torch.randn(shape, generator=generator).to(val.dtype))
            else:
                leaves.append(torch.zeros(shape, dtype=val.dtype))
        elif isinstance(val, torch.SymInt):
            leaves.append(_concrete_size(val))
        else:
            leaves.append(val)
    try:
        args, kwargs = pytree.tree_unflatten(leaves, ep.call_spec.in_spec)
    except Exception:
        return None
    return tuple(args), dict(kwargs)


def _lift_hook(gm: nn.Module) -> nn.Module:
    """Hand the exported graph module to ``normswap.graph.lift.lift_exported_module`` when it exists.

    Lifting turns aten norm calls back into nn modules, which is what the passes rewrite. A lift that
    returns a module replaces ``gm``; one that returns None is taken to have worked in place.
    """
    try:
        lift = importlib.import_module("normswap.graph.lift")
    except ModuleNotFoundError as exc:
        # Only "the lift module is not written yet" is expected; a broken import inside it must surface.
        if exc.name != "normswap.graph.lift":
            raise
        return gm
    lift_exported_module = getattr(lift, "lift_exported_module", None)
    if lift_exported_module is None:
        return gm
    lifted = lift_exported_module(gm)
    return lifted if isinstance(lifted, nn.Module) else gm


# Packages whose output classes a .pt2 may name in its pytree specs; importing one of them registers
# those classes for deserialization (Hugging Face's ModelOutput subclasses register themselves).
# Only these are imported on the archive's word: an archive must not choose what code runs.
_OUTPUT_TYPE_PACKAGES = ("transformers.", "diffusers.", "timm.")
_UNREGISTERED_TYPE = re.compile(r"Deserializing ([\w.]+) in pytree is not registered")


# torch.export.load logs under both: torch.export (the loader) and torch._export (the deserializer, which
# reports its fallback to the full unpickler there).
_EXPORT_LOGGERS = ("torch.export", "torch._export")


def _log_text(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except (TypeError, ValueError):  # torch's own format strings sometimes lack an argument
        return f"{record.msg} {record.args}"


class _Collect(logging.Handler):
    """Keeps torch.export's log records of one load attempt, to read what failed and pass the rest on."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        parts = []
        for record in self.records:
            parts.append(_log_text(record))
            if record.exc_info and record.exc_info[1] is not None:
                parts.append("".join(traceback.format_exception(record.exc_info[1])))
        return " ".join(parts)


@contextlib.contextmanager
def _listening() -> Iterator[_Collect]:
    """torch.export's log records go to a collector instead of torch's handlers, for one load attempt."""
    collect = _Collect()
    saved = []
    # torch's logging setup attaches handlers to each of its module loggers, not only to the parents
    names = [
        name
        for name in list(logging.root.manager.loggerDict)
        if any(name == top or name.startswith(top + ".") for top in _EXPORT_LOGGERS)
    ]
    for name in sorted({*_EXPORT_LOGGERS, *names}):
        log = logging.getLogger(name)
        saved.append((log, log.handlers[:], log.propagate))
        log.handlers, log.propagate = [collect], False
    try:
        yield collect
    finally:
        for log, handlers, propagate in saved:
            log.handlers, log.propagate = handlers, propagate


def _registering_module(failure: str) -> str | None:
    """The module to import so that a failed ``torch.export.load`` can succeed, if it is one we trust:
    normswap's own ops (a fused model's graph calls them), or the output classes' module of a library in
    :data:`_OUTPUT_TYPE_PACKAGES`."""
    if "torch.ops.normswap." in failure:
        return "normswap.kernels.ops"
    found = _UNREGISTERED_TYPE.search(failure)
    name = found.group(1) if found else ""
    return name.rpartition(".")[0] if name.startswith(_OUTPUT_TYPE_PACKAGES) else None


def _pass_on(records: list[logging.LogRecord]) -> None:
    """Hand the warnings of the load that succeeded (a legacy layout, a fallback to the full unpickler
    under --trust-pickle) to torch's loggers as if we had not listened: the user should see what torch
    says. One line each: an exception torch attaches is reduced to its first line."""
    for record in records:
        if record.levelno < logging.WARNING:
            continue
        text = _log_text(record)
        if record.exc_info and record.exc_info[1] is not None:
            text = f"{text} ({_describe(record.exc_info[1])})"
        record.msg, record.args, record.exc_info, record.exc_text = text, None, None, None
        logging.getLogger(record.name).handle(record)


def _read_exported_program(path: Path, *, trust_pickle: bool) -> Any:
    """``torch.export.load`` of an archive that :func:`~normswap.load.archive.check_pt2_archive` passed,
    registering what the archive needs (see :func:`_registering_module`) and retrying; only archives that
    need it pay for those imports."""
    from normswap.load.archive import check_program_calls, check_pt2_archive

    imported: set[str] = set()
    # An open file avoids torch's suffix check, so a .pt2 archive saved as model.pt still loads; the
    # scan and the load read the same open file.
    with path.open("rb") as f:
        check_pt2_archive(path, f, trust_pickle=trust_pickle)
        while True:
            # torch names what is missing only in a warning it logs, not in the exception it raises;
            # torch's handlers are set aside while an attempt may still fail and be retried, and what a
            # successful attempt logged is passed on to them afterwards
            with _listening() as collect:
                try:
                    f.seek(0)
                    program = torch.export.load(f)
                except Exception as exc:
                    module = _registering_module(" ".join([collect.text(), str(exc)]))
                    if module is None or module in imported:
                        raise
                    try:
                        importlib.import_module(module)
                    except ImportError:
                        raise exc from None
                    imported.add(module)
                    continue
            _pass_on(collect.records)
            check_program_calls(path, program)
            return program


def is_args_kwargs_pair(value: Any) -> bool:
    """Whether ``value`` has the layout of ``ExportedProgram.example_inputs``: (args tuple, kwargs dict)."""
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], (tuple, list))
        and isinstance(value[1], Mapping)
        and all(isinstance(k, str) for k in value[1])
    )


def _example_inputs_of(ep: torch.export.ExportedProgram) -> tuple[tuple, dict] | None:
    """The archive's stored example inputs, if they have the (args, kwargs) form torch writes."""
    examples = ep.example_inputs
    if examples is not None and is_args_kwargs_pair(examples):
        return tuple(examples[0]), dict(examples[1])
    return None


def _load_exported_program(path: Path, source: str, *, trust_pickle: bool) -> LoadedModel:
    from normswap.load.archive import UnsafeArchiveError

    try:
        ep = _read_exported_program(path, trust_pickle=trust_pickle)
    except UnsafeArchiveError:
        raise
    except Exception as exc:
        raise BadInputError(f"cannot load torch.export archive {path}: {_describe(exc)}") from None
    examples = _example_inputs_of(ep) or _synthesize_example_inputs(ep)
    args, kwargs = examples if examples is not None else (None, None)
    try:
        module = ep.module()
    except Exception as exc:
        # a program torch deserialized but cannot rebuild into modules: its internals were edited
        raise BadInputError(
            f"cannot rebuild the program of torch.export archive {path} into a module: {_describe(exc)}"
        ) from None
    model = _lift_hook(module)
    return LoadedModel(model=model, example_args=args, example_kwargs=kwargs, source=source, format="pt2")


def _load_pickled_module(path: Path, source: str) -> LoadedModel:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                result = torch.load(path, weights_only=False, map_location="cpu")
            except RuntimeError as exc:
                if "magic number" not in str(exc):
                    raise
                # Written by pickle.dump rather than torch.save; the user already trusted it.
                with path.open("rb") as f:
                    result = pickle.load(f)
    except Exception as exc:
        raise BadInputError(f"cannot unpickle {path}: {_describe(exc)}") from None
    model, args, kwargs = _unpack_model_and_inputs(result, f"pickle {path}")
    return LoadedModel(model=model, example_args=args, example_kwargs=kwargs, source=source, format="pickle")


def _refuse_weights_only_file(path: Path, kind: str) -> BadInputError:
    return BadInputError(
        f"{path} holds {kind} (weights only), not a model: give the model's factory as "
        f"package.module:callable and pass this file with --weights {path}"
    )


def _refuse_meta_tensors(loaded: LoadedModel) -> LoadedModel:
    """A model whose tensors are on the ``meta`` device has shapes but no values: nothing to rewrite or
    compare, and every check on it would pass having compared nothing."""
    named = (*loaded.model.named_parameters(), *loaded.model.named_buffers())
    on_meta = [name for name, tensor in named if tensor.is_meta]
    if on_meta:
        raise BadInputError(
            f"model {loaded.source} has {len(on_meta)} tensors on the meta device (shapes without values, "
            f"e.g. {on_meta[0]}): build it with real weights, or give them with --weights"
        )
    return loaded


def load_model(spec: str, *, weights: str | Path | None = None, trust_pickle: bool = False) -> LoadedModel:
    """Load the model named by ``spec``: a model file, or a factory ``package.module:callable``.

    An existing file wins over the factory reading, since a file name may itself contain ':'.
    """
    return _refuse_meta_tensors(_load_model(spec, weights=weights, trust_pickle=trust_pickle))


def _load_model(spec: str, *, weights: str | Path | None, trust_pickle: bool) -> LoadedModel:
    path = Path(spec)
    if path.exists():
        if weights is not None:
            raise BadInputError(
                f"--weights only applies to a factory (package.module:callable); {spec} is a model file"
            )
        fmt = detect_format(path)
        if fmt is ModelFormat.EXPORTED_PROGRAM:
            return _load_exported_program(path, spec, trust_pickle=trust_pickle)
        if fmt is ModelFormat.TORCHSCRIPT:
            raise BadInputError(
                f"{path} is a TorchScript archive; normswap rewrites eager or torch.export models: "
                "export it with torch.export.save or give its factory as package.module:callable"
            )
        if fmt is ModelFormat.STATE_DICT:
            raise _refuse_weights_only_file(path, "a state dict")
        if fmt is ModelFormat.SAFETENSORS:
            raise _refuse_weights_only_file(path, "safetensors tensors")
        if not trust_pickle:
            raise BadInputError(
                f"{path} is a pickled Python object; unpickling runs arbitrary code, so normswap refuses it "
                "without --trust-pickle (or export the model with torch.export.save, or give its factory)"
            )
        return _load_pickled_module(path, spec)

    if ":" not in spec:
        raise BadInputError(
            f"model file not found: {spec} (give a .pt2 file, or a factory as package.module:callable)"
        )
    model, args, kwargs = _load_factory(spec)
    if weights is not None:
        load_weights(model, weights)
    return LoadedModel(model=model, example_args=args, example_kwargs=kwargs, source=spec, format="factory")
