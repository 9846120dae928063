"""When an eager call of a fused norm may go straight to the kernels, skipping the dispatcher.

The custom ops cost a Python round trip through the dispatcher and the custom-op autograd on every call;
plain tensors with nothing recording or transforming the call do not need it (:func:`skips_dispatcher`).
:func:`eager_plan` answers that, the argument checks and the route (:mod:`._routes`) once per kind of
call: in a model every layer makes the same calls, and at a few rows each microsecond of host time is
the model's. Also here: :func:`triton_on_cpu`, which lets the tests run the kernels on CPU tensors in
the interpreter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

from normswap.kernels import _routes
from normswap.kernels._launch import check_args, interpreter_enabled, triton_available, triton_supports
from normswap.kernels._routes import choose_route, forced_route, native_kernel

_force_triton_on_cpu = 0


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Make the ops run their Triton kernels on CPU tensors, through the interpreter.

    For tests on machines without a GPU: it needs triton and ``TRITON_INTERPRET=1``. A plain counter
    rather than a context variable, because the autograd engine may run the backward on another thread.
    """
    global _force_triton_on_cpu
    if not triton_available():
        raise RuntimeError("triton_on_cpu() needs triton installed")
    if not interpreter_enabled():
        raise RuntimeError(
            "triton_on_cpu() needs TRITON_INTERPRET=1: compiled kernels cannot read CPU memory"
        )
    _force_triton_on_cpu += 1
    try:
        yield
    finally:
        _force_triton_on_cpu -= 1


def use_triton(*tensors: torch.Tensor | None) -> bool:
    x = tensors[0]
    assert x is not None
    if not triton_supports(*tensors):
        return False
    if x.device.type == "cuda":
        return triton_available()
    return x.device.type == "cpu" and _force_triton_on_cpu > 0


# A Parameter is a plain tensor too; any other subclass (FakeTensor, DTensor, ...) must see the op.
_PARAMETER = torch.nn.Parameter
# torch's own C functions, bound once: every eager call asks them, and inside a model a norm's Python
# calls cost several times what they cost in a tight loop (measured on an H200 host: a fused LayerNorm
# on torch's route took 60 us a call inside GPT-2 against nn.LayerNorm's 29, where a loop of the same
# call showed 20 against 14), so the path counts calls, not only their work
_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack
_dispatch_stack_depth = torch._C._len_torch_dispatch_stack
_tracing_state = torch._C._get_tracing_state


def transformed() -> bool:
    """Whether a torch.func transform (grad, vmap, jacfwd, ...) or forward-mode AD is active."""
    return _peek_interpreter_stack() is not None or forward_ad._current_level >= 0


def skips_dispatcher(*tensors: torch.Tensor | None) -> bool:
    """Whether an eager call may launch the kernels without going through the custom op.

    The op costs a Python round trip through the dispatcher and the custom-op autograd on every call,
    several times the launcher's own host time, and at a few rows that host time is the whole cost.
    It is only needed when something records or transforms the call: torch.compile, a dispatch mode
    (export's fake and proxy tracing), a functorch transform or the legacy vmap of batched gradients,
    torch.jit.trace, or a tensor subclass. Plain tensors the Triton kernels take, with nothing watching,
    go to the same kernels through an autograd.Function (``_EAGER_FUNCTIONS``) instead; CPU tensors and
    other dtypes keep the op and its reference math.
    """
    if transformed():
        return False  # a functorch transform
    return not _watched(tensors) and use_triton(*tensors)


