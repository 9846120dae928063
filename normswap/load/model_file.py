"""Read the model a user points normswap at, without ever running code they did not ask us to run.

A model arrives as a file or as a factory (``package.module:callable`` or ``path/to/file.py:callable``).
Files are told apart by their bytes, not their suffix, because ``.pt`` alone can hold a pickled module, a
state dict, a torch.export archive or a TorchScript archive, and each needs a different answer.

Safety rule: nothing is unpickled with the full pickle machinery unless the user passed ``--trust-pickle``.
To decide between "state dict" and "pickled object" we use torch's ``weights_only`` unpickler, which
refuses any global outside its allowlist *before* calling it, so probing a malicious file runs nothing.
"""

from __future__ import annotations

import enum
import io
import pickle
import pickletools
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from normswap.errors import BadInputError, describe, first_line
from normswap.load.checkpoint_dir import (
    CheckpointDirectory,
    build_on_meta,
    is_checkpoint_directory,
    load_checkpoint_directory,
    read_checkpoint_directory,
)
from normswap.load.config_inputs import example_inputs, made_inputs_notes
from normswap.load.factory import load_factory, unpack_model_and_inputs
from normswap.load.json_io import parse_json
from normswap.load.program import load_program

# A safetensors header larger than this is not a header but a misread length from some other format.
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


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

    ``format`` is a short label for reports: "pt2", "factory", "pickle" or "directory" (a Hugging Face
    model directory, whose checked description is ``checkpoint``).
    """

    model: nn.Module
    example_args: tuple | None
    example_kwargs: dict | None
    source: str
    format: str
    checkpoint: CheckpointDirectory | None = None
    # why no example inputs came with the model (a directory whose config does not say enough to make
    # them): what a command that needs inputs says when the user gives none
    no_inputs_reason: str = ""
    # what the user is told about the example inputs normswap made (a directory's, from its config)
    notes: list[str] = field(default_factory=list)


def _directory_model(model: nn.Module, checkpoint: CheckpointDirectory, spec: str) -> LoadedModel:
    """A directory's model with the example inputs its config gives, or the reason it gives none: the
    user's own inputs (--inputs, --input-shape) may still serve."""
    try:
        args, kwargs = example_inputs(model, checkpoint.config)
    except BadInputError as exc:
        return LoadedModel(model, None, None, spec, "directory", checkpoint, no_inputs_reason=str(exc))
    notes = made_inputs_notes(kwargs)
    return LoadedModel(
        model, args, kwargs, source=spec, format="directory", checkpoint=checkpoint, notes=notes
    )


class _Probe(NamedTuple):
    # format is None when the file is a valid weights-only torch.save file holding something other than
    # a mapping (a tensor, a tuple of tensors): readable as data, but neither a model nor a state dict.
    format: ModelFormat | None
    payload: Any


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
        return isinstance(parse_json(header, str(path), "safetensors header"), dict)
    except BadInputError:  # not JSON (or absurdly nested): not a safetensors file
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
            raise _unreadable(path, f"corrupt zip archive: {first_line(exc)}", what) from None
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
        raise _unreadable(path, f"truncated or corrupt: {describe(exc)}", what) from None
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
            raise _unreadable(path, f"corrupt safetensors file: {describe(exc)}", what) from None
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
        detail = next((ln for ln in lines if ln.startswith("size mismatch")), first_line(exc))
        raise BadInputError(f"weights file {path} does not fit the model: {first_line(detail)}") from None
    problems = []
    if result.missing_keys:
        problems.append(f"missing keys: {_key_list(list(result.missing_keys))}")
    if result.unexpected_keys:
        problems.append(f"unexpected keys: {_key_list(list(result.unexpected_keys))}")
    if problems:
        raise BadInputError(f"weights file {path} does not match the model: {'; '.join(problems)}")


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
        raise BadInputError(f"cannot unpickle {path}: {describe(exc)}") from None
    model, args, kwargs = unpack_model_and_inputs(result, f"pickle {path}")
    from normswap.load.exported_module import ExportedModule

    if isinstance(model, ExportedModule):
        # a graph rewrite's .pt holds its program: read as the same program's .pt2 is (norms lifted to
        # modules, its example inputs), so every command sees one model whichever file holds it
        from normswap.load.program import program_module

        model, program_args, program_kwargs = program_module(path, model.program)
        if args is None and kwargs is None:
            args, kwargs = program_args, program_kwargs
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
    """Load the model named by ``spec``: a model file, a Hugging Face model directory, or a factory
    ``package.module:callable``.

    An existing file wins over the factory reading, since a file name may itself contain ':'.
    """
    return _refuse_meta_tensors(_load_model(spec, weights=weights, trust_pickle=trust_pickle))


