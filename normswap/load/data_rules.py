"""The one rule for what a tensor of data may hold, whichever command reads it and from whatever source
(``--inputs``, ``--data``, ``--calibrate``, ``--holdout``, a factory's batches): a plain dense tensor with
values, each element in memory of its own, none of them NaN or infinite.
:class:`normswap.calibrate.data.CalibrationData` applies it to every tensor of every batch;
:func:`refuse_nonfinite_inputs` (NaN and Inf) to every example input, whether read from a file, carried by
a factory or a .pt2, or passed from Python (which may also be an expanded view, ``arange(T).expand(B, T)``).
One exemption, on every route alike: an additive attention mask, a tensor of
no value above 0 (0 and -Inf: ``nn.Transformer.generate_square_subsequent_mask``; ALiBi's negative biases),
since a batch that is a valid example input is valid data; a -Inf among positive values (an image's) is
refused as the data's fault."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from normswap.errors import BadInputError
from normswap.util.finite import all_finite


def _self_overlapping(tensor: torch.Tensor) -> bool:
    """Whether some elements share memory (an ``expand``ed or stride-0 view): its memory extent, the last
    element's offset + 1, is below its element count."""
    extent = 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return extent < tensor.numel()


def position(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def check_data_tensor(tensor: torch.Tensor, where: str, *, rows_per_batch: int | None = None) -> None:
    """The one rule for a tensor of data (``where`` names it: the file or source, the batch, the input):
    BadInputError unless it is a plain dense tensor with values, each element in memory of its own, all
    of them finite. ``rows_per_batch``: the tensor is a whole file's, to be cut into batches of that many
    rows; a bad value's message then names its batch too. Cheap next to the model's forward (one pass)."""
    shape = tuple(tensor.shape)
    if type(tensor) is not torch.Tensor:
        what = (
            "a torch.nn.Parameter (a model's weight)"
            if isinstance(tensor, torch.nn.Parameter)
            else f"a {type(tensor).__name__} (a tensor subclass)"
        )
        raise BadInputError(
            f"{where} is {what}, not plain data: save plain tensors (tensor.detach().clone())"
        )
    if tensor.layout != torch.strided:
        raise BadInputError(
            f"{where} is a {str(tensor.layout).removeprefix('torch.')} tensor of shape {shape}: give dense "
            "tensors (tensor.to_dense())"
        )
    if tensor.is_meta:
        raise BadInputError(
            f"{where} is on the meta device (a shape of {shape} without values): give real data"
        )
    if tensor.numel() == 0:
        raise BadInputError(f"{where} has shape {shape}: it holds no values (a dimension of length 0)")
    if _self_overlapping(tensor):
        raise BadInputError(
            f"{where} is an expanded view of shape {shape} over {tensor.untyped_storage().nbytes()} bytes (its "
            "rows share memory, so it declares far more data than it holds): save real rows (tensor.contiguous())"
        )
    refuse_nonfinite_values(tensor, where, rows_per_batch=rows_per_batch)


def refuse_nonfinite_values(tensor: torch.Tensor, where: str, *, rows_per_batch: int | None = None) -> None:
    """BadInputError naming the first NaN or Inf of ``tensor`` (``where``, and its batch when
    ``rows_per_batch`` cuts it): the data's fault, said before the model runs on it (a +Inf used to pass
    --inputs and the model was then called broken for the NaN it computed). An additive mask's or
    bias's -Inf passes: in a tensor no value of which is above 0 (0 and -Inf, ALiBi's negative slopes)."""
    if tensor.is_meta or not (tensor.is_floating_point() or tensor.is_complex()):
        return  # no values (a model built on the meta device carries such examples), or no NaN to hold
    if not tensor.is_complex() and all_finite(tensor):
        return  # the common case, in one pass and without masks as large as the tensor
    bad = torch.isnan(tensor)
    for part in (tensor.real, tensor.imag) if tensor.is_complex() else (tensor,):
        bad |= part == float("inf")
        minus = part == float("-inf")
        if bool(minus.any()) and bool((part[~minus] > 0).any()):
            bad |= minus  # not a mask: a -Inf among data values (an image's) is as broken as a +Inf
    if not bool(bad.any()):
        return
    first = int(bad.reshape(-1).nonzero()[0])
    value = tensor.reshape(-1)[first].item()
    index = position(first, tensor.shape)
    batch = f" (batch {index[0] // rows_per_batch})" if rows_per_batch and index else ""
    raise BadInputError(
        f"{where} holds {int(bad.sum())} NaN/Inf value(s), the first ({value}) at index {list(index)}"
        f"{batch}: clean the data (e.g. torch.nan_to_num) or drop those rows (-Inf is accepted in an "
        "additive mask or bias, a tensor with no value above 0)"
    )


def refuse_nonfinite_inputs(args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> None:
    """:func:`refuse_nonfinite_values` for every tensor of a call's inputs (``where``: whose inputs), each
    named by its place (``args[0]``, ``attention_mask=``): an inputs file, a factory's or a .pt2's own
    example, the example a Python caller passes."""
    named = [(f"args[{i}]", value) for i, value in enumerate(args)]
    named += [(f"{key}=", value) for key, value in kwargs.items()]
    for name, value in named:
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                refuse_nonfinite_values(leaf, f"{where}: {name}")
