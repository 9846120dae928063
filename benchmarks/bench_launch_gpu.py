"""Host time of one eager fused-norm call on a GPU: Triton's own launch against the direct launch
(normswap.kernels._direct), and the converted modules against the modules they replace (CUDA).

At one row a norm's kernel takes a few microseconds, so the wall time of a loop of calls is the host's.
Every case is timed with the direct launch on and off, interleaved in one run (median over repeats of
the mean of a loop of calls, the GPU synchronized at the loop's ends). Rows of 4096 bf16 values; the
kernel route is forced where the case names it. Also: where the time of one call goes (cProfile of
the kernel route with direct launches on), so the next cut is found from a measurement.

    python benchmarks/bench_launch_gpu.py --out gpu_out/launch.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

N = 4096
EPS = 1e-6


def _us_per_call(fn: Callable[[], object], calls: int) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _fused_like_convert(norm, x):
    """``norm`` as ``--to fused`` rewrites it (the FuseNorm pass on a one-module model)."""
    import torch

    from normswap.passes import FuseNorm, Pipeline

    converted, report = Pipeline([FuseNorm()])(torch.nn.Sequential(norm), (x,))
    if not report.ok or not any(p.changes for p in report.passes):
        raise SystemExit(f"FuseNorm did not rewrite {type(norm).__name__}: {report}")
    return converted


def _cases() -> dict[str, tuple[str | None, Callable[[], object]]]:
    """{case: (forced route or None, zero-argument call)}."""
    import torch
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from normswap.kernels import add_rms_norm, layer_norm, rms_norm
    from normswap.modules.fused import FusedLayerNorm

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, N, device=dev, dtype=dt)
    r = torch.randn(1, N, device=dev, dtype=dt)
    w = torch.randn(N, device=dev, dtype=dt)
    b = torch.randn(N, device=dev, dtype=dt)
    xg, rg, wg, bg = (t.clone().requires_grad_() for t in (x, r, w, b))
    dy = torch.randn(1, N, device=dev, dtype=dt)
    ln = torch.nn.LayerNorm(N, device=dev, dtype=dt)
    fused_ln = FusedLayerNorm.from_module(ln)
    llama = LlamaRMSNorm(N, eps=EPS).to(dev, dt)
    fused_llama = _fused_like_convert(llama, x)[0]  # the module itself, as in a model

    def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return fn()

        return call

    return {
        "F.rms_norm fwd": (None, no_grad(lambda: F.rms_norm(x, (N,), w, EPS))),
        "F.layer_norm fwd": (None, no_grad(lambda: F.layer_norm(x, (N,), w, b, EPS))),
        "rms_norm fwd, kernel": ("triton", no_grad(lambda: rms_norm(x, w, None, EPS))),
        "layer_norm fwd, kernel": ("triton", no_grad(lambda: layer_norm(x, w, b, EPS))),
        "add_rms_norm fwd, kernel": ("triton", no_grad(lambda: add_rms_norm(x, r, w, None, EPS))),
        "F.rms_norm fwd+bwd": (None, lambda: F.rms_norm(xg, (N,), wg, EPS).backward(dy)),
        "F.layer_norm fwd+bwd": (None, lambda: F.layer_norm(xg, (N,), wg, bg, EPS).backward(dy)),
        "rms_norm fwd+bwd, kernel": ("triton", lambda: rms_norm(xg, wg, None, EPS).backward(dy)),
        "layer_norm fwd+bwd, kernel": ("triton", lambda: layer_norm(xg, wg, bg, EPS).backward(dy)),
        "add_rms_norm fwd+bwd, kernel": (
            "triton",
            lambda: add_rms_norm(xg, rg, wg, None, EPS)[0].backward(dy),
        ),
        "nn.LayerNorm module": (None, no_grad(lambda: ln(x))),
        "FusedLayerNorm module, routed": (None, no_grad(lambda: fused_ln(x))),
        "FusedLayerNorm module, kernel": ("triton", no_grad(lambda: fused_ln(x))),
        "LlamaRMSNorm module": (None, no_grad(lambda: llama(x))),
        "FusedRMSNorm (llama) module, routed": (None, no_grad(lambda: fused_llama(x))),
        "FusedRMSNorm (llama) module, kernel": ("triton", no_grad(lambda: fused_llama(x))),
    }


def run(calls: int, repeats: int) -> dict:
    import contextlib

    import torch

    from normswap.kernels import kernel_route
    from normswap.kernels._direct import set_direct_launch

    records = []
    for case, (route, fn) in _cases().items():
        forced = kernel_route(route) if route else contextlib.nullcontext()
        # A backward costs several times a forward: fewer calls keep every loop near the same length.
        case_calls = calls // 4 if "bwd" in case else calls
        samples: dict[str, list[float]] = {"direct": [], "triton": []}
        with forced:
            for mode in ("direct", "triton"):  # warm both (compiles, caches, plans)
                set_direct_launch(mode == "direct")
                _us_per_call(fn, case_calls // 4)
            for _ in range(repeats):
                for mode in ("direct", "triton"):
                    set_direct_launch(mode == "direct")
                    samples[mode].append(_us_per_call(fn, case_calls))
        set_direct_launch(True)
        record = {"case": case, **{f"{m}_us": statistics.median(v) for m, v in samples.items()}}
        records.append(record)
        print(f"{case:40} direct {record['direct_us']:7.1f} us   triton launch {record['triton_us']:7.1f} us")

    profile_text = io.StringIO()
    with kernel_route("triton"), torch.no_grad():
        from normswap.kernels import rms_norm

        x = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            rms_norm(x, w, None, EPS)
        profiler.disable()
    pstats.Stats(profiler, stream=profile_text).sort_stats("tottime").print_stats(18)
    print(profile_text.getvalue()[-4000:])
    return {
        "meta": {
            "what": f"host microseconds per eager call, one row of {N} bf16 values; direct launch on/off interleaved",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "python": platform.python_version(),
            "timing": f"median over {repeats} repeats of the mean of {calls} calls ({calls // 4} with a backward), synchronized at the ends",
            "command": "python benchmarks/bench_launch_gpu.py " + " ".join(sys.argv[1:]),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "records": records,
        "profile_kernel_route_rms_fwd": profile_text.getvalue()[-6000:],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_launch_gpu needs a CUDA device", file=sys.stderr)
        return 2
    result = run(args.calls, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
