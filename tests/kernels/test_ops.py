"""The ``normswap::*`` custom ops on their CPU path (reference math), and their registrations.

The forward on CPU *is* the reference function, so y must match bit for bit; the backward is the
hand-derived formula in ``reference.reference_bwd``, checked here against autograd through the reference.
``opcheck`` covers schema, fake and autograd registration; export and compile check that graphs keep the
op as one node.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from normswap.kernels import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from normswap.modules.fused import FusedAddLayerNorm, FusedRMSNorm
from tests.kernels.conftest import (
    CASTINGS,
    DTYPES,
    REFERENCES,
    check_all,
    fused_grads,
    make_params,
    randn,
    reference_grads,
)

OPS = torch.ops.normswap


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("casting", "offset"), [*CASTINGS, ("llama", 1.0)])
@pytest.mark.parametrize(
    ("affine", "bias"), [(True, True), (True, False), (False, False)], ids=["w+b", "w", "plain"]
)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_cpu_path_matches_reference(kind, affine, bias, casting, offset, dtype):
    shape = (5, 123, 123)
    x = randn(shape, dtype, seed=0, scale=2.0, shift=0.5)
    w, b = make_params(shape[-1], dtype, affine, bias)
    dy = randn(shape, dtype, seed=2)
    args = (kind, x, None, w, b, 1e-5, casting, offset, dy)
    got, want = fused_grads(*args, triton=False), reference_grads(*args)
    assert torch.equal(got["y"], want["y"])
    check_all(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_cpu_add_norm(kind, dtype):
    shape = (4, 9, 64)
    x, r = randn(shape, dtype, seed=0), randn(shape, dtype, seed=1)
    w, b = make_params(64, dtype, True, True)
    dy, dh = randn(shape, dtype, seed=2), randn(shape, dtype, seed=3)
    args = (kind, x, r, w, b, 1e-6, "none", 0.0, dy, dh)
    got, want = fused_grads(*args, triton=False), reference_grads(*args)
    assert torch.equal(got["h"], x + r)
    check_all(got, want, dtype)


def test_unused_h_output():
    """If h is not read again, its gradient arrives as zeros (or not at all): dx is the norm's alone."""
    x, r = randn((3, 32), torch.float32, seed=0), randn((3, 32), torch.float32, seed=1)
    x.requires_grad_()
    y, _ = add_rms_norm(x, r, torch.ones(32))
    y.sum().backward()
    xr = (x.detach() + r).requires_grad_()
    REFERENCES["rms"](xr, 1, torch.ones(32), None, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


def test_unsupported_dtype_takes_reference_path():
    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w), REFERENCES["rms"](x, 1, w, None, 1e-6), atol=0, rtol=0)


def test_multi_dim_normalized_shape():
    x = randn((2, 3, 4, 5), torch.float32, seed=0)
    w = randn((4, 5), torch.float32, seed=1)
    b = randn((4, 5), torch.float32, seed=2)
    torch.testing.assert_close(layer_norm(x, w, b, normalized_ndim=2), REFERENCES["layer"](x, 2, w, b, 1e-5))
    r = randn(x.shape, torch.float32, seed=3)
    y, h = add_layer_norm(x, r, w, b, normalized_ndim=2)
    torch.testing.assert_close(y, REFERENCES["layer"](x + r, 2, w, b, 1e-5))
    assert torch.equal(h, x + r)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: rms_norm(x, torch.ones(8), casting="fp8"), "casting"),
        (lambda x: rms_norm(x, torch.ones(7)), "weight must have shape"),
        (lambda x: layer_norm(x, None, torch.ones(4)), "bias must have shape"),
        (lambda x: add_rms_norm(x, x.half()), "residual"),
        (lambda x: add_rms_norm(x, x[:1]), "residual"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(2, 8))


def test_eps_zero_is_kept():
    x = torch.tensor([[0.0, 0.0, 3.0, 4.0]])
    torch.testing.assert_close(rms_norm(x, eps=0.0), REFERENCES["rms"](x, 1, None, None, 0.0))


