"""The record normswap keeps for each normalization it finds."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

NORM_KINDS = ("batch", "layer", "group", "instance", "rms", "other")


@dataclass
class NormSite:
    """One normalization in a model.

    ``source`` says how it was found: ``"module"`` (a class whose semantics we know: torch.nn's, ours,
    FrozenBatchNorm), ``"structural"`` (a class we do not know, recognized by what its forward computes:
    a norm written out in any form, or one ``F.layer_norm``/``F.rms_norm`` call on its own tensors),
    ``"functional"`` (a ``F.layer_norm``-style call inside some other module's forward) or ``"pattern"``
    (a norm written out as elementary ops inside another module's forward).
    """

    path: str
    kind: str
    source: str
    class_name: str | None = None
    normalized_dims: tuple[int, ...] | None = None
    normalized_shape: tuple[int, ...] | None = None
    eps: float | None = None
    affine: bool = False
    bias: bool = False
    running_stats: bool = False
    momentum: float | None = None
    num_groups: int | None = None
    casting: str = "none"
    weight_offset: float = 0.0
    # Names of the norm's affine tensors inside its module ("gain", "shift" for a hand-written class);
    # None means torch's names, "weight" and "bias".
    weight_name: str | None = None
    bias_name: str | None = None
    dtype: str | None = None
    training: bool | None = None
    call_count: int | None = None
    producer: str | None = None
    consumers: list[str] = field(default_factory=list)
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    order: int = field(default=math.inf, repr=False, compare=False)  # type: ignore[assignment]

    @property
    def is_module(self) -> bool:
        """True when the norm is a whole module that can be replaced by another module."""
        return self.source in ("module", "structural")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("module", None)
        data.pop("order", None)
        for key in ("normalized_dims", "normalized_shape"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data
