"""A model built on the meta device, traced as though its weights were on a real device.

Why: a model read later into FSDP2 shards (a model directory, a .pt2) is built on the meta device, and
the checks before training (can the output be exported?) must run on it before any weight is read. A
model built from a config traces on meta inputs, but a .pt2's program was captured on a device and
asserts it (``_assert_tensor_metadata(device=cpu)``), so it must see tensors that claim that device.
Fake tensors (torch's ``FakeTensorMode``) do: they carry a device, a shape and a dtype and no memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


def _input_device(args: Any, kwargs: Any) -> torch.device | None:
    devices = {t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return next(iter(devices)) if len(devices) == 1 else None


@contextlib.contextmanager
def fake_weights(model: nn.Module, args: Any, kwargs: Any) -> Iterator[None]:
    """While in the block, each meta parameter and buffer of ``model`` is a fake tensor of its shape and
    dtype on the device of the real inputs (``args``, ``kwargs``); put back on the way out, also on
    error. Nothing changes for a model without meta tensors, or for inputs that are not on one real
    device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = _input_device(args, kwargs)
    held = [
        (collection, name, tensor)
        for module in model.modules()
        for collection in (module._parameters, module._buffers)
        for name, tensor in collection.items()
        if tensor is not None and tensor.is_meta
    ]
    if device is None or device.type == "meta" or not held:
        yield
        return
    # one fake tensor per meta tensor: a tied weight stays one tensor
    mode, fakes = FakeTensorMode(allow_non_fake_inputs=True), {}
    try:
        for collection, name, tensor in held:
            fake = fakes.get(id(tensor))
            if fake is None:
                with mode:
                    fake = torch.empty_strided(
                        tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device
                    )
                if isinstance(tensor, nn.Parameter):
                    fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                fakes[id(tensor)] = fake
            collection[name] = fake
        yield
    finally:
        for collection, name, tensor in held:
            collection[name] = tensor
