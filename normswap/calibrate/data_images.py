"""A folder of images as calibration data: which files are images (by their magic bytes, checked
before any decoding), and one image decoded, resized to cover the model's input, centre-cropped and
scaled to [0, 1]."""

from __future__ import annotations

import math
import os
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


def image_geometry(example_args: tuple | None, folder: Path) -> tuple[int, int, int]:
    """(channels, H, W) of the model's first example input, which image batches must match."""
    first = example_args[0] if example_args else None
    if not isinstance(first, torch.Tensor) or first.ndim != 4 or first.shape[1] not in (1, 3):
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else None
        got = (
            f"the model's example input is {shape}" if shape is not None else "the model has no example input"
        )
        raise BadInputError(
            f"data folder {folder}: images need the model's input size as a (N, 1 or 3, H, W) tensor, but "
            f"{got}; pass --input-shape 1,3,H,W"
        )
    return int(first.shape[1]), int(first.shape[2]), int(first.shape[3])


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
