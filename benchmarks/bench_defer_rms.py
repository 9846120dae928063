"""CPU forward time of ``--defer-rms`` (FlashNorm) against the folded model it starts from, same run.

A Llama built from a config (fp32, random weights, norm weights drawn around 1) is converted twice with
normswap's passes: ``FoldNormAffine`` (the norms' weights moved into their readers) and
``FoldNormAffine`` + ``DeferRMS`` (then each RMS scale applied after the matmuls). The deferred model
is an exported GraphModule, so the folded model is timed both as the module and exported the same
way: the difference between those two is the GraphModule's, not the rewrite's. Median of repeated
forwards after a warm-up, the three variants alternated, at sequence length 1 (one decoding step
without a cache) and 512.

    python benchmarks/bench_defer_rms.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", nargs="+", type=int, default=[1, 512])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    import torch
    import transformers

    from normswap.passes import DeferRMS, FoldNormAffine, Pipeline

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 256,
        vocab_size=4096,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
    example = (torch.randint(0, 4096, (1, 16)),)
    kwargs = {"use_cache": False}
    folded, _ = Pipeline([FoldNormAffine()])(model, example, kwargs)
    deferred, report = Pipeline([FoldNormAffine(), DeferRMS()])(model, example, kwargs)
    changed = len(report.passes[1].changes)
    dims = {"input_ids": {1: torch.export.Dim("seq", min=1, max=4096)}}
    exported = torch.export.export(
        folded, example, kwargs, dynamic_shapes={**dims, "use_cache": None}
    ).module()
    variants = {"folded": folded, "folded, exported": exported, "deferred (exported)": deferred}
    rows = []
    with torch.no_grad():
        for seq in args.seq:
            ids = torch.randint(0, 4096, (1, seq))
            want = folded(ids, use_cache=False).logits
            times: dict[str, list[float]] = {name: [] for name in variants}
            diffs = {}
            for name, m in variants.items():
                got = m(ids, use_cache=False).logits
                diffs[name] = float((got - want).abs().max() / want.abs().max())
            for _ in range(args.repeats):
                for name, m in variants.items():
                    start = time.perf_counter()
                    m(ids, use_cache=False)
                    times[name].append((time.perf_counter() - start) * 1e3)
            for name in variants:
                row = {"seq": seq, "variant": name, "median_ms": statistics.median(times[name])}
                row["max_rel_vs_folded"] = diffs[name]
                rows.append(row)
                print(
                    f"seq {seq:<4} {name:20} {row['median_ms']:8.2f} ms  max rel vs folded {diffs[name]:.1e}"
                )
    result = {
        "meta": {
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
            "torch": torch.__version__,
            "model": f"Llama, {args.layers} layers, hidden {args.hidden}, fp32",
            "deferred_norms": changed,
            "timing": f"median of {args.repeats} alternated forwards after a warm-up",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "defer_rms_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
