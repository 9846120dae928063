"""Python and C function calls per eager call of a fused norm (CPU; deterministic, unlike host timings).

    python benchmarks/count_host_calls.py [--out benchmarks/results]

Inside a model a norm's host time is mostly the calls it makes: on an H200 host a fused LayerNorm on
torch's route took 60 µs a call inside GPT-2 against ``nn.LayerNorm``'s 29, where a tight loop of the
same call showed 20 against 14 (benchmarks/results/model_host_h200_before.txt), because between other
layers' code every call runs cold. Timings on this project's shared CPU machine vary by more than what
a change saves, so this counts what a call does instead: every Python function entered and every C
function called (``sys.setprofile``), for the modules users get from ``--to fused`` against torch's
own, on torch's route and on the kernel route (kernel launches replaced by no-ops, as in
bench_host_overhead.py), without and with autograd recording, forward and backward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors through the launcher (kernel launches stubbed below)

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
N = 768


def count_calls(fn: Callable[[], object]) -> int:
    """Python functions entered plus C functions called by one ``fn()`` (after a first, warming call)."""
    fn()
    calls = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls - 1  # setprofile(None) itself


def _cases() -> dict[str, Callable[[], object]]:
    from normswap.modules.fused import FusedLayerNorm, FusedRMSNorm

    torch.manual_seed(0)
    layer_norm, rms_norm = nn.LayerNorm(N), nn.RMSNorm(N)
    fused_layer, fused_rms = FusedLayerNorm.from_module(layer_norm), FusedRMSNorm.from_module(rms_norm)
    x = torch.randn(1, 4, N)
    xg = x.clone().requires_grad_()
    dy = torch.randn(1, 4, N)

    def no_grad(module: nn.Module) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return module(x)

        return call

    return {
        "nn.LayerNorm, no grad": no_grad(layer_norm),
        "FusedLayerNorm, no grad": no_grad(fused_layer),
        "nn.RMSNorm, no grad": no_grad(rms_norm),
        "FusedRMSNorm, no grad": no_grad(fused_rms),
        "nn.LayerNorm, forward recording": lambda: layer_norm(xg),
        "FusedLayerNorm, forward recording": lambda: fused_layer(xg),
        "nn.LayerNorm, forward + backward": lambda: layer_norm(xg).backward(dy),
        "FusedLayerNorm, forward + backward": lambda: fused_layer(xg).backward(dy),
    }


def run() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_host_overhead import _stub_kernels

    from normswap.kernels import kernel_route, triton_on_cpu

    _stub_kernels()
    records = []
    with triton_on_cpu():
        for case, fn in _cases().items():
            record: dict[str, object] = {"case": case}
            for route in ("torch", "triton"):
                with kernel_route(route):
                    record[f"{route}_route_calls"] = count_calls(fn)
            records.append(record)
    return {
        "meta": {
            "what": f"Python functions entered + C functions called per eager call, one row of 1 x 4 x {N} fp32",
            "note": "torch's own modules take no route: both columns are the same call",
            "kernel_route": "kernel launches replaced by no-ops (the Triton interpreter's own calls not counted)",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "records": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run()
    for r in result["records"]:
        print(
            f"{r['case']:38} torch route {r['torch_route_calls']:5}   kernel route {r['triton_route_calls']:5}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "host_calls_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
