"""Shared pieces of the fused-norm tests: dtypes and their tolerance, inputs, the reference with autograd.

On the Triton interpreter: ``@triton.jit`` picks interpreted or compiled kernels when it runs, so the
usual advice is to set ``TRITON_INTERPRET=1`` before anything imports triton. normswap's launcher makes
that choice per launch instead (``normswap.kernels._launch.kernel_module``), so the ``interpreter``
fixture below can switch it on for exactly the tests that want it, whatever the rest of the session
imported first, and GPU tests in the same session still run compiled kernels. The interpreter tests
assert that the kernels they ran were the interpreted ones.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, NamedTuple

import pytest
import torch

from normswap.kernels import add_layer_norm, add_rms_norm, layer_norm, rms_norm, triton_on_cpu
from normswap.kernels._launch import SUPPORTED_DTYPES
from normswap.kernels.reference import layer_norm_reference, rms_norm_reference
from normswap.util.tolerance import kernel_tolerance

try:
    import triton.language as tl
except ImportError:  # the interpreter fixture skips; the reference tests need no triton
    tl = None

DTYPES = list(SUPPORTED_DTYPES)
REFERENCES = {"rms": rms_norm_reference, "layer": layer_norm_reference}
FUNCS = {"rms": rms_norm, "layer": layer_norm}
ADD_FUNCS = {"rms": add_rms_norm, "layer": add_layer_norm}
# casting mode and weight offset: gemma stores w with y = x * (1 + w).
CASTINGS = [("none", 0.0), ("llama", 0.0), ("gemma", 1.0)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    atol, rtol = kernel_tolerance(dtype)  # the library's own table, for outputs and gradients alike
    assert actual.shape == expected.shape, what
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def make_params(
    n: int, dtype: torch.dtype, affine: bool, bias: bool, seed: int = 0
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.randn(n, generator=g) * 0.5 + 1.0).to(dtype).requires_grad_() if affine else None
    b = (torch.randn(n, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    return w, b


def randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(dtype)


def _leaves(**tensors: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """Fresh leaf copies (requiring grad) of the given tensors; None stays None."""
    return {k: t.detach().clone().requires_grad_() if t is not None else None for k, t in tensors.items()}


def _backward_and_collect(
    y: torch.Tensor,
    h: torch.Tensor | None,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    leaves: dict[str, torch.Tensor | None],
) -> dict[str, torch.Tensor | None]:
    """Backpropagate sum(y * dy) [+ sum(h * dh)]; return y, h and the gradient of every leaf."""
    loss = (y.float() * dy.float()).sum()
    if dh is not None:
        loss = loss + (h.float() * dh.float()).sum()
    loss.backward()
    out = {"y": y.detach(), "h": h.detach() if h is not None else None}
    for name, leaf in leaves.items():
        out["d" + name] = leaf.grad if leaf is not None else None
    return out


class NormCase(NamedTuple):
    """One parity case: what to normalize, how, and the incoming gradients (dh only with a residual)."""

    kind: str
    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float
    casting: str
    weight_offset: float
    dy: torch.Tensor
    dh: torch.Tensor | None = None


def reference_grads(*case: Any, exact_llama_dweight: bool = True) -> dict[str, torch.Tensor | None]:
    """Reference outputs and gradients by autograd through normswap.kernels.reference.

    ``case`` holds the fields of :class:`NormCase`, in order. The loss is sum(y * dy) [+ sum(h * dh)], so
    dy (dh) is the incoming gradient of y (h). ``exact_llama_dweight=False`` keeps autograd's own llama
    dweight (what the original model computes, and what the torch route computes) instead of the exact sum.
    """
    kind, x, residual, weight, bias, eps, casting, weight_offset, dy, dh = NormCase(*case)
    leaves = _leaves(x=x, residual=residual, weight=weight, bias=bias)
    h = leaves["x"] + leaves["residual"] if residual is not None else leaves["x"]
    y = REFERENCES[kind](h, 1, leaves["weight"], leaves["bias"], eps, casting, weight_offset)
    out = _backward_and_collect(y, h, dy, dh, leaves)
    if residual is None:
        out["h"] = None  # h is x itself here, not an output
    if casting == "llama" and weight is not None and exact_llama_dweight:
        # In llama mode autograd forms dweight from dy * n_cast in the half-precision dtype, rounding every
        # product before summing over rows: over hundreds of rows that alone exceeds the fp16 tolerance
        # (dweight is a sum with cancellation). The kernels sum the same products in fp32, so the truth
        # here is that sum done exactly; n_cast is the reference's own rounded normalized value.
        n_cast = REFERENCES[kind](h.detach(), 1, None, None, eps, "llama", 0.0)
        exact = (dy.double() * n_cast.double()).reshape(-1, x.shape[-1]).sum(0)
        out["dweight"] = exact.to(weight.dtype)
    return out


def fused_grads(*case: Any, triton: bool) -> dict[str, torch.Tensor | None]:
    """The fused ops' outputs and gradients for the loss of :func:`reference_grads`.

    ``triton=True`` runs CPU tensors through the Triton kernels (needs the ``interpreter`` fixture);
    CUDA tensors take Triton either way.
    """
    kind, x, residual, weight, bias, eps, casting, weight_offset, dy, dh = NormCase(*case)
    leaves = _leaves(x=x, residual=residual, weight=weight, bias=bias)
    numerics = (leaves["weight"], leaves["bias"], eps, casting, weight_offset)
    with triton_on_cpu() if triton and x.device.type == "cpu" else contextlib.nullcontext():
        if residual is None:
            y, h = FUNCS[kind](leaves["x"], *numerics), None
        else:
            y, h = ADD_FUNCS[kind](leaves["x"], leaves["residual"], *numerics)
        # Inside the context: the backward must run the same kernels as the forward.
        return _backward_and_collect(y, h, dy, dh, leaves)


def check_all(
    got: dict, want: dict, dtype: torch.dtype, names=("y", "h", "dx", "dresidual", "dweight", "dbias")
):
    """Compare the named entries of two ``*_grads`` results with the dtype's tolerance."""
    for name in names:
        if want.get(name) is None:
            assert got.get(name) is None, name
            continue
        assert_close(got[name], want[name], dtype, name)


