"""Write a converted Hugging Face model as a model directory: sharded safetensors with their index, the
config updated for what changed, and the other files of the input directory copied.

The directory is written with transformers' own ``save_pretrained`` (standard layout: shards named
``model-0000i-of-0000N.safetensors`` with ``format: pt`` metadata, ``model.safetensors.index.json``)
into a temporary sibling, and renamed to its name only once complete: an interrupted run leaves a
hidden ``.NAME.normswap-tmp-...`` folder, never a directory that looks complete. An existing path is
never written over.

Two kinds of output, told apart by comparing the converted model's module classes with those the config
builds:

- the same classes (a norm's affine folded into the next linear; weights rewritten in place): a stock
  directory, loaded by ``AutoModel*.from_pretrained`` like the original;
- changed classes (LayerNorm -> RMSNorm, fused norms): the new modules are recorded as recipes in
  ``normswap.json`` (:mod:`normswap.modules.recipes`) and :func:`normswap.load.load_model` rebuilds
  them. transformers is not patched: its ``from_pretrained`` would build the original classes, so such a
  directory is for normswap's loader (or a model built the same way by hand).

A model whose changes have no recipe (a graph rewrite, parametrizations) is refused before any work,
with the module that has none: save it as .pt2.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError
from normswap.load.checkpoint_dir import CONFIG_FILE, RECORD_FILE, CheckpointDirectory, quiet_transformers
from normswap.load.folder_files import folder_file
from normswap.load.safetensors_io import TensorEntry, read_header
from normswap.load.stock_reading import finish_directory, stock_of_directory, stock_on_meta
from normswap.load.tensor_names import MERGED_ON_LOAD, loaded_names
from normswap.load.weight_files import HIDDEN, STOCK, write_index
from normswap.util.dtypes import floating_dtype

# Files of the input directory not copied: the weights (rewritten), what save_pretrained writes anew, and
# other weight formats that would hold the unconverted model.
_WRITTEN_ANEW = {
    CONFIG_FILE,
    RECORD_FILE,
    "generation_config.json",
    *(n for names in (STOCK, HIDDEN) for n in (names.index, names.single)),
}
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".pt2",
)
_DEFAULT_SHARD_BYTES = 5 * 1024**3


@dataclass
class WrittenDirectory:
    """What :func:`write_checkpoint_directory` wrote: the shards, whether the stock ``from_pretrained``
    loads the result (``stock``), the modules recorded in ``normswap.json``, the files copied from the
    input directory and those left out (other weight formats, folders), and the config keys changed."""

    path: Path
    shards: list[str]
    stock: bool
    recorded_modules: dict[str, Any] = field(default_factory=dict)
    copied_files: list[str] = field(default_factory=list)
    not_copied: list[str] = field(default_factory=list)
    config_changes: dict[str, Any] = field(default_factory=dict)
    neutral_affine: list[str] = field(default_factory=list)
    reload_max_rel: float | None = None
    # why the weights are under normswap's names, which stock loaders do not read (None: stock names)
    stock_refused: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "shards": self.shards,
            "stock_from_pretrained": self.stock,
            "stock_refused": self.stock_refused,
            "recorded_modules": sorted(self.recorded_modules),
            "copied_files": self.copied_files,
            "not_copied": self.not_copied,
            "config_changes": self.config_changes,
            "neutral_affine": self.neutral_affine,
            "reload_max_rel": self.reload_max_rel,
        }


# A file extension, as in .pt2, .onnx, .safetensors: letters first. What follows the last dot of
# "Qwen2.5-0.5B-folded" (a version in a model's name) is none, and that name is a directory like any other.
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,11}")


def is_directory_output(path: str | Path) -> bool:
    """An output path whose name ends in no file extension names a model directory, as in every Hugging
    Face tool: ``-o out``, ``-o out/``, ``-o Qwen2.5-0.5B-folded``."""
    return _EXTENSION.fullmatch(Path(path).suffix) is None


def _is_pretrained(model: nn.Module) -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return isinstance(model, transformers.PreTrainedModel)


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


def _neutral_affine(
    stock: nn.Module, converted: nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """The tensors that make ``stock`` (the class the config builds, on meta) compute what ``converted``
    (the same norm left without affine by a fold) computes: the values the fold recorded on it
    (:func:`~normswap.modules.norms.folded_affine`: weight 1, or 0 for a ``(1 + w)`` norm, bias 0), in
    ``dtype`` (the converted model's: a model written with --dtype is not the dtype its config names).
    Confirmed by running both on random inputs and asking for equal outputs; None when nothing was
    recorded or the stock class does not compute the same with them."""
    import copy

    from normswap.modules.norms import folded_affine

    recorded = folded_affine(converted)
    if recorded is None or _own_tensors(converted) or list(converted.children()) or list(stock.children()):
        return None
    stock_tensors = _own_tensors(stock)
    if set(recorded) != set(stock_tensors) or any(
        tuple(recorded[n].shape) != tuple(stock_tensors[n].shape) for n in recorded
    ):
        return None
    dtype = dtype or next((t.dtype for t in stock_tensors.values()), torch.float32)
    tensors = {name: value.to(device="cpu", dtype=dtype) for name, value in recorded.items()}
    probe = copy.deepcopy(stock).to_empty(device="cpu").to(dtype)
    shape = next(iter(tensors.values())).shape
    x = (torch.randn(4, 3, *shape, generator=torch.Generator().manual_seed(0)) * 3 + 1).to(dtype)
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(probe, name).copy_(value)
        return tensors if torch.equal(probe(x), converted(x)) else None


@dataclass
class DirectoryPlan:
    """How a converted model goes into a model directory: ``recorded`` module path -> recipe of the modules
    normswap's loader rebuilds; ``neutral`` state-dict name -> tensor added where a stock class with
    neutral affine computes what the converted weightless norm computes (a folded norm's affine)."""

    recorded: dict[str, Any] = field(default_factory=dict)
    neutral: dict[str, torch.Tensor] = field(default_factory=dict)


def _same_class(stock: nn.Module, module: nn.Module) -> bool:
    """The same class, or the same class parametrized alike: torch gives every parametrized module a class
    of its own (``ParametrizedConv1d``), so two weight-normed convs never share one."""
    from torch.nn.utils import parametrize

    from normswap.modules.recipes import module_recipe

    if type(stock) is type(module):
        return True
    if not (parametrize.is_parametrized(stock) and parametrize.is_parametrized(module)):
        return False
    recipe = module_recipe(module)
    return recipe is not None and recipe == module_recipe(stock)


def plan_directory(model: nn.Module, stock_model: nn.Module) -> DirectoryPlan:
    """Compare the converted model with ``stock_model`` (what its config builds, on meta), module by
    module (class and own tensor names), and say how each difference is written. BadInputError when one cannot be: a class without
    a recipe, a module gone. Such a model is saved as .pt2."""
    from normswap.modules.recipes import module_recipe

    stock = dict(stock_model.named_modules())
    dtype = floating_dtype(model)
    plan = DirectoryPlan()
    present: set[str] = set()
    for name, module in model.named_modules():
        present.add(name)
        if any(name.startswith(parent + ".") for parent in plan.recorded):
            continue  # inside a recorded module: built with it
        original = stock.get(name)
        same_class = original is not None and _same_class(original, module)
        if same_class and set(_own_tensors(original)) == set(_own_tensors(module)):
            continue
        if original is not None and name:
            neutral = _neutral_affine(original, module, dtype)
            if neutral is not None:
                plan.neutral.update({f"{name}.{key}": value for key, value in neutral.items()})
                continue
        recipe = module_recipe(module) if name else None
        if recipe is None:
            raise BadInputError(unrecordable(name, module))
        plan.recorded[name] = recipe
    if plan.recorded and loaded_names(stock_model, []) is None:
        # the directory could be written but not read back (the reader's rule): refused before writing
        raise BadInputError(
            f"the conversion changes {len(plan.recorded)} modules (e.g. {next(iter(plan.recorded))}), which a "
            f"model directory records, but {MERGED_ON_LOAD}: save as .pt2; nothing written"
        )
    gone = [n for n in stock if n not in present and not any(n.startswith(p + ".") for p in plan.recorded)]
    if gone:
        raise BadInputError(
            f"the conversion removed {len(gone)} modules the config builds (e.g. {gone[0]}): a model "
            "directory cannot say so; save as .pt2"
        )
    return plan


def unrecordable(name: str, module: nn.Module) -> str:
    """Why the converted model's ``module`` at ``name``, not what its config builds, cannot be written into
    a model directory (its class has no recipe): one sentence for every route that finds it."""
    return (
        f"the converted model's {name or 'root'} ({type(module).__name__}) is not what its config builds, "
        "and normswap cannot record it in a model directory: save as .pt2; nothing written"
    )


def check_directory_plan(model: nn.Module) -> None:
    """Refuse, as soon as the converted ``model`` exists (before calibrating it or writing anything), a model
    a directory cannot hold: the check :func:`write_checkpoint_directory` makes first."""
    plan_directory(model, stock_on_meta(type(model), model.config))


def check_directory_output(model: nn.Module, path: str | Path) -> None:
    """Refuse, before any work, a directory output the model cannot be written to: not a transformers
    model, a missing parent folder. An existing path is the output rule's
    (:func:`normswap.load.paths.check_output`, which every command and :func:`normswap.save` apply)."""
    path = Path(path)
    if not _is_pretrained(model):
        raise BadInputError(
            f"-o {path}: a model directory is written for a transformers model (save_pretrained); "
            f"this is a {type(model).__name__}: save as .pt2, .pt or .onnx"
        )
    if not path.parent.is_dir():
        raise BadInputError(f"output directory does not exist: {path.parent}")


def _tie_setting(model: nn.Module) -> bool | None:
    """Whether the model's input and output embeddings are one tensor now (None: it has no pair)."""
    try:
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if inputs is None or outputs is None:
        return None
    return inputs.weight is outputs.weight


def _shard_bytes(source: CheckpointDirectory | None) -> int:
    if source is None or not source.shard_bytes:
        return _DEFAULT_SHARD_BYTES
    # as the input was cut: its largest shard (a little over, since the header is not tensor data)
    return max(source.shard_bytes.values())


def copy_side_files(source: CheckpointDirectory | None, temp: Path) -> tuple[list[str], list[str]]:
    if source is None:
        return [], []
    copied, skipped = [], []
    for entry in sorted(source.path.iterdir()):
        name = entry.name
        if name in _WRITTEN_ANEW or name in source.shards or (temp / name).exists():
            continue
        if not entry.is_file() or name.lower().endswith(_WEIGHT_SUFFIXES):
            skipped.append(name)  # folders (e.g. original/) and other weight files hold the unconverted model
            continue
        # never through a symlink out of the model folder (a tokenizer.json linked to a private file)
        shutil.copyfile(folder_file(source.path, name), temp / name)
        copied.append(name)
    return copied, skipped


def write_checkpoint_directory(
    model: nn.Module,
    path: str | Path,
    *,
    source: CheckpointDirectory | None = None,
    verify: Callable[[Path], float] | None = None,
    overwrite: bool = False,
) -> WrittenDirectory:
    """Write ``model`` (a transformers model) as a model directory at ``path``, atomically.

    ``source``: the directory it was loaded from, whose shard size is kept and whose other files
    (tokenizer, README, ...) are copied. ``verify``: called with the complete temporary directory before
    it takes its name; it loads it back and compares it with ``model``, returning the max relative
    difference, or raises, and then nothing is kept. An existing ``path`` is refused unless
    ``overwrite``; with it the new directory replaces the old one atomically."""
    from normswap.load.paths import check_output
    from normswap.load.save import directory_output

    path = Path(path)
    check_output("-o", path, overwrite=overwrite, directory=True)
    check_directory_output(model, path)
    stock_model = stock_on_meta(type(model), model.config)  # what from_pretrained builds, built once
    plan = plan_directory(model, stock_model)
    config = model.config
    tie = _tie_setting(model)
    config_changes: dict[str, Any] = {}
    saved_tie = getattr(config, "tie_word_embeddings", None)
    if tie is not None and saved_tie is not None and bool(saved_tie) != tie:
        config_changes["tie_word_embeddings"] = tie
    try:
        with directory_output(path, overwrite=overwrite) as temp:
            if config_changes:
                config.tie_word_embeddings = tie
            state = {**model.state_dict(), **plan.neutral}
            with quiet_transformers():
                model.save_pretrained(
                    temp, state_dict=state, max_shard_size=_shard_bytes(source), safe_serialization=True
                )
            stock_refused = finish_directory(temp, plan.recorded, lambda: stock_model)
            reload_error = verify(temp) if verify is not None else None
            copied, not_copied = copy_side_files(source, temp)
            shards = sorted(p.name for p in temp.glob("*.safetensors"))
    finally:
        if config_changes:
            config.tie_word_embeddings = saved_tie
    return WrittenDirectory(
        path=path,
        shards=shards,
        stock=stock_refused is None,
        stock_refused=stock_refused,
        recorded_modules=plan.recorded,
        neutral_affine=sorted(plan.neutral),
        copied_files=copied,
        not_copied=not_copied,
        config_changes=config_changes,
        reload_max_rel=reload_error,
    )


def stored_headers(
    checkpoint: CheckpointDirectory,
) -> dict[str, tuple[dict[str, TensorEntry], dict[str, str]]]:
    """Each shard's header (tensor name -> entry, and its metadata), as stored."""
    return {shard: read_header(checkpoint.path / shard) for shard in checkpoint.shards}


def finish_from_source(
    checkpoint: CheckpointDirectory,
    temp: Path,
    shards: list[str],
    *,
    config_changes: dict[str, Any],
    recorded: dict[str, Any],
) -> str | None:
    """Complete a model directory whose ``shards`` were written at ``temp`` in the layout of the directory
    ``checkpoint`` (a stream, a block-by-block calibration, a sharded save): the index, named as the
    input's weights are (one file without an index stays so); ``config.json`` with ``config_changes``;
    ``normswap.json`` for the modules the input recorded and ``recorded`` adds, the weight files named for
    who may read them (:func:`~normswap.load.stock_reading.finish_directory`); and the input's
    ``generation_config.json``. Returns why stock loaders are kept out (None: they read it)."""
    assert checkpoint.weights is not None
    if len(shards) > 1 or checkpoint.weights.indexed:
        weight_map: dict[str, str] = {}
        total = 0
        for shard in shards:
            entries, _ = read_header(temp / shard)
            for name, entry in entries.items():
                weight_map[name] = shard
                total += entry.nbytes
        write_index(temp, weight_map, total, checkpoint.weights.names)
    config = {**checkpoint.config, **config_changes}
    (temp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    modules = {**checkpoint.replaced_modules, **recorded}
    stock_refused = finish_directory(temp, modules, lambda: stock_of_directory(checkpoint))
    generation = folder_file(checkpoint.path, "generation_config.json")
    if generation.is_file():
        shutil.copyfile(generation, temp / generation.name)
    return stock_refused
