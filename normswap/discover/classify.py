"""Recognize norm modules from what they are and what they hold, without running them.

torch.nn classes are known by type. Classes from other libraries are recognized by structure, not by
name: a module holding ``running_mean``/``running_var`` buffers and an ``eps`` is a (frozen) batch norm
whatever it is called. Norm classes whose math can only be told by running them (HF Llama/Gemma/T5
RMSNorm, hand-written LayerNorms) are recognized from the graph in :mod:`normswap.discover.find`.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.discover.site import NormSite
from normswap.modules.norms import LayerNorm as RefLayerNorm
from normswap.modules.norms import RMSNorm as RefRMSNorm

EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")


def module_eps(module: nn.Module) -> float | None:
    for name in EPS_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _dtype(module: nn.Module) -> str | None:
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        if t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return None


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def classify_module(path: str, module: nn.Module) -> NormSite | None:
    """A site for a module whose norm semantics are known from its type or buffers, else None."""
    base = {
        "path": path,
        "source": "module",
        "class_name": _class_name(module),
        "module": module,
        "dtype": _dtype(module),
        "training": module.training,
    }
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return NormSite(
            kind="batch",
            normalized_dims=(1,),
            normalized_shape=(module.num_features,),
            eps=module.eps,
            affine=module.affine,
            bias=module.affine,
            running_stats=module.track_running_stats and module.running_mean is not None,
            momentum=module.momentum,
            **base,
        )
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return NormSite(
            kind="instance",
            normalized_dims=None,  # every spatial dim; the count depends on the input rank
            normalized_shape=(module.num_features,),
            eps=module.eps,
            affine=module.affine,
            bias=module.affine,
            running_stats=module.track_running_stats,
            momentum=module.momentum,
            **base,
        )
    if isinstance(module, nn.GroupNorm):
        return NormSite(
            kind="group",
            normalized_dims=None,
            normalized_shape=(module.num_channels,),
            eps=module.eps,
            affine=module.affine,
            bias=module.affine,
            num_groups=module.num_groups,
            **base,
        )
    if isinstance(module, (nn.LayerNorm, RefLayerNorm)):
        shape = tuple(module.normalized_shape)
        return NormSite(
            kind="layer",
            normalized_dims=_module_dims(module, shape),
            normalized_shape=shape,
            eps=module.eps,
            affine=module.weight is not None,
            bias=module.bias is not None,
            casting=getattr(module, "casting", "none"),
            weight_offset=getattr(module, "weight_offset", 0.0),
            **base,
        )
    if isinstance(module, (getattr(nn, "RMSNorm", ()), RefRMSNorm)):
        shape = tuple(module.normalized_shape)
        eps = module.eps
        return NormSite(
            kind="rms",
            normalized_dims=_module_dims(module, shape),
            normalized_shape=shape,
            # torch.nn.RMSNorm with eps=None uses the dtype's machine epsilon at run time
            eps=eps if eps is not None else torch.finfo(torch.float32).eps,
            affine=module.weight is not None,
            bias=getattr(module, "bias", None) is not None,
            casting=getattr(module, "casting", "none"),
            weight_offset=getattr(module, "weight_offset", 0.0),
            **base,
        )
    return _classify_frozen_batchnorm(module, base)


def _module_dims(module: nn.Module, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The trailing dims, or the one channel dim of normswap's fused channel norms (``channel_dim``)."""
    channel_dim = getattr(module, "channel_dim", None)
    if isinstance(channel_dim, int) and channel_dim < -1:
        return (channel_dim,)
    return tuple(range(-len(shape), 0))


def _classify_frozen_batchnorm(module: nn.Module, base: dict) -> NormSite | None:
    buffers = dict(module.named_buffers(recurse=False))
    params = dict(module.named_parameters(recurse=False))
    mean, var = buffers.get("running_mean"), buffers.get("running_var")
    if mean is None or var is None or mean.ndim != 1 or var.shape != mean.shape:
        return None
    weight = buffers.get("weight", params.get("weight"))
    bias = buffers.get("bias", params.get("bias"))
    eps = module_eps(module)
    return NormSite(
        kind="batch",
        normalized_dims=(1,),
        normalized_shape=_shape(mean),
        eps=eps if eps is not None else 1e-5,
        affine=weight is not None,
        bias=bias is not None,
        running_stats=True,
        momentum=None,
        **base,
    )


def is_norm_candidate(module: nn.Module) -> bool:
    """A leaf module that might be a norm we can only recognize by running it."""
    if list(module.children()):
        return False
    if module_eps(module) is not None:
        return True
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.ndim == 1
        and not isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd))
    )
