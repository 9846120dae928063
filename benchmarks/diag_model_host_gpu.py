"""Where a converted model's extra time goes, per norm call (CUDA; issue 27's diagnosis).

    python benchmarks/diag_model_host_gpu.py --out DIR

The H200 whole-model run (benchmarks/results/models_fused_h200.json) put a converted GPT-2's prefill at
0.85x its original: 0.87 ms more per forward over 25 norm calls, ~35 µs a call, where a fused call on
torch's route adds ~3 µs to ``F.layer_norm`` on a CPU. This builds the same GPT-2 (bf16, random
weights), converts it with the FuseNorm pass, and in one process:

- times a prefill (batch 1, seq 512, no grad) of the original, the converted model, and the converted
  model with every fused module's forward replaced by a bare ``F.layer_norm`` (what is left is not the
  route's wrapper), the three interleaved;
- times one norm module alone at the prefill's shape: ``nn.LayerNorm`` against ``FusedLayerNorm``;
- counts the operators and CUDA runtime calls of one prefill of each model (torch.profiler) and prints
  those whose counts differ;
- profiles 20 prefills of the converted model with cProfile (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_models_fused", HERE / "bench_models_fused.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _host_us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(200):
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


def _op_counts(fn: Callable[[], object]) -> Counter:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return Counter({e.key: e.count for e in prof.key_averages()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bench = _bench_module()
    from normswap.modules.fused import FusedLayerNorm

    model, config = bench._build("gpt2")
    converted, _ = bench._convert(model)
    thin, _ = bench._convert(model)
    for module in thin.modules():
        if isinstance(module, FusedLayerNorm):
            module.forward = lambda x, m=module: F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
    ids = torch.randint(0, config.vocab_size, (1, 512), device="cuda")

    def prefill(m: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return m(ids, use_cache=False).logits

        return run

    results: dict[str, object] = {}
    ms = bench._interleaved_ms(
        {
            "original": prefill(model),
            "converted": prefill(converted),
            "converted, bare F.layer_norm": prefill(thin),
        }
    )
    results["prefill b1 s512 ms"] = ms
    for name, value in ms.items():
        print(f"prefill b1 s512 {name:30} {value:7.3f} ms ({ms['original'] / value:.3f}x)", flush=True)

    ln = model.transformer.h[0].ln_1
    fused = converted.transformer.h[0].ln_1
    x = torch.randn(1, 512, config.n_embd, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        per_call = {
            "nn.LayerNorm module": _host_us(lambda: ln(x)),
            "FusedLayerNorm module": _host_us(lambda: fused(x)),
            "F.layer_norm": _host_us(
                lambda: F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
            ),
        }
    results["one norm call, host us"] = per_call
    for name, value in per_call.items():
        print(f"one call at 1x512x768 bf16, no grad: {name:24} {value:6.1f} us", flush=True)

    original_ops, converted_ops = _op_counts(prefill(model)), _op_counts(prefill(converted))
    differ = {
        k: (original_ops.get(k, 0), converted_ops.get(k, 0))
        for k in sorted(set(original_ops) | set(converted_ops))
        if original_ops.get(k, 0) != converted_ops.get(k, 0)
    }
    results["op counts that differ (original, converted)"] = differ
    print("operators and runtime calls whose counts differ in one prefill (original, converted):")
    for k, (a, b) in differ.items():
        print(f"  {k[:70]:70} {a:5} {b:5}")

    run = prefill(converted)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    (args.out / "model_host.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
