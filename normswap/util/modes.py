"""Put a model in inference mode and back, including modules that forbid ``.eval()``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


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
