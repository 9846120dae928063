"""Calibration data: what ``--data`` names, read as a stream of model inputs.

``DATA`` is one of

- a folder of images (searched recursively, hidden files skipped): each image is decoded with
  torchvision, resized so that it covers the model's example input H x W (aspect ratio kept), centre-cropped
  to exactly H x W, scaled to [0, 1] and optionally normalized (``imagenet`` mean/std); every file must be a
  JPEG, PNG, GIF or WEBP image, since silently skipping files would calibrate on less data than intended;
  the images are fed as the example's image input is (:func:`~normswap.calibrate.data_images.image_geometry`):
  the first positional input, or a keyword (an HF vision model's ``pixel_values``);
- a ``.pt`` file read with the weights-only unpickler: one tensor ``(N, ...)`` split into batches of
  ``batch_size`` rows, a list/tuple of tensors (each one batch), or a list/tuple of batches (each a tuple of
  positional inputs or a dict of keyword inputs);
- a factory ``package.module:callable`` or ``path/to/file.py:callable``, called with no arguments, returning
  any iterable of batches (a DataLoader, a generator) or a tensor/list as above.

A batch reaches the model as positional args (a tensor, a tuple/list) or kwargs (a dict). When the model's
example inputs are known and a batch carries more positional items than the model takes, the extra ones
(a DataLoader's labels) are dropped, and a note says so; when they are keywords with exactly one tensor (an
HF model's ``input_ids``, which its .pt2 takes by name only), a positional tensor is fed by that name with
the example's other settings. Batches are streamed: a folder of a million images is never held in memory
at once.

Every problem with the data (no files, a file that is not an image, a batch whose layout differs from the
others or from the model's example input) is one :class:`~normswap.errors.BadInputError` naming the batch
or file.

Every tensor of every batch, whatever its source, passes :func:`check_data_tensor` as it is read, the one
rule for what data may hold: a plain dense tensor with values (not a Parameter or other subclass, not
sparse, not on the meta device, not empty), each element its own memory (an expanded view, which a 1 kB
file can declare with 10^7 rows, is refused before any work), and no NaN or Inf (a NaN pixel would make
every fitted statistic NaN). Every command that reads data (convert --calibrate, --holdout, recalibrate,
distill, the sequential route) reads it through :class:`CalibrationData`, so none needs a copy of the rule.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from normswap.calibrate.data_images import image_files, image_geometry, load_image
from normswap.errors import BadInputError
from normswap.errors import describe as _describe
from normswap.load.data_rules import check_data_tensor, position
from normswap.load.factory import import_callable
from normswap.load.model_file import read_tensor_file

DEFAULT_BATCH_SIZE = 32

# Per-channel (mean, std) of the datasets models are commonly trained on, for inputs scaled to [0, 1].
NORMALIZATIONS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


@dataclass(frozen=True)
class ModelInputs:
    """One batch as the model is called with it: ``model(*args, **kwargs)``."""

    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = [(f"args[{i}]", a) for i, a in enumerate(self.args)]
        named += [(f"kwargs[{k!r}]", v) for k, v in self.kwargs.items()]
        return [(name, t) for name, t in named if isinstance(t, torch.Tensor)]

    def describe(self) -> str:
        """Shapes of the tensors, for messages: ``args[0] (16, 3, 32, 32)``."""
        return ", ".join(f"{name} {tuple(t.shape)}" for name, t in self.tensors()) or "no tensors"

    @property
    def num_samples(self) -> int:
        """Rows of the first tensor: the batch size, as far as a model-agnostic reader can tell."""
        tensors = self.tensors()
        return int(tensors[0][1].shape[0]) if tensors and tensors[0][1].ndim else 0


def as_model_inputs(batch: Any) -> ModelInputs:
    """A batch in any accepted form: ModelInputs, a tensor, a tuple/list of positional args or a dict."""
    if isinstance(batch, ModelInputs):
        return batch
    if isinstance(batch, torch.Tensor):
        return ModelInputs((batch,))
    if isinstance(batch, Mapping) and all(isinstance(k, str) for k in batch):
        return ModelInputs((), dict(batch))
    if isinstance(batch, (tuple, list)):
        return ModelInputs(tuple(batch))
    raise BadInputError(
        f"a batch of type {type(batch).__name__} cannot be fed to a model: expected a tensor, a tuple/list "
        "of positional inputs or a dict of keyword inputs"
    )


def _layout(inputs: ModelInputs) -> tuple:
    return (
        len(inputs.args),
        tuple(sorted(inputs.kwargs)),
        tuple((name, t.ndim) for name, t in inputs.tensors()),
    )


class CalibrationData:
    """An iterable of :class:`ModelInputs`, checked batch by batch as it is read.

    ``num_batches`` is None when the source cannot tell in advance (a generator). ``first`` is the first
    batch read, kept so a command can export the model with it when there are no example inputs.
    """

    def __init__(
        self,
        source: Callable[[], Iterable[Any]],
        *,
        description: str,
        num_batches: int | None,
        example_args: tuple | None = None,
        example_kwargs: dict | None = None,
        name: str | None = None,
    ) -> None:
        self._source = source
        self.description = description
        # what messages call the source ("data file x.pt"): the description without its counts
        self.name = name or description
        self.num_batches = num_batches
        self.first: ModelInputs | None = None
        self.notes: list[str] = []
        # (size, input name) of the model's token ids when the reader knows the model (token_vocabulary)
        self.vocabulary: tuple[int, str] | None = None
        self._example = (
            ModelInputs(tuple(example_args or ()), dict(example_kwargs or {}))
            if example_args is not None or example_kwargs is not None
            else None
        )

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("this calibration data does not know its length in advance")
        return self.num_batches

    def take(self, count: int | None) -> list[ModelInputs]:
        """The first ``count`` batches (None: all), read and checked; none at all is refused, on every
        route (an empty list fitted nothing and the conversion was reported ok)."""
        batches = list(itertools.islice(self, count))
        if not batches:
            raise BadInputError(f"{self.name}: no batches to calibrate on")
        return batches

    def __iter__(self) -> Iterator[ModelInputs]:
        reference: ModelInputs | None = None
        for index, batch in enumerate(_guarded(self._source, self.description)):
            inputs = self._fit_to_model(as_model_inputs(batch), index)
            _check_batch(inputs, index, self.name)
            if self.vocabulary is not None:
                _check_ids(self.vocabulary, inputs, index, self.name)
            if reference is None:
                reference = inputs
                self.first = inputs
                self._check_against_example(inputs)
            elif _layout(inputs) != _layout(reference):
                raise BadInputError(
                    f"{self.name}: batch {index} ({inputs.describe()}) is laid out differently from batch 0 "
                    f"({reference.describe()})"
                )
            yield inputs

    def _fit_to_model(self, inputs: ModelInputs, index: int) -> ModelInputs:
        example = self._example
        if example is None or inputs.kwargs:
            return inputs
        if example.kwargs:
            return self._as_keyword(inputs, example, index)
        wanted = len(example.args)
        if wanted and len(inputs.args) > wanted:
            if index == 0:
                self.notes.append(
                    f"batches hold {len(inputs.args)} items and the model takes {wanted} input"
                    f"{'s' if wanted > 1 else ''}: only the first {wanted} are fed (the rest, e.g. labels, "
                    "are ignored)"
                )
            return ModelInputs(inputs.args[:wanted])
        return inputs

    def _as_keyword(self, inputs: ModelInputs, example: ModelInputs, index: int) -> ModelInputs:
        """A positional batch for a model whose example inputs are keywords (an HF model, its .pt2: a .pt2
        exported with ``input_ids=`` takes it by name only): fed as that keyword when the example has
        exactly one tensor, the example's settings (``use_cache=False``) kept."""
        tensors = [k for k, v in example.kwargs.items() if isinstance(v, torch.Tensor)]
        if (
            example.args
            or len(tensors) != 1
            or not inputs.args
            or not isinstance(inputs.args[0], torch.Tensor)
        ):
            return inputs
        if index == 0:
            extra = (
                f" (the other {len(inputs.args) - 1} item(s), e.g. labels, are ignored)"
                if len(inputs.args) > 1
                else ""
            )
            self.notes.append(f"batches are fed as {tensors[0]}=, the model's one tensor input{extra}")
        settings = {k: v for k, v in example.kwargs.items() if k != tensors[0]}
        return ModelInputs((), {tensors[0]: inputs.args[0], **settings})

    def _check_against_example(self, inputs: ModelInputs) -> None:
        example = self._example
        if example is None:
            return
        mine, theirs = dict(inputs.tensors()), dict(example.tensors())
        for name, tensor in mine.items():
            ref = theirs.get(name)
            if ref is not None and ref.ndim != tensor.ndim:
                raise BadInputError(
                    f"{self.name}: batch 0 has {name} of shape {tuple(tensor.shape)} ({tensor.ndim}-D) where "
                    f"the model's example input is {tuple(ref.shape)} ({ref.ndim}-D)"
                )