def _opcheck_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    r = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    xb = torch.randn(4, 16, generator=g).bfloat16().requires_grad_()
    wf = torch.randn(16, generator=g, requires_grad=True)
    stats = x.detach().float().mean(-1), x.detach().float().var(-1, unbiased=False).add(1e-5).rsqrt()
    dy = torch.randn(3, 5, 16, generator=g)
    cases = [
        ("rms-none", "rms_norm_fwd", (x, w, None, 1e-6, "none", 0.0)),
        ("rms-llama-bf16-offset", "rms_norm_fwd", (xb, wf, None, 1e-6, "llama", 1.0)),
        ("rms-plain", "rms_norm_fwd", (x, None, None, 1e-6, "gemma", 0.0)),
        ("ln", "layer_norm_fwd", (x, w, b, 1e-5, "none", 0.0)),
        ("ln-plain-bf16", "layer_norm_fwd", (xb, None, None, 1e-5, "llama", 0.0)),
        ("add-rms", "add_rms_norm_fwd", (x, r, w, None, 1e-6, "llama", 0.0)),
        ("add-ln", "add_layer_norm_fwd", (x, r, w, b, 1e-5, "gemma", 1.0)),
        ("rms-bwd", "rms_norm_bwd", (dy, x.detach(), w.detach(), None, stats[1], "none", 0.0)),
        ("ln-bwd", "layer_norm_bwd", (dy, x.detach(), w.detach(), b.detach(), *stats, "none", 0.0)),
        ("add-rms-bwd", "add_rms_norm_bwd", (dy, dy, x.detach(), w.detach(), None, stats[1], "none", 0.0)),
        ("add-ln-bwd", "add_layer_norm_bwd", (dy, None, x.detach(), None, b.detach(), *stats, "llama", 0.0)),
    ]
    return [pytest.param(name, args, id=case_id) for case_id, name, args in cases]


@pytest.mark.parametrize(("name", "args"), _opcheck_cases())
def test_opcheck(name, args):
    torch.library.opcheck(getattr(OPS, name).default, args)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.add_norm = FusedAddLayerNorm(16)
        self.norm = FusedRMSNorm(16, casting="llama")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, h = self.add_norm(self.lin(x), x)
        return self.norm(y) + h


