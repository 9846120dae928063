"""A module as plain data: the class and constructor arguments of the modules normswap puts into a model.

A checkpoint directory whose conversion changed module classes or their parameters (LayerNorm -> RMSNorm,
a norm moved onto the fused kernels, a folded BatchNorm become an Identity and its conv given a bias)
records each new module as a recipe in JSON,
and the loader builds it back. The file a recipe comes from is untrusted: a recipe names a class only
from :data:`RECIPE_CLASSES` and gives only the constructor arguments that class is known to take, each
checked for its type, so reading one runs no code of the file's choosing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _WeightNorm, weight_norm

from normswap.kernels.reference import CASTING_MODES
from normswap.modules.centered import CenteredEmbedding
from normswap.modules.fused import FusedChannelLayerNorm, FusedChannelRMSNorm, FusedLayerNorm, FusedRMSNorm
from normswap.modules.norms import LayerNorm, RMSNorm

_AFFINE_NORMS: tuple[type[nn.Module], ...] = (
    RMSNorm,
    LayerNorm,
    FusedRMSNorm,
    FusedLayerNorm,
    FusedChannelRMSNorm,
    FusedChannelLayerNorm,
)
_CHANNEL_NORMS = (FusedChannelRMSNorm, FusedChannelLayerNorm)

# torch's layers whose parameters a fold changes (a BatchNorm folded into a conv gives it a bias)
_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

# Recipe class name -> class. Names are normswap's own, not import paths: a file cannot name anything else.
RECIPE_CLASSES: dict[str, type[nn.Module]] = {
    cls.__name__: cls for cls in (*_AFFINE_NORMS, *_LAYERS, nn.Identity, CenteredEmbedding)
}


def _weight_norm_dim(module: nn.Module) -> int | None:
    """The dim of a weight norm that is a module's only parametrization (of its ``weight``), else None."""
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is None or set(parametrizations) != {"weight"}:
        return None
    stack = list(parametrizations["weight"])
    if len(stack) != 1 or not isinstance(stack[0], _WeightNorm):
        return None
    return int(stack[0].dim)


def module_recipe(module: nn.Module) -> dict[str, Any] | None:
    """``{"class": NAME, "kwargs": {...}}`` that :func:`build_from_recipe` turns back into a module like
    ``module`` (its tensors aside), or None when its class has no recipe. A Conv or Linear whose weight
    is weight-normed (``parametrizations.weight_norm``, nothing else stacked) adds
    ``"weight_norm": {"dim": DIM}``."""
    if parametrize.is_parametrized(module):
        dim = _weight_norm_dim(module)
        base = type(module).__bases__[0]  # torch subclasses the module's class to parametrize it
        if dim is None or base not in _LAYERS:
            return None
        plain = _layer_recipe(base, module)
        return {**plain, "weight_norm": {"dim": dim}}
    cls = type(module)
    name = cls.__name__
    if RECIPE_CLASSES.get(name) is not cls:
        return None
    if cls is nn.Identity:
        return {"class": name, "kwargs": {}}
    if cls in _LAYERS:
        return _layer_recipe(cls, module)
    if cls is CenteredEmbedding:
        sizes = {"num_embeddings": module.num_embeddings, "embedding_dim": module.embedding_dim}
        return {"class": name, "kwargs": {**sizes, "padding_idx": module.padding_idx}}
    if (getattr(module, "_weight_key", "weight"), getattr(module, "_bias_key", "bias")) != ("weight", "bias"):
        return None  # a fused norm keeping a hand-written norm's own names ("gain"): not a plain class
    kwargs: dict[str, Any] = {
        "normalized_shape": list(module.normalized_shape),
        "eps": module.eps,
        "elementwise_affine": module.elementwise_affine,
        "bias": module.bias is not None,
        "casting": module.casting,
        "weight_offset": module.weight_offset,
    }
    if isinstance(module, _CHANNEL_NORMS):
        kwargs["channel_dim"] = module.channel_dim
    return {"class": name, "kwargs": kwargs}


