"""The weight files of a model directory: under which names they are kept, found, checked and renamed.

A directory keeps its safetensors weights as ``save_pretrained`` writes them: ``model.safetensors``, or
shards listed by ``model.safetensors.index.json``. A directory normswap wrote whose recorded modules
transformers would build as other classes computing another function (:mod:`normswap.load.stock_reading`
says which, and ``normswap.json`` says why) keeps the same files under normswap's names: every weight
file's name prefixed with ``normswap-`` (``normswap-model.safetensors.index.json``,
``normswap-model-00001-of-00002.safetensors``). A stock loader (``from_pretrained``, and the tools that
read the index by its name) then finds no weights and stops, instead of loading the original classes
with these tensors: another model, and one it would not warn about where the tensor names agree
(LayerNorm read where RMSNorm was written). normswap's readers read both namings.

Everything here reads a directory as untrusted: an index names shards only as plain safetensors file
names inside the directory, each must be a readable safetensors file holding the tensors the index puts
there, and pickled ``pytorch_model.bin`` weights are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from normswap.errors import BadInputError, describe
from normswap.load.folder_files import folder_file, read_json


@dataclass(frozen=True)
class WeightNames:
    """One naming of a directory's weight files: the index, the single file, and the prefix of shards."""

    index: str
    single: str
    prefix: str

    def shard(self, name: str) -> str:
        """``name`` (a shard file of either naming) in this naming."""
        bare = name.removeprefix(HIDDEN.prefix)
        return self.prefix + bare


STOCK = WeightNames("model.safetensors.index.json", "model.safetensors", "")
# the names stock loaders do not look for (the weights of a model they would misread)
HIDDEN = WeightNames("normswap-model.safetensors.index.json", "normswap-model.safetensors", "normswap-")
_PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class StoredWeights:
    """A directory's weight files: their naming, the shard file names in order, tensor name -> shard, and
    whether an index lists them (else one file holds them all)."""

    names: WeightNames
    shards: tuple[str, ...]
    weight_map: dict[str, str]
    indexed: bool

    @property
    def hidden(self) -> bool:
        """Whether the files are under normswap's names, which stock loaders do not read."""
        return self.names is HIDDEN


def shard_keys(path: Path) -> list[str]:
    """The tensor names in a safetensors file, from its header alone; BadInputError if it is not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # the Rust reader raises its own error types
        raise BadInputError(f"{path} is not a readable safetensors file ({describe(exc)})") from None


def _shard_path(directory: Path, index: str, name: object) -> Path:
    if (
        not isinstance(name, str)
        or not name.endswith(".safetensors")
        or name != Path(name).name
        or name.startswith(".")
        or "\\" in name
    ):
        raise BadInputError(
            f"{directory / index} names a shard {name!r:.120} that is not a safetensors file name in the "
            "directory itself"
        )
    path = folder_file(directory, name)
    if not path.is_file():
        raise BadInputError(f"{directory / index} names {name}, which is not in {directory}")
    return path


def _naming(directory: Path) -> WeightNames | None:
    present = [
        names
        for names in (STOCK, HIDDEN)
        if folder_file(directory, names.index).is_file() or folder_file(directory, names.single).is_file()
    ]
    if len(present) > 1:
        raise BadInputError(
            f"{directory} holds weights under both the stock names ({STOCK.index} / {STOCK.single}) and "
            f"normswap's ({HIDDEN.index} / {HIDDEN.single}): which of them is the model is not clear"
        )
    return present[0] if present else None


def find_weights(directory: Path) -> StoredWeights:
    """The checked weight files of ``directory``, under either naming; BadInputError, with the reason,
    for a directory whose weights cannot be read as they are."""
    names = _naming(directory)
    if names is None:
        if any((directory / name).exists() for name in _PICKLED_WEIGHTS):
            raise BadInputError(
                f"{directory} holds pickled weights (pytorch_model.bin) and no safetensors; unpickling runs "
                "code, so normswap reads safetensors only: convert the weights with transformers' "
                "save_pretrained (safe_serialization is its default) and give that directory"
            )
        raise BadInputError(f"{directory} has a config.json but no {STOCK.single} and no {STOCK.index}")
    index_path = folder_file(directory, names.index)
    if not index_path.is_file():
        keys = shard_keys(folder_file(directory, names.single))
        return StoredWeights(names, (names.single,), {key: names.single for key in keys}, indexed=False)
    index = read_json(index_path, "safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInputError(f"{index_path} has no 'weight_map' of tensor names to shard files")
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        _shard_path(directory, names.index, shard)
        shards.setdefault(shard, []).append(str(tensor))
    for shard, tensors in shards.items():
        present = set(shard_keys(directory / shard))
        absent = [t for t in tensors if t not in present]
        if absent:
            raise BadInputError(
                f"{directory / shard} lacks {len(absent)} tensors that {names.index} puts there "
                f"(e.g. {absent[0]})"
            )
    weight_map = {str(k): str(v) for k, v in weight_map.items()}
    return StoredWeights(names, tuple(sorted(shards)), weight_map, indexed=True)


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int, names: WeightNames) -> None:
    """The safetensors index of ``directory`` under ``names``, as ``save_pretrained`` writes one."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / names.index).write_text(json.dumps(index, indent=2) + "\n")


def rename_weights(directory: Path, names: WeightNames) -> list[str]:
    """Give the weight files of ``directory`` (a directory being written, not yet published) the names
    ``names`` says, the index rewritten to match; returns the shard file names."""
    stored = find_weights(directory)
    if stored.names is names:
        return list(stored.shards)
    renamed = {shard: names.shard(shard) if stored.indexed else names.single for shard in stored.shards}
    for old, new in renamed.items():
        (directory / old).rename(directory / new)
    if stored.indexed:
        index = read_json(directory / stored.names.index, "safetensors index")
        total = index.get("metadata", {}).get("total_size", 0) if isinstance(index, dict) else 0
        write_index(directory, {t: renamed[s] for t, s in stored.weight_map.items()}, total, names)
        (directory / stored.names.index).unlink()
    return sorted(renamed.values())
