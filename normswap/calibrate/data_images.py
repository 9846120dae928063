"""A folder of images as calibration data: which files are images (by their magic bytes, checked
before any decoding), and one image decoded, resized to cover the model's input, centre-cropped and
scaled to [0, 1]."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.errors import BadInputError
from normswap.errors import describe as _describe

# What torchvision.io.decode_image reads, told apart by magic bytes so a folder is checked before decoding.
_IMAGE_SIGNATURES: tuple[tuple[bytes, int, str], ...] = (
    (b"\xff\xd8\xff", 0, "JPEG"),
    (b"\x89PNG\r\n\x1a\n", 0, "PNG"),
    (b"GIF87a", 0, "GIF"),
    (b"GIF89a", 0, "GIF"),
    (b"WEBP", 8, "WEBP"),
)


def _image_kind(path: Path) -> str | None:
    with path.open("rb") as f:
        head = f.read(16)
    for magic, offset, kind in _IMAGE_SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            return kind
    return None


def image_files(folder: Path) -> list[Path]:
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(root) / n for n in sorted(names) if not n.startswith(".")]
    if not files:
        raise BadInputError(f"data folder {folder} holds no files")
    for path in files:
        if not path.is_file():
            raise BadInputError(f"data folder {folder}: {path.relative_to(folder)} is not a regular file")
        if _image_kind(path) is None:
            raise BadInputError(
                f"data folder {folder}: {path.relative_to(folder)} is not a JPEG, PNG, GIF or WEBP image"
            )
    return files


@dataclass(frozen=True)
class ImageInput:
    """Where a model takes its images, and the geometry image batches must match."""

    channels: int
    height: int
    width: int
    dtype: torch.dtype
    # the keyword the model takes them by (an HF vision model's ``pixel_values``); None: its first input
    keyword: str | None = None


def _image_shaped(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 4


def image_geometry(
    example_args: tuple | None, folder: Path, example_kwargs: dict | None = None
) -> ImageInput:
    """Where and at what (channels, H, W) the model takes images: its example's (N, C, H, W) tensor, its
    first positional input or else its one floating keyword input of four dims (an HF vision model's
    ``pixel_values``, which its .pt2 takes by name only). Images are read in its floating dtype (float32
    for an integer one)."""
    args, kwargs = tuple(example_args or ()), dict(example_kwargs or {})
    found: list[tuple[str | None, torch.Tensor]] = (
        [(None, args[0])] if args and _image_shaped(args[0]) else []
    )
    if not found:
        found = [(k, v) for k, v in kwargs.items() if _image_shaped(v) and v.is_floating_point()]
    if len(found) > 1:
        names = ", ".join(k for k, _ in found if k is not None)
        raise BadInputError(
            f"data folder {folder}: the model's example inputs hold several (N, C, H, W) tensors ({names}): "
            "which one takes the images is unclear; give the data as a .pt file of keyword batches or a factory"
        )
    keyword, first = found[0] if found else (None, None)
    if first is None or first.shape[1] not in (1, 3):
        shape = tuple(first.shape) if first is not None else _first_shape(args, kwargs)
        got = (
            f"the model's example input is {shape}" if shape is not None else "the model has no example input"
        )
        raise BadInputError(
            f"data folder {folder}: images need the model's input size as a (N, 1 or 3, H, W) tensor, but "
            f"{got}; pass --input-shape 1,3,H,W"
        )
    dtype = first.dtype if first.is_floating_point() else torch.float32
    return ImageInput(int(first.shape[1]), int(first.shape[2]), int(first.shape[3]), dtype, keyword)


def _first_shape(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The shape of the example's first tensor, for the message that refuses it."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    return tuple(tensors[0].shape) if tensors else None


def load_image(path: Path, channels: int, height: int, width: int) -> torch.Tensor:
    """One image as a float tensor (channels, height, width) in [0, 1]: resized to cover, centre-cropped."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as TF

    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    try:
        image = decode_image(str(path), mode=mode)
    except Exception as exc:
        raise BadInputError(f"cannot decode image {path}: {_describe(exc)}") from None
    if image.ndim == 4:  # an animated GIF: its first frame
        image = image[0]
    h, w = image.shape[-2:]
    # Scale so the image covers H x W with the aspect ratio kept, then crop the centre: no distortion.
    scale = max(height / h, width / w)
    size = [max(height, math.ceil(h * scale - 1e-6)), max(width, math.ceil(w * scale - 1e-6))]
    if size != [h, w]:
        image = TF.resize(image, size, antialias=True)
    image = TF.center_crop(image, [height, width])
    return image.float().div_(255.0)
