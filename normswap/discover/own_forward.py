"""A norm class with a forward of its own that computes more than the norm is not a norm module.

``class ScaledLN(nn.LayerNorm)`` whose forward returns ``super().forward(x) * 0.5 + torch.tanh(x)`` holds
a LayerNorm's weight and bias and passes ``isinstance(m, nn.LayerNorm)``, but replacing the module (a
swap, a weightless norm after folding its affine) drops the ``tanh`` branch, and treating every op of its
call as the norm lets a rewrite believe that nothing reads its input but the norm (recentring the stream
then moves ``tanh(x)``). Discovery therefore reads such a class as what it is: a norm call inside some
module's forward (a ``functional`` site owned by the module), which every pass already handles.

A class whose forward computes only the norm keeps its module site: a cast around it (open_clip's fp32
LayerNorm), the channels-first moves around it (timm's ``LayerNorm2d``, read as a norm over dim -3),
views, reads of its own tensors' shapes. Arithmetic on its tensors is more than the norm: Nemotron's
``LayerNorm1P`` normalizes with ``self.weight + 1``, which a module site would read as ``weight``. So is
an activation, except in timm's norm+act classes (``BatchNormAct2d``: :func:`norm_act_tail`), whose
activation every pass that replaces the norm keeps after it, under its own name.
This is the one place that rule lives (a ``.pt2``'s lift keeps such a norm an op by the same list of
ops, :data:`normswap.graph.ops.BESIDE_NORM_OPS`); no pass repeats it.
"""

from __future__ import annotations

import sys

from torch import nn

from normswap.graph.analysis import GraphView, ModuleCall
from normswap.graph.ops import BESIDE_NORM_OPS, op_name
from normswap.modules.semantics import declared_semantics

_OWN_PACKAGES = ("torch.nn.", "normswap.")

_TIMM_NORM_ACT = ("BatchNormAct2d", "SyncBatchNormAct", "FrozenBatchNormAct2d")


def norm_act_tail(bn: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """``[("drop", m), ("act", m)]`` for timm's norm+act classes (what runs after the norm, in order),
    None for any other class."""
    timm_layers = sys.modules.get("timm.layers.norm_act")  # imported already if the model uses it
    if timm_layers is None:
        return None
    for name in _TIMM_NORM_ACT:
        cls = getattr(timm_layers, name, None)
        if cls is not None and type(bn).forward is cls.forward:
            return [(part, getattr(bn, part)) for part in ("drop", "act") if hasattr(bn, part)]
    return None


def forward_is_foreign(module: nn.Module) -> bool:
    """Whether ``module``'s forward is written outside torch.nn and normswap (a user's or library's)."""
    for cls in type(module).__mro__:
        if "forward" in cls.__dict__:
            return not cls.__module__.startswith(_OWN_PACKAGES)
    return False


def extra_ops(view: GraphView, call: ModuleCall, norm_ops: frozenset[str]) -> list[str]:
    """The ops of ``call`` that are neither the norm (an op named in ``norm_ops``) nor what a norm's
    forward may hold around it; empty when the call computes only its norm."""
    found: list[str] = []
    for n in call.nodes:
        if n.op in ("get_attr", "placeholder") or view.is_param(n):
            continue
        name = op_name(n) or str(n.target)
        if name not in norm_ops and name not in BESIDE_NORM_OPS:
            found.append(name)
    return found


def computes_more_than_its_norm(
    view: GraphView, path: str, module: nn.Module, norm_ops: frozenset[str]
) -> bool:
    """True for a known norm class (a module site) whose own forward computes more than its norm in
    some call: discovery then finds the norm inside it as a call in that module's forward."""
    if declared_semantics(module) is None:
        return False  # known by its buffers, not as a torch.nn class (FrozenBatchNorm2d computes x * s + b)
    if not forward_is_foreign(module) or norm_act_tail(module) is not None:
        return False
    return any(extra_ops(view, call, norm_ops) for call in view.calls.get(path, []))