def _guarded(source: Callable[[], Iterable[Any]], description: str) -> Iterator[Any]:
    """Iterate a user's iterable, turning its own exceptions into one-line BadInputErrors."""
    try:
        iterator = iter(source())
    except BadInputError:
        raise
    except Exception as exc:
        raise BadInputError(f"cannot iterate {description}: {_describe(exc)}") from None
    index = 0
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except BadInputError:
            raise
        except Exception as exc:
            raise BadInputError(
                f"{description} raised while producing batch {index}: {_describe(exc)}"
            ) from None
        yield batch
        index += 1


def _check_batch(inputs: ModelInputs, index: int, source: str) -> None:
    tensors = inputs.tensors()
    if not tensors:
        raise BadInputError(f"{source}: batch {index} holds no tensors")
    for name, tensor in tensors:
        check_data_tensor(tensor, f"{source}: batch {index}, {name}")
        if tensor.ndim == 0:
            raise BadInputError(f"{source}: batch {index}, {name} is a scalar: it holds no samples")


# ---------------------------------------------------------------------------------------------------
# Sources


def _split_rows(tensor: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return list(torch.split(tensor, batch_size, dim=0))


def _batches_from_payload(
    payload: Any, what: str, batch_size: int | None, strict: bool
) -> tuple[list[Any], str]:
    """Batches held by a loaded ``.pt`` payload or returned by a factory as a tensor or a sequence."""
    if isinstance(payload, torch.Tensor):
        if payload.ndim == 0:
            raise BadInputError(f"{what} holds a scalar tensor: no samples to calibrate on")
        size = batch_size or DEFAULT_BATCH_SIZE
        # the whole tensor before it is cut: a stride-0 tensor of 10^7 rows is refused before 10^6 splits,
        # and a NaN in rows a command does not read (a held-out file's later batches) is refused too
        check_data_tensor(payload, what, rows_per_batch=size)
        batches = _split_rows(payload, size)
        return (
            batches,
            f"{what}: {payload.shape[0]} samples of {tuple(payload.shape[1:])} in batches of {size}",
        )
    if isinstance(payload, (tuple, list)):
        if not payload:
            raise BadInputError(f"{what} holds an empty {type(payload).__name__}: no batches")
        if batch_size is not None and strict:
            raise BadInputError(
                f"--batch-size applies to an image folder or a single tensor; {what} holds its own batches"
            )
        if all(isinstance(b, torch.Tensor) for b in payload):
            return list(payload), f"{what}: {len(payload)} batches"
        if all(isinstance(b, (tuple, list, Mapping)) for b in payload):
            return list(payload), f"{what}: {len(payload)} batches"
        kinds = sorted({type(b).__name__ for b in payload})
        raise BadInputError(
            f"{what} holds a {type(payload).__name__} of {', '.join(kinds)}: expected a list of batch tensors "
            "or a list of batches (each a tuple of tensors or a dict of tensors)"
        )
    raise BadInputError(
        f"{what} holds a {type(payload).__name__}: expected a tensor (N, ...), a list of batch tensors or a "
        "list of batches (each a tuple of tensors or a dict of tensors)"
    )


def _tensor_file_data(path: Path, batch_size: int | None, strict: bool, **example: Any) -> CalibrationData:
    payload = read_tensor_file(path, what="data file")
    name = f"data file {path}"
    batches, description = _batches_from_payload(payload, name, batch_size, strict)
    return CalibrationData(
        lambda: batches, description=description, num_batches=len(batches), name=name, **example
    )


def _import_data_factory(spec: str) -> Callable[[], Any]:
    usage = "expected a folder, a .pt file, or a factory package.module:callable or path/to/file.py:callable"
    return import_callable(spec, "data factory", bad_spec=f"data not found: {spec} ({usage})")


def _factory_data(spec: str, batch_size: int | None, strict: bool, **example: Any) -> CalibrationData:
    factory = _import_data_factory(spec)
    what = f"data factory '{spec}'"
    try:
        result = factory()
    except Exception as exc:
        raise BadInputError(f"{what} raised {_describe(exc)}") from None
    if isinstance(result, (torch.Tensor, tuple, list)):
        batches, description = _batches_from_payload(result, what, batch_size, strict)
        return CalibrationData(
            lambda: batches, description=description, num_batches=len(batches), name=what, **example
        )
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Iterable):
        raise BadInputError(
            f"{what} returned a value of type {type(result).__name__}: expected an iterable of batches (a DataLoader, a "
            "generator, a list) or a tensor (N, ...)"
        )
    if batch_size is not None and strict:
        raise BadInputError(
            f"--batch-size applies to an image folder or a single tensor; {what} yields its own batches"
        )
    try:
        known = len(result)  # type: ignore[arg-type]
    except TypeError:
        known = None
    return CalibrationData(lambda: result, description=what, num_batches=known, name=what, **example)


