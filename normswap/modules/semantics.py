"""What a normalization computes: the one record of a norm's semantics, and the one vocabulary of kinds.

:class:`NormKind` is the kind of a norm everywhere: in discovery's records, in the JSON report (its
values, ``"rms"``, ``"layer"``, ... are the strings the report has always carried), in the passes and in
the command line, whose longer spellings (``--to rmsnorm``, ``--from layernorm``) :meth:`NormKind.parse`
and :func:`parse_target` accept. :data:`SWAP_TARGETS` is the map from those spellings to what a swap
builds; nothing else spells a kind.

:class:`NormSemantics` is what a norm computes, stated once: its kind, the dims and shape it normalizes,
the eps it *applies* for the dtype it runs in, whether it has a weight and a bias and under which names
its module stores them, its casting mode and weight offset. Discovery computes one per norm
(:mod:`normswap.discover`); every pass, and every module built to replace a norm (the fused modules, the
swapped norms), reads that record instead of reading the module again.

:func:`declared_semantics` is the one reader of the classes whose attributes state their semantics
(torch.nn's norms and normswap's own); norms of any other class are read off the graph by discovery.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from normswap.modules.norms import LayerNorm, RMSNorm


class NormKind(str, Enum):
    """The kind of a normalization. A ``str``, so it compares equal to and serializes as its value."""

    BATCH = "batch"
    LAYER = "layer"
    GROUP = "group"
    INSTANCE = "instance"
    RMS = "rms"
    OTHER = "other"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def long_name(self) -> str:
        """The command line's spelling: ``rmsnorm``, ``layernorm``, ... (``other`` stays ``other``)."""
        return self.value if self is NormKind.OTHER else f"{self.value}norm"

    @classmethod
    def parse(cls, text: str | NormKind) -> NormKind:
        """The kind named by ``text``: a value (``rms``), a long name (``rmsnorm``, ``RMSNorm``) or an op
        name (``rms_norm``). ValueError, listing the choices, for anything else."""
        if isinstance(text, NormKind):
            return text
        key = str(text).strip().lower().replace("_", "")
        for kind in cls:
            if key in (kind.value, kind.long_name):
                return kind
        choices = ", ".join(k.value for k in cls)
        raise ValueError(f"unknown norm kind {text!r}; choose from {choices} (or rmsnorm, layernorm, ...)")


NORM_KINDS: tuple[str, ...] = tuple(k.value for k in NormKind)

# What ``--to``/``SwapNorm`` may build: a norm of another kind, or a norm-free layer (DyT, Derf, a plain
# affine).
DYT, DERF, IDENTITY = "dyt", "derf", "identity"
SWAP_TARGETS: dict[str, str] = {
    **{
        k.long_name: k
        for k in (NormKind.RMS, NormKind.LAYER, NormKind.BATCH, NormKind.GROUP, NormKind.INSTANCE)
    },
    DYT: DYT,
    DERF: DERF,
    IDENTITY: IDENTITY,
}
# ``--to fused``: every norm for its fused twin, same semantics (normswap.passes.FuseNorm).
FUSED = "fused"
# Pre-CRMSNorm: LayerNorm -> RMSNorm on a residual stream one dimension narrower (exact only).
CRMSNORM = "crmsnorm"
# ``--to cosine``: Linear/Conv layers become cosine-normalized (normswap.passes.CosineLayers); no norm is
# swapped, the layers before norms change.
COSINE = "cosine"
CONVERT_TARGETS: tuple[str, ...] = (*SWAP_TARGETS, FUSED, CRMSNORM, COSINE)


def parse_target(text: str) -> str:
    """The ``--to`` spelling of a target (a key of :data:`SWAP_TARGETS`, or ``fused``), from that
    spelling or a kind's value (``rms`` -> ``rmsnorm``). ValueError, listing the choices, otherwise."""
    key = str(text).strip().lower()
    if key in CONVERT_TARGETS:
        return key
    try:
        kind = NormKind.parse(key)
    except ValueError:
        kind = None
    if kind is not None and kind.long_name in SWAP_TARGETS:
        return kind.long_name
    raise ValueError(f"unknown norm target {text!r}; choose from {', '.join(CONVERT_TARGETS)}")


