"""Where the host time of an eager fused backward goes at one row (CUDA; issue 27's diagnosis).

    python benchmarks/diag_backward_host_gpu.py --out DIR

On an H100 a fused RMSNorm forward + backward at 1 x 4096 bf16 cost ~560 µs of host time where its
forward (64 µs) and its backward launcher alone (66 µs) add up to far less; on the CPU the same Python
path with the launches stubbed costs 45 µs (benchmarks/results/backward_host_cpu.txt). This times the
backward's parts in the context autograd runs them in against the same calls alone, wall clock per call
(medians of 5 loops, autograd multithreading off so everything runs on this thread), and writes
torch.profiler traces of both (CPU + CUDA activity) for reading offline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import normswap.kernels.ops as ops
from normswap.kernels import kernel_route, rms_norm
from normswap.kernels._direct import _DIRECT
from normswap.kernels._launch import launch_bwd, launch_fwd


def host_us(fn: Callable[[], object], calls: int = 400) -> float:
    """Median over 5 loops of the wall microseconds per call, the GPU synchronized around each loop."""
    for _ in range(max(50, calls // 10)):
        fn()
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


class _Timed:
    """Wall time of every call of a function, by the context it was called in."""

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn
        self.times: dict[str, list[float]] = defaultdict(list)
        self.context = "alone"

    def __call__(self, *args: object) -> object:
        start = time.perf_counter_ns()
        out = self.fn(*args)
        self.times[self.context].append((time.perf_counter_ns() - start) / 1e3)
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=4096)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    n = args.n
    torch.autograd.set_multithreading_enabled(False)
    x = torch.randn(1, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    xd, wd = x.detach(), w.detach()
    _, _, _, rstd = launch_fwd("rms", xd, None, wd, None, 1e-6, "none", 0.0)
    results: dict[str, float] = {}

    with kernel_route("triton"):
        y_kept = rms_norm(x, w, None, 1e-6)
        cases: dict[str, Callable[[], object]] = {
            "F.rms_norm fwd+bwd": lambda: F.rms_norm(x, (n,), w, 1e-6).backward(dy),
            "normswap fwd (recording)": lambda: rms_norm(x, w, None, 1e-6),
            "normswap fwd+bwd": lambda: rms_norm(x, w, None, 1e-6).backward(dy),
            # no gradient accumulation into .grad
            "normswap fwd+grad()": lambda: torch.autograd.grad(rms_norm(x, w, None, 1e-6), (x, w), dy),
            # the backward alone, the graph kept
            "normswap bwd alone (retain_graph)": lambda: torch.autograd.grad(
                y_kept, (x, w), dy, retain_graph=True
            ),
            "launch_bwd alone": lambda: launch_bwd("rms", dy, None, xd, wd, None, None, rstd, "none", 0.0),
            "launch_fwd alone": lambda: launch_fwd("rms", xd, None, wd, None, 1e-6, "none", 0.0),
            "torch.empty x4 + sum + to": lambda: (
                torch.empty((1, n), dtype=torch.bfloat16, device="cuda"),
                torch.empty((1, n), dtype=torch.float32, device="cuda").sum(0).to(torch.bfloat16),
                rstd.reshape(1).float().contiguous(),
            ),
        }
        for name, fn in cases.items():
            results[name] = host_us(fn)
            print(f"{name:36} {results[name]:8.1f} us", flush=True)

        # launch_bwd timed where autograd calls it and alone, same process, same tensors
        timed = _Timed(ops.launch_bwd)
        ops.launch_bwd = timed  # type: ignore[assignment]
        timed.context = "in autograd"
        for _ in range(300):
            rms_norm(x, w, None, 1e-6).backward(dy)
        torch.cuda.synchronize()
        timed.context = "alone"
        for _ in range(300):
            timed("rms", dy, None, xd, wd, None, None, rstd, "none", 0.0)
        torch.cuda.synchronize()
        ops.launch_bwd = timed.fn  # type: ignore[assignment]
        for context, values in timed.times.items():
            results[f"launch_bwd wall, {context}"] = statistics.median(values[50:])
            print(
                f"launch_bwd wall per call, {context:12} median {statistics.median(values[50:]):7.1f} us "
                f"p90 {sorted(values[50:])[int(0.9 * len(values[50:]))]:7.1f}",
                flush=True,
            )

        for kernel in _DIRECT.values():
            name = getattr(kernel.kernel, "__name__", repr(kernel.kernel))
            print(f"{name:32} launches {kernel.launches:7} direct {kernel.direct_launches:7}")

        from torch.profiler import ProfilerActivity, profile

        for label, fn in (
            ("autograd", lambda: rms_norm(x, w, None, 1e-6).backward(dy)),
            ("alone", lambda: launch_bwd("rms", dy, None, xd, wd, None, None, rstd, "none", 0.0)),
        ):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(args.out / f"bwd_trace_{label}.json"))
            print(f"--- profile: {label} (20 calls)")
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50
                )
            )
    (args.out / "bwd_host.json").write_text(
        json.dumps({"n": n, "device": torch.cuda.get_device_name(), "us": results}, indent=1)
    )


if __name__ == "__main__":
    main()
