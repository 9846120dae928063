"""Put a model in inference mode and back, including modules that forbid ``.eval()``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx, nn


def set_inference_mode(model: nn.Module) -> nn.Module:
    """``model.eval()``; for a torch.export module (whose mode is baked into its graph and whose
    ``eval`` raises) only the flags of its submodules are cleared. Returns ``model``."""
    try:
        model.eval()
    except NotImplementedError:
        for module in model.modules():
            if module is not model:
                module.training = False
    return model


@contextlib.contextmanager
def modes_restored(*models: nn.Module, inference: bool = False) -> Iterator[None]:
    """Every module's training flag is put back on exit, also on error: normswap never leaves a user's
    model in another mode. With ``inference`` the models are in inference mode meanwhile."""
    modes = {m: m.training for model in models for m in model.modules()}
    try:
        if inference:
            for model in models:
                set_inference_mode(model)
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def updates_its_state(model: nn.Module) -> bool:
    """Whether running ``model`` may change it, so that a run that must not (a comparison, a count)
    runs a copy: a module in training mode that computes something (a BatchNorm moves its statistics),
    or a graph that writes into its own tensors (an in-place op on them, or a batch/instance norm that
    updates the running statistics it reads: a program exported in training mode, an fx trace of
    ``F.batch_norm(..., training=True)``). A graph's own flag, a bare ``nn.Module`` that only holds a
    program's tensors and torch.export's guard module change nothing: a ``.pt2``'s module reports
    training mode and refuses ``eval()``, and copying it on every run doubled its memory."""
    for module in model.modules():
        if isinstance(module, fx.GraphModule):
            if any(_writes_own_tensor(node) for node in module.graph.nodes):
                return True
        elif type(module) is not nn.Module and module.training and type(module).__name__ != "GuardsFn":
            return True
    return False


# norm ops that update the running statistics passed to them when they normalize with the batch's own:
# name -> (position of the running mean: aten's, torch.nn.functional's), (position of the flag, default)
_STATISTICS_OPS = {
    "batch_norm": ((3, 1), (5, False)),
    "native_batch_norm": ((3, 1), (5, None)),
    "instance_norm": ((3, 1), (5, True)),
}


def _writes_own_tensor(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    aten = isinstance(target, torch._ops.OpOverload)
    if aten:
        name = target._schema.name.split("::")[-1]
        if target._schema.is_mutable and any(
            isinstance(a, fx.Node) and a.op == "get_attr" for a in node.args
        ):
            return True
    else:
        name = getattr(target, "__name__", "")
    if name not in _STATISTICS_OPS:
        return False
    (aten_at, functional_at), (flag_at, default) = _STATISTICS_OPS[name]
    at = aten_at if aten else functional_at
    running = node.args[at] if len(node.args) > at else node.kwargs.get("running_mean")
    flag = (
        node.args[flag_at]
        if len(node.args) > flag_at
        else node.kwargs.get("training", node.kwargs.get("use_input_stats", default))
    )
    return isinstance(running, fx.Node) and flag is not False