def _layer_recipe(cls: type[nn.Module], module: nn.Module) -> dict[str, Any]:
    if cls is nn.Linear:
        return {
            "class": cls.__name__,
            "kwargs": {
                "in_features": module.in_features,
                "out_features": module.out_features,
                "bias": module.bias is not None,
            },
        }
    padding = module.padding if isinstance(module.padding, str) else list(module.padding)
    return {
        "class": cls.__name__,
        "kwargs": {
            "in_channels": module.in_channels,
            "out_channels": module.out_channels,
            "kernel_size": list(module.kernel_size),
            "stride": list(module.stride),
            "padding": padding,
            "dilation": list(module.dilation),
            "groups": module.groups,
            "bias": module.bias is not None,
            "padding_mode": module.padding_mode,
        },
    }


def _check_shape(value: Any) -> list[int]:
    if not isinstance(value, list) or not value or not all(type(d) is int and d > 0 for d in value):
        raise ValueError(f"normalized_shape must be a list of positive ints, got {value!r}")
    return value


def _check_number(key: str, value: Any) -> float:
    if type(value) not in (int, float) or value != value or abs(value) == float("inf"):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def _check_bool(key: str, value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _affine_kwargs(kwargs: Mapping[str, Any], channel: bool) -> dict[str, Any]:
    expected = {"normalized_shape", "eps", "elementwise_affine", "bias", "casting", "weight_offset"}
    if channel:
        expected.add("channel_dim")
    if set(kwargs) != expected:
        raise ValueError(f"arguments must be exactly {sorted(expected)}, got {sorted(kwargs)}")
    eps = _check_number("eps", kwargs["eps"])
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if kwargs["casting"] not in CASTING_MODES:
        raise ValueError(f"casting must be one of {list(CASTING_MODES)}, got {kwargs['casting']!r}")
    checked = {
        "normalized_shape": _check_shape(kwargs["normalized_shape"]),
        "eps": eps,
        "elementwise_affine": _check_bool("elementwise_affine", kwargs["elementwise_affine"]),
        "bias": _check_bool("bias", kwargs["bias"]),
        "casting": kwargs["casting"],
        "weight_offset": _check_number("weight_offset", kwargs["weight_offset"]),
    }
    if channel:
        dim = kwargs["channel_dim"]
        if type(dim) is not int or dim >= -1:
            raise ValueError(f"channel_dim must be a negative int below -1, got {dim!r}")
        checked["channel_dim"] = dim
    return checked


def _check_count(key: str, value: Any, minimum: int = 1) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{key} must be an int >= {minimum}, got {value!r}")
    return value


def _check_ints(key: str, value: Any, rank: int, minimum: int) -> list[int]:
    if not isinstance(value, list) or len(value) != rank:
        raise ValueError(f"{key} must be a list of {rank} ints, got {value!r}")
    return [_check_count(key, v, minimum) for v in value]


def _layer_kwargs(cls: type[nn.Module], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if cls is nn.Linear:
        if set(kwargs) != {"in_features", "out_features", "bias"}:
            raise ValueError(
                f"arguments must be exactly ['bias', 'in_features', 'out_features'], got {sorted(kwargs)}"
            )
        return {
            "in_features": _check_count("in_features", kwargs["in_features"]),
            "out_features": _check_count("out_features", kwargs["out_features"]),
            "bias": _check_bool("bias", kwargs["bias"]),
        }
    expected = {
        "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias", "padding_mode"
    }  # fmt: skip
    if set(kwargs) != expected:
        raise ValueError(f"arguments must be exactly {sorted(expected)}, got {sorted(kwargs)}")
    rank = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[cls]
    padding = kwargs["padding"]
    if not (padding in ("same", "valid") or isinstance(padding, list)):
        raise ValueError(f"padding must be 'same', 'valid' or a list of ints, got {padding!r}")
    if kwargs["padding_mode"] not in _PADDING_MODES:
        raise ValueError(
            f"padding_mode must be one of {list(_PADDING_MODES)}, got {kwargs['padding_mode']!r}"
        )
    return {
        "in_channels": _check_count("in_channels", kwargs["in_channels"]),
        "out_channels": _check_count("out_channels", kwargs["out_channels"]),
        "kernel_size": _check_ints("kernel_size", kwargs["kernel_size"], rank, 1),
        "stride": _check_ints("stride", kwargs["stride"], rank, 1),
        "padding": padding if isinstance(padding, str) else _check_ints("padding", padding, rank, 0),
        "dilation": _check_ints("dilation", kwargs["dilation"], rank, 1),
        "groups": _check_count("groups", kwargs["groups"]),
        "bias": _check_bool("bias", kwargs["bias"]),
        "padding_mode": kwargs["padding_mode"],
    }


def _embedding_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if set(kwargs) != {"num_embeddings", "embedding_dim", "padding_idx"}:
        raise ValueError(
            f"arguments must be exactly ['embedding_dim', 'num_embeddings', 'padding_idx'], got {sorted(kwargs)}"
        )
    count = _check_count("num_embeddings", kwargs["num_embeddings"])
    padding = kwargs["padding_idx"]
    if padding is not None and (type(padding) is not int or not -count <= padding < count):
        raise ValueError(f"padding_idx must be null or an int in [-{count}, {count}), got {padding!r:.80}")
    return {
        "num_embeddings": count,
        "embedding_dim": _check_count("embedding_dim", kwargs["embedding_dim"]),
        "padding_idx": padding,
    }


def _weight_norm_recipe_dim(value: Any, ndim: int) -> int:
    if not isinstance(value, Mapping) or set(value) != {"dim"}:
        raise ValueError(f"weight_norm must be {{'dim': DIM}}, got {value!r:.80}")
    dim = value["dim"]
    if not isinstance(dim, int) or isinstance(dim, bool) or not -1 <= dim < ndim:
        raise ValueError(f"weight_norm dim must be an int in [-1, {ndim}), got {dim!r:.80}")
    return dim


def build_from_recipe(
    recipe: Any, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The module a recipe describes, with fresh tensors of ``dtype`` on ``device``; ValueError, with
    the reason, for anything but a recipe :func:`module_recipe` could have written."""
    if not isinstance(recipe, Mapping) or set(recipe) - {"weight_norm"} != {"class", "kwargs"}:
        raise ValueError(f"a module recipe is {{'class': NAME, 'kwargs': {{...}}}}, got {recipe!r:.200}")
    name, kwargs = recipe["class"], recipe["kwargs"]
    if "weight_norm" in recipe:
        module = build_from_recipe({"class": name, "kwargs": kwargs}, device=device, dtype=dtype)
        if type(module) not in _LAYERS:
            raise ValueError(f"weight_norm is for {', '.join(c.__name__ for c in _LAYERS)}, not {name!r:.80}")
        dim = _weight_norm_recipe_dim(recipe["weight_norm"], module.weight.ndim)
        return weight_norm(module, "weight", dim=dim)
    cls = RECIPE_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown module class {name!r:.80} (known: {', '.join(sorted(RECIPE_CLASSES))})")
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{name}: kwargs must be a mapping, got {kwargs!r:.80}")
    if cls is nn.Identity:
        if kwargs:
            raise ValueError(f"Identity takes no arguments, got {sorted(kwargs)}")
        return nn.Identity()
    if cls in _LAYERS:
        return cls(**_layer_kwargs(cls, kwargs), device=device, dtype=dtype)
    if cls is CenteredEmbedding:
        return cls(**_embedding_kwargs(kwargs), device=device, dtype=dtype)
    checked = _affine_kwargs(kwargs, channel=cls in _CHANNEL_NORMS)
    channel_dim = checked.pop("channel_dim", None)
    module = cls(**checked, device=device, dtype=dtype)
    if channel_dim is not None:
        module.channel_dim = channel_dim
    return module