@dataclass(frozen=True)
class NormSemantics:
    """What one norm computes, as it computes it. Frozen: discovery states it once and passes read it.

    - ``normalized_dims``: the dims it normalizes over, counted from the end (``(-1,)``; ``(-3,)`` for
      a LayerNorm2d over the C of NCHW; ``(1,)`` for BatchNorm's channel dim; None for GroupNorm and an
      InstanceNorm whose input rank is unknown); ``normalized_shape``: the shape of its affine tensors.
    - ``eps``: the eps it adds, *as applied* for ``dtype``, the dtype it runs in (the input's where the
      graph shows it, else its parameters'): ``nn.RMSNorm(eps=None)`` and ``F.rms_norm(eps=None)`` take
      theirs from the dtype (:func:`default_rms_eps`), HF's norms keep theirs in ``variance_epsilon``.
      None only when it could not be read (a norm found in a graph whose eps is a tensor).
    - ``weight_name``/``bias_name``: the names of its weight and bias inside its module (``"weight"``,
      ``"bias"`` for torch's classes, ``"gain"``/``"shift"`` for a hand-written one); None when it has
      none, or when the tensor is not one its module stores (a norm inside a larger forward).
    - ``casting``: where it rounds (``normswap.kernels.reference``); ``weight_offset``: Gemma's 1 in
      ``(1 + w)``.
    - ``num_groups``, ``running_stats``, ``momentum``: GroupNorm's groups; whether a batch/instance norm
      normalizes with stored statistics, and how training updates them.
    """

    kind: NormKind
    normalized_shape: tuple[int, ...] | None = None
    normalized_dims: tuple[int, ...] | None = None
    eps: float | None = None
    dtype: str | None = None
    affine: bool = False
    bias: bool = False
    weight_name: str | None = None
    bias_name: str | None = None
    casting: str = "none"
    weight_offset: float = 0.0
    num_groups: int | None = None
    running_stats: bool = False
    momentum: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", NormKind.parse(self.kind))
        for key in ("normalized_shape", "normalized_dims"):
            value = getattr(self, key)
            if value is not None:
                object.__setattr__(self, key, tuple(int(d) for d in value))
        if self.eps is not None:
            object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "weight_offset", float(self.weight_offset))

    def module_kwargs(self) -> dict[str, Any]:
        """Constructor arguments of normswap's RMSNorm/LayerNorm (and their fused twins) for this norm."""
        if self.normalized_shape is None or self.eps is None:
            raise ValueError("its normalized shape or eps could not be determined")
        return {
            "normalized_shape": self.normalized_shape,
            "eps": self.eps,
            "elementwise_affine": self.affine,
            "bias": self.bias,
            "casting": self.casting,
            "weight_offset": self.weight_offset,
        }

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        for key in ("normalized_shape", "normalized_dims"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data


# ---------------------------------------------------------------------------------------------------
# eps as applied


_PROBE = (2.0**-14, 2.0**-12, 2.0**-10)  # normal numbers in every float dtype, squares far below 1e-3


@functools.cache
def default_rms_eps(dtype: torch.dtype) -> float:
    """The eps ``F.rms_norm``/``nn.RMSNorm`` add when given ``eps=None``, for inputs of ``dtype``.

    torch has stated this differently across releases (the input dtype's machine epsilon, or that of the
    type it computes in: fp32's for fp16/bf16/fp32, fp64's for fp64), so it is measured, once per dtype,
    on the installed torch: rows of one small constant ``s`` normalize to ``s / sqrt(s^2 + eps)``, which
    each candidate eps predicts differently; the candidate that reproduces torch's output is the eps.
    """
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    finfo = torch.finfo
    candidates = sorted({finfo(dtype).eps, finfo(torch.float32).eps, finfo(torch.float64).eps})
    s = torch.tensor(_PROBE, dtype=torch.float64)
    try:
        x = s.to(dtype)[:, None].expand(len(_PROBE), 4)
        got = torch.nn.functional.rms_norm(x, (4,), None, None)[:, 0].double()
    except (RuntimeError, TypeError):  # a dtype torch cannot normalize on the CPU: its documented rule
        return float(finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps)
    errors = [float((got - s / torch.sqrt(s * s + eps)).abs().max()) for eps in candidates]
    return float(candidates[errors.index(min(errors))])


def applied_eps(declared: float | None, dtype: torch.dtype | None) -> float:
    """The eps a norm adds given its declared ``eps`` (None: the dtype's default) and its dtype."""
    if declared is not None:
        return float(declared)
    return default_rms_eps(dtype if dtype is not None else torch.get_default_dtype())


# ---------------------------------------------------------------------------------------------------
# Classes whose attributes state their semantics


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).replace("torch.", "") if dtype is not None else None


