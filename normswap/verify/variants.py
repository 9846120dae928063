"""Inputs beyond the example, so that an exact rewrite is checked on the function, not on one input.

An exact rewrite checked on the example inputs alone can be wrong everywhere else: a model whose forward
branches on a shape (``bn(y) if x.shape[-1] >= 8 else y``) computes one function per branch, and the
example exercises only one of them. The variants here change the inputs along the dims a model usually
accepts freely (the batch dim, the length of token inputs, the spatial or sequence dims of floating
inputs), with deterministic data derived from the example. Which ones the model really accepts is
decided by running the ORIGINAL model on each (:func:`accepted_variants`): a size it rejects (an
attention window, a position table, a fixed image size) is not a free size, and is dropped.

The cost is bounded: a handful of candidates (never a grid of sizes), none with more than twice the
example's elements.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from normswap.util.shapes import format_shapes, input_shapes
from normswap.verify.compare import run_model
from normswap.verify.metrics import flatten_outputs, nonfinite_where

# A variant holds at most this many times the example's elements: enough to cross a size threshold the
# example sits below, never enough to make the check cost more than a few example runs.
MAX_ELEMENT_RATIO = 2.0
# Seed of the generated data: the same model and example always get the same variants.
SEED = 0


@dataclass
class InputVariant:
    """One set of inputs for the model: the example itself or an example changed along free dims."""

    label: str  # what was changed: "batch 3", "length 3", "channels-first size 8x8"
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def shapes(self) -> list[list[int]]:
        return input_shapes(self.args, self.kwargs)

    def describe(self) -> str:
        return format_shapes(self.shapes)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "shapes": self.shapes}


def _leaves(args: tuple | None, kwargs: dict | None) -> tuple[list[Any], Any]:
    return pytree.tree_flatten((tuple(args or ()), dict(kwargs or {})))


def _numel(args: tuple, kwargs: dict) -> int:
    leaves, _ = _leaves(args, kwargs)
    return sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))


def _is_mask_like(t: torch.Tensor) -> bool:
    """A bool tensor, or an integer one holding only 0 and 1 (an attention mask, token type ids).

    Such a tensor is a pattern, not data: random values would mask whole rows (NaN or meaningless
    outputs), so it is extended by repeating its last slice, which continues padding as padding and
    attention as attention (HF ``attention_mask`` with 1 = attend, torch ``key_padding_mask`` with
    True = ignore: both stay consistent).
    """
    if t.dtype == torch.bool:
        return True
    if t.is_floating_point() or t.is_complex() or t.numel() == 0:
        return False
    return bool(((t == 0) | (t == 1)).all())


def _fill_like(t: torch.Tensor, shape: list[int], dim: int, generator: torch.Generator) -> torch.Tensor:
    """New values of ``shape`` (``t``'s shape but along ``dim``) that ``t``'s model would accept.

    - masks (:func:`_is_mask_like`) repeat their last slice along ``dim``;
    - integers (token ids, class ids) are drawn within the example's min..max, so that an id stays
      valid for the embedding table it indexes;
    - floating values are drawn from a normal with the example's mean and std, keeping activations in
      the range the example exercised (exactness is judged relative to the output's scale);
    - complex values are standard normal.
    """
    if t.numel() == 0:
        return torch.zeros(shape, dtype=t.dtype, device=t.device)
    if _is_mask_like(t):
        last = t.narrow(dim, t.shape[dim] - 1, 1)
        return last.expand(shape).clone()
    if t.is_complex():
        return torch.randn(shape, generator=generator, dtype=t.dtype).to(t.device)
    if not t.is_floating_point():
        low, high = int(t.min()), int(t.max())
        values = torch.randint(low, high + 1, shape, generator=generator, dtype=torch.int64)
        return values.to(device=t.device, dtype=t.dtype)
    ref = t.double()
    mean = float(ref.mean())
    std = float(ref.std()) if t.numel() > 1 else 0.0
    if not (math.isfinite(mean) and math.isfinite(std)):
        mean, std = 0.0, 1.0
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * std + mean
    return values.to(device=t.device, dtype=t.dtype)


def resize_dim(
    t: torch.Tensor, dim: int, size: int, generator: torch.Generator, *, keep_end: bool = False
) -> torch.Tensor:
    """``t`` with ``dim`` cut to its first ``size`` entries (its last, with ``keep_end``), or extended to
    ``size`` with values like ``t``'s (:func:`_fill_like`). Cutting keeps a part of the example (a crop of
    an image, the first tokens of a sentence, with its mask cut the same way), so the smaller input is
    still a real one."""
    t = t.detach()
    old = t.shape[dim]
    if size <= old:
        return t.narrow(dim, old - size if keep_end else 0, size).clone()
    shape = list(t.shape)
    shape[dim] = size - old
    return torch.cat([t, _fill_like(t, shape, dim, generator)], dim=dim)


def _resized(
    args: tuple, kwargs: dict, plan: Callable[[torch.Tensor], dict[int, int]], *, keep_end: bool = False
) -> tuple[tuple, dict] | None:
    """The inputs with every tensor's dims resized as ``plan(tensor)`` says ({dim: new size}), a cut
    keeping the end with ``keep_end``; None when the plan changes nothing."""
    generator = torch.Generator().manual_seed(SEED)
    leaves, spec = _leaves(args, kwargs)
    changed = False
    new_leaves = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            for dim, size in sorted(plan(leaf).items()):
                if leaf.shape[dim] != size:
                    leaf = resize_dim(leaf, dim, size, generator, keep_end=keep_end)
                    changed = True
        new_leaves.append(leaf)
    if not changed:
        return None
    new_args, new_kwargs = pytree.tree_unflatten(new_leaves, spec)
    return tuple(new_args), dict(new_kwargs)


def _grow(size: int, dims: int) -> int:
    """A larger size for ``dims`` dims changed together: their product grows by at most 2x."""
    return max(size + 1, math.floor(size * MAX_ELEMENT_RATIO ** (1 / max(dims, 1))))


def _shrink(size: int) -> int:
    """A clearly smaller size (a quarter): far enough to cross a size threshold the example sits above
    (``if x.shape[-1] >= 8``), never below 1."""
    return max(1, size // 4)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves, _ = _leaves(args, kwargs)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def batch_variants(args: tuple, kwargs: dict) -> list[InputVariant]:
    """The batch dim changed on every input at once: b -> b + 1, and b -> 1 when b > 1.

    The batch size is dim 0 of the first tensor; every tensor whose dim 0 has that size changes with it
    (input_ids and attention_mask together), others (a shared table, a scalar) stay. ``b + 1`` rows
    keep the example's rows and add one; batch 1 is the first row, the size where ``squeeze()`` and
    batch-statistics code paths part from the rest.
    """
    batched = [t for t in _tensors(args, kwargs) if t.ndim >= 1]
    if not batched:
        return []
    b = batched[0].shape[0]
    sizes = [b + 1] + ([1] if b > 1 else [])
    found = []
    for size in sizes:
        resized = _resized(
            args, kwargs, lambda t, size=size: {0: size} if t.ndim >= 1 and t.shape[0] == b else {}
        )
        if resized is not None:
            found.append(InputVariant(f"batch {size}", *resized))
    return found


def sequence_variants(args: tuple, kwargs: dict) -> list[InputVariant]:
    """The length of integer/bool inputs of rank >= 2 (token ids, masks), shorter and longer.

    The length is the last dim of the first such tensor; every dim after dim 0 of every integer/bool
    tensor with that size changes with it, so input_ids, attention_mask, token_type_ids and a square
    (B, 1, T, T) mask stay consistent. Shorter is a quarter (a prefix of the tokens, or their end for
    a left-padded batch, :func:`_padded_at_start`); longer appends
    tokens drawn within the example's id range, and grows the total by at most 2x. A length past a
    position table or attention window makes the original model raise, and the variant is dropped.
    """

    def dims(t: torch.Tensor, length: int) -> list[int]:
        if t.ndim < 2 or t.is_floating_point() or t.is_complex():
            return []
        return [d for d in range(1, t.ndim) if t.shape[d] == length]

    tensors = _tensors(args, kwargs)
    first = next((t for t in tensors if t.ndim >= 2 and dims(t, t.shape[-1])), None)
    if first is None:
        return []
    length = first.shape[-1]
    together = max(len(dims(t, length)) for t in tensors)
    left_padded = any(_padded_at_start(t, length) for t in tensors)
    found = []
    for size in (_shrink(length), _grow(length, together)):
        if size == length:
            continue
        resized = _resized(
            args, kwargs, lambda t, size=size: dict.fromkeys(dims(t, length), size), keep_end=left_padded
        )
        if resized is not None:
            found.append(InputVariant(f"length {size}", *resized))
    return found


def _padded_at_start(t: torch.Tensor, length: int) -> bool:
    """Whether ``t`` is the mask of a left-padded batch of sentences of ``length`` tokens: the rows that
    are all one value (the longest sentences: that value marks a token, 1 in HF's ``attention_mask``,
    False in torch's ``key_padding_mask``) are there, and every other row is a run of the other value
    (padding) followed by tokens. A shorter variant of such a batch keeps its last tokens: its first
    ones would leave a sentence with no token to attend to, whose outputs no two runtimes agree on."""
    if t.ndim != 2 or t.shape[-1] != length or length < 2 or not _is_mask_like(t):
        return False
    rows = t.to(torch.int64)
    whole = (rows == rows[:, :1]).all(dim=1)
    token_values = rows[whole, 0].unique()
    if not bool(whole.any()) or bool(whole.all()) or len(token_values) != 1:
        return False
    token = int(token_values[0])
    padded = rows[~whole]
    starts_padded = (padded[:, 0] != token) & (padded[:, -1] == token)
    # a run of padding then tokens: the values never go back from token to padding
    monotone = ((padded[:, 1:] == token) | (padded[:, :-1] != token)).all(dim=1)
    return bool((starts_padded & monotone).all())


# Where the free dims of a floating input of rank >= 3 are: (N, C, *spatial) as torch convolutions
# take them, or (N, *spatial_or_sequence, C) as channels-last images and (B, T, D) embeddings do.
_LAYOUTS: dict[str, Callable[[int], range]] = {
    "channels-first": lambda ndim: range(2, ndim),
    "channels-last": lambda ndim: range(1, ndim - 1),
}


def spatial_variants(args: tuple, kwargs: dict) -> list[InputVariant]:
    """The spatial (or sequence) dims of floating inputs of rank >= 3, smaller and larger.

    The layout is not known, so both are tried (:data:`_LAYOUTS`); the wrong one changes a channel or
    feature dim, which the original model rejects, and is dropped. Sizes change through one map from
    old size to new size over all floating inputs of rank >= 3, so an image and a same-sized mask stay
    together. Smaller is a quarter of each size (a crop of the example); larger grows the element count
    by at most 2x (a 16x16 image becomes 22x22: an odd size also tries the rounding of strided layers).
    """
    floats = [t for t in _tensors(args, kwargs) if t.ndim >= 3 and t.is_floating_point()]
    if not floats:
        return []
    reference = floats[0]
    found = []
    for layout, free in _LAYOUTS.items():
        dims = list(free(reference.ndim))
        sizes = {reference.shape[d] for d in dims}
        for grow in (False, True):
            new = {s: _grow(s, len(dims)) if grow else _shrink(s) for s in sizes}

            def plan(t: torch.Tensor, new: dict[int, int] = new, layout: str = layout) -> dict[int, int]:
                if t.ndim < 3 or not t.is_floating_point():
                    return {}
                return {d: new[t.shape[d]] for d in _LAYOUTS[layout](t.ndim) if t.shape[d] in new}

            resized = _resized(args, kwargs, plan)
            if resized is not None:
                size = "x".join(str(new[reference.shape[d]]) for d in dims)
                found.append(InputVariant(f"{layout} size {size}", *resized))
    return found


def candidate_variants(args: tuple | None, kwargs: dict | None) -> list[InputVariant]:
    """Every variant worth trying for these example inputs, example excluded, in a fixed order.

    Batch, then sequence length, then spatial sizes; a variant whose shapes repeat the example's or an
    earlier variant's is left out, and so is one with more than :data:`MAX_ELEMENT_RATIO` times the
    example's elements. Non-tensor inputs (``use_cache=False``) are passed unchanged.
    """
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    budget = MAX_ELEMENT_RATIO * max(_numel(args, kwargs), 1)
    seen = [input_shapes(args, kwargs)]
    found = []
    for variant in (
        *batch_variants(args, kwargs),
        *sequence_variants(args, kwargs),
        *spatial_variants(args, kwargs),
    ):
        if variant.shapes in seen or _numel(variant.args, variant.kwargs) > budget:
            continue
        seen.append(variant.shapes)
        found.append(variant)
    return found


def describe_error(exc: BaseException) -> str:
    """One line for an exception a model raised on some inputs."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def nonfinite_output(output: Any) -> str | None:
    """Where the first floating-point tensor of the original's output holding a NaN or Inf holds it
    (:func:`normswap.verify.metrics.nonfinite_where`); None when every one is finite."""
    for name, t in flatten_outputs(output):
        where = nonfinite_where(name, t, t)
        if where is not None:
            return where
    return None


@dataclass
class VariantProbe:
    """Which candidate variants the original model accepts, with its outputs on them."""

    accepted: list[InputVariant] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # the model's output on each accepted variant
    rejected: list[dict[str, Any]] = field(default_factory=list)  # variant, shapes, reason

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": [v.to_dict() for v in self.accepted], "rejected": self.rejected}


def accepted_variants(model: torch.nn.Module, candidates: list[InputVariant]) -> VariantProbe:
    """Run ``model`` (the original) once on each candidate; keep those it accepts.

    A variant the model raises on is not a free size of the model (a fixed image size, a position
    limit), not a problem of any rewrite, and is dropped with the model's reason. One whose outputs are
    not finite is dropped too: NaN compares unequal to itself, so it could only make a correct rewrite
    fail. The outputs are kept: they are the reference the first pass is compared with.
    """
    probe = VariantProbe()
    for variant in candidates:
        try:
            output = run_model(model, copy.deepcopy(variant.args), copy.deepcopy(variant.kwargs))
        except Exception as exc:  # a model rejects a shape in its own ways; any of them means "not free"
            probe.rejected.append({**variant.to_dict(), "reason": describe_error(exc)})
            continue
        where = nonfinite_output(output)
        if where is not None:  # the generated input is not one the original computes: said where
            probe.rejected.append({**variant.to_dict(), "reason": where})
            continue
        probe.accepted.append(variant)
        probe.outputs.append(output)
    return probe
