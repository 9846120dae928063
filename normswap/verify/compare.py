"""Compare two models on the same inputs: the check behind ``convert`` and the pipeline."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.modules.copying import copy_model
from normswap.util.modes import updates_its_state
from normswap.verify.metrics import TensorComparison, compare_tensors, flatten_outputs


@dataclass
class ModelComparison:
    outputs: list[TensorComparison] = field(default_factory=list)

    @property
    def within_tolerance(self) -> bool:
        """Every output within the exact tolerance; False when nothing was compared, since a check that
        compared no tensor proves nothing."""
        return bool(self.outputs) and all(o.within_tolerance for o in self.outputs)

    @property
    def nonfinite(self) -> str | None:
        """Where the first output holding a NaN or Inf holds it; None when every output is finite."""
        return next((o.nonfinite for o in self.outputs if o.nonfinite), None)

    @property
    def worst_sqnr_db(self) -> float:
        """The lowest SQNR; NaN when an output holds a NaN or Inf (then no SQNR is a number)."""
        if self.nonfinite:
            return float("nan")
        return min((o.sqnr_db for o in self.outputs), default=float("inf"))

    @property
    def worst_rel(self) -> float:
        """The largest max_abs / max|ref|; NaN when an output holds a NaN or Inf."""
        if self.nonfinite:
            return float("nan")
        return max((o.max_rel for o in self.outputs), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "within_tolerance": self.within_tolerance,
            "nonfinite": self.nonfinite,
            "worst_sqnr_db": self.worst_sqnr_db,
            "compared": len(self.outputs),
            "outputs": [asdict(o) for o in self.outputs],
        }


_MISSING = object()


@contextlib.contextmanager
def attributes_restored(model: nn.Module) -> Iterator[None]:
    """Undo what a forward rebinds on its modules. Some forwards adapt themselves to the input and keep
    the change: Hugging Face's Swin shrinks each layer's ``window_size`` to a small input's resolution,
    after which the example's size fails; run on an input variant, the converted model would be saved
    so changed. Attributes set, rebound or deleted during the run are put back as they were."""
    saved = [(vars(m), dict(vars(m))) for m in model.modules()]
    try:
        yield
    finally:
        for attrs, before in saved:
            for name in [name for name in attrs if name not in before]:
                del attrs[name]
            for name, value in before.items():
                if attrs.get(name, _MISSING) is not value:
                    attrs[name] = value


def run_model(model: nn.Module, args: tuple | None, kwargs: dict | None) -> Any:
    """Run ``model`` without changing it: a model whose run would change it
    (:func:`~normswap.util.modes.updates_its_state`: a BatchNorm in training mode updates its running
    statistics) runs on a copy, and what the forward rebinds on its modules is put back
    (:func:`attributes_restored`)."""
    if updates_its_state(model):
        model = copy_model(model)
    with torch.no_grad(), attributes_restored(model):
        return model(*(args or ()), **(kwargs or {}))


def compare_outputs(reference: Any, output: Any, *, floating_only: bool = True) -> ModelComparison:
    """Every output of ``reference`` against the same-named output of ``output``.

    ``floating_only=False`` (the exact checks) also compares integer and bool outputs, by equality.
    """
    ref_items = flatten_outputs(reference, floating_only=floating_only)
    out_items = dict(flatten_outputs(output, floating_only=floating_only))
    result = ModelComparison()
    for name, ref in ref_items:
        if name not in out_items:
            raise ValueError(f"converted model has no output {name!r}")
        result.outputs.append(compare_tensors(name, ref, out_items[name]))
    return result


def compare_models(
    original: nn.Module,
    converted: nn.Module,
    args: tuple | None,
    kwargs: dict | None = None,
    *,
    floating_only: bool = True,
) -> ModelComparison:
    """Run both models on the same (copied) inputs and compare every floating-point output (every
    tensor output with ``floating_only=False``)."""
    ref = run_model(original, copy.deepcopy(args), copy.deepcopy(kwargs))
    out = run_model(converted, copy.deepcopy(args), copy.deepcopy(kwargs))
    return compare_outputs(ref, out, floating_only=floating_only)