def module_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of the first floating-point tensor ``module`` holds itself (None if it holds none)."""
    for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        if t.is_floating_point():
            return t.dtype
    return None


def _names(module: nn.Module, affine: bool, bias: bool) -> dict[str, str | None]:
    # normswap's fused modules may keep a hand-written norm's names (normswap.modules.fused.FusedNorm)
    return {
        "weight_name": module.__dict__.get("_weight_key", "weight") if affine else None,
        "bias_name": module.__dict__.get("_bias_key", "bias") if bias else None,
    }


def _trailing_dims(module: nn.Module, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The trailing dims, or the one channel dim of normswap's fused channel norms (``channel_dim``)."""
    channel_dim = getattr(module, "channel_dim", None)
    if isinstance(channel_dim, int) and channel_dim < -1:
        return (channel_dim,)
    return tuple(range(-len(shape), 0))


def declared_semantics(module: nn.Module, dtype: torch.dtype | None = None) -> NormSemantics | None:
    """The semantics of a module whose class states them (torch.nn's BatchNorm, InstanceNorm, GroupNorm,
    LayerNorm, RMSNorm and their subclasses; normswap's RMSNorm/LayerNorm, fused or not), running in
    ``dtype`` (default: its parameters' dtype); None for any other module.

    A subclass that computes something else than its base (timm's LayerNorm2d permutes around it) is
    corrected by discovery from the graph (its ``normalized_dims``).
    """
    dtype = dtype if dtype is not None else module_dtype(module)
    common: dict[str, Any] = {"dtype": dtype_name(dtype)}
    if isinstance(module, nn.modules.batchnorm._BatchNorm | nn.modules.instancenorm._InstanceNorm):
        batch = isinstance(module, nn.modules.batchnorm._BatchNorm)
        return NormSemantics(
            kind=NormKind.BATCH if batch else NormKind.INSTANCE,
            normalized_dims=(1,) if batch else None,  # instance: every spatial dim, as many as the input has
            normalized_shape=(module.num_features,),
            eps=module.eps,
            affine=module.affine,
            bias=module.affine,
            running_stats=bool(module.track_running_stats and (not batch or module.running_mean is not None)),
            momentum=module.momentum,
            **_names(module, module.affine, module.affine),
            **common,
        )
    if isinstance(module, nn.GroupNorm):
        return NormSemantics(
            kind=NormKind.GROUP,
            normalized_shape=(module.num_channels,),
            eps=module.eps,
            affine=module.affine,
            bias=module.affine,
            num_groups=module.num_groups,
            **_names(module, module.affine, module.affine),
            **common,
        )
    rms = isinstance(module, nn.RMSNorm | RMSNorm)
    if not rms and not isinstance(module, nn.LayerNorm | LayerNorm):
        return None
    shape = tuple(module.normalized_shape)
    affine = module.weight is not None
    bias = getattr(module, "bias", None) is not None
    return NormSemantics(
        kind=NormKind.RMS if rms else NormKind.LAYER,
        normalized_dims=_trailing_dims(module, shape),
        normalized_shape=shape,
        # nn.RMSNorm(eps=None) takes its eps from the dtype it runs in
        eps=applied_eps(module.eps, dtype),
        affine=affine,
        bias=bias,
        casting=getattr(module, "casting", "none"),
        weight_offset=getattr(module, "weight_offset", 0.0),
        **_names(module, affine, bias),
        **common,
    )


__all__ = [
    "CONVERT_TARGETS",
    "COSINE",
    "CRMSNORM",
    "DERF",
    "DYT",
    "FUSED",
    "IDENTITY",
    "NORM_KINDS",
    "SWAP_TARGETS",
    "NormKind",
    "NormSemantics",
    "applied_eps",
    "declared_semantics",
    "default_rms_eps",
    "dtype_name",
    "module_dtype",
    "parse_target",
]
