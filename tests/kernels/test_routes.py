"""The per-shape route of an eager fused-norm call: the Triton kernel, or torch's own ops.

The route is chosen on CUDA from measured rules; here (no GPU) the rules are set by the tests and the
torch route is forced onto CPU tensors, whose eager calls take the same code path as CUDA ones under
``triton_on_cpu``. Both routes are held to the reference math, gradients included.
"""

from __future__ import annotations

import json

import pytest
import torch

from normswap.kernels import _routes, kernel_route, layer_norm, rms_norm, route_rules
from normswap.kernels._routes import choose_route, load_rules, reload_environment, route_key
from normswap.modules.fused import FusedRMSNorm
from tests.kernels.conftest import CASTINGS, check_all, fused_grads, make_params, randn, reference_grads

KEY = route_key("rms", False, True, 2, False)


def test_rules_pick_the_kernel_from_min_rows_on_per_row_length():
    rules = {KEY: [(1024, 512), (4096, 64)]}
    with route_rules(rules):
        assert choose_route("rms", False, True, torch.bfloat16, False, 511, 768) == "torch"
        assert choose_route("rms", False, True, torch.bfloat16, False, 512, 768) == "triton"
        assert choose_route("rms", False, True, torch.bfloat16, False, 63, 4096) == "torch"
        assert choose_route("rms", False, True, torch.bfloat16, False, 64, 2048) == "triton"
        # beyond the longest measured length: its verdict (64 rows), not "always the kernel"
        assert choose_route("rms", False, True, torch.bfloat16, False, 63, 32768) == "torch"
        assert choose_route("rms", False, True, torch.bfloat16, False, 64, 32768) == "triton"
        # another key (fp32, training, LayerNorm) has no rule: the kernel
        assert choose_route("rms", False, True, torch.float32, False, 1, 768) == "triton"
        assert choose_route("rms", False, True, torch.bfloat16, True, 1, 768) == "triton"
        assert choose_route("layer", False, True, torch.bfloat16, False, 1, 768) == "triton"
    with route_rules(rules), kernel_route("triton"):
        assert choose_route("rms", False, True, torch.bfloat16, False, 1, 768) == "triton"


def test_route_keys_name_what_changes_the_answer():
    assert route_key("layer", True, False, 4, True) == "layer+add:composed:fp32:train"
    assert route_key("rms", False, True, 2, False) == "rms:native:half:infer"


def test_rules_file_is_checked(tmp_path):
    good = tmp_path / "rules.json"
    good.write_text(json.dumps({"rules": {KEY: [[1024, 512], [4096, 64]]}}))
    assert load_rules(good) == {KEY: ((1024, 512), (4096, 64))}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rules": {KEY: [[4096, 64], [1024, 512]]}}))
    with pytest.raises(ValueError, match="ascending order"):
        load_rules(bad)
    bad.write_text(json.dumps({"timings": []}))
    with pytest.raises(ValueError, match="no 'rules' table"):
        load_rules(bad)
    bad.write_text(json.dumps({"rules": {KEY: [["x", 1]]}}))
    with pytest.raises(ValueError, match="not a list of \\[n_max, min_rows\\] pairs"):
        load_rules(bad)


def test_a_rules_file_of_the_earlier_tuner_keeps_its_measured_kernel_lengths(tmp_path):
    """The tuner before rows past the last entry followed it left out the trailing lengths where the
    kernel won at every count (past the last entry then meant the kernel). Read today, such a rule gets
    its run's longest length with no rows to wait for: the lengths it measured as kernel wins stay so
    (benchmarks/results/routes_h100_bf16.json). A rule measured to the end, ending in a kernel verdict,
    or from a file without the run's lengths, is taken as it is."""
    old = tmp_path / "old.json"
    meta = {"lengths": [512, 1024, 2048, 4096, 8192, 16384], "fp32_lengths": [512, 4096]}
    rules = {
        KEY: [[512, 4096]],
        "rms:native:half:train": [[512, 4096], [16384, 64]],
        "rms+add:native:half:infer": [[512, 4096], [1024, 0]],
        "rms:native:fp32:infer": [[512, 4096]],
    }
    old.write_text(json.dumps({"meta": meta, "rules": rules}))
    loaded = load_rules(old)
    assert loaded[KEY] == ((512, 4096), (16384, 0))
    assert loaded["rms:native:half:train"] == ((512, 4096), (16384, 64))
    assert loaded["rms+add:native:half:infer"] == ((512, 4096), (1024, 0))
    assert loaded["rms:native:fp32:infer"] == ((512, 4096), (4096, 0))  # the run's fp32 lengths
    with route_rules(loaded):
        assert choose_route("rms", False, True, torch.bfloat16, False, 1, 2048) == "triton"
        assert choose_route("rms", False, True, torch.bfloat16, False, 1, 512) == "torch"
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"rules": {KEY: [[512, 4096]]}}))
    assert load_rules(bare)[KEY] == ((512, 4096),)


