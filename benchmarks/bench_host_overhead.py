"""Host time per call of the fused norms, kernels excluded (runs on any machine, no GPU needed).

At a few rows a norm's GPU time is a few microseconds, so what a call costs on the host (argument
checks, the dispatcher, autograd bookkeeping, allocating outputs) is what it costs. This measures that
part on the CPU: the kernels run through the same launcher as on CUDA (``triton_on_cpu`` with
``TRITON_INTERPRET=1``), but every kernel launch is replaced by a no-op, so the figure is everything a
call does except Triton's own launch and the kernel. Two routes are compared side by side, in one run:

    op:    the ``normswap::*_fwd`` custom op, as torch.compile / export see it (the dispatcher, the
           custom-op autograd, then the launcher)
    eager: what a plain eager call takes (an autograd.Function straight to the launcher)

for the forward under no_grad, the forward with autograd recording, and forward + backward, for
RMSNorm, LayerNorm and the fused add + RMSNorm, on one row of 4096 fp32 values. Reported: the median
over repeats of the mean microseconds per call, and eager / op. ``torch.nn.functional`` on the same
tiny input (which does compute, on the CPU) is printed for scale.

    python benchmarks/bench_host_overhead.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

# CPU tensors through the launcher (read per launch, see normswap.kernels._launch.kernel_module)
os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
N = 4096
EPS = 1e-6


class _NoLaunch:
    """Stands for a jit kernel: ``kernel[grid](*args, **meta)`` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _stub_kernels() -> None:
    from normswap.kernels import _launch

    names = (
        "norm_fwd_tile_kernel",
        "norm_fwd_chunked_kernel",
        "norm_bwd_tile_kernel",
        "norm_bwd_row_dots_kernel",
    )
    _launch._KERNEL_MODULES[True] = types.SimpleNamespace(**{name: _NoLaunch() for name in names})


def _us_per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(calls // 10):  # warm up
        fn()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(means)


def _cases() -> dict[str, dict[str, Callable[[], object]]]:
    """{case: {route: zero-argument call}}."""
    from normswap.kernels import add_rms_norm, layer_norm, rms_norm

    ops = torch.ops.normswap
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(1, N, generator=g), torch.randn(1, N, generator=g)
    w, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
    xg, rg, wg, bg = (t.clone().requires_grad_() for t in (x, r, w, b))
    dy = torch.randn(1, N, generator=g)
    numerics = ("none", 0.0)

    def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return fn()

        return call

    def with_backward(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        return lambda: fn().backward(dy)

    return {
        "rms fwd (no_grad)": {
            "op": no_grad(lambda: ops.rms_norm_fwd(x, w, None, EPS, *numerics)[0]),
            "eager": no_grad(lambda: rms_norm(x, w, None, EPS)),
        },
        "rms fwd (autograd)": {
            "op": lambda: ops.rms_norm_fwd(xg, wg, None, EPS, *numerics)[0],
            "eager": lambda: rms_norm(xg, wg, None, EPS),
        },
        "rms fwd+bwd": {
            "op": with_backward(lambda: ops.rms_norm_fwd(xg, wg, None, EPS, *numerics)[0]),
            "eager": with_backward(lambda: rms_norm(xg, wg, None, EPS)),
        },
        "layer fwd+bwd": {
            "op": with_backward(lambda: ops.layer_norm_fwd(xg, wg, bg, EPS, *numerics)[0]),
            "eager": with_backward(lambda: layer_norm(xg, wg, bg, EPS)),
        },
        "add_rms fwd (no_grad)": {
            "op": no_grad(lambda: ops.add_rms_norm_fwd(x, r, w, None, EPS, *numerics)[:2]),
            "eager": no_grad(lambda: add_rms_norm(x, r, w, None, EPS)),
        },
        "add_rms fwd+bwd": {
            "op": with_backward(lambda: ops.add_rms_norm_fwd(xg, rg, wg, None, EPS, *numerics)[0]),
            "eager": with_backward(lambda: add_rms_norm(xg, rg, wg, None, EPS)[0]),
        },
        "torch F.rms_norm fwd (no_grad, computes)": {
            "torch": no_grad(lambda: F.rms_norm(x, (N,), w, EPS)),
        },
    }


def run(calls: int = 2000, repeats: int = 7) -> dict:
    from normswap.kernels import triton_on_cpu

    _stub_kernels()
    records = []
    with triton_on_cpu():
        for case, routes in _cases().items():
            timed = {route: _us_per_call(fn, calls, repeats) for route, fn in routes.items()}
            record = {"case": case, **{f"{route}_us": us for route, us in timed.items()}}
            if "op" in timed:
                record["eager_over_op"] = timed["eager"] / timed["op"]
            records.append(record)
            shown = ", ".join(f"{route} {us:6.1f} us" for route, us in timed.items())
            ratio = f"  (eager/op {record['eager_over_op']:.2f})" if "op" in timed else ""
            print(f"{case:42} {shown}{ratio}")
    return {
        "meta": {
            "what": "host microseconds per call on one row of 4096 fp32, kernel launches replaced by no-ops",
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "timing": f"median over {repeats} repeats of the mean of {calls} calls",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_host_overhead needs triton (the launcher imports it)", file=sys.stderr)
        return 2
    result = run(args.calls, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "host_overhead_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
