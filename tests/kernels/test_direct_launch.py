"""Direct launches of compiled kernels (normswap.kernels._direct): the key rule on the CPU, against
Triton's own specialization, the argument order and the fallbacks on a recording kernel, and the
launches themselves on a GPU, bitwise against Triton's own launch."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from normswap.kernels._direct import DirectKernel, launch_key, set_direct_launch
from normswap.kernels._launch import norm_bwd, norm_fwd

triton = pytest.importorskip("triton")

INTS = [
    0,
    1,
    2,
    15,
    16,
    17,
    32,
    48,
    4096,
    4097,
    2**31 - 16,
    2**31 - 1,
    2**31,
    2**31 + 16,
    2**32 + 1,
    2**63 - 16,
    2**63,
    2**64 - 16,
    -1,
    -16,
    -17,
    -(2**31),
    -(2**31) - 16,
]
FLOATS = [0.0, 1.0, 1e-6, 1e300, -2.5]


def _tensors() -> list[torch.Tensor]:
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        base = torch.zeros(64, dtype=dtype)
        out += [base, base[1:], base[8:], base[16:]]  # aligned and not, by the element size
    return out


def _triton_specialization(value):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, True, True)


def test_launch_key_is_at_least_as_fine_as_tritons_specialization():
    """Two arguments with one key are specialized alike by Triton: a kernel compiled for the first is
    the kernel Triton would launch for the second."""
    values = [*INTS, *FLOATS, *_tensors(), True, False, None]
    pairs = 0
    for a, b in itertools.combinations(values, 2):
        if type(a) is not type(b):
            continue
        if launch_key((a,), {}) == launch_key((b,), {}):
            pairs += 1
            assert _triton_specialization(a) == _triton_specialization(b), (a, b)
    assert pairs > 40  # the key merges what may be merged: otherwise every size would compile anew


def test_launch_key_merges_sizes_triton_merges():
    assert launch_key((32, 48, 4096), {}) == launch_key((64, 1024, 8192), {})  # multiples of 16
    assert launch_key((17,), {}) == launch_key((4097,), {})
    assert launch_key((1,), {}) != launch_key((17,), {})  # Triton makes a 1 a constant
    assert launch_key((16,), {}) != launch_key((17,), {})
    assert launch_key((2**31 - 16,), {}) != launch_key((2**31 + 16,), {})  # i32 / i64
    base = torch.zeros(64)
    assert launch_key((base,), {}) != launch_key((base[1:],), {})
    assert launch_key((base,), {"BLOCK_N": 64}) != launch_key((base,), {"BLOCK_N": 128})
    assert launch_key((base,), {"A": 1, "B": 2}) != launch_key((base,), {"A": 2, "B": 1})


def test_argument_lists_of_mixed_kinds_share_a_key_only_when_triton_specializes_them_alike():
    """The key is one flat sequence (a tensor gives two entries, its dtype and alignment): lists of
    several arguments of mixed kinds, including lists of different lengths, never share a key unless
    they are as long and every position is of one kind and specialized alike by Triton."""
    import random

    pool = [*INTS, *FLOATS, *_tensors(), True, False, None]
    rng = random.Random(0)
    lists = [tuple(rng.choice(pool) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    seen: dict = {}
    shared = 0
    for args in lists:
        other = seen.setdefault(launch_key(args, {}), args)
        if other is args:
            continue
        shared += 1
        assert len(other) == len(args), (other, args)
        for a, b in zip(other, args, strict=True):
            assert type(a) is type(b), (other, args)
            if a is not None:
                assert _triton_specialization(a) == _triton_specialization(b), (other, args)
    assert shared > 100  # lists that may share a kernel do share a key


class _RecordingKernel:
    """Stands in for a jit kernel: ``kernel[grid](...)`` records the call and returns a compiled
    kernel whose launcher records what it is given."""

    def __init__(self, params, constexprs=("FLAG", "BLOCK")):
        self.params = [SimpleNamespace(name=n, is_constexpr=n in constexprs) for n in params]
        self.pre_run_hooks = []
        self.jit_launches = []
        self.runs = []
        self.compiled = SimpleNamespace(function="fn", packed_metadata="meta", run=self._run)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            return self.compiled

        return launch

    def _run(self, *args):
        self.runs.append(args)


def _runtime(debug=False, enter=None):
    """Triton's runtime knobs as the launcher reads them, device 0 and its stream 7 (no GPU needed)."""
    knobs = SimpleNamespace(debug=debug, launch_enter_hook=enter, launch_exit_hook=None)
    return knobs, lambda device: 7, lambda: 0


@pytest.fixture
def recording():
    kernel = _RecordingKernel(["X", "N", "eps", "FLAG", "BLOCK"])
    return kernel, DirectKernel(kernel, _runtime())