def _folder_data(
    folder: Path,
    batch_size: int | None,
    normalize: str | None,
    example_args: tuple | None,
    example_kwargs: dict | None,
) -> CalibrationData:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        raise BadInputError("reading an image folder needs torchvision: pip install torchvision") from None
    taken = image_geometry(example_args, folder, example_kwargs)
    channels, height, width = taken.channels, taken.height, taken.width
    files = image_files(folder)
    size = batch_size or DEFAULT_BATCH_SIZE
    # a model that takes its images by keyword (an HF vision model, its .pt2) is fed them by that name,
    # with the example's settings (interpolate_pos_encoding=False) kept
    settings = {k: v for k, v in (example_kwargs or {}).items() if not isinstance(v, torch.Tensor)}
    stats = None
    if normalize is not None:
        mean, std = NORMALIZATIONS[normalize]
        if channels != len(mean):
            raise BadInputError(
                f"--normalize {normalize} is for {len(mean)}-channel images; the model takes {channels}"
            )
        stats = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def batches() -> Iterator[torch.Tensor | ModelInputs]:
        for start in range(0, len(files), size):
            images = torch.stack(
                [load_image(p, channels, height, width) for p in files[start : start + size]]
            )
            if stats is not None:
                images = (images - stats[0]) / stats[1]
            images = images.to(taken.dtype)
            yield images if taken.keyword is None else ModelInputs((), {taken.keyword: images, **settings})

    count = math.ceil(len(files) / size)
    description = (
        f"data folder {folder}: {len(files)} images at {channels}x{height}x{width} in batches of {size}"
        + (f", {normalize}-normalized" if normalize else "")
        + (f", fed as {taken.keyword}=" if taken.keyword is not None else "")
    )
    return CalibrationData(
        batches,
        description=description,
        num_batches=count,
        example_args=example_args,
        example_kwargs=example_kwargs,
        name=f"data folder {folder}",
    )


