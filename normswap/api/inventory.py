"""What ``normswap inspect MODEL`` does, as a library call: every norm of a model (and its
cosine-normalized layers), found on one graph capture, as one typed result.

::

    found = normswap.api.inspect("gpt2_dir", input_shapes=["int64:1,16"])
    print(found.inventory.counts())

A model directory is built on the meta device: its norms are found without reading a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normswap.api.sources import check_inputs_fit, load_for_inference
from normswap.errors import BadInputError
from normswap.load.inputs import resolve_inputs

if TYPE_CHECKING:
    from normswap.discover.cosine import CosineSite
    from normswap.discover.find import NormInventory


@dataclass
class Inspection:
    """The norms of ``model`` (a spec): the inventory, the cosine-normalized layers (``cosine``), and
    whether the weights were left unread (``weights_read`` False for a model directory, whose cosine
    layers are then not looked for). :meth:`to_dict` is ``inspect --json``."""

    model: str
    inventory: NormInventory
    cosine: list[CosineSite] = field(default_factory=list)
    weights_read: bool = True

    def to_dict(self) -> dict[str, Any]:
        inventory = self.inventory
        return {
            "model": self.model,
            "graph_method": inventory.graph_method,
            "graph_errors": inventory.capture.errors,
            "graph_notes": inventory.capture.notes,
            "counts": inventory.counts(),
            "sites": [s.to_dict() for s in inventory],
            "cosine_layers": [c.to_dict() for c in self.cosine],
        }


def inspect(
    model: str,
    *,
    weights: str | Path | None = None,
    trust_pickle: bool = False,
    inputs: str | Path | None = None,
    input_shapes: list[str] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> Inspection:
    """Find every normalization in ``model`` (a spec): kind, shape, eps, affine, and what feeds and reads
    it, on the example inputs (``inputs``, ``input_shapes`` or the model's own) when known. Inputs that
    the user gave are first run once, so inputs that do not fit fail in one line."""
    from normswap.discover import find_norms

    loaded = load_for_inference(model, weights, trust_pickle, structure_only=True)
    resolved = resolve_inputs(loaded, inputs_file=inputs, input_shapes=input_shapes)
    args, kwargs = resolved if resolved is not None else (None, None)
    directory = loaded.format == "directory"
    if directory and resolved is not None:
        args, kwargs = _on_meta(args), _on_meta(kwargs)
    if inputs is not None or input_shapes:
        try:
            check_inputs_fit(loaded.model, args, kwargs, outputs_judged=False)
        except BadInputError as exc:
            # A directory's model is built on the meta device, where some forwards cannot run at all
            # (GPT-2's calls .item()): that says nothing of the inputs, and the capture below, which
            # traces the model on them, says what does not fit. Any other failure is the inputs'.
            if not (directory and "meta" in str(exc).lower()):
                raise
    if on_step is not None:
        on_step("capturing a graph of the model")
    inventory = find_norms(loaded.model, args, kwargs)
    # Cosine-normalized layers are confirmed by running the candidate ops on random rows with the
    # layer's weights, which a directory built on the meta device does not have.
    cosine: list[CosineSite] = []
    if not directory and (args is not None or kwargs):
        from normswap.discover.cosine import find_cosine_sites

        cosine = find_cosine_sites(loaded.model, args, kwargs, captured=inventory.capture)
    return Inspection(model, inventory, cosine, weights_read=not directory)


def _on_meta(value: Any) -> Any:
    """Inputs for a model built on the meta device: every tensor as a meta tensor of its shape and dtype."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(v) for v in value)
    return value
