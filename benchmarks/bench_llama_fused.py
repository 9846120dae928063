"""A Llama converted with ``--to fused --fuse-add`` against the original, eager and torch.compile (CUDA only).

Two measurements, each timed side by side in one process (``triton.testing.do_bench`` medians):

``block``: one Llama decoder layer with its embedding and final norm (hidden 4096, bf16, batch 1,
    sequence 2K-8K): forward and forward + backward of the original eager, the original compiled, the
    converted model eager and the converted model compiled. The fused ops are ``triton_op``s, so
    Inductor compiles their Triton kernels into its own code around the rest of the layer.
``model``: a 1.1B-parameter Llama built from a config (TinyLlama's shape: 22 layers, hidden 2048,
    bf16, random weights): tokens per second of a forward and of a training step (forward, cross
    entropy, backward, AdamW step), original against converted.

The conversion is normswap's own pipeline (``FuseNorm`` then ``FuseAddNorm``), checked by it on its
example inputs; the converted model is an exported ``GraphModule`` with dynamic batch and sequence
dims. Before timing, both models' outputs are compared on the timed input.

    python benchmarks/bench_llama_fused.py --tag h100
    python benchmarks/bench_llama_fused.py --only block --seq 2048
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _llama(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=8192,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    # Random norm weights: the default ones are exactly 1, which would hide a wrong weight multiply.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model.to(torch.bfloat16).eval(), config


def _convert(model, vocab: int):
    import torch

    from normswap.passes import FuseAddNorm, FuseNorm, Pipeline

    example = torch.randint(0, vocab, (2, 64), device="cuda")
    t0 = time.perf_counter()
    converted, report = Pipeline([FuseNorm(), FuseAddNorm()])(model, (example,), {"use_cache": False})
    seconds = time.perf_counter() - t0
    if not report.ok:
        raise SystemExit(f"conversion failed its checks: {report.exact_failures}")
    fused = sum(len(p.changes) for p in report.passes)
    return converted, {"convert_s": seconds, "changes": fused}


def _logits(model, ids):
    return model(ids, use_cache=False).logits


def _median_ms(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=300, grad_to_none=grad_to_none, return_mode="median"))


def _max_rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max())


def bench_block(seqs: list[int]) -> dict:
    import torch

    model, config = _llama(1, 4096, 11008, 32, 32, 32000)
    converted, conversion = _convert(model, config.vocab_size)
    variants = {
        "original eager": model,
        "original compiled": torch.compile(model),
        "converted eager": converted,
        "converted compiled": torch.compile(converted),
    }
    params = {name: [p for p in m.parameters() if p.requires_grad] for name, m in variants.items()}
    rows = []
    failed: dict[str, str] = {}  # a variant that fails is recorded with its error; the others go on
    for seq in seqs:
        ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
        with torch.no_grad():
            want = _logits(model, ids)
        for name, m in variants.items():
            row = {"seq": seq, "variant": name}
            rows.append(row)
            if name in failed:
                row["error"] = failed[name]
                continue
            try:
                with torch.no_grad():
                    row["max_rel_vs_original"] = _max_rel(_logits(m, ids), want)
                    row["fwd_ms"] = _median_ms(lambda m=m, ids=ids: _logits(m, ids))

                def train(m=m, ids=ids):
                    _logits(m, ids).float().square().mean().backward()

                train()
                row["fwd_bwd_ms"] = _median_ms(train, grad_to_none=params[name])
            except Exception as e:  # reported, and the run goes on
                failed[name] = row["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"block seq={seq:<5} {name:19} FAILED {row['error'][:300]}", flush=True)
                continue
            print(
                f"block seq={seq:<5} {name:19} fwd {row['fwd_ms']:7.3f} ms  fwd+bwd {row['fwd_bwd_ms']:7.3f} ms  "
                f"max rel diff {row['max_rel_vs_original']:.1e}",
                flush=True,
            )
    return {"conversion": conversion, "rows": rows}


def bench_model(batch: int, seq: int) -> dict:
    import torch
    import torch.nn.functional as F

    model, config = _llama(22, 2048, 5632, 32, 4, 32000)
    n_params = sum(p.numel() for p in model.parameters())
    converted, conversion = _convert(model, config.vocab_size)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    targets = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    tokens = batch * seq
    rows = []
    with torch.no_grad():
        want = _logits(model, ids)
        got = _logits(converted, ids)
    diff = _max_rel(got, want)
    del want, got
    # Both stay in eval mode (an exported GraphModule has no train mode): Llama has no dropout, so a
    # training step computes the same either way.
    for name, m in (("original", model), ("converted", converted)):
        with torch.no_grad():
            fwd = _median_ms(lambda m=m: _logits(m, ids))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)

        def step(m=m, opt=opt):
            logits = _logits(m, ids)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            step()
            train = _median_ms(step)
        except Exception as e:  # reported, and the run goes on
            rows.append({"variant": name, "fwd_ms": fwd, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"model {name:9} training step FAILED {rows[-1]['error'][:300]}", flush=True)
            continue
        finally:
            del opt
            torch.cuda.empty_cache()
        rows.append(
            {
                "variant": name,
                "fwd_ms": fwd,
                "train_step_ms": train,
                "fwd_tokens_per_s": tokens / fwd * 1e3,
                "train_tokens_per_s": tokens / train * 1e3,
            }
        )
        print(
            f"model {name:9} fwd {tokens / fwd * 1e3:10.0f} tok/s ({fwd:.1f} ms)  "
            f"train step {tokens / train * 1e3:10.0f} tok/s ({train:.1f} ms)",
            flush=True,
        )
    return {
        "params": n_params,
        "batch": batch,
        "seq": seq,
        "conversion": conversion,
        "max_rel_logits_vs_original": diff,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("block", "model"), default=None)
    p.add_argument("--seq", nargs="+", type=int, default=[2048, 4096, 8192], help="block: sequence lengths")
    p.add_argument("--batch", type=int, default=4, help="model: batch size")
    p.add_argument("--model-seq", type=int, default=2048, help="model: sequence length")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="gpu", help="output file llama_fused_TAG.json")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_llama_fused needs a CUDA device (none found); nothing was measured.", file=sys.stderr)
        return 2
    import triton

    result: dict = {
        "meta": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "timing": "triton.testing.do_bench median",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    }
    if args.only in (None, "block"):
        result["block"] = bench_block(args.seq)
    if args.only in (None, "model"):
        torch.compiler.reset()
        torch.cuda.empty_cache()
        result["model"] = bench_model(args.batch, args.model_seq)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"llama_fused_{args.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