def load_model_structure(
    spec: str, *, weights: str | Path | None = None, trust_pickle: bool = False
) -> LoadedModel:
    """Like :func:`load_model`, but a Hugging Face model directory is built from its config on the meta
    device, its weights not read, with example inputs on the meta device too: for work that needs the
    model's structure and shapes only (``inspect``)."""
    _refuse_what_is_no_spec(spec)
    path = Path(spec)
    if path.is_dir() and is_checkpoint_directory(path):
        if weights is not None:
            raise BadInputError(f"--weights only applies to a factory; {spec} is a model directory")
        checkpoint = read_checkpoint_directory(path)
        return _directory_model(build_on_meta(checkpoint), checkpoint, spec)
    return load_model(spec, weights=weights, trust_pickle=trust_pickle)


def _load_directory(path: Path, spec: str) -> LoadedModel:
    if not is_checkpoint_directory(path):
        raise BadInputError(
            f"{spec} is a directory without a config.json: give a Hugging Face model directory, a model file "
            "or a factory"
        )
    checkpoint = read_checkpoint_directory(path)
    return _directory_model(load_checkpoint_directory(checkpoint), checkpoint, spec)


def _refuse_what_is_no_spec(spec: object) -> None:
    """The one sentence for a module (or anything else) passed where a spec is read, on every reader."""
    if not isinstance(spec, str | Path):
        raise BadInputError(
            f"a model is given as a spec here (a model file, a model directory or package.module:callable), "
            f"not a {type(spec).__name__} object; normswap.convert takes a module"
        )


def _load_model(spec: str, *, weights: str | Path | None, trust_pickle: bool) -> LoadedModel:
    _refuse_what_is_no_spec(spec)
    path = Path(spec)
    if path.exists():
        if weights is not None:
            raise BadInputError(
                f"--weights only applies to a factory (package.module:callable); {spec} is a model file"
            )
        if path.is_dir():
            return _load_directory(path, spec)
        fmt = detect_format(path)
        if fmt is ModelFormat.EXPORTED_PROGRAM:
            model, args, kwargs = load_program(path, trust_pickle=trust_pickle)
            return LoadedModel(
                model=model, example_args=args, example_kwargs=kwargs, source=spec, format="pt2"
            )
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
    model, args, kwargs = load_factory(spec)
    if weights is not None:
        load_weights(model, weights)
    return LoadedModel(model=model, example_args=args, example_kwargs=kwargs, source=spec, format="factory")


def weights_by_rows(weights: str | Path) -> dict[str, Any] | None:
    """A weights file's tensors by name, each readable by rows without reading the rest: a safetensors
    file's (file, byte range) entries, or a torch.save zip archive's tensors memory-mapped (a slice reads
    only its pages). None for a file that can only be read whole (torch's legacy, non-zip format); the
    caller loads it the usual way (:func:`load_weights`, with its refusals)."""
    from normswap.load.safetensors_io import read_header

    path = Path(weights)
    probe = _probe(path, "weights file")
    if probe.format is ModelFormat.SAFETENSORS:
        try:
            entries, _ = read_header(path)
        except BadInputError:  # a dtype normswap's reader does not take: safetensors reads it whole
            return None
        return {name: (path, entry) for name, entry in entries.items()}
    if probe.format is ModelFormat.PICKLED_OBJECT or not zipfile.is_zipfile(path):
        return None
    state = _unwrap_state_dict(_tensors_from_probe(path, probe, "weights file"), path)
    if not all(isinstance(value, torch.Tensor) for value in state.values()):
        return None
    return dict(state)
