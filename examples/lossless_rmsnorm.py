"""LayerNorm -> RMSNorm with no change in the outputs: a Hugging Face GPT-2 built from a config.

Run: python examples/lossless_rmsnorm.py

Every reader of GPT-2's residual stream is a LayerNorm, so normswap centers the stream's writers
(embeddings, attention and MLP output projections) and then each LayerNorm equals an RMSNorm. The LM
head shares the embedding matrix; it keeps the original values and the embedding gets a centered copy.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from normswap.passes import Pipeline, RecenterLayerNorm


def build() -> tuple[GPT2LMHeadModel, tuple, dict]:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # trained LayerNorms are far from weight 1, bias 0; so are these
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 128, (2, 12))
    return model, (ids,), {"use_cache": False}


def main() -> None:
    model, args, kwargs = build()
    converted, report = Pipeline([RecenterLayerNorm()])(model, args, kwargs)
    rewrite = report.passes[0]
    for change in rewrite.changes:
        print(f"{change.site}: {change.description}")
    for skip in rewrite.skips:
        print(f"skipped {skip.site}: {skip.reason}")
    remaining = sum(isinstance(m, torch.nn.LayerNorm) for m in converted.modules())
    print(f"LayerNorm modules left: {remaining}")
    tied = converted.lm_head.weight is converted.transformer.wte.weight
    print(f"LM head tied to the token embedding: {'yes' if tied else 'no'}")
    worst = max(report.overall.outputs, key=lambda o: o.max_rel)
    print(
        f"{len(rewrite.changes)} LayerNorms -> RMSNorm; logits max abs {worst.max_abs:.3g} "
        f"= {worst.max_rel:.3g} x max|ref| (tolerance {worst.tolerance:g}); "
        f"{'exact' if report.ok and worst.within_tolerance else 'NOT exact'}"
    )


if __name__ == "__main__":
    main()
