"""CSA picks over relocated segments: the native lightning indexer's top-k over the union of every segment's visible
entries (the query roped once, each segment's keys turned to its place), or each row's own document's offline
picks, numbered as global entry ids (segment j's entry w is first[j] + w, `keys.offsets`) or split back per
segment."""
from __future__ import annotations

import torch

import runtime.kernels as K
from runtime.kernels._host import to_device_nowait
from runtime.kernels import rope_
from runtime.model.deepseek_v4 import Rotary
from .keys import angles, delta_turns, memo, offsets, shifted


def own_global_picks(segments, qpos, own_picks, first, total, trig=None):
    """[T, k] each row's own-segment picks (local entry ids, -1 = none; the segment holding its position) as global
    ids numbered by `first` (`total` where a slot picked nothing). Each row's base id is built once per call's rows
    and layout (`trig`): its host->device copies would each wait for the stream."""
    def base():
        starts = torch.tensor([s.delta for s in segments], device=qpos.device)
        own = torch.searchsorted(starts, qpos, right=True) - 1
        return torch.tensor(first, device=qpos.device)[own][:, None]
    b = memo(trig, ("own_base", tuple(s.delta for s in segments), tuple(first)), base)
    return torch.where(own_picks >= 0, own_picks.long() + b, total)


def pick_runs(gp, first, total, trig=None):
    """Global picks [T, k] -> (the same sorted ascending per row, bounds [T, P+1]: where each segment's run starts
    in the row's list; bounds[:, P] is the row's count of real picks). What the fused kernel walks."""
    return _sorted_runs(gp, first + [total], trig)


def part_runs(gp, spans, trig=None):
    """Global picks [T, k] -> (the same sorted ascending per row, runs [T, 2P]: per part p with segment ids
    spans[p] = (first, count), where its ids start (column p) and end (column P + p) in the row's sorted list). What
    the stacked picks parts read: each part its own run, not every slot."""
    return _sorted_runs(gp, [f for f, _ in spans] + [f + n for f, n in spans], trig)


def _sorted_runs(gp, edges: list[int], trig=None):
    """gp sorted ascending per row, and where each of `edges` (global ids) falls in each row. The edges go to the
    device once per call's rows and edges (`trig`), without waiting for the stream."""
    gp = gp.sort(dim=1).values.contiguous()
    at = memo(trig, ("edges", tuple(edges), gp.shape[0]), lambda: to_device_nowait(
        torch.tensor(edges, dtype=torch.long), gp.device).expand(gp.shape[0], -1).contiguous())
    return gp, torch.searchsorted(gp, at)


def local_picks(gp: torch.Tensor, f: int, n: int) -> torch.Tensor:
    """Global picks [T, k] -> one segment's local entry ids (its entries are f..f+n-1; -1 for every other slot),
    in the slots' order. What the reference path's per-segment parts take."""
    return torch.where((gp >= f) & (gp < f + n), gp - f, -1)


def split_picks(gp, first, total):
    """Global picks [T, k] -> `local_picks` of every segment."""
    return [local_picks(gp, f, e - f) for f, e in zip(first, first[1:] + [total])]


def global_from_split(picks: list, first: list[int], total: int, segments) -> torch.Tensor:
    """A caller's per-segment picks (local entry ids [T, k_j], -1 = none; None = none; at least one given) ->
    [T, sum k_j] global ids numbered by `first` (`total` for an empty slot or an id past its segment's entries)."""
    parts = []
    for pk, f, s in zip(picks, first, segments):
        if pk is not None:
            n = 0 if s.entries is None else s.entries.shape[0]
            parts.append(torch.where((pk >= 0) & (pk < n), pk.long() + f, total))
    return torch.cat(parts, dim=1)


def indexer_global_picks(attn, qpos, segments, idx_inputs, first, total, trig=None):
    """Native lightning-indexer top-k over the union of every segment's visible entries as global ids (segment j's
    entry w = first[j] + w; `total` where a slot picked nothing). The query is roped once at t and each segment's
    keys turned by +Delta_j (on the kernels as the one launch over every segment loads them)."""
    h, qr = idx_inputs
    keyed = [(j, seg) for j, seg in enumerate(segments) if seg.index_keys is not None and seg.index_keys.shape[0]]
    if not keyed:
        return torch.full((qpos.shape[0], 0), total, dtype=torch.long, device=qpos.device)
    col = 0
    for j, seg in keyed:
        if first[j] != col:
            raise ValueError(f"first={first} must number the segments' indexer keys in order")
        col += seg.index_keys.shape[0]
    if col != total:
        raise ValueError(f"total={total} must be the number of indexer keys ({col})")
    q, w_raw = attn.indexer.query(h, qr)
    w = attn.indexer.head_weights(q, w_raw)              # once for every segment
    T = qpos.shape[0]
    # the query is roped once, at t; each segment's keys are turned by +Delta instead (q(t - D) . k = q(t) . k(+D))
    rope_(q, *angles(attn, qpos, 0, T, 0, trig))
    deltas = tuple(seg.delta for _, seg in keyed)
    cs = delta_turns(attn, deltas, qpos.device, trig)
    # every segment's scores land in their columns of one [T, total] block (no concatenation); segment j's
    # columns are first[j].. (checked above), so a column's index IS the entry's global id
    s = torch.empty((T, total), dtype=torch.float32, device=h.device)
    keys = [seg.index_keys for _, seg in keyed]
    if K.enabled(q):
        counts = tuple(k.shape[0] for k in keys)
        programs = memo(trig, ("index_programs", counts), lambda: K.parts_programs(list(counts), q.device))
        K.indexer_scores_parts(q, keys, list(deltas), cs, w, qpos, s, programs=programs)
    else:
        for (j, seg), c, sn in zip(keyed, cs[:, 0], cs[:, 1]):
            n = seg.index_keys.shape[0]
            turned = Rotary.apply(seg.index_keys, c.expand(n, -1), sn.expand(n, -1))
            attn.indexer.scores_roped(q, None, shifted(qpos, 0, T, seg.delta, trig), turned,
                                      out=s[:, first[j]:first[j] + n], w=w)
    top = s.topk(min(attn.indexer.topk, s.shape[1]), dim=-1)
    return torch.where(torch.isinf(top.values), total, top.indices)
