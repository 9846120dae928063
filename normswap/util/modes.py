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
    or a graph that writes into its own tensors (a program exported in training mode). A graph's own
    flag, and a bare ``nn.Module`` that only holds a program's tensors, change nothing: a ``.pt2``'s
    module reports training mode and refuses ``eval()``, and copying it on every run doubled its memory."""
    for module in model.modules():
        if isinstance(module, fx.GraphModule):
            if any(_writes_own_tensor(node) for node in module.graph.nodes):
                return True
        elif type(module) is not nn.Module and module.training and not _export_internal(module):
            return True
    return False


def _export_internal(module: nn.Module) -> bool:
    """A module torch.export adds to the module of a program (its input guards), whose mode means nothing."""
    return type(module).__module__.startswith("torch.export.")


def _writes_own_tensor(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target._schema.is_mutable and any(isinstance(a, fx.Node) and a.op == "get_attr" for a in node.args)
