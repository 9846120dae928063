"""Example inputs: the tensors normswap feeds a model to trace it and to compare outputs before/after.

They come, in order of preference, from ``--inputs FILE``, from ``--input-shape`` specs, or from the model
source itself (a factory's second return value, a torch.export archive's stored examples).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError, describe, first_line
from normswap.load.data_rules import refuse_nonfinite_inputs
from normswap.load.model_file import LoadedModel, read_tensor_file
from normswap.load.program import is_args_kwargs_pair

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

# Token ids for a model without an embedding table: small enough to be valid for most index uses.
_DEFAULT_INT_HIGH = 100

_NEED_INPUTS = (
    "this command needs example inputs: pass --inputs FILE (a tuple or dict of tensors saved with "
    "torch.save) or --input-shape 1,3,224,224 (repeatable; prefix int64: for token ids)"
)


@dataclass(frozen=True)
class InputSpec:
    """Shape and dtype of one positional input to synthesize."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def parse_input_shape(text: str) -> InputSpec:
    """Parse ``[dtype:]d0,d1,...`` such as ``1,3,224,224`` or ``int64:1,16`` (dtype defaults to float32)."""
    expected = (
        f"bad --input-shape {text!r}: expected comma-separated positive sizes like 1,3,224,224, "
        f"optionally prefixed by a dtype like int64:1,16 (dtypes: {', '.join(sorted(set(_DTYPES)))})"
    )
    dtype_name, sep, dims = text.strip().rpartition(":")
    if sep:
        dtype = _DTYPES.get(dtype_name.strip().lower())
        if dtype is None:
            raise BadInputError(expected)
    else:
        dtype = torch.float32
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise BadInputError(expected) from None
    if not shape or any(d < 1 for d in shape):
        raise BadInputError(expected)
    return InputSpec(shape=shape, dtype=dtype)


def _index_high(model: nn.Module | None) -> int:
    """Exclusive upper bound for synthesized integer inputs, so token ids index every embedding table."""
    if model is None:
        return _DEFAULT_INT_HIGH
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return min(sizes) if sizes else _DEFAULT_INT_HIGH


def _bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return None


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: MemoryError, or torch's CPU/CUDA allocator giving up."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        phrase in text for phrase in ("can't allocate memory", "not enough memory", "out of memory")
    )


def _spec_text(spec: InputSpec) -> str:
    return f"{str(spec.dtype).removeprefix('torch.')}:{','.join(map(str, spec.shape))}"


