"""The fixed active-row controller shared by every model family's reuse path: the profile's `select` rule
(`choose`) over the signals the first fences give (deviation, the native indexer's picks) or a draft pass."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from runtime.kernels._host import to_device_nowait
from .profile import ReuseProfile


def budget_rows(budget: float, n: int) -> int:
    """Rows a budget (a fraction of the `n` candidates) buys: ceil(budget x n), at most n."""
    return min(n, math.ceil(budget * n - 1e-9))


def choose_active(prof: ReuseProfile, deviation: torch.Tensor, idx_score: torch.Tensor, seg_lens: list[int],
                  deltas: list[int], q_start: int, n_q: int) -> torch.Tensor:
    """The mixed rule's active rows at the profile's budget: the first ceil(budget x candidates) rows of
    `mixed_order`."""
    n = deviation.shape[0]
    k = budget_rows(prof.budget, n)
    return first_rows(mixed_order(prof, deviation, idx_score, seg_lens, deltas, q_start, n_q, k), n, k)


def first_rows(order: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A bool mask over `n` candidates: the first `k` rows of `order`."""
    active = torch.zeros(n, dtype=torch.bool, device=order.device)
    active[order[:k]] = True
    return active


def mixed_order(prof: ReuseProfile, deviation: torch.Tensor, idx_score: torch.Tensor, seg_lens: list[int],
                deltas: list[int], q_start: int, n_q: int, budget: int) -> torch.Tensor:
    """Candidates are the relocated rows (segments of `seg_lens` at request offsets `deltas`); `budget` the rows
    the first reusable layer buys. Every candidate, in the order the budget is spent on them: this priority
    order, each class ranked within itself:
      0. with `sink_rows`: the first rows of every relocated segment;
      1. dirty rows: the top half of the budget by first-fence deviation;
      2. join rows (first/last `join_rows` of every relocated segment), nearest the join first;
      3. rows of blocks the native indexer picks for the question rows, most picked first (DeepSeek only);
      4. the most recent `recent_rows` rows of the request, most recent first;
      5. whatever budget is left: remaining rows by deviation.
    Question and new rows are always active and are not candidates."""
    n = deviation.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=deviation.device)
    order: list[torch.Tensor] = [sink_mask(prof, seg_lens, deviation.device).nonzero().flatten()] \
        if prof.sink_rows else []
    order.append(torch.argsort(deviation, descending=True, stable=True)[: (budget + 1) // 2])
    # each row's distance to its segment's nearer end, and its request position: on the host (numpy over every
    # segment at once), one copy each
    r, ln = in_segment(seg_lens)
    to_join = np.minimum(r, ln - 1 - r)
    dist = to_device_nowait(torch.from_numpy(np.where(to_join < prof.join_rows, to_join, 1 << 30)), deviation.device)
    joins = torch.argsort(dist, stable=True)
    order.append(joins[dist[joins] < (1 << 30)])
    picked = torch.argsort(idx_score, descending=True, stable=True)
    order.append(picked[idx_score[picked] > 0])
    req_pos = to_device_nowait(torch.from_numpy(np.repeat(np.asarray(deltas, dtype=np.int64), seg_lens) + r),
                               deviation.device)
    recent = torch.argsort(req_pos, descending=True, stable=True)
    order.append(recent[req_pos[recent] >= q_start + n_q - prof.recent_rows])
    order.append(torch.argsort(deviation, descending=True, stable=True))
    # the distinct rows of the concatenated classes, in order, without a host round trip per row: each row's
    # earliest place in the order (the last class holds every row), then the rows by it
    ids = torch.cat(order)
    first = torch.full((n,), ids.numel(), dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, ids, torch.arange(ids.numel(), device=ids.device), reduce="amin")
    return torch.argsort(first, stable=True)


def sink_mask(prof: ReuseProfile, seg_lens: list[int], device) -> torch.Tensor:
    """The first `prof.sink_rows` rows of every relocated segment (its own attention sink when it was computed
    alone), over the relocated rows."""
    return to_device_nowait(torch.from_numpy(in_segment(seg_lens)[0] < prof.sink_rows), device)


def in_segment(seg_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per relocated row (host int64 arrays): its row within its segment, and its segment's length."""
    lens = np.asarray(seg_lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    ln = np.repeat(lens, lens)
    return np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts, lens), ln


def choose_top(prof: ReuseProfile, score: torch.Tensor) -> torch.Tensor:
    """The whole budget (ceil(budget x candidates)) to the rows of highest `score`, ties to the earlier row; no
    protected classes. Question and new rows are not candidates."""
    n = score.shape[0]
    return first_rows(torch.argsort(score, descending=True, stable=True), n, budget_rows(prof.budget, n))


def choose_by_deviation(prof: ReuseProfile, deviation: torch.Tensor) -> torch.Tensor:
    """CacheBlend's rule: the whole budget goes to the rows whose first-fence K/V deviate most from their
    artifact (`choose_top` on the deviation)."""
    return choose_top(prof, deviation)


def choose(prof: ReuseProfile, deviation: torch.Tensor, idx_score: torch.Tensor | None,
           draft: Callable[[], torch.Tensor], seg_lens: list[int], deltas: list[int], q_start: int,
           n_q: int) -> torch.Tensor:
    """The active relocated rows at the profile's budget (`fill_order`'s first ceil(budget x candidates))."""
    n = deviation.shape[0]
    k = budget_rows(prof.budget, n)
    return first_rows(fill_order(prof, deviation, idx_score, draft, seg_lens, deltas, q_start, n_q, k), n, k)


def fill_order(prof: ReuseProfile, deviation: torch.Tensor, idx_score: torch.Tensor | None,
               draft: Callable[[], torch.Tensor], seg_lens: list[int], deltas: list[int], q_start: int,
               n_q: int, budget: int) -> torch.Tensor:
    """Every relocated row in the order the profile's `select` rule spends a budget on them (`budget`: the rows
    the first reusable layer buys, which the mixed rule's dirty class is sized by): "mixed" (`mixed_order`, with
    the native indexer's picks `idx_score` where the model has an indexer, else none), "deviation" (CacheBlend's
    rule: the rows whose first-fence K/V deviate most from their artifact) or "attention" (the question's draft
    attention per relocated row, `draft()`, computed only for this rule), ties to the earlier row. With
    `sink_rows`, every relocated segment's first rows come first. A layer's active rows are a prefix of it, so
    per-layer budgets (`ReuseProfile.layer_budget`) give nested sets."""
    if prof.select in ("deviation", "attention"):
        score = draft() if prof.select == "attention" and deviation.numel() else deviation
        if prof.sink_rows:
            score = score.masked_fill(sink_mask(prof, seg_lens, score.device), float("inf"))
        return torch.argsort(score, descending=True, stable=True)
    idx = torch.zeros_like(deviation) if idx_score is None else idx_score
    return mixed_order(prof, deviation, idx, seg_lens, deltas, q_start, n_q, budget)


def check_active(active: torch.Tensor, n_reloc: int) -> torch.Tensor:
    """A caller's active-row mask (tests, benchmarks and studies comparing two paths on the same rows), checked:
    one bool per relocated row."""
    if active.dtype != torch.bool or tuple(active.shape) != (n_reloc,):
        raise ValueError(f"active must be a bool mask of the {n_reloc} relocated rows (one bool per relocated "
                         f"row), got {active.dtype} {tuple(active.shape)}")
    return active


def doc_offsets(lengths: list[int]) -> list[int]:
    """Each segment's request offset: documents back to back from 0."""
    out, pos = [], 0
    for n in lengths:
        out.append(pos)
        pos += n
    return out
