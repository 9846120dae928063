"""What Pre-CRMSNorm (``--to crmsnorm``) saves and costs: parameters, matmul FLOPs and CPU latency of the
original model, its Pre-RMSNorm form (``--to rmsnorm --exact``) and its Pre-CRMSNorm form, in one run.

    python benchmarks/bench_crmsnorm.py [--models gpt2,opt,vit] [--repeats 30] [--out benchmarks/results]

Models are built from the standard configs of GPT-2 small, OPT-125m and ViT-B/16 (random weights: the
figures do not depend on them), fp32, batch 1 (128 tokens; one 224 x 224 image). FLOPs are counted by
``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions; elementwise ops such as the
norms' sums are not counted by it, so the norms' extra work is stated separately). Latency: median of
``--repeats`` calls after 3 warm-up calls, the three forms interleaved call by call. The largest relative
difference of each converted model's output from the original's is recorded.
Results: ``benchmarks/results/crmsnorm_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

import normswap

RESULTS = Path(__file__).resolve().parent / "results"


def _model(name: str) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        return model.eval(), (torch.randint(0, 50257, (1, 128)),), {"use_cache": False}
    if name == "opt":
        config = transformers.OPTConfig(
            hidden_size=768,
            num_hidden_layers=12,
            ffn_dim=3072,
            num_attention_heads=12,
            word_embed_proj_dim=768,
        )
        return (
            transformers.OPTForCausalLM(config).eval(),
            (torch.randint(0, 50272, (1, 128)),),
            {"use_cache": False},
        )
    if name == "vit":
        model = transformers.ViTForImageClassification(transformers.ViTConfig(num_labels=1000))
        return model.eval(), (torch.randn(1, 3, 224, 224),), {}
    raise SystemExit(f"unknown model {name}")


def _main_output(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def _flops(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(*args, **kwargs)
    return counter.get_total_flops()


def _measure(name: str, repeats: int) -> dict[str, Any]:
    model, args, kwargs = _model(name)
    forms: dict[str, torch.nn.Module] = {"original": model}
    conversions = {}
    for label, to in (("pre_rmsnorm", "rmsnorm"), ("pre_crmsnorm", "crmsnorm")):
        start = time.perf_counter()
        result = normswap.convert(model, normswap.ConvertConfig(to=to, exact=True), args, kwargs)
        conversions[label] = {"seconds": time.perf_counter() - start, "ok": result.ok}
        if not result.ok:
            raise SystemExit(f"{name} --to {to}: {result.refusal}")
        forms[label] = result.model
    with torch.no_grad():
        reference = _main_output(model(*args, **kwargs))
        for label in ("pre_rmsnorm", "pre_crmsnorm"):
            out = _main_output(forms[label](*args, **kwargs))
            conversions[label]["max_rel_difference"] = (
                (out - reference).abs().max() / reference.abs().max()
            ).item()
        times: dict[str, list[float]] = {label: [] for label in forms}
        for i in range(repeats + 3):
            for label, form in forms.items():
                start = time.perf_counter()
                form(*args, **kwargs)
                if i >= 3:
                    times[label].append(time.perf_counter() - start)
    record = {}
    for label, form in forms.items():
        record[label] = {
            "parameters": sum(p.numel() for p in form.parameters()),
            "flops": _flops(form, args, kwargs),
            "median_ms": 1000 * statistics.median(times[label]),
            **conversions.get(label, {}),
        }
    hidden = model.config.hidden_size
    norms = sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    tokens = args[0].shape[0] * (args[0].shape[1] if args[0].ndim == 2 else 197)
    record["norm_extra_elementwise"] = {
        "what": "per norm and token: a sum over d-1 values and a copy of d values (the concatenation)",
        "norms": norms,
        "tokens": tokens,
        "total_ops": norms * tokens * (2 * hidden - 1),
    }
    record["hidden"] = hidden
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,opt,vit")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results = {}
    for name in args.models.split(","):
        results[name] = _measure(name, args.repeats)
        r = results[name]
        print(
            f"{name}: parameters {r['original']['parameters']:,} / {r['pre_rmsnorm']['parameters']:,} / "
            f"{r['pre_crmsnorm']['parameters']:,}; GFLOPs {r['original']['flops'] / 1e9:.4f} / "
            f"{r['pre_rmsnorm']['flops'] / 1e9:.4f} / {r['pre_crmsnorm']['flops'] / 1e9:.4f}; median ms "
            f"{r['original']['median_ms']:.1f} / {r['pre_rmsnorm']['median_ms']:.1f} / "
            f"{r['pre_crmsnorm']['median_ms']:.1f}",
            flush=True,
        )
    payload = {
        "command": "python benchmarks/bench_crmsnorm.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "crmsnorm_cpu.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
