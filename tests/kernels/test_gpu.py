"""The compiled Triton kernels on a CUDA device against the reference math (skipped without CUDA).

Same comparisons as the interpreter tests, at sizes the interpreter cannot afford: long rows through the
chunked kernels, many rows through the persistent backward, and torch.compile with inductor.
"""

from __future__ import annotations

import pytest
import torch

from normswap.kernels import kernel_route
from normswap.kernels._launch import norm_bwd, norm_fwd
from normswap.kernels._routes import BUILTIN_RULES
from normswap.modules import LayerNorm, RMSNorm
from normswap.modules.fused import FusedLayerNorm, FusedRMSNorm
from tests.kernels.conftest import (
    CASTINGS,
    DTYPES,
    check_all,
    fused_grads,
    make_params,
    randn,
    reference_grads,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_compiled")]

SHAPES = [
    (1, 1),
    (3, 7),
    (5, 123, 123),
    (64, 769),
    (256, 4096),
    (16, 16384),
    (8, 20000),
    (4, 65536),
    (2, 131072),
]


def _on_cuda(*tensors):
    return [t.cuda() if t is not None else None for t in tensors]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_shapes(kind, dtype, shape):
    x, dy = _on_cuda(randn(shape, dtype, seed=0, scale=2.0, shift=1.0), randn(shape, dtype, seed=1))
    w, b = _on_cuda(*make_params(shape[-1], dtype, affine=True, bias=kind == "layer"))
    args = (
        kind,
        x,
        None,
        w.requires_grad_(),
        b.requires_grad_() if b is not None else None,
        1e-5,
        "none",
        0.0,
        dy,
    )
    check_all(fused_grads(*args, triton=True), reference_grads(*args), dtype)


@pytest.mark.parametrize(("casting", "offset"), [*CASTINGS, ("llama", 1.0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_modes(kind, residual, dtype, casting, offset):
    shape = (33, 1000)
    x, dy = _on_cuda(randn(shape, dtype, seed=0), randn(shape, dtype, seed=1))
    r, dh = _on_cuda(randn(shape, dtype, seed=2), randn(shape, dtype, seed=3)) if residual else (None, None)
    w, b = _on_cuda(*make_params(shape[-1], dtype, affine=True, bias=True))
    args = (kind, x, r, w.requires_grad_(), b.requires_grad_(), 1e-6, casting, offset, dy, dh)
    check_all(fused_grads(*args, triton=True), reference_grads(*args), dtype)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_strided_and_deterministic(kind):
    base = torch.randn(64, 3000, device="cuda", dtype=torch.bfloat16)
    x = base[:, 100:2148]  # row stride 3000, no copy
    w, b = _on_cuda(*make_params(2048, torch.bfloat16, True, True))
    dy = torch.randn_like(x)
    y, _, mean, rstd = norm_fwd(kind, x, None, w, b, 1e-5, "none", 0.0)
    grads = [norm_bwd(kind, dy, None, x, w, b, mean, rstd, "none", 0.0) for _ in range(2)]
    for a, c in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, c)  # partial sums, no atomics: bitwise reproducible
    want = reference_grads(kind, x, None, w, b, 1e-5, "none", 0.0, dy)
    got = {"y": y, "dx": grads[0][0], "dweight": grads[0][1], "dbias": grads[0][2]}
    check_all(got, want, torch.bfloat16, names=("y", "dx", "dweight", "dbias"))


@pytest.mark.parametrize(("ref_cls", "fused_cls"), [(RMSNorm, FusedRMSNorm), (LayerNorm, FusedLayerNorm)])
def test_inductor_compile(ref_cls, fused_cls):
    ref = ref_cls(1024, casting="llama", device="cuda", dtype=torch.bfloat16)
    fused = torch.compile(fused_cls.from_module(ref), fullgraph=True)
    x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = fused(x), ref(x2)
    check_all({"y": y}, {"y": y2.detach()}, torch.bfloat16, names=("y",))
    y.float().square().sum().backward()
    y2.float().square().sum().backward()
    check_all({"dx": x.grad}, {"dx": x2.grad}, torch.bfloat16, names=("dx",))


@pytest.mark.parametrize("route", ["torch", "triton"])
@pytest.mark.parametrize(("casting", "offset"), [*CASTINGS, ("llama", 1.0)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_both_routes(kind, residual, casting, offset, route):
    """Each route of an eager call, forced, against the reference: few rows (where the torch route is
    taken) and many, bf16, gradients included."""
    for shape in ((3, 768), (4096, 2048)):
        dtype = torch.bfloat16
        x, dy = _on_cuda(randn(shape, dtype, seed=0), randn(shape, dtype, seed=1))
        r, dh = (
            _on_cuda(randn(shape, dtype, seed=2), randn(shape, dtype, seed=3)) if residual else (None, None)
        )
        w, b = _on_cuda(*make_params(shape[-1], dtype, affine=True, bias=kind == "layer"))
        args = (
            kind,
            x,
            r,
            w.requires_grad_(),
            b.requires_grad_() if b is not None else None,
            1e-6,
            casting,
            offset,
            dy,
            dh,
        )
        with kernel_route(route):
            got = fused_grads(*args, triton=True)
        # the torch route is the original's own ops: its llama dweight is autograd's, rounded per row
        want = reference_grads(*args, exact_llama_dweight=route == "triton")
        check_all(got, want, dtype)


def test_builtin_rules_are_measured():
    """The shipped rules came from a GPU run (benchmarks/tune_routes.py): not empty, ascending."""
    assert BUILTIN_RULES, "no measured route rules: run benchmarks/tune_routes.py on a GPU"
    for key, rule in BUILTIN_RULES.items():
        assert [n for n, _ in rule] == sorted({n for n, _ in rule}), key