def load_calibration_data(
    spec: str | Path,
    *,
    example_args: tuple | None = None,
    example_kwargs: dict | None = None,
    batch_size: int | None = None,
    normalize: str | None = None,
    ignore_inapplicable: bool = False,
    model: Any = None,
) -> CalibrationData:
    """Open ``spec`` (a folder of images, a ``.pt`` file or a factory) as a stream of checked batches.

    ``example_args``/``example_kwargs`` are the model's example inputs when known: they give the image size
    and let batches be checked (and extra items such as labels dropped) before the model runs.
    ``batch_size`` (default 32) splits an image folder or a single tensor; anything that yields its own
    batches refuses it rather than ignore it. ``normalize`` names a mean/std from :data:`NORMALIZATIONS`.
    ``ignore_inapplicable`` drops those two where they do not apply instead of refusing: for a second
    source read with the options given for the first (a held-out batch). ``model``: the model the data
    is for; its token ids (an HF model's) are then checked against its vocabulary as each batch is read.
    """
    data = _open_data(spec, example_args, example_kwargs, batch_size, normalize, ignore_inapplicable)
    data.vocabulary = None if model is None else token_vocabulary(model)
    return data


def _open_data(
    spec: str | Path,
    example_args: tuple | None,
    example_kwargs: dict | None,
    batch_size: int | None,
    normalize: str | None,
    ignore_inapplicable: bool,
) -> CalibrationData:
    if batch_size is not None and batch_size < 1:
        raise BadInputError(f"--batch-size must be at least 1, got {batch_size}")
    if normalize is not None and normalize not in NORMALIZATIONS:
        raise BadInputError(f"--normalize {normalize!r}: choose from {', '.join(NORMALIZATIONS)}")
    path = Path(spec)
    if path.is_dir():
        return _folder_data(path, batch_size, normalize, example_args, example_kwargs)
    strict = not ignore_inapplicable
    if normalize is not None and strict:
        raise BadInputError("--normalize applies to an image folder; normalize tensors before saving them")
    example = {"example_args": example_args, "example_kwargs": example_kwargs}
    if path.exists():
        return _tensor_file_data(path, batch_size, strict, **example)
    if ":" not in str(spec):
        raise BadInputError(
            f"data not found: {spec} (give a folder of images, a .pt file of tensors or a factory "
            "package.module:callable)"
        )
    return _factory_data(str(spec), batch_size, strict, **example)


