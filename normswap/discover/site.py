"""The record normswap keeps for each normalization it finds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from normswap.modules.semantics import NORM_KINDS, NormKind, NormSemantics


def _semantic(name: str) -> property:
    def get(self: NormSite) -> Any:
        return getattr(self.semantics, name)

    get.__doc__ = f"``semantics.{name}``"
    return property(get)


@dataclass
class NormSite:
    """One normalization in a model: what it computes (``semantics``) and where it sits.

    ``semantics`` (:class:`normswap.modules.semantics.NormSemantics`) is frozen and computed once, by
    discovery: kind, normalized dims and shape, eps as applied for the dtype the norm runs in, affine and
    bias with their parameter names, casting mode, weight offset. Every pass reads it; none reads the
    module's attributes again. Its fields are also readable on the site itself (``site.eps`` is
    ``site.semantics.eps``), read-only; the JSON form (:meth:`to_dict`) is flat, as it has always been.

    The rest is placement, which discovery fills in as it learns it. ``source`` says how the norm was
    found: ``"module"`` (a class whose semantics we know: torch.nn's, ours, FrozenBatchNorm),
    ``"structural"`` (a class we do not know, recognized by what its forward computes: a norm written out
    in any form, or one ``F.layer_norm``/``F.rms_norm`` call on its own tensors), ``"functional"`` (a
    ``F.layer_norm``-style call inside some other module's forward) or ``"pattern"`` (a norm written out as
    elementary ops inside another module's forward).
    """

    path: str
    source: str
    semantics: NormSemantics
    class_name: str | None = None
    training: bool | None = None
    call_count: int | None = None
    producer: str | None = None
    consumers: list[str] = field(default_factory=list)
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    order: int = field(default=math.inf, repr=False, compare=False)  # type: ignore[assignment]

    kind = _semantic("kind")
    normalized_dims = _semantic("normalized_dims")
    normalized_shape = _semantic("normalized_shape")
    eps = _semantic("eps")
    dtype = _semantic("dtype")
    affine = _semantic("affine")
    bias = _semantic("bias")
    weight_name = _semantic("weight_name")
    bias_name = _semantic("bias_name")
    casting = _semantic("casting")
    weight_offset = _semantic("weight_offset")
    num_groups = _semantic("num_groups")
    running_stats = _semantic("running_stats")
    momentum = _semantic("momentum")

    @property
    def is_module(self) -> bool:
        """True when the norm is a whole module that can be replaced by another module."""
        return self.source in ("module", "structural")

    def inside(self) -> str:
        """For messages about a norm that is not a module: "inside a forward", or, for the norm of a norm
        class whose own forward computes more than its norm (:mod:`normswap.discover.own_forward`; its
        class is this site's), "inside X.forward, which computes more than the norm"."""
        if self.is_module or not self.class_name or "::" in self.class_name:
            return "inside a forward"
        return f"inside {self.class_name.rsplit('.', 1)[-1]}.forward, which computes more than the norm"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            **self.semantics.to_dict(),
            "class_name": self.class_name,
            "training": self.training,
            "call_count": self.call_count,
            "producer": self.producer,
            "consumers": list(self.consumers),
        }


__all__ = ["NORM_KINDS", "NormKind", "NormSemantics", "NormSite"]
