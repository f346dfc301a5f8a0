"""The first fences' signals for choosing a request's active rows (`controller.choose_active`): how far each
relocated row's latent moved in the request's context, and which rows the native indexer picks for the question."""
from __future__ import annotations

import torch

from runtime.model.deepseek_v4 import Rotary


def deviation(block, latent_req, reloc, deltas, layer) -> torch.Tensor:
    """CacheBlend's signal for free: the request-context latent of the first fences against the artifact's
    latent of the same layer (moved to the request frame), relative per row."""
    outs = []
    a = 0
    for d, delta in zip(reloc, deltas):
        art = d.layers[layer].latent
        moved = Rotary.apply(art, *block.attn.rotary.cos_sin(torch.full((d.n,), delta, device=art.device)))
        got = latent_req[a:a + d.n]
        outs.append((got.float() - moved.float()).norm(dim=-1) / moved.float().norm(dim=-1).clamp_min(1e-12))
        a += d.n
    return torch.cat(outs)


def indexer_rows(topk, n_reloc, prefix_n, n_q, block) -> torch.Tensor:
    """Rows of the compressed blocks that the native indexer picks for the question rows, scored by how many
    question rows pick them."""
    score = torch.zeros(n_reloc, device=topk.device)
    picks = topk[-n_q:].flatten()
    picks = picks[picks >= 0]
    if picks.numel() == 0:
        return score
    rows = (picks[:, None] * 4 + torch.arange(4, device=picks.device)).flatten() - prefix_n
    rows = rows[(rows >= 0) & (rows < n_reloc)]
    score.index_add_(0, rows, torch.ones_like(rows, dtype=score.dtype))
    return score
