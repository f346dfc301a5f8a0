"""Adaptive MoE fanout (SPEC §5): each active row keeps the fewest routed experts whose weight reaches tau."""
from __future__ import annotations

import torch


def adaptive_fanout(w: torch.Tensor, idx: torch.Tensor, tau: float, min_experts: int):
    """Router top-k weights w and expert ids idx [T, k] -> (both sorted by decreasing weight, ids with the dropped
    slots set to -1, k per row): k = smallest k >= min_experts whose normalized cumulative weight reaches tau; the
    kept slots keep their original weights (SPEC §5)."""
    order = torch.argsort(w, dim=-1, descending=True, stable=True)
    w, idx = w.gather(1, order), idx.gather(1, order)
    cum = w.cumsum(-1) / w.sum(-1, keepdim=True)
    k = (cum < tau - 1e-6).sum(-1) + 1
    k = k.clamp(min=min_experts, max=w.shape[1])
    keep = torch.arange(w.shape[1], device=w.device)[None, :] < k[:, None]
    return w, torch.where(keep, idx, torch.full_like(idx, -1)), k

