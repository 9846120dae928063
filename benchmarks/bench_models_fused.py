"""Whole models as users run them, original against ``--to fused``, side by side in one process (CUDA).

Models built from configs with random weights (norm weights drawn around 1), bf16: GPT-2 small (124M),
GPT-2 medium (355M) and a 1.1B Llama (TinyLlama's shape). Each is converted with normswap's FuseNorm
pass (the user's module kept, its norms swapped for fused modules: what ``--to fused`` does), and timed
as three variants in the same run:

    original              the model as built
    converted             the fused modules, each eager call on its measured route (kernel or torch)
    converted kernel-only the fused modules forced onto the Triton kernel (the route before routing)

Rows: prefill (forward, no grad, batch 1, seq 512 and 2048, or GPT-2's 1024), decode (one token with a KV cache of 512,
batch 1 and 32; the cache is cropped back after each step) and a training step (forward, cross entropy,
backward, fused AdamW). Timing: CUDA events around a loop of calls; the variants' loops interleaved, 9
rounds, the median of each. Eager only (a
compiled run is future work: see the README). Route rules come from the built-in table or from
``NORMSWAP_ROUTE_RULES`` (a tuner's output), which the JSON records.

    python benchmarks/bench_models_fused.py --out gpu_out/models.json [--models gpt2 llama]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

MODELS = ("gpt2", "gpt2-medium", "llama")


def _calls_for(fn: Callable[[], object], min_loop_ms: float = 20.0) -> int:
    """How many back-to-back calls make a loop long enough to time (after a warm-up call)."""
    import torch

    fn()
    torch.cuda.synchronize()
    calls = 1
    while calls < 256 and _loop_ms(fn, calls) * calls < min_loop_ms:
        calls *= 2
    return calls


def _loop_ms(fn: Callable[[], object], calls: int) -> float:
    """Milliseconds per call of one loop of ``calls`` calls, by CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int = 9) -> dict[str, float]:
    """Median ms per call of each function, their loops interleaved (A B C A B C ...) so that drift of
    the clocks or the host over the run falls on every variant alike."""
    calls = {name: _calls_for(fn) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_loop_ms(fn, calls[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


def _build(name: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name.startswith("gpt2"):
        config = GPT2Config() if name == "gpt2" else GPT2Config(n_embd=1024, n_layer=24, n_head=16)
        cls = GPT2LMHeadModel
    else:
        config = LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=4096,
        )
        cls = LlamaForCausalLM
    with torch.device("cuda"):
        model = cls(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or ".ln_" in pname:
                p.normal_(1.0, 0.2) if pname.endswith("weight") else p.normal_(0.0, 0.2)
    return model.to(torch.bfloat16).eval(), config


def _convert(model):
    import copy

    import torch

    from normswap.passes import FuseNorm, Pipeline

    example = torch.randint(0, 1000, (2, 64), device="cuda")
    t0 = time.perf_counter()
    converted, report = Pipeline([FuseNorm()])(copy.deepcopy(model), (example,), {"use_cache": False})
    if not report.ok:
        raise SystemExit(f"conversion failed its checks: {report.exact_failures}")
    return converted, {
        "convert_s": time.perf_counter() - t0,
        "changes": sum(len(p.changes) for p in report.passes),
    }


def _rows(model, config, vocab: int) -> list[tuple[str, Callable[[], object]]]:
    import torch
    import torch.nn.functional as F

    rows = []
    longest = getattr(config, "n_positions", None) or config.max_position_embeddings
    for seq in (512, min(2048, longest)):  # GPT-2 has 1024 positions
        ids = torch.randint(0, vocab, (1, seq), device="cuda")

        def prefill(ids=ids):
            with torch.no_grad():
                return model(ids, use_cache=False).logits

        rows.append((f"prefill b1 s{seq}", prefill))
    for batch in (1, 32):
        prompt = torch.randint(0, vocab, (batch, 512), device="cuda")
        token = torch.randint(0, vocab, (batch, 1), device="cuda")
        with torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values

        def decode(token=token, cache=cache):
            with torch.no_grad():
                out = model(token, past_key_values=cache, use_cache=True).logits
            cache.crop(-1)  # drop the token just appended (negative: by count, in every version)
            return out

        rows.append((f"decode b{batch} kv512", decode))
    batch, seq = (4, 512) if "gpt2" in type(model).__name__.lower() else (2, 1024)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def train():
        logits = model(ids, use_cache=False).logits
        F.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows.append((f"train step b{batch} s{seq}", train))
    return rows


def _with_route(fn: Callable[[], object], route: str | None) -> object:
    from normswap.kernels import kernel_route

    with kernel_route(route):
        return fn()


def bench(name: str) -> dict:
    import torch

    model, config = _build(name)
    converted, conversion = _convert(model)
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (1, 256), device="cuda")
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.float()
        got = converted(ids, use_cache=False).logits.float()
    max_rel = float((got - want).abs().max() / want.abs().max())
    variants = {
        "original": (model, None),
        "converted": (converted, None),
        "converted kernel-only": (converted, "triton"),
    }
    results: dict[str, dict[str, float | str]] = {}
    rows = {variant: dict(_rows(m, config, vocab)) for variant, (m, _route) in variants.items()}
    for row in rows["original"]:
        fns = {}
        for variant, (_m, route) in variants.items():
            fn = rows[variant][row]
            fns[variant] = lambda fn=fn, route=route: _with_route(fn, route)
        try:
            results[row] = dict(_interleaved_ms(fns))
        except Exception as e:  # recorded, and the run goes on
            results[row] = {"error": f"{type(e).__name__}: {e}"[:500]}
    del rows
    torch.cuda.empty_cache()
    for row, by_variant in results.items():
        base = by_variant.get("original")
        cells = []
        for variant in variants:
            v = by_variant.get(variant)
            if isinstance(v, float) and isinstance(base, float):
                cells.append(f"{variant} {v:8.3f} ms ({base / v:.3f}x)")
            else:
                cells.append(f"{variant} {v}")
        print(f"{name:12} {row:22} " + "  ".join(cells), flush=True)
    params = sum(p.numel() for p in model.parameters())
    del model, converted
    torch.cuda.empty_cache()
    return {"params": params, "conversion": conversion, "max_rel_logits": max_rel, "ms": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import torch

    from normswap.kernels._direct import direct_launch_enabled

    if not torch.cuda.is_available():
        print("bench_models_fused needs a CUDA device; nothing was measured", file=sys.stderr)
        return 2
    result: dict = {
        "meta": {
            "command": " ".join(
                ["python benchmarks/bench_models_fused.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "direct_launch": direct_launch_enabled(),
            "route_rules": os.environ.get("NORMSWAP_ROUTE_RULES", "built-in"),
            "timing": "CUDA events around a loop of calls, variants interleaved, median of 9 rounds; ratio = original ms / variant ms",
        },
        "models": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        try:
            result["models"][name] = bench(name)
        except Exception as e:  # recorded, and the next model runs
            result["models"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{name}: FAILED {result['models'][name]['error'][:400]}", flush=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
