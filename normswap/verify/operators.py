"""What a rewrite costs per forward: the operators one forward of the model runs, before and after.

Counted where torch dispatches them (a :class:`TorchDispatchMode` around one forward on the example, no
gradient): every ATen or custom op the model calls, once per call, by its name without the overload
(``aten.addmm.default`` is ``addmm``); what an op runs inside (a fused op's own implementation) is the
op's business and not counted. One forward each of the original and the converted model, so the cost
is two example runs, not an export: the figure every in-memory conversion reports (the streamed route
holds no model and reports none).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from normswap.modules.copying import copy_model
from normswap.util.modes import updates_its_state
from normswap.verify.compare import attributes_restored


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = getattr(func, "overloadpacket", func)
        namespace = getattr(packet, "_qualified_op_name", "").split("::")[0]
        name = getattr(packet, "__name__", str(func))
        self.counts[name if namespace in ("aten", "") else f"{namespace}.{name}"] += 1
        return func(*args, **(kwargs or {}))


def operator_counts(model: nn.Module, example_args: tuple, example_kwargs: dict[str, Any]) -> Counter[str]:
    """The operators one forward of ``model`` on the example runs, by name (module doc)."""
    counting = _Counting()
    args, kwargs = copy.deepcopy(tuple(example_args)), copy.deepcopy(dict(example_kwargs))
    if updates_its_state(model):
        # run as run_model runs it (on a copy), but copied before the count: the copy's clone, detach
        # and set_ are not the model's work
        model = copy_model(model)
    with torch.no_grad(), attributes_restored(model), counting:
        model(*args, **kwargs)
    return counting.counts


@dataclass
class OperatorCost:
    """The operators per forward of the original and of the converted model (:func:`operator_counts`)."""

    before: dict[str, int]
    after: dict[str, int]

    @property
    def added(self) -> dict[str, int]:
        return dict(sorted((Counter(self.after) - Counter(self.before)).items()))

    @property
    def removed(self) -> dict[str, int]:
        return dict(sorted((Counter(self.before) - Counter(self.after)).items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "before": sum(self.before.values()),
            "after": sum(self.after.values()),
            "added": self.added,
            "removed": self.removed,
        }

    def summary(self) -> str:
        """``operators per forward 1,012 -> 1,004 (+12 mean, -20 native_layer_norm)``."""
        changes = [f"+{n} {op}" for op, n in self.added.items()]
        changes += [f"-{n} {op}" for op, n in self.removed.items()]
        moved = f" ({', '.join(changes)})" if changes else " (the same operators)"
        return f"operators per forward {sum(self.before.values()):,} -> {sum(self.after.values()):,}{moved}"


def operator_cost(
    original: nn.Module, converted: nn.Module, example_args: tuple, example_kwargs: dict[str, Any]
) -> OperatorCost:
    """One forward of each model on the example, its operators counted."""
    before = operator_counts(original, example_args, example_kwargs)
    after = operator_counts(converted, example_args, example_kwargs)
    return OperatorCost(dict(sorted(before.items())), dict(sorted(after.items())))


__all__ = ["OperatorCost", "operator_cost", "operator_counts"]