def test_environment_forces_a_route_or_refuses_a_bad_one(monkeypatch):
    try:
        monkeypatch.setenv("NORMSWAP_KERNEL_ROUTE", "torch")
        # read at import: the rules decide (the kernel at many rows)
        assert choose_route("rms", False, True, torch.bfloat16, False, 1 << 20, 65536) == "triton"
        reload_environment()
        assert choose_route("rms", False, True, torch.bfloat16, False, 1 << 20, 65536) == "torch"
        monkeypatch.setenv("NORMSWAP_KERNEL_ROUTE", "fast")
        reload_environment()
        with pytest.raises(ValueError, match="NORMSWAP_KERNEL_ROUTE must be one of"):
            choose_route("rms", False, True, torch.bfloat16, False, 1, 768)
    finally:
        monkeypatch.delenv("NORMSWAP_KERNEL_ROUTE")
        reload_environment()


def test_environment_rules_file(monkeypatch, tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": {KEY: [[1024, 512]]}}))
    try:
        monkeypatch.setenv("NORMSWAP_ROUTE_RULES", str(rules))
        reload_environment()
        assert choose_route("rms", False, True, torch.bfloat16, False, 511, 768) == "torch"
        assert choose_route("rms", False, True, torch.bfloat16, False, 512, 768) == "triton"
        # the file rewritten at the same path is read again by reload_environment, and the cached
        # decisions of eager calls (keyed by current_state) are not served for the new rules
        state = _routes.current_state
        rules.write_text(json.dumps({"rules": {KEY: [[1024, 64]]}}))
        reload_environment()
        assert choose_route("rms", False, True, torch.bfloat16, False, 100, 768) == "triton"
        assert _routes.current_state != state
    finally:
        monkeypatch.delenv("NORMSWAP_ROUTE_RULES")
        reload_environment()


@pytest.mark.parametrize(("casting", "offset"), [*CASTINGS, ("llama", 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_torch_route_computes_the_norm_and_its_gradients(interpreter, kind, residual, dtype, casting, offset):
    shape = (5, 7, 96)
    x, dy = randn(shape, dtype, seed=0, scale=2.0, shift=1.0), randn(shape, dtype, seed=1)
    r, dh = (randn(shape, dtype, seed=2), randn(shape, dtype, seed=3)) if residual else (None, None)
    # no bias on the plain RMSNorm: F.rms_norm's case (with one, the route composes the reference)
    w, b = make_params(shape[-1], dtype, affine=True, bias=kind == "layer" or casting != "none")
    args = (kind, x, r, w, b, 1e-5, casting, offset, dy, dh)
    with kernel_route("torch"):
        got = fused_grads(*args, triton=True)
    names = ["y", "h", "dx", "dresidual", "dweight", "dbias"]
    if kind == "layer" and casting == "none" and dtype == torch.bfloat16:
        # the CPU's F.layer_norm sums a bf16 bias gradient in bf16 (CUDA's sums in fp32, which
        # tests/kernels/test_gpu.py checks); the route hands the call to it, so that is its figure here
        names.remove("dbias")
    check_all(got, reference_grads(*args, exact_llama_dweight=False), dtype, names=tuple(names))


def test_torch_route_is_torchs_own_ops_and_the_kernel_route_is_not(interpreter):
    x = randn((4, 64), torch.float32, seed=0).requires_grad_()
    w, b = make_params(64, torch.float32, affine=True, bias=True)
    from normswap.kernels import triton_on_cpu

    with triton_on_cpu():
        with kernel_route("torch"):
            native = layer_norm(x, w, b)
            composed = rms_norm(x, w, None, 1e-6, "llama")
        with kernel_route("triton"):
            kernel = layer_norm(x, w, b)
    assert type(native.grad_fn).__name__ == "NativeLayerNormBackward0"
    assert "Function" not in type(composed.grad_fn).__name__  # the reference's own ops
    assert type(kernel.grad_fn).__name__.startswith("LayerNormFunction")
    torch.testing.assert_close(native, kernel, atol=1e-5, rtol=1e-5)


def test_graph_capture_keeps_the_op_whatever_the_eager_route(interpreter):
    norm = FusedRMSNorm(32, eps=1e-6)
    x = torch.randn(2, 3, 32)
    with kernel_route("torch"):
        program = torch.export.export(norm, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "normswap.rms_norm_fwd.default" in targets, targets
