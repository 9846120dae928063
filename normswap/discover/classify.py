"""Recognize norm modules from what they are and what they hold, without running them.

torch.nn classes (and normswap's own) are known by type: their semantics are read by
:func:`normswap.modules.semantics.declared_semantics`, the one reader of declared attributes. Classes
from other libraries are recognized by structure, not by name: a module holding ``running_mean`` /
``running_var`` buffers and an ``eps`` is a (frozen) batch norm whatever it is called. Norm classes whose math can only be told by running them (HF Llama/Gemma/T5
RMSNorm, hand-written LayerNorms) are recognized from the graph in :mod:`normswap.discover.find`.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.discover.site import NormSite
from normswap.modules.semantics import NormKind, NormSemantics, declared_semantics, dtype_name, module_dtype

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


def classify_module(path: str, module: nn.Module) -> NormSite | None:
    """A site for a module whose norm semantics are known from its type or buffers, else None."""
    semantics = declared_semantics(module)
    if semantics is None:
        semantics = _frozen_batchnorm(module)
    if semantics is None:
        return None
    return NormSite(
        path=path,
        source="module",
        semantics=semantics,
        class_name=_class_name(module),
        module=module,
        training=module.training,
    )


def _frozen_batchnorm(module: nn.Module) -> NormSemantics | None:
    """A batch norm frozen into buffers (torchvision's FrozenBatchNorm2d and the like), by its buffers."""
    buffers = dict(module.named_buffers(recurse=False))
    params = dict(module.named_parameters(recurse=False))
    mean, var = buffers.get("running_mean"), buffers.get("running_var")
    if mean is None or var is None or mean.ndim != 1 or var.shape != mean.shape:
        return None
    weight = buffers.get("weight", params.get("weight"))
    bias = buffers.get("bias", params.get("bias"))
    eps = module_eps(module)
    return NormSemantics(
        kind=NormKind.BATCH,
        normalized_dims=(1,),
        normalized_shape=tuple(mean.shape),
        eps=eps if eps is not None else 1e-5,
        dtype=dtype_name(module_dtype(module)),
        affine=weight is not None,
        bias=bias is not None,
        weight_name="weight" if weight is not None else None,
        bias_name="bias" if bias is not None else None,
        running_stats=True,
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
