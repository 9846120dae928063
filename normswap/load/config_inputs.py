"""Example inputs made from a model directory's config, for models that come without any: token ids,
images of the configured size, raw audio."""

from __future__ import annotations

import inspect
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
    convolutional one whose config fixes none), raw audio for ``length`` frames for a speech encoder, log-mel
    features for a speech model that reads them (Whisper's fixed 2 x ``max_source_positions`` frames), and
    for an encoder-decoder (T5, BART, Whisper) half as many decoder token ids besides, on ``device``
    (default: the model's). BadInputError, saying how to give inputs, otherwise."""
    if device is None:
        device = next((t.device for t in model.parameters()), torch.device("cpu"))
    dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
    name = getattr(model, "main_input_name", "input_ids")
    text = _sub_config(config, "text_config")
    made = _main_input(name, config, text, batch, length)
    if made is None:
        raise BadInputError(
            f"cannot make example inputs for a model whose main input is {name!r} from its config: give "
            "--inputs FILE (a dict of tensors saved with torch.save, keyed by the forward's parameter names) "
            "or --input-shape"
        )
    decoder = _decoder_ids(model, config, text, batch, max(2, length // 2))
    if decoder is not None:
        made["decoder_input_ids"] = decoder
    kwargs: dict[str, Any] = {
        key: value.to(device, dtype) if value.is_floating_point() else value.to(device)
        for key, value in made.items()
    }
    if _caches_by_default(model, config):
        # A decoder's config turns its key/value cache on: its forward then returns a DynamicCache, which
        # no graph capture can carry, and the graph rewrites (--to crmsnorm, --defer-rms, --fuse-add) would
        # have nothing to rewrite. A one-pass example needs no cache, and every file normswap writes is
        # exported without it anyway; inputs a user gives keep what they say.
        kwargs["use_cache"] = False
    return (), kwargs


# said wherever inputs made from a config run (convert, distill, export...), as the capture's own setting is
CACHE_OFF_NOTE = (
    "the example inputs made from the config run with use_cache=False: the config turns the key/value "
    "cache on, which no graph capture or written program carries"
)


def made_inputs_notes(kwargs: dict[str, Any] | None) -> list[str]:
    """What to tell the user about example inputs :func:`example_inputs` made (``kwargs``)."""
    return [CACHE_OFF_NOTE] if kwargs is not None and kwargs.get("use_cache") is False else []


def _caches_by_default(model: nn.Module, config: dict[str, Any]) -> bool:
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    # the built config: a config.json without the key takes the class's default (GPT-2's is on), and a
    # multimodal model keeps it on its text config
    built = getattr(model, "config", None)
    text = built.get_text_config() if hasattr(built, "get_text_config") else built
    on = getattr(text, "use_cache", None)
    return takes and bool(config.get("use_cache", False) if on is None else on)


def _sub_config(config: dict[str, Any], key: str) -> dict[str, Any]:
    found = config.get(key)
    return found if isinstance(found, dict) else config


def _token_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _main_input(
    name: str, config: dict[str, Any], text: dict[str, Any], batch: int, length: int
) -> dict[str, torch.Tensor] | None:
    """The model's main input, by its name (``model.main_input_name``); None when the config does not say
    enough to make it."""
    generator = torch.Generator().manual_seed(0)
    if name == "input_ids" and isinstance(text.get("vocab_size"), int) and text["vocab_size"] > 0:
        length = min(length, int(text.get("max_position_embeddings") or text.get("n_positions") or length))
        return {"input_ids": _token_ids(text["vocab_size"], batch, length)}
    vision = _sub_config(config, "vision_config")
    size, channels = vision.get("image_size"), vision.get("num_channels", 3)
    if name == "pixel_values" and size is None and _convolutional(vision):
        size = _ANY_IMAGE_SIZE
    if name == "pixel_values" and size is not None:
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return {
            "pixel_values": torch.rand(batch, int(channels), int(height), int(width), generator=generator)
        }
    if name == "input_values" and isinstance(config.get("conv_stride"), list):
        # raw audio (wav2vec2, HuBERT): enough samples for ``length`` frames after the conv feature encoder
        samples = (length + 1) * math.prod(config["conv_stride"]) + sum(config.get("conv_kernel") or [])
        return {"input_values": torch.randn(batch, samples, generator=generator)}
    if name == "input_features" and isinstance(config.get("num_mel_bins"), int):
        # Whisper: (batch, mel bins, frames), and its encoder takes exactly 2 x max_source_positions frames
        frames = 2 * int(config.get("max_source_positions") or 1500)
        return {"input_features": torch.randn(batch, config["num_mel_bins"], frames, generator=generator)}
    if name == "input_features" and isinstance(config.get("input_feat_per_channel"), int):
        # Speech2Text: (batch, frames, features x channels); its conv subsampler shortens the frames 4x
        features = config["input_feat_per_channel"] * int(config.get("input_channels") or 1)
        return {"input_features": torch.randn(batch, 4 * length, features, generator=generator)}
    return None


def _decoder_ids(
    model: nn.Module, config: dict[str, Any], text: dict[str, Any], batch: int, length: int
) -> torch.Tensor | None:
    """Decoder token ids for an encoder-decoder whose forward takes them (T5, BART, Whisper: without them
    it raises), within the decoder's vocab and position table; None for any other model."""
    if not config.get("is_encoder_decoder"):
        return None
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    decoder = _sub_config(config, "decoder")
    vocab = decoder.get("vocab_size") or text.get("vocab_size")
    if "decoder_input_ids" not in parameters or not isinstance(vocab, int) or vocab <= 0:
        return None
    limit = decoder.get("max_target_positions") or decoder.get("max_position_embeddings")
    return _token_ids(vocab, batch, min(length, int(limit or length)), seed=1)


def same_inputs(a: tuple[tuple, dict[str, Any]], b: tuple[tuple, dict[str, Any]]) -> bool:
    """Whether two ``(args, kwargs)`` pairs are the same inputs: the same keys, and tensors of the same
    dtype, shape and values (on the CPU), other values equal."""

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(x.cpu(), y.cpu())
            )
        return type(x) is type(y) and x == y

    (args_a, kwargs_a), (args_b, kwargs_b) = a, b
    return (
        len(args_a) == len(args_b)
        and kwargs_a.keys() == kwargs_b.keys()
        and all(same(x, y) for x, y in zip(args_a, args_b, strict=True))
        and all(same(kwargs_a[k], kwargs_b[k]) for k in kwargs_a)
    )
