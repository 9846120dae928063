"""ONNX Runtime (CPU) latency of ``export --target onnxruntime`` against the standard-op export.

Both files come from the same model in the same run (HF GPT-2 and Llama built from configs, random
weights, fp32) and are timed side by side in onnxruntime on the CPU, with its graph optimizations on
(the default, which fuses norm patterns itself where it recognizes them) and off (what a runtime that
runs the file as written sees: minimal builds, or optimizations disabled). Median of repeated runs
after a warm-up; node counts from the files.

    python benchmarks/bench_onnx_ort.py [--seq 128] [--tag cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _models(layers: int) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=8192, use_cache=False)
    ).eval()
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=layers,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=8192,
            use_cache=False,
        )
    ).eval()
    return {"gpt2": gpt2, "llama": llama}


def _median_ms(session, feeds: dict, repeats: int) -> float:
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="cpu", help="output file onnx_ort_TAG.json")
    args = p.parse_args(argv)

    import onnxruntime as ort
    import torch

    from normswap.export.onnx import export_onnx

    rows = []
    folder = Path(tempfile.mkdtemp())
    for name, model in _models(args.layers).items():
        kwargs = {"input_ids": torch.randint(0, 8192, (args.batch, args.seq)), "use_cache": False}
        feeds = {"input_ids": kwargs["input_ids"].numpy()}
        exports = {}
        for target in ("standard", "onnxruntime"):
            path = folder / f"{name}_{target}.onnx"
            exports[target] = (path, export_onnx(model, path, (), kwargs, target=target))
        for level in ("ORT_ENABLE_ALL", "ORT_DISABLE_ALL"):
            options = ort.SessionOptions()
            options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
            options.intra_op_num_threads = 2
            sessions = {
                t: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                for t, (path, _) in exports.items()
            }
            # alternate the two files so that drift in the machine hits both alike
            timed: dict[str, list[float]] = {t: [] for t in sessions}
            for _ in range(3):
                for t, session in sessions.items():
                    timed[t].append(_median_ms(session, feeds, args.repeats))
            for t, (_, result) in exports.items():
                row = {
                    "model": name,
                    "target": t,
                    "optimizations": level,
                    "median_ms": statistics.median(timed[t]),
                    "nodes": sum(result.op_counts.values()),
                    "fused": result.onnxruntime_fusion.get("fused", {}),
                    "max_rel_vs_pytorch": max(o.max_rel for o in result.outputs),
                }
                rows.append(row)
                print(
                    f"{name:6} {t:12} {level:16} {row['median_ms']:8.2f} ms  {row['nodes']:5} nodes  {row['fused']}",
                    flush=True,
                )
    result = {
        "meta": {
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "onnxruntime": ort.__version__,
            "torch": torch.__version__,
            "layers": args.layers,
            "batch": args.batch,
            "seq": args.seq,
            "timing": f"median of 3 alternating medians of {args.repeats} runs, 2 threads",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"onnx_ort_{args.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
