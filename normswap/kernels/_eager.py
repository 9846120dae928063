"""When an eager call of a fused norm may go straight to the kernels, skipping the dispatcher.

The custom ops cost a Python round trip through the dispatcher and the custom-op autograd on every call;
plain tensors with nothing recording or transforming the call do not need it (:func:`_skips_dispatcher`).
Also here: :func:`triton_on_cpu`, which lets the tests run the kernels on CPU tensors in the interpreter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from normswap.kernels._launch import interpreter_enabled, triton_available, triton_supports

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


def _use_triton(*tensors: torch.Tensor | None) -> bool:
    x = tensors[0]
    assert x is not None
    if not triton_supports(*tensors):
        return False
    if x.device.type == "cuda":
        return triton_available()
    return x.device.type == "cpu" and _force_triton_on_cpu > 0


# Parameters are plain tensors too; any other subclass (FakeTensor, DTensor, ...) must see the op.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _transformed() -> bool:
    """Whether a torch.func transform (grad, vmap, jacfwd, ...) or forward-mode AD is active."""
    return torch._C._functorch.peek_interpreter_stack() is not None or forward_ad._current_level >= 0


def _skips_dispatcher(*tensors: torch.Tensor | None) -> bool:
    """Whether an eager call may launch the kernels without going through the custom op.

    The op costs a Python round trip through the dispatcher and the custom-op autograd on every call,
    several times the launcher's own host time, and at a few rows that host time is the whole cost.
    It is only needed when something records or transforms the call: torch.compile, a dispatch mode
    (export's fake and proxy tracing), a functorch transform or the legacy vmap of batched gradients,
    torch.jit.trace, or a tensor subclass. Plain tensors the Triton kernels take, with nothing watching,
    go to the same kernels through an autograd.Function (``_EAGER_FUNCTIONS``) instead; CPU tensors and
    other dtypes keep the op and its reference math.
    """
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if _transformed() or torch._C._get_tracing_state():
        return False  # a functorch transform, or torch.jit.trace (the TorchScript ONNX exporter)
    for t in tensors:
        if t is None:
            continue
        # the legacy vmap of is_grads_batched / jacobian(vectorize=True) hides behind a plain type
        if type(t) not in _PLAIN_TENSOR_TYPES or torch._C._functorch.is_legacy_batchedtensor(t):
            return False
    return _use_triton(*tensors)


__all__ = ["triton_on_cpu"]
