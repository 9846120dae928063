"""Host time of the fused RMSNorm's eager forward + backward with the kernel launches stubbed out (CPU).

    TRITON_INTERPRET=1 python benchmarks/bench_backward_host_cpu.py

On an H100 a fused RMSNorm forward + backward at 1 x 4096 cost ~560 us of host time where its forward
(64 us) and its backward launcher alone (66 us) add up to far less (benchmarks/results/
backward_host_h100.txt). This runs the same Python path (the module, the autograd.Function that skips
the dispatcher, its backward, autograd's engine) on the CPU with ``launch_fwd``/``launch_bwd`` replaced
by functions that only allocate their outputs, so that what remains is our code and the engine's: if it
is small here, the missing time is in the launch itself or in the GPU backward's device thread.
Medians of 5 runs of 2000 calls, one thread, side by side with torch's own ``F.rms_norm`` and an
identity ``autograd.Function``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("run with TRITON_INTERPRET=1 (the kernel route on the CPU needs Triton's interpreter)")

import torch
import torch.nn.functional as F

import normswap.kernels.ops as ops
from normswap.kernels._eager import triton_on_cpu
from normswap.modules.fused import FusedRMSNorm


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    torch.set_num_threads(1)
    n = 4096
    x = torch.randn(1, n, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(n))
    dy = torch.ones(1, n)
    # zeros, not torch.empty: uninitialized memory may hold denormals, whose arithmetic (the gradient
    # accumulation) is slow enough on the CPU to dominate
    y, rstd, dx, dw = torch.zeros(1, n), torch.ones(1), torch.zeros(1, n), torch.zeros(n)
    ops.launch_fwd = lambda *args: (y.clone(), None, None, rstd)  # type: ignore[assignment]
    ops.launch_bwd = lambda *args: (dx.clone(), dw.clone(), None)  # type: ignore[assignment]
    module = FusedRMSNorm(n)
    with triton_on_cpu():
        rows = {
            "normswap fwd (launch stubbed)": _us(lambda: module(x)),
            "normswap fwd+bwd (launches stubbed)": _us(lambda: module(x).backward(dy)),
        }
    rows["identity Function fwd+bwd"] = _us(lambda: _Identity.apply(x).backward(dy))
    rows["F.rms_norm fwd"] = _us(lambda: F.rms_norm(x, (n,), w))
    rows["F.rms_norm fwd+bwd"] = _us(lambda: F.rms_norm(x, (n,), w).backward(dy))
    for name, us in rows.items():
        print(f"{name:38} {us:7.1f} us")


if __name__ == "__main__":
    main()
