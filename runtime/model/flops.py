"""Analytic FLOP count of DeepSeek-V4's major operators (projections, attention, indexer, MoE).

A multiply-add counts 2. Attention counts the keys each query really attends (window, causal compressed
entries, the indexer's top-k), not masked work. The reuse engine's FLOP ledger builds on these terms."""
from __future__ import annotations

from dataclasses import dataclass

from .config import CSA, HCA, ModelConfig


@dataclass(frozen=True)
class LayerFlops:
    projections: float
    attention: float
    indexer: float
    moe: float

    @property
    def total(self) -> float:
        return self.projections + self.attention + self.indexer + self.moe


def _sum_min(T: int, start: int, cap: int) -> float:
    lo, hi = start + 1, start + T                       # values t+1 run over [lo, hi]
    below_hi = min(hi, cap - 1)
    s = (below_hi * (below_hi + 1) - (lo - 1) * lo) / 2 if below_hi >= lo else 0.0
    n_cap = hi - max(lo, cap) + 1
    return s + (cap * n_cap if n_cap > 0 else 0.0)


def _sum_ready(T: int, start: int, ratio: int, cap: int | None = None) -> float:
    """sum over t of the entries complete before t, (t+1)//ratio, optionally capped."""
    tot = 0.0
    for t in range(start, start + T):
        n = (t + 1) // ratio
        tot += n if cap is None else min(n, cap)
    return tot


def layer_flops(cfg: ModelConfig, layer: int, T: int, start: int = 0, experts_per_row: int | None = None,
                out_rows: int | None = None) -> LayerFlops:
    """The layer on T rows at positions start..start+T-1. `out_rows` (Block.forward's): only the last out_rows rows'
    outputs are computed; every row still feeds the cache (the latent W_kv, the compressors, the indexer's keys,
    and the attention-site mHC mix that forms their input), the rest is counted on those rows alone."""
    d, H, D, qr = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    kind, ratio = cfg.layer_kind(layer), cfg.compress_ratios[layer]
    Q = T if out_rows is None else min(int(out_rows), T)     # rows whose outputs are computed: the last Q
    qs = start + T - Q
    proj = 2 * T * d * D + 2 * Q * (d * qr + qr * H * D + H * D * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d)
    hc = 2 * (T + Q) * (2 + cfg.hc_mult) * cfg.hc_mult * cfg.hc_mult * d      # the attention site's on T, the FFN's on Q
    proj += hc
    if ratio:
        proj += 2 * 2 * T * d * D * (2 if kind == CSA else 1)
    attn = 4 * H * D * _sum_min(Q, qs, cfg.window_size)
    idx = 0.0
    if kind == HCA:
        attn += 4 * H * D * _sum_ready_fast(Q, qs, ratio)
    elif kind == CSA:
        attn += 4 * H * D * _sum_ready_fast(Q, qs, 4, cfg.index_topk)
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        idx = 2 * Q * (qr * ih * idim + d * ih) + 2 * T * 2 * d * 2 * idim + 2 * ih * idim * _sum_ready_fast(Q, qs, 4)
    k = cfg.n_activated_experts if experts_per_row is None else experts_per_row
    moe = 2 * Q * d * cfg.n_routed_experts + (k + 1) * 3 * 2 * Q * d * cfg.moe_inter_dim
    return LayerFlops(proj, attn, idx, moe)


def _sum_ready_fast(T: int, start: int, ratio: int, cap: int | None = None) -> float:
    if T <= 20000:
        return _sum_ready(T, start, ratio, cap)
    import numpy as np
    n = (np.arange(start, start + T, dtype=np.int64) + 1) // ratio
    if cap is not None:
        n = np.minimum(n, cap)
    return float(n.sum())
