"""Eager calls skip the dispatcher: same kernels, same results, and tracing still sees the custom op.

On CUDA (here: CPU tensors through the Triton interpreter, ``triton_on_cpu``) the public functions call
the kernels through a ``torch.autograd.Function`` instead of the ``normswap::`` op when nothing records
the call, to save the op's host time at small row counts. These tests pin down both halves of that: the
two routes give bitwise the same outputs and gradients, and export, ``make_fx`` and fake tensors still
get the op.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from normswap.kernels import add_layer_norm, add_rms_norm, layer_norm, rms_norm, triton_on_cpu
from normswap.modules.fused import FusedRMSNorm

pytestmark = pytest.mark.usefixtures("interpreter")

OPS = torch.ops.normswap
# public function, its op, whether it takes a residual
FAMILIES = {
    "rms_norm": (rms_norm, OPS.rms_norm_fwd, False),
    "layer_norm": (layer_norm, OPS.layer_norm_fwd, False),
    "add_rms_norm": (add_rms_norm, OPS.add_rms_norm_fwd, True),
    "add_layer_norm": (add_layer_norm, OPS.add_layer_norm_fwd, True),
}


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (6, 37)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(dtype)

    return {
        "x": randn(*shape) * 2 + 0.5,
        "residual": randn(*shape),
        "weight": randn(shape[-1]) * 0.3 + 1,
        "bias": randn(shape[-1]),
        "dy": randn(*shape),
        "dh": randn(*shape),
    }


def _run(name: str, route: str, t: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """Outputs and gradients of one family through ``route`` ("eager" or "op"), and the grad_fn's name."""
    fn, op, with_residual = FAMILIES[name]
    leaves = {k: t[k].clone().requires_grad_() for k in ("x", "residual", "weight", "bias")}
    if not with_residual:
        del leaves["residual"]
    args = (*leaves.values(), 1e-5, "none", 0.0)
    with triton_on_cpu():
        if route == "eager":
            out = fn(*args[:-2])  # casting and offset at their defaults, the values given the op
            outs = out if with_residual else (out,)
        else:
            outs = op(*args)[: 2 if with_residual else 1]
        grads = (t["dy"], t["dh"])[: len(outs)]
        torch.autograd.backward(outs, grads)
    result = {f"out{i}": o.detach() for i, o in enumerate(outs)}
    result.update({f"d{k}": v.grad for k, v in leaves.items()})
    return result, type(outs[0].grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_eager_route_is_bitwise_the_op_route(name, dtype):
    t = _inputs(dtype)
    eager, eager_fn = _run(name, "eager", t)
    op, op_fn = _run(name, "op", t)
    # the eager call went through the autograd.Function, not the custom op's autograd
    assert eager_fn.endswith("FunctionBackward") and not op_fn.endswith("FunctionBackward"), (eager_fn, op_fn)
    assert eager.keys() == op.keys()
    for key, want in op.items():
        assert torch.equal(eager[key], want), key


def test_without_grad_the_eager_route_returns_the_same_values():
    t = _inputs(torch.float32)
    with triton_on_cpu(), torch.no_grad():
        got = rms_norm(t["x"], t["weight"], None, 1e-6, "llama")
        want = OPS.rms_norm_fwd(t["x"], t["weight"], None, 1e-6, "llama", 0.0)[0]
    assert got.grad_fn is None and torch.equal(got, want)


def test_tracing_records_the_op_not_the_kernels_result():
    norm = FusedRMSNorm(37, eps=1e-6)
    x = torch.randn(6, 37)
    with triton_on_cpu():
        # make_fx with real tensors: a proxy mode is active, so the call must stay an op in the graph
        traced = make_fx(norm)(x)
        exported = torch.export.export(norm, (x,), strict=False)
    for graph in (traced.graph, exported.graph):
        targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
        assert "normswap.rms_norm_fwd.default" in targets, targets
    torch.testing.assert_close(traced(x), norm(x))


def test_double_backward_through_the_eager_route():
    from normswap.kernels.reference import rms_norm_reference

    x, w = torch.randn(3, 7, requires_grad=True), (torch.rand(7) + 0.5).requires_grad_()
    ramp = torch.linspace(-1, 1, 7)

    def second(fn) -> tuple[torch.Tensor, ...]:
        first = torch.autograd.grad((fn(x, w) * ramp).sum(), (x, w), create_graph=True)
        return torch.autograd.grad(sum((g**2).sum() for g in first), (x, w))

    with triton_on_cpu():
        got = second(lambda x, w: rms_norm(x, w, None, 1e-6))
    want = second(lambda x, w: rms_norm_reference(x, 1, w, None, 1e-6))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_jit_trace_records_the_op():
    norm = FusedRMSNorm(37, eps=1e-6)
    x = torch.randn(6, 37)
    with triton_on_cpu():
        traced = torch.jit.trace(norm, (x,), check_trace=False)
    assert "normswap::rms_norm_fwd" in str(traced.graph)


def test_batched_gradients_take_the_op():
    # is_grads_batched and jacobian(vectorize=True) run the backward under the legacy vmap, whose
    # batched tensors look like plain ones: the raw launcher cannot read them, the op can
    x = torch.randn(3, 7, requires_grad=True)
    with triton_on_cpu():
        (batched,) = torch.autograd.grad(
            layer_norm(x), x, torch.eye(21).view(21, 3, 7), is_grads_batched=True
        )
        jacobian = torch.autograd.functional.jacobian(layer_norm, x, vectorize=True)
    want = torch.autograd.functional.jacobian(lambda t: torch.nn.functional.layer_norm(t, (7,)), x)
    torch.testing.assert_close(jacobian, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched.view(3, 7, 3, 7), want, atol=1e-5, rtol=1e-5)