def _vocabulary(model: Any) -> int | None:
    """The number of token ids the model's input embedding takes (a Hugging Face model's), or None."""
    get = getattr(model, "get_input_embeddings", None)
    if not callable(get):
        return None
    try:
        size = getattr(get(), "num_embeddings", None)
    except Exception:  # a model without one raises NotImplementedError
        return None
    return size if isinstance(size, int) else None


def token_vocabulary(model: Any) -> tuple[int, str] | None:
    """(vocabulary size, the name of the token-id input) of a model that takes token ids, else None."""
    vocab = _vocabulary(model)
    return None if vocab is None else (vocab, getattr(model, "main_input_name", "input_ids"))


def _check_ids(vocabulary: tuple[int, str], inputs: ModelInputs, index: int, source: str) -> None:
    vocab, main = vocabulary
    label, ids = f"kwargs[{main!r}]", inputs.kwargs.get(main)
    if ids is None and inputs.args:
        label, ids = "args[0]", inputs.args[0]
    if not isinstance(ids, torch.Tensor):
        return
    where = f"{source}: batch {index}, {label}"
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise BadInputError(
            f"{where} is {str(ids.dtype).removeprefix('torch.')}: token ids must be integers "
            "(save them as int64)"
        )
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        first = int(bad.reshape(-1).nonzero()[0])
        raise BadInputError(
            f"{where} holds token id {int(ids.reshape(-1)[first])} at index "
            f"{list(position(first, ids.shape))}, outside the model's vocabulary [0, {vocab})"
        )
