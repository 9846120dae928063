"""Hugging Face model directories: ``config.json`` plus safetensors weights, one file or shards with an
index (``model.safetensors.index.json``), as ``save_pretrained`` writes them.

The directory is read the way ``from_pretrained`` reads it, offline, with transformers' own classes and
the dtype the weights are stored in. Everything in it is untrusted until checked, and nothing in it runs:

- ``config.json`` must name a model class that transformers itself defines (``architectures``); a config
  that asks for the repository's own Python code (``auto_map``) is refused, since that code would run;
  the user can build such a model in a factory of their own instead.
- Weights are read from safetensors only (plain tensors, no pickle); an index's shard names must be
  plain file names inside the directory, every shard must be a readable safetensors file, and every
  tensor the index names must be in its shard. ``pytorch_model.bin`` (a pickle) is refused.
- Every file read from the directory (config, index, shards, ``normswap.json``, the side files copied into
  an output) is opened through :func:`normswap.load.folder_files.folder_file`: a symlink may point inside the folder, never out of
  it, so that a ``tokenizer.json`` linked to a private file elsewhere is refused, not read and copied.
- A model that the files do not fully cover (weights missing, unexpected or of the wrong shape) is
  refused: a model with some weights at their random init would pass every later check while being
  another model.

A directory normswap wrote after a conversion that changed module classes (LayerNorm -> RMSNorm, fused
norms) carries ``normswap.json``, the recipes of the new modules (:mod:`normswap.modules.recipes`):
:func:`load_checkpoint_directory` rebuilds those modules and loads the tensors into them strictly.

``build_on_meta`` builds the model from the config alone on the meta device, so that ``inspect`` and the
analysis of a large checkpoint read no weights.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError, describe
from normswap.load.folder_files import check_links, folder_file, read_json
from normswap.load.safetensors_io import stored_dtype
from normswap.load.tensor_names import MERGED_ON_LOAD, loaded_names, prefix_hint
from normswap.load.weight_files import StoredWeights, find_weights

CONFIG_FILE = "config.json"
RECORD_FILE = "normswap.json"
RECORD_FORMAT = "normswap-checkpoint"


@dataclass(frozen=True)
class CheckpointDirectory:
    """A checked Hugging Face model directory, its weights not read.

    ``shards``: the safetensors file names, in order; ``weight_map``: tensor name -> shard file name;
    ``record``: the ``normswap.json`` of a directory normswap wrote after changing module classes, or
    None; ``shard_bytes``: each shard's size on disk; ``weights``: how the weight files are named and
    whether an index lists them (:mod:`normswap.load.weight_files`).
    """

    path: Path
    config: dict[str, Any]
    architecture: str
    shards: tuple[str, ...]
    weight_map: dict[str, str]
    shard_bytes: dict[str, int] = field(default_factory=dict)
    record: dict[str, Any] | None = None
    weights: StoredWeights | None = None
    # whether each tensor is stored under the name the model gives it (set by the acceptance check;
    # False where transformers renames stored names as it loads, as for Dinov2)
    stored_as_loaded: bool = True

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_bytes.values())

    @property
    def replaced_modules(self) -> dict[str, Any]:
        """Module path -> recipe of the modules whose class normswap changed (empty for a stock directory)."""
        return dict(self.record.get("modules", {})) if self.record else {}


def is_checkpoint_directory(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a ``config.json``: what the user means as a HF model."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def _find_key(config: dict[str, Any], key: str) -> tuple[str, Any] | None:
    """(dotted place, value) of the first ``key`` anywhere in a config's nested objects, or None."""
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        place, value = stack.pop()
        if isinstance(value, dict):
            if key in value:
                return (f"{place}.{key}" if place else key), value[key]
            stack += [(f"{place}.{k}" if place else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{place}[{i}]", v) for i, v in enumerate(value)]
    return None


def _architecture(config: dict[str, Any], path: Path) -> str:
    import transformers

    # anywhere in the config: transformers follows an auto_map in a sub-config (text_config) too
    found = _find_key(config, "auto_map")
    if found is not None:
        where, value = found
        keys = sorted(value) if isinstance(value, dict) else value
        raise BadInputError(
            f"{path / CONFIG_FILE} asks for the repository's own Python code ({where}: {keys!r:.120}); "
            "normswap runs no code from a model directory: build the model in a factory of your own "
            "(package.module:callable) and give that instead"
        )
    found = _find_key(config, "quantization_config")
    if found is not None:
        where, value = found
        method = value.get("quant_method") if isinstance(value, dict) else None
        raise BadInputError(
            f"{path / CONFIG_FILE} describes quantized weights ({where}: {method or value!r:.80}); normswap "
            "rewrites full-precision weights only: give the unquantized model (or dequantize it first)"
        )
    names = config.get("architectures")
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise BadInputError(
            f"{path / CONFIG_FILE} must name one model class in 'architectures' (e.g. [\"LlamaForCausalLM\"]), "
            f"got {names!r:.120}"
        )
    name = names[0]
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise BadInputError(
            f"{path / CONFIG_FILE}: architecture {name!r:.80} is not a model class of transformers "
            f"{transformers.__version__}"
        )
    return name


def _record(directory: Path) -> dict[str, Any] | None:
    path = folder_file(directory, RECORD_FILE)
    if not path.is_file():
        return None
    record = read_json(path, "normswap record")
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise BadInputError(f"{path} is not a record normswap wrote (its 'format' is not {RECORD_FORMAT!r})")
    if not isinstance(record.get("modules", {}), dict):
        raise BadInputError(f"{path}: 'modules' must map module paths to recipes")
    return record


def read_checkpoint_directory(path: str | Path) -> CheckpointDirectory:
    """Check a Hugging Face model directory (config, index, shard headers) without reading its weights."""
    directory = Path(path)
    if not is_checkpoint_directory(directory):
        raise BadInputError(f"{directory} is not a model directory (no {CONFIG_FILE} in it)")
    check_links(directory)
    config = read_json(folder_file(directory, CONFIG_FILE), "model config")
    if not isinstance(config, dict):
        raise BadInputError(f"{directory / CONFIG_FILE} is not a JSON object")
    architecture = _architecture(config, directory)
    weights, record = find_weights(directory), _record(directory)
    if weights.hidden and record is None:
        raise BadInputError(
            f"{directory} keeps its weights under normswap's names ({weights.names.single}...) but has no "
            f"{RECORD_FILE} saying which modules they belong to: it is not a directory normswap wrote"
        )
    checkpoint = CheckpointDirectory(
        path=directory,
        config=config,
        architecture=architecture,
        shards=weights.shards,
        weight_map=weights.weight_map,
        shard_bytes={name: (directory / name).stat().st_size for name in weights.shards},
        record=record,
        weights=weights,
    )
    return replace(checkpoint, stored_as_loaded=accept_model_folder(checkpoint))


def accept_model_folder(checkpoint: CheckpointDirectory) -> bool:
    """The one acceptance check of a model directory, run by every route before any work (it is part of
    :func:`read_checkpoint_directory`): the model its config describes, built on the meta device (no
    memory), must be exactly what the files hold: every tensor of the model stored once (tied ones
    through one name), nothing stored that the model lacks, each with the model's shape, in a dtype
    normswap reads. The streamed route writes the files' tensors and the in-memory route loads them, so
    without this the one refuses what the other writes; and a config asking for a 4 TB model is refused
    by its shapes here, before anything is allocated. Returns whether every tensor is stored under the
    name the model gives it (False where transformers renames them as it loads)."""

    model = build_on_meta(checkpoint)
    expected = model.state_dict(keep_vars=True)
    cls = type(model)
    ignore_missing = [re.compile(p) for p in getattr(cls, "_keys_to_ignore_on_load_missing", None) or ()]
    ignore_unexpected = [
        re.compile(p) for p in getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ()
    ]
    # transformers renames some architectures' stored keys as it loads them (Dinov2's attention.attention.key
    # is k_proj): compare the names the loader will use
    loaded = loaded_names(model, list(checkpoint.weight_map))
    if loaded is None:  # the loader merges or splits tensors: names cannot be compared one to one
        return False
    stored_as_loaded = all(stored == name for stored, name in loaded.items())
    stored = set(loaded.values())
    # a tied tensor appears under several names in the state dict and is stored under one of them
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    missing = [
        names[0]
        for names in by_tensor.values()
        if not any(n in stored for n in names) and not any(p.search(names[0]) for p in ignore_missing)
    ]
    unexpected = sorted(
        name
        for name, as_loaded in loaded.items()
        if as_loaded not in expected and not any(p.search(name) for p in ignore_unexpected)
    )
    if missing or unexpected:
        info = {"missing_keys": missing, "unexpected_keys": unexpected}
        hint = prefix_hint(missing, unexpected, checkpoint.architecture)
        raise BadInputError(
            f"{checkpoint.path}: the weights do not match the model: {_describe_mismatch(info)} (the "
            f"{checkpoint.architecture} its {CONFIG_FILE} describes){hint}"
        )
    for name, shard_path, entry in stored_entries(checkpoint):
        target = expected.get(loaded.get(name, name))
        if target is not None and tuple(target.shape) != entry.shape:
            raise BadInputError(
                f"{shard_path}: {name} has shape {list(entry.shape)} where the model its "
                f"{CONFIG_FILE} describes has {list(target.shape)}"
            )
    return stored_as_loaded


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and load reports: normswap reports what matters itself."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _model_class(checkpoint: CheckpointDirectory) -> type[nn.Module]:
    import transformers

    return getattr(transformers, checkpoint.architecture)


def transformers_config(checkpoint: CheckpointDirectory) -> Any:
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(
            checkpoint.path, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        raise BadInputError(
            f"transformers cannot read {checkpoint.path / CONFIG_FILE}: {describe(exc)}"
        ) from None


def parameter_names(model: nn.Module, checkpoint: CheckpointDirectory) -> frozenset[str]:
    """The stored names of ``checkpoint`` that are ``model``'s parameters (every name of a tied one,
    through the renamings transformers' loader makes: GPT-NeoX stores its head as ``embed_out``): what
    the NaN/Inf rule of :mod:`normswap.util.finite` holds to the parameter rule when a directory is read
    tensor by tensor."""
    from normswap.load.tensor_names import loaded_names

    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    stored = list(checkpoint.weight_map)
    renamed = loaded_names(model, stored) or {name: name for name in stored}
    return frozenset(name for name in stored if renamed.get(name, name) in parameters)


def build_on_meta(checkpoint: CheckpointDirectory) -> nn.Module:
    """The directory's model built from its config on the meta device (shapes and dtypes, no values),
    with normswap's recorded modules in place: what inspection and analysis need, no weight read."""
    config = transformers_config(checkpoint)
    cls = _model_class(checkpoint)
    # an architecture of another model family than the config's model_type (LlamaForCausalLM over a
    # GPT-2 config) fails somewhere inside its constructor: say which two disagree instead
    wanted = getattr(cls, "config_class", None)
    if isinstance(wanted, type) and not isinstance(config, wanted):
        raise BadInputError(
            f"{checkpoint.path / CONFIG_FILE}: architecture {checkpoint.architecture} takes a "
            f"{getattr(wanted, 'model_type', wanted.__name__)!r} config, but model_type is "
            f"{getattr(config, 'model_type', None)!r}"
        )
    dtype = stored_dtype(config, checkpoint.path / CONFIG_FILE)
    try:
        with quiet_transformers(), torch.device("meta"):
            model = cls._from_config(config, dtype=dtype)
    except Exception as exc:
        raise BadInputError(
            f"transformers cannot build {checkpoint.architecture} from {checkpoint.path / CONFIG_FILE}: "
            f"{describe(exc)}"
        ) from None
    from normswap.load.recorded import replace_recorded

    replace_recorded(model, checkpoint, device="meta")
    return model.eval()


@contextlib.contextmanager
def _weight_init_skipped() -> Iterator[None]:
    """transformers' own context for building a model whose every weight is loaded right after (what its
    DeepSpeed path does): torch's init functions and the model's ``init_weights`` do nothing inside it,
    while buffers computed in ``__init__`` (rotary frequencies, position ids) are computed as usual.
    Initializing the weights of a 4096-wide OPT shell only to overwrite them took 8 s and 1.2 GB of
    float32 temporaries; without it, 1.5 s. Where transformers has no such context, weights are
    initialized as before. The context swaps torch's init functions for no-ops only while it is open
    (transformers' doing, undone on exit, also on error), around the model's construction alone, on
    the thread that builds it: no other normswap thread runs then."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4
        except ImportError:
            yield
            return
    with no_init_weights():
        yield


def stored_entries(directory: CheckpointDirectory) -> Iterator[tuple[str, Path, Any]]:
    """Each tensor the directory stores, as its name, its shard's path and its header entry
    (``TensorEntry``), read from the shard the index names for it; headers only, no tensor read."""
    from normswap.load.safetensors_io import read_header

    for shard in directory.shards:
        entries, _ = read_header(directory.path / shard)
        for name, entry in entries.items():
            if directory.weight_map.get(name) == shard:
                yield name, directory.path / shard, entry


def stored_tensor_reader(
    directory: CheckpointDirectory, parameters: frozenset[str] = frozenset(), *, checked: bool = True
) -> Callable[[str], torch.Tensor]:
    """Reads one stored tensor of ``directory`` by its stored name (each shard's header read once), held
    to the NaN/Inf rule of :mod:`normswap.util.finite`: a parameter's (``parameters``) or a buffer's;
    unless not ``checked`` (a directory normswap wrote, or one already read under the rule: the comparison
    that reads it judges it)."""
    from normswap.load.safetensors_io import read_header, read_model_tensor, read_tensor

    headers: dict[str, dict[str, Any]] = {}

    def read(name: str) -> torch.Tensor:
        shard = directory.weight_map[name]
        if shard not in headers:
            headers[shard] = read_header(directory.path / shard)[0]
        if not checked:
            return read_tensor(directory.path / shard, headers[shard][name])
        return read_model_tensor(
            directory.path / shard, name, headers[shard][name], buffer=name not in parameters
        )

    return read


def build_to_load(checkpoint: CheckpointDirectory, config: Any = None) -> nn.Module:
    """The directory's model (or the model of ``config``, a transformers config) on the CPU in the stored
    dtype, weights not initialized: the caller loads every one of them (and must refuse a model whose
    files do not cover it: an unloaded weight holds whatever the memory held)."""
    if config is None:
        config = transformers_config(checkpoint)
    with quiet_transformers(), _weight_init_skipped():
        model = _model_class(checkpoint)._from_config(config, dtype=stored_dtype(config))
        # transformers 5 ties weights inside the init_weights that the context skips: tie them here, so
        # that a tied head is the embedding (one stored tensor) as in the model from_pretrained builds
        model.tie_weights()
    return model


def load_checkpoint_directory(checkpoint: CheckpointDirectory) -> nn.Module:
    """The directory's model with its weights, in eval mode, in the dtype they are stored in."""
    if checkpoint.replaced_modules:
        return _load_with_record(checkpoint)
    try:
        with quiet_transformers():
            model, info = _model_class(checkpoint).from_pretrained(
                checkpoint.path,
                local_files_only=True,
                trust_remote_code=False,
                use_safetensors=True,
                output_loading_info=True,
            )
    except BadInputError:
        raise
    except Exception as exc:
        raise BadInputError(f"transformers could not load {checkpoint.path}: {describe(exc)}") from None
    problems = {k: list(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise BadInputError(
            f"{checkpoint.path}: the weights do not match the model: {_describe_mismatch(info)}"
        )
    return model.eval()


def _describe_mismatch(info: dict[str, Any]) -> str:
    parts = []
    for key, label in (
        ("missing_keys", "missing"),
        ("unexpected_keys", "unexpected"),
        ("mismatched_keys", "wrong shape"),
    ):
        values = sorted(str(v) for v in info.get(key) or ())
        if values:
            parts.append(f"{len(values)} {label} (e.g. {values[0]})")
    parts += [str(msg).splitlines()[0] for msg in info.get("error_msgs") or ()]
    return "; ".join(parts) or "unknown"


def _load_with_record(checkpoint: CheckpointDirectory) -> nn.Module:
    """Build the stock model, put the recorded modules in, and load every tensor from the shards into it:
    each model tensor exactly once from the files (tied tensors through their one stored name), nothing
    left over, shapes as stored."""
    from normswap.load.recorded import replace_recorded
    from normswap.load.safetensors_io import fill_tensor

    model = build_to_load(checkpoint)
    replace_recorded(model, checkpoint, device="cpu")
    expected = model.state_dict(keep_vars=True)
    # the names transformers' loader gives the stored tensors (save_pretrained writes GPT-NeoX's lm_head
    # as embed_out, a folded bias included): the files are read under those names
    loaded = loaded_names(model, list(checkpoint.weight_map))
    if loaded is None:
        raise BadInputError(
            f"{checkpoint.path}: {MERGED_ON_LOAD}: load it as it was written from, or save the model as .pt2"
        )
    stored = set(loaded.values())
    # A tied tensor appears under several names in the state dict and is stored under one of them.
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    missing = [names[0] for names in by_tensor.values() if not any(n in stored for n in names)]
    unexpected = sorted(stored - set(expected))
    if missing or unexpected:
        info = {"missing_keys": missing, "unexpected_keys": unexpected}
        raise BadInputError(
            f"{checkpoint.path}: the weights do not match the model: {_describe_mismatch(info)}"
        )
    # the one way normswap loads a stored tensor into a model's (the verification shells use it too):
    # read straight into the tensor's memory where its layout allows
    for name, shard_path, entry in stored_entries(checkpoint):
        fill_tensor(shard_path, name, entry, expected[loaded[name]])
    return model.eval()
