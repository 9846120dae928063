"""What each exact rewrite costs the model it rewrites: stored values and bytes, and operators per forward.

    python benchmarks/bench_rewrite_cost.py [--out benchmarks/results]

Standard configs with random weights (the figures do not depend on them), fp32: GPT-2 small (tied
embeddings) and a 1B-class Llama shape reduced to 2 layers, timm's ViT-S/16 with LayerScale, and
torchvision's ResNet-50. For each exact rewrite that applies, in one run: the conversion's own size
figures (``ConversionResult.size``: the tensors the model stores, each once) and its operators of one
forward (``ConversionResult.operators``: the ops torch dispatches on the example, on this CPU, by name),
with what the rewrite added and removed. Results:
``benchmarks/results/rewrite_cost_cpu.json``; the table in docs/benchmarks.md comes from it.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import normswap

RESULTS = Path(__file__).resolve().parent / "results"


def _gpt2() -> tuple[torch.nn.Module, tuple, dict]:
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    return model, (torch.randint(0, 50257, (1, 128)),), {"use_cache": False}


def _llama() -> tuple[torch.nn.Module, tuple, dict]:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000,
    )  # fmt: skip
    return (
        transformers.LlamaForCausalLM(config).eval(),
        (torch.randint(0, 32000, (1, 128)),),
        {"use_cache": False},
    )


def _vit() -> tuple[torch.nn.Module, tuple, dict]:
    import timm

    model = timm.create_model("vit_small_patch16_224", pretrained=False, init_values=1e-5).eval()
    return model, (torch.randn(1, 3, 224, 224),), {}


def _resnet() -> tuple[torch.nn.Module, tuple, dict]:
    import torchvision

    return torchvision.models.resnet50().eval(), (torch.randn(1, 3, 224, 224),), {}


CASES: list[tuple[str, Any, dict[str, Any]]] = [
    ("GPT-2 small", _gpt2, {"to": "rmsnorm", "exact": True}),
    ("GPT-2 small", _gpt2, {"to": "crmsnorm", "exact": True}),
    ("GPT-2 small", _gpt2, {"fold_norm_affine": True}),
    ("Llama (d 2048, 2 layers)", _llama, {"fold_norm_affine": True}),
    ("Llama (d 2048, 2 layers)", _llama, {"defer_rms": True}),
    ("ViT-S/16, LayerScale", _vit, {"fold_layerscale": True}),
    ("ViT-S/16, LayerScale", _vit, {"to": "rmsnorm", "exact": True}),
    ("ResNet-50", _resnet, {"fold_bn": True}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    options = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, build, rewrite in CASES:
        model, args, kwargs = build()
        result = normswap.convert(model, normswap.ConvertConfig(**rewrite), args, kwargs)
        assert result.ok and result.size is not None, result.refusal
        assert result.operators is not None  # the conversion's own count (normswap.verify.operators)
        before_ops, after_ops = Counter(result.operators.before), Counter(result.operators.after)
        added, removed = after_ops - before_ops, before_ops - after_ops
        before, after = result.size
        row = {
            "model": name,
            "rewrite": " ".join(result.config.rewrites()),
            "changes": result.changes,
            "values": [before.values, after.values],
            "bytes": [before.bytes, after.bytes],
            "ops": [sum(before_ops.values()), sum(after_ops.values())],
            "ops_added": dict(sorted(added.items())),
            "ops_removed": dict(sorted(removed.items())),
        }
        rows.append(row)
        print(
            f"{name} {row['rewrite']}: values {before.values:,} -> {after.values:,}; ops {row['ops'][0]} -> "
            f"{row['ops'][1]} (+{dict(added)} -{dict(removed)})",
            flush=True,
        )
    machine = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor()}
    out = options.out / "rewrite_cost_cpu.json"
    out.write_text(
        json.dumps(
            {"command": "python benchmarks/bench_rewrite_cost.py", "machine": machine, "rows": rows}, indent=2
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