def test_replays_in_signature_order(recording):
    kernel, wrapped = recording
    x = torch.zeros(32)
    wrapped[(4,)](x, 64, 1e-5, BLOCK=128, FLAG=True, num_warps=4)
    assert len(kernel.jit_launches) == 1 and not kernel.runs  # the first launch is Triton's own
    wrapped[(5, 2)](x, 80, 1e-6, BLOCK=128, FLAG=True, num_warps=4)
    assert len(kernel.jit_launches) == 1 and wrapped.direct_launches == 1
    run = kernel.runs[0]
    assert run[:4] == (5, 2, 1, 7)  # grid padded to three dims, the current stream
    assert run[4:9] == ("fn", "meta", None, None, None)
    assert run[9:] == (x, 80, 1e-6, True, 128)  # keyword constants in the kernel's parameter order
    wrapped[(5,)](x, 81, 1e-6, BLOCK=128, FLAG=True, num_warps=4)  # 81 is not a multiple of 16: new key
    assert len(kernel.jit_launches) == 2
    previous = set_direct_launch(False)
    try:
        wrapped[(5,)](x, 80, 1e-6, BLOCK=128, FLAG=True, num_warps=4)
    finally:
        set_direct_launch(previous)
    assert len(kernel.jit_launches) == 3 and wrapped.direct_launches == 1
    assert wrapped.launches == 4  # every launch counted, whichever way it went


@pytest.mark.parametrize(
    "runtime",
    [_runtime(enter=SimpleNamespace(calls=[print])), _runtime(enter=print), _runtime(debug=True)],
    ids=["hook chain with a call", "plain hook", "TRITON_DEBUG"],
)
def test_falls_back_to_triton_while_a_hook_or_debug_is_on(runtime):
    kernel = _RecordingKernel(["X", "N", "eps", "FLAG", "BLOCK"])
    wrapped = DirectKernel(kernel, runtime)
    for _ in range(3):
        wrapped[(1,)](torch.zeros(4), 16, 1.0, BLOCK=16, FLAG=False, num_warps=1)
    assert len(kernel.jit_launches) == 3 and wrapped.direct_launches == 0


def test_an_empty_hook_chain_does_not_stop_direct_launches():
    kernel = _RecordingKernel(["X", "N", "eps", "FLAG", "BLOCK"])
    wrapped = DirectKernel(kernel, _runtime(enter=SimpleNamespace(calls=[])))
    for _ in range(3):
        wrapped[(1,)](torch.zeros(4), 16, 1.0, BLOCK=16, FLAG=False, num_warps=1)
    assert len(kernel.jit_launches) == 1 and wrapped.direct_launches == 2


def test_a_constant_given_by_position_is_never_replayed():
    """A tl.constexpr passed positionally would be keyed by its specialization facts (32 and 48 alike):
    such a call always goes through Triton's launch."""
    kernel = _RecordingKernel(["X", "BLOCK"])
    wrapped = DirectKernel(kernel, _runtime())
    for block in (32, 48, 32):
        wrapped[(1,)](torch.zeros(4), block)
    assert len(kernel.jit_launches) == 3 and not kernel.runs


def test_a_parameter_left_to_its_default_is_never_replayed():
    kernel = _RecordingKernel(["X", "N", "BLOCK"])
    wrapped = DirectKernel(kernel, _runtime())
    for _ in range(3):
        wrapped[(1,)](torch.zeros(4), 16)  # BLOCK left to the kernel's default
    assert len(kernel.jit_launches) == 3 and not kernel.runs


# The GPU half: every launch bitwise equal to Triton's own, across the specialization boundaries.
GPU_CASES = [
    # (rows, length, offset of x in its buffer, row stride pad)
    (1, 4096, 0, 0),
    (1, 4096, 1, 0),  # x not 16-byte aligned
    (7, 1000, 0, 0),
    (7, 1000, 0, 3),  # row stride not a multiple of 16
    (16, 768, 0, 0),
    (17, 768, 8, 16),
    (4096, 2048, 0, 0),
    (2, 40000, 0, 0),  # the chunked kernels
    (2, 40000, 3, 5),
]


def _case_tensors(rows, n, offset, pad, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(rows * (n + pad) + offset, generator=g).to(dtype).cuda()
    return buf[offset:].as_strided((rows, n), (n + pad, 1))


def _run_both(kind, x, r, w, b, dy):
    y, h, mean, rstd = norm_fwd(kind, x, r, w, b, 1e-5, "none", 0.0)
    normed = h if h is not None else x
    dx, dw, db = norm_bwd(kind, dy, None, normed, w, b, mean, rstd, "none", 0.0)
    return [t for t in (y, h, mean, rstd, dx, dw, db) if t is not None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True])
def test_direct_launches_equal_tritons_own(kind, residual):
    from normswap.kernels._direct import _DIRECT

    for dtype in (torch.bfloat16, torch.float32):
        for case_index, (rows, n, offset, pad) in enumerate(GPU_CASES):
            x = _case_tensors(rows, n, offset, pad, dtype, seed=case_index)
            r = _case_tensors(rows, n, offset, pad, dtype, seed=100 + case_index) if residual else None
            dy = torch.randn(rows, n, device="cuda", dtype=dtype)
            w = torch.randn(n, device="cuda", dtype=dtype) * 0.5 + 1
            b = torch.randn(n, device="cuda", dtype=dtype) if kind == "layer" else None
            previous = set_direct_launch(False)
            try:
                want = _run_both(kind, x, r, w, b, dy)
            finally:
                set_direct_launch(previous)
            before = sum(k.direct_launches for k in _DIRECT.values())
            first, second = (_run_both(kind, x, r, w, b, dy) for _ in range(2))
            assert sum(k.direct_launches for k in _DIRECT.values()) > before, "nothing was launched directly"
            for a, c, d in zip(want, first, second, strict=True):
                assert torch.equal(a, c) and torch.equal(a, d), (kind, residual, dtype, rows, n, offset, pad)
