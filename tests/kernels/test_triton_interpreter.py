"""The Triton kernels themselves, run on CPU by the Triton interpreter, against the reference math.

Through the custom ops (``triton_on_cpu``), so autograd wiring is covered too, and through the launchers
where a test needs a knob the ops do not have (``max_block_n``, to reach the chunked kernels cheaply).
The interpreter truncates fp32 -> bf16 where GPUs round to nearest even; the launchers switch the kernels
to a software rounding under the interpreter (``RNE_BF16``), so bf16 results round as on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from normswap.kernels import rms_norm, triton_on_cpu
from normswap.kernels._launch import norm_bwd, norm_fwd
from tests.kernels.conftest import (
    CASTINGS,
    DTYPES,
    assert_close,
    check_all,
    fused_grads,
    make_params,
    randn,
    reference_grads,
)

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("casting", "offset"), CASTINGS)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_matches_reference(kind, casting, offset, dtype):
    """Every dtype x casting mode, with the parameters each norm usually has (LN: w + b, RMS: w)."""
    shape = (5, 123, 123)
    x = randn(shape, dtype, seed=0, scale=2.0, shift=0.5)
    w, b = make_params(shape[-1], dtype, affine=True, bias=kind == "layer")
    dy = randn(shape, dtype, seed=2)
    args = (kind, x, None, w, b, 1e-5, casting, offset, dy)
    check_all(fused_grads(*args, triton=True), reference_grads(*args), dtype)


@pytest.mark.parametrize(("affine", "bias"), [(False, False), (False, True), (True, True), (True, False)])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_optional_parameters(kind, affine, bias):
    """Each weight/bias combination, in the mode with the most roundings (llama, bf16)."""
    dtype = torch.bfloat16
    shape = (3, 41, 123)
    x = randn(shape, dtype, seed=0, scale=2.0, shift=0.5)
    w, b = make_params(shape[-1], dtype, affine, bias)
    dy = randn(shape, dtype, seed=2)
    args = (kind, x, None, w, b, 1e-5, "llama", 0.0, dy)
    check_all(fused_grads(*args, triton=True), reference_grads(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("casting", ["none", "llama"])
def test_add_norm_matches_reference(kind, casting, dtype):
    shape = (3, 37, 96)
    x = randn(shape, dtype, seed=0)
    residual = randn(shape, dtype, seed=1, scale=3.0)
    w, b = make_params(shape[-1], dtype, affine=True, bias=kind == "layer")
    dy = randn(shape, dtype, seed=2)
    dh = randn(shape, dtype, seed=3)  # h feeds the next residual add as well
    args = (kind, x, residual, w, b, 1e-6, casting, 0.0, dy, dh)
    got, want = fused_grads(*args, triton=True), reference_grads(*args)
    check_all(got, want, dtype)
    # Both inputs of the add get the same gradient, dh included.
    torch.testing.assert_close(got["dx"], got["dresidual"], atol=0, rtol=0)


@pytest.mark.parametrize("n", [1, 7, 769])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_hidden_sizes(kind, n):
    dtype = torch.float32
    x = randn((3, 5, n), dtype, seed=n, shift=1.0)
    w, b = make_params(n, dtype, affine=True, bias=True)
    dy = randn(x.shape, dtype, seed=n + 1)
    args = (kind, x, None, w, b, 1e-6, "none", 0.0, dy)
    check_all(fused_grads(*args, triton=True), reference_grads(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_long_rows_take_the_chunked_kernels(kind, dtype):
    # 20000 > the whole-row limits (16384 forward, 8192 backward): the default configuration chunks.
    n = 20000
    x = randn((2, n), dtype, seed=0, scale=2.0, shift=3.0)
    w, b = make_params(n, dtype, affine=True, bias=True)
    dy = randn(x.shape, dtype, seed=1)
    args = (kind, x, None, w, b, 1e-5, "none", 0.0, dy)
    check_all(fused_grads(*args, triton=True), reference_grads(*args), dtype)


@pytest.mark.parametrize(
    ("residual", "casting", "offset"),
    [(False, "none", 0.0), (True, "llama", 1.0)],
    ids=["plain", "add-llama"],
)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_chunked_kernels_match_tile_kernels(kind, residual, casting, offset):
    """Forcing a 256-element limit runs the chunked kernels (ragged last chunk) on a small shape."""
    dtype = torch.bfloat16
    n = 769
    x = randn((6, n), dtype, seed=0, scale=4.0, shift=10.0)  # a large mean stresses the LN merge
    r = randn((6, n), dtype, seed=1) if residual else None
    w, b = make_params(n, dtype, affine=True, bias=True)
    dy = randn(x.shape, dtype, seed=2)
    dh = randn(x.shape, dtype, seed=3) if residual else None
    outs = {}
    for limit in (None, 256):
        y, h, mean, rstd = norm_fwd(kind, x, r, w, b, 1e-5, casting, offset, max_block_n=limit)
        grads = norm_bwd(
            kind, dy, dh, h if residual else x, w, b, mean, rstd, casting, offset, max_block_n=limit
        )
        outs[limit] = (y, h, mean, rstd, *grads)
    for a, c in zip(outs[None], outs[256], strict=True):
        if a is None:
            assert c is None
        else:
            # Same math in a different summation order: fp32 statistics agree to rounding.
            assert_close(c, a, dtype if a.dtype != torch.float32 else torch.float32)
    want = reference_grads(kind, x, r, w, b, 1e-5, casting, offset, dy, dh)
    got = dict(zip(("y", "h", "mean", "rstd", "dx", "dweight", "dbias"), outs[256], strict=True))
    check_all(got, want, dtype, names=("y", "h", "dx", "dweight", "dbias"))


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_strided_inputs(kind):
    dtype = torch.float32
    base = randn((4, 40, 70), dtype, seed=0)
    w, b = make_params(33, dtype, affine=True, bias=True)
    views = {
        "transposed": base[:, :33, :].transpose(0, 1).transpose(1, 2)[:, :, :4],  # last-dim stride != 1
        "column slice": base[:, :, 10:43],  # row stride 70, no copy needed
        "row step": base[::2, ::3, :33],
    }
    for name, x in views.items():
        assert not x.is_contiguous(), name
        dy = randn(x.shape, dtype, seed=1)
        wn = w if x.shape[-1] == 33 else make_params(x.shape[-1], dtype, True, True)[0]
        bn = b if x.shape[-1] == 33 else make_params(x.shape[-1], dtype, True, True)[1]
        args = (kind, x, None, wn, bn, 1e-5, "none", 0.0, dy)
        check_all(fused_grads(*args, triton=True), reference_grads(*args), dtype)


def test_broadcast_output_gradient():
    # y.sum().backward() hands the op an expanded dy whose strides are all 0.
    x = randn((3, 9, 16), torch.float32, seed=0).requires_grad_()
    w, _ = make_params(16, torch.float32, True, False)
    with triton_on_cpu():
        rms_norm(x, w).sum().backward()
    want = reference_grads("rms", x, None, w, None, 1e-6, "none", 0.0, torch.ones(x.shape))
    assert_close(x.grad, want["dx"], torch.float32, "dx")
    assert_close(w.grad, want["dweight"], torch.float32, "dweight")


def test_mixed_parameter_dtype_llama():
    """fp32 weight on bf16 activations, llama mode: like HF, the weight multiply promotes to fp32."""
    x = randn((4, 64), torch.bfloat16, seed=0)
    w = make_params(64, torch.float32, True, False)[0]
    dy = randn(x.shape, torch.float32, seed=1)
    args = ("rms", x, None, w, None, 1e-6, "llama", 0.0, dy)
    got, want = fused_grads(*args, triton=True), reference_grads(*args)
    assert got["y"].dtype == torch.float32
    check_all(got, want, torch.bfloat16)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_no_rows(kind):
    x = torch.empty((0, 5, 16))
    w, b = make_params(16, torch.float32, True, True)
    y, _, mean, rstd = norm_fwd(kind, x, None, w, b, 1e-5, "none", 0.0)
    assert y.shape == x.shape and rstd.shape == (0, 5)
    dx, dw, db = norm_bwd(kind, torch.empty_like(x), None, x, w, b, mean, rstd, "none", 0.0)
    assert dx.shape == x.shape
    assert torch.equal(dw, torch.zeros(16)) and torch.equal(db, torch.zeros(16))


def test_statistics_are_fp32():
    x = randn((4, 7, 48), torch.bfloat16, seed=0, shift=2.0)
    _, _, mean, rstd = norm_fwd("layer", x, None, None, None, 1e-5, "none", 0.0)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (4, 7)
    x32 = x.float()
    torch.testing.assert_close(mean, x32.mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(x32.var(-1, unbiased=False) + 1e-5))


@pytest.mark.parametrize("rows", [1, 300], ids=["one-program", "several-programs"])
@pytest.mark.parametrize(
    ("w_dtype", "b_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["bf16-params", "fp32-params", "mixed-params"],
)
def test_weight_and_bias_gradients_share_one_partial_buffer(rows, w_dtype, b_dtype):
    """The backward sums the weight's and bias's per-program partials in one buffer (one program: its
    row is the sum). Both routes give the reference gradients in each parameter's dtype, and the op's
    results never alias each other (a custom op may not return aliases)."""
    x = randn((rows, 96), torch.bfloat16, seed=0, scale=2.0, shift=0.5)
    w = make_params(96, w_dtype, True, False)[0]
    b = make_params(96, b_dtype, False, True)[1]
    dy = randn(x.shape, torch.bfloat16, seed=2)
    args = ("layer", x, None, w, b, 1e-5, "llama", 0.0, dy)
    want = reference_grads(*args)
    got = fused_grads(*args, triton=True)  # the eager route: launch_bwd's views are fine there
    check_all(got, want, torch.bfloat16)
    assert got["dweight"].dtype == w_dtype and got["dbias"].dtype == b_dtype
    _, _, mean, rstd = norm_fwd("layer", x, None, w, b, 1e-5, "llama", 0.0)
    with triton_on_cpu():
        dx, dw, db = torch.ops.normswap.layer_norm_bwd(dy, x, w, b, mean, rstd, "llama", 0.0)
        torch.library.opcheck(
            torch.ops.normswap.layer_norm_bwd.default,
            (dy, x, w, b, mean, rstd, "llama", 0.0),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )
    assert dw.untyped_storage().data_ptr() != db.untyped_storage().data_ptr()
    assert_close(dx, want["dx"], torch.bfloat16, "dx")
    assert_close(dw, want["dweight"], torch.bfloat16, "dweight")
    assert_close(db, want["dbias"], torch.bfloat16, "dbias")
