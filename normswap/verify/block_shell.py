"""A model directory's model with one block, whose block takes any block's weights in turn: the shell
the block-by-block verification (:mod:`normswap.verify.blockwise`) and calibration
(:mod:`normswap.calibrate.sequential`) run a model in without holding it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from normswap.errors import BadInputError
from normswap.load.checkpoint_dir import CheckpointDirectory, build_to_load, transformers_config
from normswap.load.recorded import replace_recorded
from normswap.load.safetensors_io import TensorEntry, fill_tensor, read_header
from normswap.load.tensor_names import stored_names


def shell_names(model: nn.Module, checkpoint: CheckpointDirectory) -> dict[str, str]:
    """Each name ``model`` (the directory's model, or its model with one block) gives a stored tensor ->
    the name ``checkpoint`` stores it under: transformers renames some architectures' tensors as it loads
    them (ViT's ``vit.encoder.layer.0.attention.attention.query`` is ``vit.layers.0.attention.q_proj``),
    and a shell is filled by the model's names. BadInputError where the loader merges or splits tensors
    (no name is one stored tensor): such a model is not run block by block."""
    names = stored_names(model, list(checkpoint.weight_map))
    if names is None:
        raise BadInputError(
            f"{checkpoint.path}: transformers merges or splits this architecture's tensors as it loads "
            "them, and a model with one block is filled tensor by tensor: it cannot be run block by block; "
            "convert or compare it in memory"
        )
    return names


class BlockShell:
    """One model directory's model with one block, whose block takes any block's weights; ``checked``:
    what a refusal calls the model held to the broken-model rule as it is read (None: normswap's output)."""

    def __init__(
        self, checkpoint: CheckpointDirectory, blocks: str, checked: str | None = "the model"
    ) -> None:
        self.checked = checked
        config = transformers_config(checkpoint)
        config = copy.deepcopy(config)
        config.num_hidden_layers = 1
        for key in ("layer_types",):
            if isinstance(getattr(config, key, None), list):
                setattr(config, key, getattr(config, key)[:1])
        # weights left uninitialized: _load below fills every one the shell has (or refuses)
        self.model = build_to_load(checkpoint, config).eval()
        self.checkpoint = checkpoint
        self._stored = shell_names(self.model, checkpoint)
        self.blocks = blocks
        self.last_block = f"{blocks}.0"  # the block whose output the head reads
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self.recipes = checkpoint.replaced_modules
        # modules normswap changed outside the blocks (a final norm) are put in once
        outside = {p: r for p, r in self.recipes.items() if not p.startswith(blocks + ".")}
        replace_recorded(self.model, checkpoint, device="cpu", only=outside)
        self._load(lambda name: None if name.startswith(blocks + ".") else name)

    def _load(self, model_name: Callable[[str], str | None]) -> None:
        """Copy into the shell every tensor whose name ``model_name`` maps to one of the directory's model
        (the shell's block 0 -> block ``i``), read under the name it is stored by (tied names share one
        tensor: one stored name fills them all)."""
        wanted: dict[str, list[torch.Tensor]] = {}
        missing = []
        groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            groups.setdefault(id(tensor), []).append((name, tensor))
        for members in groups.values():
            sources = [model_name(name) for name, _ in members]
            if all(s is None for s in sources):
                continue
            stored = next((self._stored[s] for s in sources if s in self._stored), None)
            if stored is None:
                missing.append(next(s for s in sources if s is not None))
                continue
            wanted.setdefault(stored, []).append(members[0][1])
        if missing:
            raise BadInputError(
                f"{self.checkpoint.path}: {len(missing)} tensors not stored (e.g. {missing[0]})"
            )
        with torch.no_grad():
            for name, targets in wanted.items():
                shard = self.checkpoint.weight_map[name]
                if shard not in self._headers:
                    self._headers[shard] = read_header(self.checkpoint.path / shard)[0]
                entry = self._headers[shard][name]
                value = fill_tensor(
                    self.checkpoint.path / shard, name, entry, targets[0], checked=self.checked
                )
                for target in targets[1:]:
                    target.copy_(value)

    def take_block(self, index: int) -> nn.Module:
        """The shell's block, now block ``index`` of the directory's model."""
        prefix, shell_prefix = f"{self.blocks}.{index}.", f"{self.blocks}.0."
        inside = {shell_prefix + p[len(prefix) :]: r for p, r in self.recipes.items() if p.startswith(prefix)}
        if inside:
            replace_recorded(self.model, self.checkpoint, device="cpu", only=inside)
        self._load(lambda name: prefix + name[len(shell_prefix) :] if name.startswith(shell_prefix) else None)
        return self.model.get_submodule(shell_prefix[:-1])
