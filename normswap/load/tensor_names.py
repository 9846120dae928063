"""How a model directory's stored tensor names relate to the model's: the names transformers' loader
gives them (its per-architecture key renamings), and the hint for files saved with or without a head."""

from __future__ import annotations

from torch import nn


def loaded_names(model: nn.Module, names: list[str]) -> dict[str, str] | None:
    """Each stored tensor name -> the name transformers' loader gives it in ``model`` (its key renamings
    for the architecture; the same name when it has none). None when the architecture's conversion
    merges or splits tensors (a fused expert weight): then no name maps to one tensor."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # a transformers without load-time conversions
        return {name: name for name in names}
    try:
        transforms = get_model_conversion_mapping(model)
    except Exception:  # a model transformers cannot map is loaded by name
        return {name: name for name in names}
    if any(isinstance(t, WeightConverter) for t in transforms):
        return None
    return {name: rename_source_key(name, transforms, [])[0] for name in names}


def stored_names(model: nn.Module, names: list[str]) -> dict[str, str] | None:
    """The other way round: each name ``model`` gives a stored tensor (of the stored ``names``) -> its
    stored name, by :func:`loaded_names` (the one renaming rule), for a reader that starts from the
    model's names (a model with one block, filled block by block). None where that is None."""
    loaded = loaded_names(model, names)
    return None if loaded is None else {as_loaded: stored for stored, as_loaded in loaded.items()}


# Why a model directory with recorded modules cannot hold (or be read back as) an architecture whose
# loading merges or splits tensors: one sentence for the reader and for the writer, which refuses first.
MERGED_ON_LOAD = (
    "transformers merges or splits this architecture's tensors as it loads them, and a directory with "
    "recorded modules is read tensor by tensor"
)


def prefix_hint(missing: list[str], unexpected: list[str], architecture: str) -> str:
    """A note when the mismatch is a head: the files hold a model with (or without) the base-model prefix
    that the architecture lacks (has), e.g. a GPT2LMHeadModel's files under 'architectures: GPT2Model'."""
    if missing and unexpected and all("." in n for n in unexpected):
        prefixes = {n.split(".", 1)[0] for n in unexpected}
        if len(prefixes) <= 2 and any(n.split(".", 1)[1] in missing for n in unexpected if "." in n):
            return (
                f" (the files hold a model with a head or a base-model prefix {sorted(prefixes)}; "
                f"'architectures' must name the class that saved them, not {architecture})"
            )
    return ""