def _watched(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether something records the call (torch.compile, a dispatch mode, torch.jit.trace: the
    TorchScript ONNX exporter) or a tensor is not a plain one (a subclass, or the legacy vmap of
    is_grads_batched / jacobian(vectorize=True), which hides behind a plain type)."""
    if torch.compiler.is_compiling() or _dispatch_stack_depth() or _tracing_state():
        return True
    # A loop, not any(<generator>): this runs on every eager call, and at a few rows host time counts.
    for t in tensors:
        # a Parameter is never batched by the legacy vmap (it batches inputs and gradients): its type
        # suffices, and a module's call skips one C call per parameter
        if (
            t is not None
            and type(t) is not _PARAMETER
            and (type(t) is not torch.Tensor or _is_legacy_batched(t))
        ):
            return True
    return False


def flatten_norm_dims(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    normalized_ndim: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``x`` with its last ``normalized_ndim`` dims flattened into one, and the affine tensors with it:
    the kernels normalize the last dim, and normalizing the last k dims is the same over their
    flattening."""
    if normalized_ndim == 1:
        return x, weight, bias
    if normalized_ndim < 1 or x.ndim < normalized_ndim:
        raise ValueError(f"cannot normalize the last {normalized_ndim} dims of a {x.ndim}-d input")
    return (
        x.flatten(-normalized_ndim),
        weight.reshape(-1) if weight is not None else None,
        bias.reshape(-1) if bias is not None else None,
    )


@dataclass(frozen=True)
class EagerPlan:
    """How an eager call runs: ``torch`` (torch's own ops; ``native``: one native kernel, called with
    ``shape``, the normalized dims) or the kernel."""

    torch: bool
    native: bool
    shape: tuple[int, ...] = ()


_KERNEL_PLAN = EagerPlan(torch=False, native=False)
_PLANS: dict[tuple, EagerPlan | None] = {}
_MISSING = object()
_MAX_PLANS = 4096  # distinct kinds of call kept; a model makes a handful, so this only bounds a leak


def _flat_check(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    casting: str,
    normalized_ndim: int,
) -> None:
    """The launcher's refusals, made on the shapes the kernels will see (the last dims flattened)."""
    flat, w, b = flatten_norm_dims(x, weight, bias, normalized_ndim)
    r = residual.flatten(-normalized_ndim) if residual is not None and normalized_ndim > 1 else residual
    check_args(flat, r, w, b, casting)
    if flat.shape[-1] == 0:
        raise ValueError("cannot normalize over an empty last dimension")


def eager_plan(
    kind: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    casting: str,
    weight_offset: float,
    normalized_ndim: int,
    train: bool,
) -> EagerPlan | None:
    """How an eager call runs, or None when it must go through the op (see :func:`skips_dispatcher`).

    Raises the launcher's errors for arguments it refuses. The answer depends only on what the key
    holds (shapes, dtypes, device, numerics, whether autograd records, the forced route and the rules),
    so it is computed once per key; the watchers (torch.compile, dispatch modes, tracing, tensor
    subclasses) are looked at on every call.
    """
    if _watched((x, residual, weight, bias)):
        return None
    key = (
        kind,
        x.shape,
        x.dtype,
        x.device,
        None if residual is None else (residual.shape, residual.dtype),
        None if weight is None else (weight.shape, weight.dtype),
        None if bias is None else (bias.shape, bias.dtype),
        casting,
        weight_offset,
        normalized_ndim,
        train,
        _force_triton_on_cpu > 0,
        _routes.current_state,
    )
    plan = _PLANS.get(key, _MISSING)
    if plan is not _MISSING:
        return plan
    if not use_triton(x, residual, weight, bias):
        plan = None  # the op: the reference math (CPU, float64, ...)
    else:
        _flat_check(x, residual, weight, bias, casting, normalized_ndim)
        plan = _KERNEL_PLAN
        if x.device.type == "cuda" or forced_route() is not None:
            native = native_kernel(kind, x, weight, bias, casting, weight_offset)
            n = x.shape[x.ndim - normalized_ndim :].numel()
            route = choose_route(kind, residual is not None, native, x.dtype, train, x.numel() // n, n)
            if route == "torch":
                plan = EagerPlan(torch=True, native=native, shape=tuple(x.shape[x.ndim - normalized_ndim :]))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


__all__ = ["EagerPlan", "eager_plan", "flatten_norm_dims", "triton_on_cpu"]
