"""How the fused-norm ops are registered with torch.library: ``triton_op`` where triton is installed."""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["triton"] is None (blocked)
        return False


# triton_op where triton is installed: torch.compile decomposes a triton_op into its torch ops and
# Triton launches (the launcher wraps them in wrap_triton while tracing), so Inductor compiles the
# kernels into its own code and plans memory around them, where a custom_op is an opaque call;
# torch.export keeps either as one node. Registering a triton_op imports triton. Without triton (CPU
# builds of torch) a custom_op, which needs nothing, so those users see no "Triton not available".
_REGISTER = torch.library.triton_op if _triton_installed() else torch.library.custom_op

_SCHEMA_TYPES = {"Tensor": torch.Tensor, "Tensor?": torch.Tensor | None, "float": float, "str": str}


def _with_signature(fn, schema: str):
    """``fn(*args)`` given the signature ``schema`` spells (what some torch versions read instead of it).

    torch 2.11's triton_op infers the schema from the function's signature and ignores ``schema=``, and
    the ops' implementations take ``*args`` (one implementation per family serves several schemas).
    """
    params_text, returns_text = schema.split(" -> ")
    params = []
    for item in params_text.strip("()").split(", "):
        type_name, name = item.rsplit(" ", 1)
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_SCHEMA_TYPES[type_name]
            )
        )
    n_out = len(returns_text.strip("()").split(", "))
    returns = tuple[(torch.Tensor,) * n_out] if n_out > 1 else torch.Tensor

    signature = inspect.Signature(params, return_annotation=returns)

    def call(*args, **kwargs):
        if kwargs:
            args = signature.bind(*args, **kwargs).args
        return fn(*args)

    # A partial, not a def: torch's triton_op reads the implementation's source to find its kernels,
    # and that reading imports Inductor (about a second at every `import normswap`). A partial has no
    # source, so it finds none; _name_kernels names them instead.
    impl = functools.partial(call)
    impl.__signature__ = signature  # type: ignore[attr-defined]
    impl.__name__ = fn.__name__  # type: ignore[attr-defined]
    impl.__globals__ = call.__globals__  # type: ignore[attr-defined]  # infer_schema resolves names there
    return impl


def _name_kernels(name: str) -> None:
    """Tell torch which Triton kernels the triton_op ``name`` launches.

    torch finds them by reading the implementation's source, which here it cannot (see _with_signature);
    torch.compile's autograd cache keys on their source, so without this a warm cache would go on
    running kernels from before a change to ``_kernels.py``. (The launch rules of ``_tiling`` are not
    part of any key: after changing those, clear the Inductor cache to time the new ones.)
    """
    from torch._library import triton as library_triton

    from normswap.kernels._launch import kernel_module

    kernels = kernel_module(interpret=False)
    library_triton.triton_ops_to_kernels[name] = [
        kernels.norm_fwd_tile_kernel,
        kernels.norm_fwd_chunked_kernel,
        kernels.norm_bwd_row_dots_kernel,
        kernels.norm_bwd_tile_kernel,
    ]


def register_op(name: str, fn: Callable, schema: str, fake: Callable) -> Any:
    """Define the op ``name`` with implementation ``fn`` and fake ``fake``: a triton_op where possible."""
    try:
        op = _REGISTER(name, _with_signature(fn, schema), mutates_args=(), schema=schema)
        op.register_fake(fake)
        if _REGISTER is not torch.library.custom_op:
            _name_kernels(name)
    except Exception:  # a torch whose triton_op cannot take this op: the opaque custom op still works
        if _REGISTER is torch.library.custom_op:
            raise
        op = torch.library.custom_op(name, fn, mutates_args=(), schema=schema)
        op.register_fake(fake)
    return op