def test_export_keeps_the_ops():
    model = _Block().eval()
    x = torch.randn(2, 7, 16)
    ep = torch.export.export(model, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "normswap.add_layer_norm_fwd.default" in targets
    assert "normswap.rms_norm_fwd.default" in targets
    torch.testing.assert_close(ep.module()(x), model(x))


def test_export_decompositions_keep_the_ops():
    # The default decomposition table lowers to core ATen; the custom ops have no decomposition and stay.
    ep = torch.export.export(_Block().eval(), (torch.randn(2, 7, 16),)).run_decompositions()
    assert sum("normswap" in str(n.target) for n in ep.graph.nodes) == 2


def test_compile_sees_through_the_ops():
    model = _Block()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 7, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    compiled(x).square().sum().backward()
    model(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_triton_is_optional():
    """Without triton the ops are plain custom ops and the CPU path runs (one subprocess)."""
    code = """
import sys
sys.modules["triton"] = None  # from here `import triton` raises ImportError
import torch
from normswap.kernels import _registration, rms_norm, triton_available
from normswap.modules.fused import FusedLayerNorm
assert _registration._REGISTER is torch.library.custom_op
assert not triton_available()
x = torch.randn(3, 8, requires_grad=True)
rms_norm(x, torch.ones(8)).sum().backward()
FusedLayerNorm(8)(x)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _second_order(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*inputs)
    ramp = torch.linspace(-1, 1, y.shape[-1])
    first = torch.autograd.grad((y * ramp).sum(), inputs, create_graph=True, allow_unused=True)
    loss = sum((g**2).sum() for g in first if g is not None)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def test_double_backward_matches_the_reference_math():
    from normswap.kernels import ops
    from normswap.kernels.reference import layer_norm_reference, rms_norm_reference

    torch.manual_seed(0)
    x, r, w, b = torch.randn(3, 7), torch.randn(3, 7), torch.rand(7) + 0.5, torch.randn(7)
    cases = [
        (
            lambda x, r, w, b: ops.rms_norm(x, w, b, 1e-6),
            lambda x, r, w, b: rms_norm_reference(x, 1, w, b, 1e-6),
        ),
        (
            lambda x, r, w, b: ops.layer_norm(x, w, b, 1e-5),
            lambda x, r, w, b: layer_norm_reference(x, 1, w, b, 1e-5),
        ),
        (
            lambda x, r, w, b: ops.rms_norm(x, w, None, 1e-6, "gemma", 1.0),
            lambda x, r, w, b: rms_norm_reference(x, 1, w, None, 1e-6, "gemma", 1.0),
        ),
        (
            lambda x, r, w, b: ops.add_rms_norm(x, r, w, b, 1e-6)[0],
            lambda x, r, w, b: rms_norm_reference(x + r, 1, w, b, 1e-6),
        ),
    ]
    for fused, reference in cases:
        got, expected = _second_order(fused, x, r, w, b), _second_order(reference, x, r, w, b)
        for g, e in zip(got, expected, strict=True):
            assert (g is None) == (e is None)
            if g is not None:
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        assert got[0] is not None and got[0].abs().sum() > 0  # a real second derivative w.r.t. x


def test_torch_func_transforms_and_forward_ad_give_the_reference_derivatives():
    import torch.autograd.forward_ad as fwAD
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, r, w, b = torch.randn(3, 7), torch.randn(3, 7), torch.rand(7) + 0.5, torch.randn(7)
    cases = [
        (lambda t: layer_norm(t, w, b, 1e-5), lambda t: F.layer_norm(t, (7,), w, b, 1e-5)),
        (lambda t: rms_norm(t, w, None, 1e-6), lambda t: F.rms_norm(t, (7,), w, 1e-6)),
        (lambda t: add_rms_norm(t, r, w, None, 1e-6)[0], lambda t: F.rms_norm(t + r, (7,), w, 1e-6)),
    ]
    tangent = torch.randn_like(x)
    for fused, reference in cases:
        want = torch.func.jacrev(reference)(x)
        # these raised (grad, jacrev) or returned a wrong Jacobian without a word (jacfwd) through the op
        torch.testing.assert_close(torch.func.jacrev(fused)(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.func.jacfwd(fused)(x), want, atol=1e-5, rtol=1e-5)
        grad = torch.func.grad(lambda t, f=fused: f(t).square().sum())(x)
        torch.testing.assert_close(grad, torch.func.grad(lambda t, f=reference: f(t).square().sum())(x))
        with fwAD.dual_level():
            got = fwAD.unpack_dual(fused(fwAD.make_dual(x, tangent))).tangent
        torch.testing.assert_close(got, torch.einsum("ijkl,kl->ij", want, tangent), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", [add_rms_norm, add_layer_norm])
def test_backward_when_only_the_sum_is_used(fn):
    # The statistics' gradients are not materialized, so the backward also sees dy = None when only
    # h = x + residual reaches the loss: the gradient is then dh alone, and the weight's is zero.
    x, r = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    _, h = fn(x, r, w)
    dh = torch.randn(5, 8)
    h.backward(dh)
    torch.testing.assert_close(x.grad, dh)
    torch.testing.assert_close(r.grad, dh)
    assert w.grad is None or torch.count_nonzero(w.grad) == 0


def test_ops_are_triton_ops_where_triton_is_installed():
    # torch.compile decomposes a triton_op into its kernels; a custom_op would stay an opaque call.
    pytest.importorskip("triton")
    from torch._library.triton import triton_ops_to_kernels

    from normswap.kernels._registration import _with_signature
    from normswap.kernels.ops import _FAMILIES

    for family in _FAMILIES:
        for suffix, schema in (("fwd", family.fwd_schema()), ("bwd", family.bwd_schema())):
            # the kernels torch.compile's cache keys on (the implementation itself names none)
            kernels = triton_ops_to_kernels[f"normswap::{family.name}_{suffix}"]
            assert {k.__name__ for k in kernels} == {
                "norm_fwd_tile_kernel",
                "norm_fwd_chunked_kernel",
                "norm_bwd_row_dots_kernel",
                "norm_bwd_tile_kernel",
            }
            # torch 2.11's triton_op reads the schema off the signature: the two must agree
            assert (
                torch.library.infer_schema(_with_signature(lambda *a: a, schema), mutates_args=()) == schema
            )


def test_a_torch_whose_triton_op_refuses_gets_custom_ops():
    code = """
import torch
def refuse(*args, **kwargs):
    raise ValueError("infer_schema(func): We do not support varargs")
torch.library.triton_op = refuse
from normswap.kernels import _registration, rms_norm
assert _registration._REGISTER is refuse
x = torch.randn(3, 8, requires_grad=True)
rms_norm(x, torch.ones(8)).sum().backward()
y = torch.ops.normswap.rms_norm_fwd(x.detach(), None, None, 1e-6, "none", 0.0)[0]
assert torch.equal(y, rms_norm(x.detach()))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_tiling_takes_symbolic_shapes():
    # torch.compile(dynamic=True) traces the launcher with symbolic sizes: the row count takes the
    # many-rows tiling, the row length is specialized (a SymInt cannot key the rules' cache).
    from torch.fx.experimental.proxy_tensor import make_fx

    from normswap.kernels._launch import _concrete_rows, _row_length
    from normswap.kernels._tiling import bwd_config, fwd_config

    def tiling(x):
        fwd = fwd_config(_concrete_rows(x.shape[0]), _row_length(x), interpret=False)
        bwd = bwd_config(_concrete_rows(x.shape[0]), _row_length(x), interpret=False, kind="rms")
        return x * (fwd.block_n + bwd.block_n)

    x = torch.randn(8, 3000)
    gm = make_fx(tiling, tracing_mode="symbolic")(x)
    torch.testing.assert_close(gm(x), x * (4096 + 4096))
