"""Whether transformers' own ``from_pretrained`` would read a converted model directory as the model
normswap wrote, and the one place that finishes every directory normswap writes accordingly.

A directory whose conversion changed module classes records the new modules in ``normswap.json``;
transformers knows nothing of it and builds the classes the config names. That reads the model right
only where each recorded module computes, from the same tensors, what the stock class computes (a norm
moved onto the fused kernels). Anywhere else it is another model: with other tensor names its load report
lists them and leaves weights at their initial values (a folded BatchNorm, weight norm), and with the same
names it says nothing at all (LayerNorm read where RMSNorm was written). Such a directory keeps its
weights under normswap's names (:mod:`normswap.load.weight_files`), so a stock loader finds none and
stops; ``normswap.json`` says why, and :func:`normswap.load_model` reads it.

The judgement is per recorded module, on random tensors and inputs (the function, not the stored
values): the stock class and the recorded one must hold the same tensor names and compute the same
outputs within the exact tolerance of float32. Every writer of a model directory (in memory, streamed,
block by block) calls :func:`finish_directory`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.load.checkpoint_dir import (
    RECORD_FILE,
    RECORD_FORMAT,
    CheckpointDirectory,
    quiet_transformers,
    transformers_config,
)
from normswap.load.weight_files import HIDDEN, STOCK, rename_weights
from normswap.util.tolerance import within_exact_tolerance


def stock_on_meta(cls: type[nn.Module], config: Any) -> nn.Module:
    """The model ``config`` builds with transformers' class ``cls``, on the meta device: the classes and
    tensor names a stock ``from_pretrained`` makes."""
    with quiet_transformers(), torch.device("meta"):
        return cls._from_config(config)  # type: ignore[attr-defined]


def stock_of_directory(checkpoint: CheckpointDirectory) -> nn.Module:
    """The model a directory's config builds with transformers' own classes, on the meta device."""
    import transformers

    return stock_on_meta(getattr(transformers, checkpoint.architecture), transformers_config(checkpoint))


def _class(module: nn.Module) -> str:
    return type(module).__name__


def _widths(module: nn.Module) -> list[int]:
    """The channel counts a module of this kind may normalize: its 1-d tensors' lengths and the sizes its
    constructor was given (a norm without affine has no tensor to read them from)."""
    found = {t.shape[0] for t in (*module.parameters(), *module.buffers()) if t.ndim == 1}
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, tuple | list) and shape:
        found.add(int(shape[-1]))
    for attribute in ("num_features", "num_channels", "hidden_size", "dim"):
        value = getattr(module, attribute, None)
        if isinstance(value, int) and value > 0:
            found.add(value)
    return sorted(found)


def _probe_inputs(module: nn.Module, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Inputs a module of this kind takes: token ids for an embedding; its input features for a linear
    layer and its input channels for a convolution (a layer whose weight norm was removed, recorded
    where the stock class is the same layer); for a norm, its channel count as the last dim or as dim 1
    (channels-first)."""
    if isinstance(module, nn.Embedding):
        yield torch.randint(module.num_embeddings, (2, 5), generator=generator)
        return
    if isinstance(getattr(module, "in_features", None), int):
        yield torch.randn((2, 5, module.in_features), generator=generator)
    kernel = getattr(module, "kernel_size", None)
    if isinstance(getattr(module, "in_channels", None), int) and isinstance(kernel, tuple):
        spatial = [max(8, 2 * k) for k in kernel]
        yield torch.randn((2, module.in_channels, *spatial), generator=generator)
    for width in _widths(module):
        for shape in ((2, 5, width), (2, width, 3, 3), (2, width, 5)):
            yield torch.randn(shape, generator=generator) * 2 + 0.5


def _function_difference(stock: nn.Module, recorded: nn.Module) -> str | None:
    """Why the two modules (the same tensor names, on the meta device) may compute another function, or
    None when they compute the same outputs from the same random tensors on the first probe input both
    take (an integer buffer, such as a count, is zero in both)."""
    generator = torch.Generator().manual_seed(0)
    # Cast on meta and give both modules the one set of random tensors (assigned, in eval mode, so no
    # forward writes into what the other reads): one copy of an LM's embedding in memory, not three.
    old = copy.deepcopy(stock).float().to_empty(device="cpu").eval()
    new = copy.deepcopy(recorded).float().to_empty(device="cpu").eval()
    values = {}
    for name, tensor in old.state_dict().items():
        if tensor.is_floating_point():
            values[name] = torch.randn(tensor.shape, generator=generator).mul_(0.5).add_(1)
        else:
            values[name] = torch.zeros_like(tensor)
    try:
        old.load_state_dict(values, assign=True)
        new.load_state_dict(values, assign=True)
    except RuntimeError:  # the same names, other shapes
        return "holds tensors of other shapes"
    with torch.no_grad():
        for x in _probe_inputs(old, generator):
            try:
                want, got = old(x), new(x)
            except Exception:  # not an input of this module's shape: the next one
                continue
            if (
                not isinstance(want, torch.Tensor)
                or not isinstance(got, torch.Tensor)
                or want.shape != got.shape
            ):
                return "computes another function"
            max_abs = (want.double() - got.double()).abs().max().item()
            if within_exact_tolerance(max_abs, want.double().abs().max().item(), torch.float32):
                return None
            return "computes another function"
    return "could not be run on a probe input to confirm it computes the same function"


def stock_reading_problem(stock: nn.Module, modules: Mapping[str, Any]) -> str | None:
    """Why a stock ``from_pretrained`` of a directory recording ``modules`` (path -> recipe) would build
    another model than normswap's loader, given the model its config builds (``stock``, on meta); None
    when each recorded module computes what the stock one does."""
    from normswap.modules.recipes import build_from_recipe

    for path, recipe in sorted(modules.items()):
        try:
            old = stock.get_submodule(path)
        except AttributeError:
            return f"{path} is not a module its config builds"
        new = build_from_recipe(recipe, device="meta")
        old_names, new_names = sorted(old.state_dict()), sorted(new.state_dict())
        if old_names != new_names:
            return (
                f"{path} is a {_class(new)} holding {', '.join(new_names) or 'no tensors'}; the config "
                f"builds a {_class(old)} holding {', '.join(old_names) or 'no tensors'}"
            )
        difference = _function_difference(old, new)
        if difference is not None:
            return f"{path} is a {_class(new)}; the config builds a {_class(old)}, which {difference}"
    return None


def finish_directory(temp: Path, modules: Mapping[str, Any], stock: Callable[[], nn.Module]) -> str | None:
    """Finish a model directory being written at ``temp`` (weights and config there already): record
    ``modules`` (path -> recipe, the modules whose class normswap changed) in ``normswap.json``, and
    name the weight files so that a stock ``from_pretrained`` reads them only where it builds the model
    normswap wrote. ``stock`` builds the model the config builds, on meta (called only when ``modules``
    is not empty). Returns why stock loaders are kept out, or None."""
    problem = None
    if modules:
        problem = stock_reading_problem(stock(), modules)
        how = (
            f"transformers' from_pretrained would build another model ({problem}), so the weights are "
            f"stored as {HIDDEN.prefix}* files, which it does not read"
            if problem
            else "transformers' from_pretrained builds the original classes, which compute the same function"
        )
        record = {
            "format": RECORD_FORMAT,
            "version": 1,
            "about": "modules whose class normswap changed; load this directory with normswap.load_model",
            "stock_loading": how,
            "modules": dict(modules),
        }
        (temp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    rename_weights(temp, HIDDEN if problem else STOCK)
    return problem
