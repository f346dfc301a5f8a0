"""Torch reference paths for the kernels, and the model's own torch forms they are built from (RMS norms, the
attention pieces, SwiGLU: runtime/model/deepseek_v4.py imports these). They run anywhere (CPU too),
chunked over query rows like the model (`q_chunk`), in whatever dtype they are given: the tests pass upcast
inputs (float32/float64) to get a higher-precision reference, the benchmark passes bf16 to time the path the
model runs today."""
from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


# ============================================================================ the model's own torch forms
# (runtime/model/deepseek_v4.py imports them from here: the kernels import no model)

def weighted_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def unweighted_rms_norm_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _lse_attend(scores: torch.Tensor, values: torch.Tensor, einsum: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-normalized output and its natural-log LSE; rows with no valid key give out 0 and LSE -inf."""
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - safe.unsqueeze(-1))
    out = torch.einsum(einsum, p.to(values.dtype), values)
    return out, lse


def entry_attention(q: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor, scale: float):
    """q [T,H,D]; entries [N,D]; visible [T,N] bool."""
    s = torch.einsum("thd,nd->thn", q, entries.to(q.dtype)).float() * scale
    s = s.masked_fill(~visible[:, None, :], NEG_INF)
    return _lse_attend(s, entries, "thn,nd->thd")


def gathered_attention(q: torch.Tensor, entries: torch.Tensor, idx: torch.Tensor, scale: float):
    """q [T,H,D]; entries [N,D]; idx [T,k] with -1 for no entry."""
    k = entries[idx.clamp(min=0)]                                        # [T, k, D]
    s = torch.einsum("thd,tkd->thk", q, k.to(q.dtype)).float() * scale
    s = s.masked_fill((idx < 0)[:, None, :], NEG_INF)
    return _lse_attend(s, k, "thk,tkd->thd")


def swiglu_activation(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None,
                      limit: float) -> torch.Tensor:
    """The float32 SwiGLU between an expert's projections: clamp at `limit` (0: none), silu(gate) * up, times the
    routing weights."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    h = F.silu(gate) * up
    return h if weights is None else weights * h


# ============================================================================ references of the kernels

Part = tuple[torch.Tensor, torch.Tensor]


def _merge_no_sink(parts: list[Part]) -> Part:
    """N-way LSE merge without a sink (what `merge_with_sink` does before the sink joins); rows where every
    part is empty give o = 0 and LSE -inf."""
    lses = torch.stack([lse for _, lse in parts], dim=0)
    total = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    out = torch.zeros_like(parts[0][0], dtype=torch.float32)
    for o, lse in parts:
        out = out + torch.exp(lse - safe).unsqueeze(-1) * o.float()
    return out, total.float()


def window_part(q: torch.Tensor, keys: torch.Tensor, cpos: torch.Tensor, window: int, scale: float) -> Part:
    """Window rows cpos-W+1 .. cpos clipped to [0, n): runtime/reuse/segments.py `_window_part` on roped q
    (for cpos = n_past + t with n = n_past + T it is `window_attention`)."""
    n = keys.shape[0]
    T, H, D = q.shape
    if n == 0:
        return (torch.zeros((T, H, D), dtype=q.dtype, device=q.device),
                torch.full((T, H), NEG_INF, dtype=torch.float32, device=q.device))
    rows = cpos[:, None] - window + 1 + torch.arange(window, device=cpos.device)
    valid = (rows >= 0) & (rows < n)
    k = keys[rows.clamp(0, n - 1)]
    s = torch.einsum("thd,twd->thw", q, k.to(q.dtype)).float() * scale
    s = s.masked_fill(~valid[:, None, :], NEG_INF)
    return _lse_attend(s, k, "thw,twd->thd")


def sparse_mqa_reference(q, keys, cpos, window, entries=None, mode="none", ratio=1, picks=None, scale=None,
                         chunk: int = 4096, pos_shift: int = 0) -> Part:
    """Same contract as `sparse_mqa_attention`: window part + entry part (causal or picks) merged by LSE."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    cpos = cpos.to(q.device).long()
    outs, lses = [], []
    for a in range(0, q.shape[0], chunk):
        b = min(a + chunk, q.shape[0])
        qc, pc = q[a:b], cpos[a:b]
        parts = [window_part(qc, keys, pc, window, scale)]
        if mode == "causal" and entries is not None and entries.shape[0]:
            visible = torch.arange(entries.shape[0], device=q.device)[None, :] < ((pc + pos_shift + 1) // ratio)[:, None]
            parts.append(entry_attention(qc, entries, visible, scale))
        elif mode == "picks" and entries is not None and picks is not None and picks.shape[1]:
            parts.append(gathered_attention(qc, entries, picks[a:b].long(), scale))
        o, lse = _merge_no_sink(parts)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def indexer_scores_reference(q, keys, weights, cpos, ratio: int = 4) -> torch.Tensor:
    """`Indexer.scores` from the roped index query and the scaled head weights: [T, N] with -inf past the limit."""
    ID = q.shape[-1]
    s = torch.relu(torch.einsum("thd,nd->thn", q, keys.to(q.dtype)).float()) * ID ** -0.5
    s = (s * weights.float().unsqueeze(-1)).sum(dim=1)
    ready = (cpos.to(q.device).long() + 1) // ratio
    return s.masked_fill(torch.arange(keys.shape[0], device=q.device)[None, :] >= ready[:, None], NEG_INF)


def indexer_topk_reference(q, keys, weights, cpos, k: int, ratio: int = 4, q_chunk: int = 4096):
    """`Indexer.forward`'s loop: rows chunked so the [rows, IH, N] block stays near 2^28 elements, top-k per chunk,
    -1 where the value is -inf. -> (idx [T,k'] int64, values [T,k'] float32)."""
    N, IH = keys.shape[0], q.shape[1]
    kk = min(k, N)
    if kk == 0:
        return (torch.full((q.shape[0], 0), -1, dtype=torch.long, device=q.device),
                torch.empty((q.shape[0], 0), device=q.device))
    q_chunk = max(1, min(q_chunk, (1 << 28) // (IH * N)))
    idx, vals = [], []
    for a in range(0, q.shape[0], q_chunk):
        b = a + q_chunk
        top = indexer_scores_reference(q[a:b], keys, weights[a:b], cpos[a:b], ratio).topk(kk, dim=-1)
        vals.append(top.values)
        idx.append(torch.where(torch.isinf(top.values), torch.full_like(top.indices, -1), top.indices))
    return torch.cat(idx), torch.cat(vals)
