"""The one rule for a model that holds or computes NaN or Inf: it is broken, and every route refuses it.

A rewrite cannot be checked against a model whose outputs hold NaN or Inf (nothing is compared there),
and a model whose weights do would carry the NaN into whatever is written. So, before any work and
before anything is written, every command and route refuses such a model the same way
(:class:`normswap.errors.BrokenModelError`, exit 2) with one sentence naming the tensor, what it holds
and where:

- a parameter holding NaN or Inf;
- a buffer holding NaN (a buffer may hold +-Inf: a causal mask's -Inf, a BatchNorm variance of +Inf whose
  channel then computes its bias; it counts through the outputs);
- the model's outputs on the example inputs, wherever a route runs the model.

The same two tensor rules hold for a model in memory (its parameters and buffers), each stored tensor a
streamed route reads or copies (told which stored names are parameters by the model built on the meta
device) and each process's rows under torchrun.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from normswap.errors import BrokenModelError

NOTHING_COMPARED = "nothing can be compared there, and nothing was written"
_NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def first_nonfinite(t: torch.Tensor, *, nan_only: bool = False) -> tuple[int, list[int], str] | None:
    """(count, index of the first, "NaN"/"Inf"/"-Inf") of the non-finite values of ``t`` (``nan_only``: of
    its NaNs); None if none (integer and bool tensors are always finite, meta ones hold no values)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0 or t.device.type == "meta":
        return None
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype not in _NATIVE:  # float8 and the like: torch has no isfinite/aminmax for them
        t = t.float()
    if all_finite(t):
        return None
    bad = torch.isnan(t) if nan_only else ~torch.isfinite(t)
    count = int(bad.sum())
    if count == 0:
        return None
    flat = int(bad.reshape(-1).to(torch.uint8).argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)] if t.ndim else []
    value = float(t.reshape(-1)[flat])
    kind = "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf")
    return count, index, kind


def all_finite(t: torch.Tensor) -> bool:
    """Whether a real floating tensor holds no NaN or Inf: its min and max in one pass (``aminmax``
    propagates NaN), with no mask as large as the tensor; several times faster than ``isfinite`` on the
    CPU, which counts where every weight of a checkpoint is checked as it is read."""
    if t.numel() == 0:
        return True
    if t.dtype not in _NATIVE:
        t = t.float()
    low, high = torch.aminmax(t)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def holds(found: tuple[int, list[int], str]) -> str:
    """What :func:`first_nonfinite` found, in words: "NaN at [0, 3] (2 non-finite values)"."""
    count, index, kind = found
    return f"{kind} at {index} ({count} non-finite value{'s' if count != 1 else ''})"


def refuse_nonfinite_tensor(
    name: str,
    tensor: torch.Tensor,
    model: str = "the model",
    *,
    buffer: bool = False,
    first_row: int | None = None,
) -> None:
    """Refuse ``model`` when its tensor ``name`` holds NaN or Inf (a ``buffer``: NaN), per the rule above.
    ``first_row``: ``tensor`` is the rows of ``name`` from this one on (a process's shard), and the place
    said is the whole tensor's."""
    found = first_nonfinite(tensor, nan_only=buffer)
    if found is None:
        return
    count, index, kind = found
    where = ""
    if first_row is not None and index:
        index = [index[0] + first_row, *index[1:]]
        where = f" in rows {first_row}-{first_row + tensor.shape[0] - 1}"
    what = holds((count, index, kind)).removesuffix(")") + where + ")"
    raise BrokenModelError(f"{model} is broken: its {name} holds {what}; {NOTHING_COMPARED}")


def refuse_broken_model(
    module: nn.Module, model: str = "the model", *, statistics_replaced: bool = False
) -> None:
    """The tensor rules over ``module``'s parameters and buffers (a tied one once; meta ones skipped).
    ``statistics_replaced``: BatchNorm running statistics are left out, for a command that re-estimates
    them without reading them (``recalibrate`` repairs statistics that overflowed)."""
    for name, parameter in module.named_parameters():
        refuse_nonfinite_tensor(name, parameter, model)
    statistics = {
        f"{path}.{stat}" if path else stat
        for path, m in module.named_modules()
        if statistics_replaced and isinstance(m, _BatchNorm)
        for stat in ("running_mean", "running_var")
    }
    for name, buffer in module.named_buffers():
        if name not in statistics:
            refuse_nonfinite_tensor(name, buffer, model, buffer=True)


__all__ = [
    "NOTHING_COMPARED",
    "all_finite",
    "first_nonfinite",
    "holds",
    "refuse_broken_model",
    "refuse_nonfinite_tensor",
]
