"""Outputs a model returns only when asked, checked after an exact rewrite.

An exact rewrite keeps what the model returns on the example inputs. Some models return more when a
caller asks: a Hugging Face model's ``output_hidden_states=True`` adds the residual stream between its
blocks, which recentring the stream (``--to rmsnorm --exact``) changes by design. The example a
conversion is checked on rarely asks for them, so without this check "exact" would be silent about
outputs a later caller gets changed. :func:`outputs_not_preserved` runs both models once with every
such flag the model's forward takes and names each output that moved beyond the exact tolerance.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from normswap.verify.metrics import compare_tensors, flatten_outputs

# Keyword flags of a forward that make it return more than it does by default (transformers' name);
# attention maps are left out: no exact rewrite changes them, and asking for them switches HF models to
# their eager attention.
OPTIONAL_OUTPUT_FLAGS = ("output_hidden_states",)


def _takes(model: nn.Module, flag: str) -> bool:
    """Whether ``model``'s forward takes ``flag``: by name, or (transformers 5 takes its output flags
    through ``**kwargs``) through ``**kwargs`` of a model whose config holds the flag's default."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if flag in parameters:
        return True
    takes_keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return takes_keywords and hasattr(getattr(model, "config", None), flag)


def asked_flags(model: nn.Module, kwargs: dict[str, Any]) -> list[str]:
    """The optional-output flags ``model``'s forward takes that ``kwargs`` do not already turn on."""
    return [flag for flag in OPTIONAL_OUTPUT_FLAGS if _takes(model, flag) and not kwargs.get(flag)]


@contextlib.contextmanager
def _left_as_found(*models: nn.Module) -> Iterator[None]:
    """Undo what a forward leaves on the modules: transformers installs its hidden-state hooks (local
    functions, which no pickle can write) the first time a model is asked for them, and keeps them."""
    found = [
        (m, set(m._forward_hooks), set(m._forward_pre_hooks), set(vars(m)))
        for model in models
        for m in model.modules()
    ]
    try:
        yield
    finally:
        for module, hooks, pre_hooks, attributes in found:
            for key in set(module._forward_hooks) - hooks:
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
            for key in set(module._forward_pre_hooks) - pre_hooks:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
            for name in set(vars(module)) - attributes:
                delattr(module, name)


def outputs_not_preserved(
    original: nn.Module, converted: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> list[str]:
    """Names of the outputs the original returns when asked (``output_hidden_states=True``) that the
    converted model does not return within the exact tolerance, or cannot be asked for at all (a
    written graph program takes only the example's keywords). Empty when the original takes no such
    flag or every such output is kept."""
    flags = asked_flags(original, kwargs)
    if not flags:
        return []
    with _left_as_found(original, converted), torch.no_grad():
        return _moved_outputs(original, converted, args, kwargs, flags)


def _moved_outputs(
    original: nn.Module, converted: nn.Module, args: tuple, kwargs: dict[str, Any], flags: list[str]
) -> list[str]:
    asked = {**kwargs, **dict.fromkeys(flags, True)}
    reference = dict(flatten_outputs(original(*args, **asked), floating_only=False))
    if any(not _takes(converted, flag) for flag in flags):
        default = {name for name, _ in flatten_outputs(original(*args, **kwargs), floating_only=False)}
        return [name for name in reference if name not in default]
    returned = dict(flatten_outputs(converted(*args, **asked), floating_only=False))
    moved = []
    for name, value in reference.items():
        other = returned.get(name)
        if (
            other is None
            or other.shape != value.shape
            or not compare_tensors(name, value, other).within_tolerance
        ):
            moved.append(name)
    return moved


def summarize_names(names: list[str]) -> str:
    """``output.hidden_states[0], output.hidden_states[1], output.hidden_states[2]`` as
    ``output.hidden_states[0..2]``: indexed names with one stem, in runs."""
    runs: list[tuple[str, int, int]] = []  # stem, first, last
    plain: list[str] = []
    for name in names:
        match = re.fullmatch(r"(.*)\[(\d+)\]", name)
        if match is None:
            plain.append(name)
            continue
        stem, index = match.group(1), int(match.group(2))
        if runs and runs[-1][0] == stem and runs[-1][2] == index - 1:
            runs[-1] = (stem, runs[-1][1], index)
        else:
            runs.append((stem, index, index))
    shown = [f"{stem}[{a}]" if a == b else f"{stem}[{a}..{b}]" for stem, a, b in runs]
    return ", ".join(plain + shown)