def _probe_loop(X, N, BLOCK: tl.constexpr):
    # builtins of triton.language only (tl.full, not tl.zeros): see normswap/kernels/_kernels.py
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, N, BLOCK):
        acc += tl.load(X + start + tl.arange(0, BLOCK))
    tl.store(X + tl.arange(0, BLOCK), acc)


@functools.cache
def _interpreter_fault() -> str | None:
    """Why triton's CPU interpreter cannot run the kernels here, or None when it can.

    Triton 3.6's interpreter turns a runtime loop bound into a Python int with ``int()`` on a
    one-element array, which numpy 2.4 made an error: every kernel with a loop fails there (seen on
    the GPU machine: triton 3.6.0, numpy 2.5.2). That is the interpreter's fault, not the kernels':
    the same kernels compiled run the GPU tests there.
    """
    import numpy
    import triton

    x = torch.ones(8)
    try:
        triton.jit(_probe_loop)[(1,)](x, 8, BLOCK=4)
    except Exception as e:  # the interpreter wraps whatever failed in an InterpreterError
        if "0-dimensional arrays can be converted" not in str(e):
            raise  # not the known fault: the tests must fail, not skip
        return (
            f"triton {triton.__version__}'s interpreter cannot run a loop with numpy {numpy.__version__} "
            f"(it calls int() on a one-element array): {e}"
        )
    return None


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch):
    """Run Triton kernels launched in this test on the CPU interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fault = _interpreter_fault()
    if fault is not None:
        pytest.skip(fault)
    from triton.runtime.interpreter import InterpretedFunction

    from normswap.kernels._launch import kernel_module

    assert isinstance(kernel_module().norm_fwd_tile_kernel, InterpretedFunction)
    yield


@pytest.fixture
def cuda_compiled(monkeypatch: pytest.MonkeyPatch):
    """A CUDA device and compiled (not interpreted) Triton kernels, or skip."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert os.environ.get("TRITON_INTERPRET") is None
    yield torch.device("cuda")
