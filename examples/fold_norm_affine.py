"""Fold every RMSNorm's weight into the projections that read it: a Hugging Face Llama built from a config.

Run: python examples/fold_norm_affine.py

Each Llama RMSNorm output is read only by Linear layers (q/k/v, gate/up, and the LM head through the
logits slice), so ``y = n(x) * g`` followed by ``W y`` becomes ``(W diag(g)) n(x)``: the norms lose their
weights, the projections absorb them, and the logits stay the same. The folded checkpoint still loads
into the stock ``LlamaForCausalLM`` class: the missing norm weights are initialized to 1 there.

``build()`` is also a factory for the command line (``examples/fold_norm_affine.py:build``).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from normswap.passes import FoldNormAffine, Pipeline


def build() -> tuple[LlamaForCausalLM, tuple, dict]:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # trained RMSNorm weights are far from 1; so are these
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 128, (2, 12))
    return model, (ids,), {"use_cache": False}


def main() -> None:
    model, args, kwargs = build()
    folded, report = Pipeline([FoldNormAffine()])(model, args, kwargs)
    fold = report.passes[0]
    for change in fold.changes:
        print(f"{change.site}: {change.description}")
    for skip in fold.skips:
        print(f"skipped {skip.site}: {skip.reason}")
    removed = sorted(k for c in fold.changes for k in c.details["removed_parameters"])
    print(f"state_dict keys removed: {len(removed)} (e.g. {removed[0]})")

    stock = LlamaForCausalLM(model.config).eval()
    missing = stock.load_state_dict(folded.state_dict(), strict=False).missing_keys
    with torch.no_grad():
        same = torch.allclose(stock(*args, **kwargs).logits, folded(*args, **kwargs).logits, rtol=0, atol=0)
    print(
        f"stock LlamaForCausalLM loads the folded state_dict ({len(missing)} norm weights left at 1): "
        f"{'same logits' if same else 'DIFFERENT logits'}"
    )

    worst = max(report.overall.outputs, key=lambda o: o.max_rel)
    verdict = "exact" if report.ok and report.overall.within_tolerance and same else "NOT EXACT"
    print(
        f"{len(fold.changes)} norms folded; logits max abs diff {worst.max_abs:.3g} "
        f"({worst.max_rel:.3g} x max|logit|, tolerance {worst.tolerance:g}); {verdict}"
    )
    if verdict != "exact":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