def make_inputs(
    specs: list[InputSpec], model: nn.Module | None = None, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Synthesize one tensor per spec: normal floats, integers valid as embedding ids, random bools.

    Seeded so that two runs of a command compare the same numbers. Inputs larger than the machine's
    memory are refused before anything is allocated.
    """
    # Floats are drawn in float32 and bools as int64 first: count what the drawing takes at its peak.
    sizes = [math.prod(s.shape) * max(s.dtype.itemsize, 8 if s.dtype == torch.bool else 4) for s in specs]
    memory = _machine_memory()
    if memory is not None and sum(sizes) > memory:
        big = max(range(len(specs)), key=sizes.__getitem__)
        raise BadInputError(
            f"input shape {_spec_text(specs[big])} needs {_bytes(sizes[big])} of memory, more than this "
            f"machine's {_bytes(memory)}: give a smaller shape"
        )
    generator = torch.Generator().manual_seed(seed)
    high = _index_high(model)
    tensors = []
    for spec in specs:
        try:
            if spec.dtype == torch.bool:
                tensors.append(torch.randint(0, 2, spec.shape, generator=generator).bool())
            elif spec.dtype.is_floating_point:
                # Draw in float32 and cast, so a float16 input holds the same values as its float32 twin.
                tensors.append(torch.randn(spec.shape, generator=generator).to(spec.dtype))
            else:
                bound = min(high, torch.iinfo(spec.dtype).max + 1)
                tensors.append(torch.randint(0, bound, spec.shape, generator=generator, dtype=spec.dtype))
        except (RuntimeError, MemoryError) as exc:
            if not is_out_of_memory(exc):
                raise
            raise BadInputError(
                f"cannot allocate an input of shape {_spec_text(spec)}: out of memory ({first_line(exc)}); "
                "give a smaller shape"
            ) from None
    return tuple(tensors)


def describe_inputs(args: tuple | None, kwargs: Mapping[str, Any] | None = None, limit: int = 6) -> str:
    """``(float32[1, 3, 8, 8], mask=bool[1, 8])``: what a model is called with, on one line."""

    def one(value: Any, depth: int = 0) -> str:
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(map(str, value.shape))}]"
        if isinstance(value, (tuple, list)) and depth < 2:
            inner = ", ".join(one(v, depth + 1) for v in value[:limit])
            more = ", ..." if len(value) > limit else ""
            return f"[{inner}{more}]" if isinstance(value, list) else f"({inner}{more})"
        if isinstance(value, (int, float, bool, str)) or value is None:
            return repr(value) if len(repr(value)) <= 20 else type(value).__name__
        return type(value).__name__

    parts = [one(v) for v in (args or ())] + [f"{k}={one(v)}" for k, v in (kwargs or {}).items()]
    shown = parts[:limit] + ([f"... {len(parts) - limit} more"] if len(parts) > limit else [])
    return f"({', '.join(shown)})"


def check_inputs_fit(
    model: nn.Module, args: tuple | None, kwargs: Mapping[str, Any] | None = None, *, what: str = "the model"
) -> Any:
    """Run ``model`` once on the example inputs and return its output; a failure becomes a
    ``BadInputError`` naming them.

    Commands call it before their expensive work, so inputs that do not fit the model (a wrong channel
    count or dtype, a keyword its forward does not take, more than memory holds) end in one line, not in a
    traceback minutes later. The inputs are copied and the random state restored: the run leaves no trace.
    """
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    # a NaN or Inf given is the inputs' fault, not the model's (whoever made them: a factory, a caller)
    refuse_nonfinite_inputs(args, kwargs, f"the example inputs of {what}")
    shown = describe_inputs(args, kwargs)
    # copies, in case the forward edits its inputs in place (a tensor inside autograd cannot be copied)
    with contextlib.suppress(Exception):
        args, kwargs = copy.deepcopy((args, kwargs))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            return model(*args, **kwargs)
    except Exception as exc:  # a model fails in its own ways; the user needs one sentence
        if is_out_of_memory(exc):
            raise BadInputError(
                f"{what} runs out of memory on the example inputs {shown} ({first_line(exc)}): "
                "give smaller inputs"
            ) from None
        raise BadInputError(f"{what} does not run on the example inputs {shown}: {describe(exc)}") from None


def load_inputs_file(path: str | Path) -> tuple[tuple, dict]:
    """Read ``--inputs``: a tensor, a tuple/list (positional args), a dict (kwargs) or an (args, kwargs)
    pair; a NaN or +Inf in an example input is the file's, said with its index, by the rule every data
    route applies (:func:`~normswap.load.data_rules.refuse_nonfinite_values`), not the model's."""
    payload = read_tensor_file(path, what="inputs file")
    if isinstance(payload, torch.Tensor):
        args, kwargs = (payload,), {}
    elif is_args_kwargs_pair(payload):
        args, kwargs = tuple(payload[0]), dict(payload[1])
    elif isinstance(payload, (tuple, list)):
        args, kwargs = tuple(payload), {}
    elif isinstance(payload, Mapping) and all(isinstance(k, str) for k in payload):
        args, kwargs = (), dict(payload)
    else:
        args = None
    if args is not None:
        refuse_nonfinite_inputs(args, kwargs, f"inputs file {path}")
        return args, kwargs
    raise BadInputError(
        f"inputs file {path} holds a {type(payload).__name__}: expected a tensor, a tuple/list of positional "
        "inputs or a dict of keyword inputs saved with torch.save"
    )


def resolve_inputs(
    loaded: LoadedModel,
    *,
    inputs_file: str | Path | None = None,
    input_shapes: list[str] | None = None,
) -> tuple[tuple, dict] | None:
    """The example inputs of every run: ``inputs_file`` (a torch.save file), then ``input_shapes``, then
    the model's own (a factory's, a .pt2's, a model directory's config); None when none is known."""
    if inputs_file is not None:
        return load_inputs_file(inputs_file)
    if input_shapes:
        specs = [parse_input_shape(text) for text in input_shapes]
        return make_inputs(specs, loaded.model), {}
    if loaded.example_args is not None or loaded.example_kwargs is not None:
        args, kwargs = tuple(loaded.example_args or ()), dict(loaded.example_kwargs or {})
        refuse_nonfinite_inputs(args, kwargs, f"the example inputs of {loaded.source}")  # a factory's
        return args, kwargs
    return None


def require_inputs(
    loaded: LoadedModel,
    *,
    inputs_file: str | Path | None = None,
    input_shapes: list[str] | None = None,
) -> tuple[tuple, dict]:
    """Like ``resolve_inputs`` for commands that cannot run without inputs; says how to give them (when
    none is known, a :class:`~normswap.errors.BadInputError`)."""
    resolved = resolve_inputs(loaded, inputs_file=inputs_file, input_shapes=input_shapes)
    if resolved is None:
        raise BadInputError(loaded.no_inputs_reason or _NEED_INPUTS)
    return resolved
