"""An embedding whose looked-up rows come out centred: what recentring needs of a tied token embedding.

Recentring a pre-LN transformer's residual stream (:mod:`normswap.passes.recenter`) centres every tensor
that writes into it. A token embedding whose matrix the output head also reads (GPT-2, OPT, Phi: tied
input and output embeddings) cannot be centred in place without changing the head, and a centred copy
doubles the largest matrix of a small model. Centring the rows as they are looked up,
``E[i] - mean(E[i])``, computes what the centred matrix would give and leaves ``E`` one tensor, still
tied: one mean over the hidden dim per token, at the input only. Half-precision rows are centred in fp32
and rounded once, as the centred matrix's values were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class CenteredEmbedding(nn.Embedding):
    """``nn.Embedding`` whose output rows have zero mean over the embedding dim."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input, self.weight, self.padding_idx)
        wide = rows.to(_UPCAST.get(rows.dtype, rows.dtype))
        return (wide - wide.mean(-1, keepdim=True)).to(rows.dtype)

    @classmethod
    def sharing(cls, embedding: nn.Embedding) -> CenteredEmbedding:
        """A centred embedding holding ``embedding``'s own weight (the same Parameter, so ties stay)."""
        if not plain_embedding(embedding):
            raise ValueError(f"{type(embedding).__name__} is not a plain nn.Embedding")
        centered = cls(
            embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, device="meta"
        )
        centered.weight = embedding.weight
        return centered


def plain_embedding(module: object) -> bool:
    """``module`` is torch's own ``nn.Embedding`` with no option that changes what a lookup returns."""
    return (
        type(module) is nn.Embedding
        and module.max_norm is None  # type: ignore[union-attr]
        and not module.sparse  # type: ignore[union-attr]
        and not module.scale_grad_by_freq  # type: ignore[union-attr]
    )
