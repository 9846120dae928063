"""Numbers that say how far one tensor is from another.

Exact rewrites are judged by max abs error relative to the reference's scale, with the dtype's row of
the tolerance table (:mod:`normswap.util.tolerance`), and outputs that are not floating point (ids, argmax, bool masks) by equality;
architectural ones by signal-to-noise ratio, ``20 log10(||ref|| / ||ref - out||)``.

A NaN or Inf anywhere in either tensor fails the comparison, whichever rule judges it: nothing was
compared there, and no figure (max abs, SQNR, cosine) measures it, so every figure is NaN and
``nonfinite`` says where (:func:`nonfinite_where`, the one function every comparison calls).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from normswap.util.finite import first_nonfinite
from normswap.util.tolerance import exact_tolerance, within_exact_tolerance

ORIGINAL = "the original's"
CONVERTED = "the converted model's"


def nonfinite_where(
    name: str,
    reference: torch.Tensor,
    output: torch.Tensor,
    *,
    reference_label: str = ORIGINAL,
    output_label: str = CONVERTED,
) -> str | None:
    """The one NaN/Inf rule of every comparison: None when both tensors are finite everywhere, else one
    sentence saying which tensor holds what where ("the converted model's output.logits holds NaN at
    [2, 1] (1 non-finite value)"). The reference is looked at first: a NaN in both at the same place is
    still a failure, of the reference itself, since nothing was compared there."""
    for label, tensor, broken in ((reference_label, reference, True), (output_label, output, False)):
        found = first_nonfinite(tensor)
        if found is None:
            continue
        count, index, kind = found
        values = f"{count} non-finite value{'s' if count != 1 else ''}"
        tail = ": nothing was compared there" if broken else ""
        return f"{label} {name} holds {kind} at {index} ({values}){tail}"
    return None


def sqnr_db(reference: torch.Tensor, output: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; ``inf`` when the two are identical, NaN (not a number of
    dB) when either holds a NaN or Inf: nothing measures the noise there."""
    pooled = PooledSqnr()
    pooled.add(reference, output)
    return pooled.db


@dataclass
class PooledSqnr:
    """The SQNR of several output pairs taken together (batches of one output), as validate reports it:
    the signal and the noise summed over all of them, not the worst or the mean of their SQNRs; NaN
    once any pair holds a NaN or Inf."""

    signal_sq: float = 0.0
    noise_sq: float = 0.0
    nonfinite: bool = False
    pairs: int = 0

    def add(self, reference: torch.Tensor, output: torch.Tensor) -> None:
        self.pairs += 1
        if nonfinite_where("", reference, output) is not None:
            self.nonfinite = True
            return
        ref = reference.detach().double()
        self.signal_sq += float(ref.norm()) ** 2
        self.noise_sq += float((ref - output.detach().double()).norm()) ** 2

    @classmethod
    def of(cls, pools: Iterable[PooledSqnr]) -> PooledSqnr:
        """Several pools taken together (each input's, block by block), as one pool of all their pairs."""
        pools = list(pools)
        return cls(
            sum(p.signal_sq for p in pools),
            sum(p.noise_sq for p in pools),
            any(p.nonfinite for p in pools),
            sum(p.pairs for p in pools),
        )

    @property
    def db(self) -> float:
        """NaN with no pair (nothing compared) or a non-finite one."""
        return math.nan if self.nonfinite or not self.pairs else _sqnr(self.signal_sq, self.noise_sq)


@dataclass
class TensorComparison:
    name: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_ref: float
    max_rel: float  # max_abs / max|ref|
    sqnr_db: float
    cosine: float
    tolerance: float
    within_tolerance: bool
    top1_agreement: float | None = None
    # integer and bool outputs: how many elements differ (they are compared for equality)
    mismatched: int | None = None
    # where a NaN or Inf sits (nonfinite_where); the comparison then fails and its figures are NaN
    nonfinite: str | None = None


def compare_tensors(
    name: str,
    reference: torch.Tensor,
    output: torch.Tensor,
    *,
    reference_label: str = ORIGINAL,
    output_label: str = CONVERTED,
) -> TensorComparison:
    """Every figure of ``output`` against ``reference`` (same shape).

    A NaN or Inf in either fails it (:func:`nonfinite_where`, whose labels name the two in the
    sentence): its figures are NaN, ``nonfinite`` says where.

    Integer and bool tensors are within tolerance only when equal, element for element (compared as
    they are, not through float64, which cannot tell large ids apart); the other figures still say how
    far they moved. Complex tensors are compared as their real and imaginary parts.
    """
    dtype = reference.dtype
    # None for floating tensors, judged by the tolerance; else whether the two are equal
    exact_match = (
        None
        if reference.is_floating_point() or reference.is_complex()
        else reference.shape == output.shape
        and reference.dtype == output.dtype
        and torch.equal(reference.detach().cpu(), output.detach().cpu())
    )
    if reference.is_complex():
        reference = torch.view_as_real(reference.detach().resolve_conj())
    if output.is_complex():
        output = torch.view_as_real(output.detach().resolve_conj())
    if reference.shape != output.shape:
        raise ValueError(f"output {name!r} changed shape: {tuple(reference.shape)} -> {tuple(output.shape)}")
    tol = exact_tolerance(dtype)
    nonfinite = nonfinite_where(
        name, reference, output, reference_label=reference_label, output_label=output_label
    )
    if nonfinite is not None:
        nan = math.nan
        return TensorComparison(name, tuple(reference.shape), str(dtype).replace("torch.", ""), nan, nan,
                                nan, nan, nan, tol, False, nonfinite=nonfinite)  # fmt: skip
    sums = _Sums.of(reference.detach(), output.detach(), top1=reference.ndim >= 2 and reference.shape[-1] > 1)
    max_abs, max_ref = sums.max_abs, sums.max_ref
    # one root of the product: equal outputs give a cosine of exactly 1 (two roots can give 1 + 2e-16)
    product = sums.ref_sq * sums.out_sq
    denom = math.sqrt(product) if math.isfinite(product) else math.sqrt(sums.ref_sq) * math.sqrt(sums.out_sq)
    cosine = sums.dot / denom if denom > 0 else (1.0 if max_abs == 0 else 0.0)
    top1 = sums.top1 / sums.rows if sums.rows and dtype.is_floating_point else None
    return TensorComparison(
        name=name,
        shape=tuple(reference.shape),
        dtype=str(dtype).replace("torch.", ""),
        max_abs=max_abs,
        max_ref=max_ref,
        max_rel=max_abs / max_ref if max_ref > 0 else (0.0 if max_abs == 0 else math.inf),
        sqnr_db=_sqnr(sums.ref_sq, sums.noise_sq),
        cosine=cosine,
        tolerance=tol,
        within_tolerance=(
            exact_match if exact_match is not None else within_exact_tolerance(max_abs, max_ref, dtype)
        ),
        top1_agreement=top1,
        mismatched=sums.mismatched if exact_match is not None else None,
    )


def _sqnr(signal_sq: float, noise_sq: float) -> float:
    if noise_sq == 0:
        return math.inf
    if signal_sq == 0:
        return -math.inf
    return 10 * math.log10(signal_sq / noise_sq)


@dataclass
class _Sums:
    """What :func:`compare_tensors` reports, summed in float64 over slices of whole rows (of the last dim)
    of about a million values: a model's logits (GPT-2: 50257 per token) are never copied whole into
    float64, which cost 4-5 fp64 copies of the output per comparison, on top of the model's memory."""

    max_abs: float = 0.0
    max_ref: float = 0.0
    ref_sq: float = 0.0
    out_sq: float = 0.0
    dot: float = 0.0
    noise_sq: float = 0.0
    mismatched: int = 0
    top1: int = 0  # rows whose argmax agrees (only summed when asked)
    rows: int = 0

    @classmethod
    def of(cls, reference: torch.Tensor, output: torch.Tensor, *, top1: bool, chunk: int = 1 << 20) -> _Sums:
        sums = cls()
        width = reference.shape[-1] if reference.ndim else 1
        ref_rows = reference.reshape(-1, width) if width else reference.reshape(0, 1)
        out_rows = output.reshape(-1, width) if width else output.reshape(0, 1)
        step = max(1, chunk // max(1, width))
        for start in range(0, ref_rows.shape[0], step):
            r = ref_rows[start : start + step].double().cpu()
            o = out_rows[start : start + step].double().cpu()
            diff = r - o
            if diff.numel():
                sums.max_abs = max(sums.max_abs, float(diff.abs().max()))
                sums.max_ref = max(sums.max_ref, float(r.abs().max()))
            sums.ref_sq += float((r * r).sum())
            sums.out_sq += float((o * o).sum())
            sums.dot += float((r * o).sum())
            sums.noise_sq += float((diff * diff).sum())
            sums.mismatched += int((diff != 0).sum())
            if top1:
                sums.top1 += int((r.argmax(-1) == o.argmax(-1)).sum())
                sums.rows += r.shape[0]
        return sums


def flatten_outputs(
    value: Any, prefix: str = "output", *, floating_only: bool = True, _seen: set[int] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Tensors of a model output (tensor, tuple, dict, HF ModelOutput, a cache object), with names.

    ``floating_only`` (the default) keeps floating-point tensors only: what SQNR, losses and layer
    figures need. An exact check passes ``floating_only=False`` so that integer, bool and complex
    outputs (argmax, ids, masks) are compared too. An object that is none of those (a transformers
    ``Cache``: Mamba's states, an attention cache) gives the tensors among its attributes: its iteration
    is its own protocol (Mamba's cache raises when iterated as an attention cache), its state is not.
    """
    if isinstance(value, torch.Tensor):
        return [(prefix, value)] if value.is_floating_point() or not floating_only else []
    seen = set() if _seen is None else _seen
    if id(value) in seen:  # an object reachable twice (a cache's layers pointing back) counts once
        return []
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, Mapping):
        seen.add(id(value))
        for key, item in value.items():
            found += flatten_outputs(item, f"{prefix}.{key}", floating_only=floating_only, _seen=seen)
    elif isinstance(value, (list, tuple)):
        seen.add(id(value))
        for i, item in enumerate(value):
            found += flatten_outputs(item, f"{prefix}[{i}]", floating_only=floating_only, _seen=seen)
    elif hasattr(value, "__dict__") and not isinstance(value, (str, bytes, type, nn.Module)):
        seen.add(id(value))
        for key, item in vars(value).items():
            if not key.startswith("_"):
                found += flatten_outputs(item, f"{prefix}.{key}", floating_only=floating_only, _seen=seen)
    return found


def record_module_inputs(
    model: nn.Module, modules: list[nn.Module], args: tuple | None, kwargs: dict | None
) -> dict[int, torch.Tensor]:
    """First positional input each of ``modules`` receives in one forward pass, keyed by ``id``."""
    seen: dict[int, torch.Tensor] = {}

    def hook(module: nn.Module, inputs: tuple) -> None:
        if id(module) not in seen and inputs and isinstance(inputs[0], torch.Tensor):
            seen[id(module)] = (
                inputs[0].detach().clone()
            )  # in-place ops later in the forward must not reach it

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        with torch.no_grad():
            model(*(args or ()), **(kwargs or {}))
    finally:
        for h in handles:
            h.remove()
    return seen
