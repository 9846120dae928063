"""Put a loaded model in inference mode, including modules that forbid ``.eval()``."""

from __future__ import annotations

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
