"""The signals for choosing a request's active rows (`controller.choose`): how far each relocated row's K/V (the
latent, on DeepSeek) moved in the request's context in the first fences, which rows the native indexer picks for
the question, and how much attention the question gives each row in a draft pass (`attention_mass`)."""
from __future__ import annotations

import numpy as np
import torch

from runtime.kernels._host import to_device_nowait
from runtime.model.deepseek_v4 import Rotary


def deviation(block, latent_req, reloc, deltas, layer) -> torch.Tensor:
    """CacheBlend's signal for free: the request-context latent of the first fences against the artifact's
    latent of the same layer (moved to the request frame), relative per row."""
    if not reloc:
        return latent_req.new_zeros(0, dtype=torch.float32)
    arts = [d.layers[layer].latent for d in reloc]
    art = torch.cat(arts) if len(arts) > 1 else arts[0]             # every document at once: no launch per one
    at = torch.from_numpy(np.repeat(np.asarray(deltas, dtype=np.int64), [a.shape[0] for a in arts]))
    moved = Rotary.apply(art, *block.attn.rotary.cos_sin(to_device_nowait(at, art.device)))
    return rel_deviation(latent_req[:art.shape[0]], moved)


def rel_deviation(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row ||got - ref|| / ||ref|| over every other dimension (heads, channels), float32."""
    g, r = got.float().flatten(1), ref.float().flatten(1)
    return (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)


def attention_mass(q: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scale: float) -> torch.Tensor:
    """Per key row [S] float32: the attention probability exp(q.k x scale - lse) summed over query rows and
    heads, for queries q [T,H,D] (query head h reads KV head h // (H / KV)) whose softmax normalizers are lse
    [T,H] (natural log) and keys [S,KV,D] that every query sees."""
    T, H, D = q.shape
    KV = keys.shape[1]
    s = torch.einsum("tkgd,skd->tkgs", q.view(T, KV, H // KV, D).float(), keys.float()) * scale
    return torch.exp(s - lse.view(T, KV, H // KV, 1)).sum((0, 1, 2))


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
