"""CSA picks over relocated segments: the native lightning indexer's top-k over the union of every segment's visible
entries (the indexer query turned per segment), or each row's own document's offline picks, numbered as global
entry ids (segment j's entry w is first[j] + w, `keys.offsets`) or split back per segment."""
from __future__ import annotations

import torch

from runtime.kernels import rope_
from .keys import angles, memo, offsets, shifted


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
    in the row's list; bounds[:, P] is the row's count of real picks). What the fused kernel walks. The segments'
    edges are copied to the device once per call's rows and layout (`trig`): the copy waits for the stream."""
    gp = gp.sort(dim=1).values.contiguous()
    edges = memo(trig, ("edges", tuple(first), total, gp.shape[0]), lambda: torch.tensor(
        first + [total], device=gp.device).expand(gp.shape[0], -1).contiguous())
    return gp, torch.searchsorted(gp, edges)


def split_picks(gp, first, total):
    """Global picks [T, k] -> per segment its local entry ids [T, k] (-1 where the slot is another segment's or
    empty), in the slots' order. What the stacked path's per-segment parts take."""
    return [torch.where((gp >= f) & (gp < e), gp - f, -1) for f, e in zip(first, first[1:] + [total])]


def indexer_global_picks(attn, qpos, segments, idx_inputs, first, total, trig=None):
    """Native lightning-indexer top-k over the union of every segment's visible entries (the indexer query rotated
    per segment) as global ids (segment j's entry w = first[j] + w; `total` where a slot picked nothing)."""
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
    # every segment's scores land in their columns of one [T, total] block (no concatenation); segment j's
    # columns are first[j].. (checked above), so a column's index IS the entry's global id
    s = torch.empty((qpos.shape[0], total), dtype=torch.float32, device=h.device)
    T = qpos.shape[0]
    qs = q.clone() if keyed else None        # each segment's turned query, one after the other
    for j, seg in keyed:
        n = seg.index_keys.shape[0]
        cos, sin = angles(attn, qpos, 0, T, seg.delta, trig)
        rope_(qs, cos, sin, src=q)
        attn.indexer.scores_roped(qs, None, shifted(qpos, 0, T, seg.delta, trig), seg.index_keys,
                                  out=s[:, first[j]:first[j] + n], w=w)
    top = s.topk(min(attn.indexer.topk, s.shape[1]), dim=-1)
    return torch.where(torch.isinf(top.values), total, top.indices)



def indexer_picks(attn, qpos, segments, idx_inputs, trig=None):
    """`indexer_global_picks` split per segment: the picked local entry ids [T, k] (-1 = none) of each segment, in
    the top-k order (None for every segment when no segment has indexer keys), and the number of picks made."""
    first, total = offsets(segments, "index_keys")
    if total == 0:
        return [None] * len(segments), 0
    gp = indexer_global_picks(attn, qpos, segments, idx_inputs, first, total, trig)
    return split_picks(gp, first, total), (gp < total).sum()

