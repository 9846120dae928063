"""Where a converted model's extra time goes, per norm call (CUDA; issue 27's diagnosis).

    python benchmarks/diag_model_host_gpu.py --out DIR

The H200 whole-model run (benchmarks/results/models_fused_h200.json of 2026-11-26) put a converted
GPT-2's prefill at 0.85x its original: 0.87 ms more per forward over 25 norm calls, ~35 µs a call, where
a fused call on torch's route adds ~3 µs to ``F.layer_norm`` in a loop on a CPU. This builds the same
GPT-2 (bf16, random weights), converts it with the FuseNorm pass, and in one process:

- times a prefill (batch 1, seq 512, no grad) of the original, the converted model, and the converted
  model with every fused module's forward replaced by a bare ``F.layer_norm`` (what is left is not the
  route's wrapper), interleaved, in three orders, and with the garbage collector off;
- times each norm call inside the model (the original's ``nn.LayerNorm``, the converted ``FusedLayerNorm``);
- profiles one prefill of each (GPU busy time, kernel launches and their CPU time, the top operators).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
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
    ids = torch.randint(0, config.vocab_size, (1, 512), device=next(model.parameters()).device)

    def prefill(m: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return m(ids, use_cache=False).logits

        return run

    results: dict[str, object] = {}
    variants = {
        "original": prefill(model),
        "converted": prefill(converted),
        "converted, bare F.layer_norm": prefill(thin),
    }
    # each order of the three: a variant's place in the interleaving must not decide its time
    for order in (
        ("original", "converted", "converted, bare F.layer_norm"),
        ("converted, bare F.layer_norm", "converted", "original"),
        ("converted", "original", "converted, bare F.layer_norm"),
    ):
        ms = bench._interleaved_ms({name: variants[name] for name in order})
        results[f"prefill b1 s512 ms, order {' / '.join(order)}"] = ms
        for name in order:
            print(
                f"prefill b1 s512 {name:30} {ms[name]:7.3f} ms ({ms['original'] / ms[name]:.3f}x)", flush=True
            )
        print("---")

    gc.disable()
    ms = bench._interleaved_ms({"original": variants["original"], "converted": variants["converted"]})
    gc.enable()
    results["prefill b1 s512 ms, gc disabled"] = ms
    print(f"gc disabled: original {ms['original']:.3f} ms, converted {ms['converted']:.3f} ms", flush=True)

    # host time of each norm call inside the model, and of the whole call (no sync inside the loop)
    for name, m, cls in (("original", model, torch.nn.LayerNorm), ("converted", converted, FusedLayerNorm)):
        spent: list[int] = []
        for module in m.modules():
            if type(module) is cls:

                def timed(x, _forward=module.forward, _spent=spent):
                    start = time.perf_counter_ns()
                    out = _forward(x)
                    _spent.append(time.perf_counter_ns() - start)
                    return out

                module.forward = timed
        run = variants[name]
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        spent.clear()
        start = time.perf_counter()
        for _ in range(50):
            run()
        host_ms = (time.perf_counter() - start) / 50 * 1e3
        torch.cuda.synchronize()
        per_call = statistics.median(spent) / 1e3
        for module in m.modules():
            if type(module) is cls:
                del module.forward
        results[f"{name}: norm call inside the model, host us (median)"] = per_call
        results[f"{name}: prefill host ms (no sync)"] = host_ms
        print(
            f"{name:10} norm call in the model {per_call:6.1f} us (p90 {sorted(spent)[int(0.9 * len(spent))] / 1e3:6.1f}); "
            f"prefill issued in {host_ms:6.3f} ms",
            flush=True,
        )

    from torch.profiler import ProfilerActivity, profile

    for name in ("original", "converted"):
        run = variants[name]
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events) / 3
        launches = (
            sum(
                e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel")
            )
            / 3
        )
        launch_us = (
            sum(
                e.self_cpu_time_total
                for e in events
                if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel")
            )
            / 3
        )
        results[f"{name}: profiled prefill"] = {
            "gpu_us": gpu_us,
            "launches": launches,
            "launch_cpu_us": launch_us,
        }
        print(
            f"{name:10} profiled prefill: GPU busy {gpu_us:7.0f} us, {launches:.0f} launches taking {launch_us:6.0f} us of CPU",
            flush=True,
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=45))

    (args.out / "model_host.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
