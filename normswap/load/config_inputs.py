"""Example inputs made from a model directory's config, for models that come without any: token ids,
images of the configured size, raw audio."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError

# The image size given to a convolutional vision model whose config fixes none (HF's ResNet, RegNet,
# MobileNet: they take any size): ImageNet's, which every such architecture's strides divide.
_ANY_IMAGE_SIZE = 224


def _convolutional(vision: dict[str, Any]) -> bool:
    """A vision config of a convolutional net that fixes no input size (stages of conv widths)."""
    return any(key in vision for key in ("hidden_sizes", "depths", "depth_multiplier"))


def example_inputs(
    model: nn.Module,
    config: dict[str, Any],
    *,
    batch: int = 1,
    length: int = 16,
    device: torch.device | str | None = None,
) -> tuple[tuple, dict[str, Any]]:
    """Inputs that a model of this directory takes, made from its config: ``batch`` x ``length`` token ids
    (any vocab id) for a text model, ``batch`` images of the configured size for a vision model (224 for a
    convolutional one whose config fixes no size), raw audio for ``length`` frames for a speech encoder, on
    ``device`` (default: the model's). BadInputError otherwise."""
    if device is None:
        device = next((t.device for t in model.parameters()), torch.device("cpu"))
    name = getattr(model, "main_input_name", "input_ids")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else config
    if name == "input_ids" and isinstance(text.get("vocab_size"), int) and text["vocab_size"] > 0:
        length = min(length, int(text.get("max_position_embeddings") or text.get("n_positions") or length))
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, text["vocab_size"], (batch, length), generator=generator)
        return (), {"input_ids": ids.to(device)}
    size, channels = vision.get("image_size"), vision.get("num_channels", 3)
    if name == "pixel_values" and size is None and _convolutional(vision):
        size = _ANY_IMAGE_SIZE
    if name == "pixel_values" and size is not None:
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
        generator = torch.Generator().manual_seed(0)
        pixels = torch.rand(batch, int(channels), int(height), int(width), generator=generator).to(
            device, dtype
        )
        return (), {"pixel_values": pixels}
    if name == "input_values" and isinstance(config.get("conv_stride"), list):
        # raw audio (wav2vec2, HuBERT): enough samples for ``length`` frames after the conv feature encoder
        samples = (length + 1) * math.prod(config["conv_stride"]) + sum(config.get("conv_kernel") or [])
        dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
        audio = torch.randn(batch, samples, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        return (), {"input_values": audio}
    raise BadInputError(
        f"cannot make example inputs for a model whose main input is {name!r} from its config: give --inputs "
        "or --input-shape"
    )
