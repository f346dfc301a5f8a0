"""The per-request row plan: which of a call's rows are active (every head, MoE) and which are not (Global heads
and the restored Local contribution), with every index tensor the reusable layers need, built once per request
on the host from one read of the active mask, so that a reusable layer makes no host sync."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.kernels._host import to_device_nowait
from runtime.model.deepseek_v4 import share_positions


@dataclass
class Rows:
    """The rows of one call (active rows, or the others), fixed for a request: their indices among the call's
    rows (None: all of them, in order), request positions on the device and on the host, and the RoPE angles each
    segment needs (per query chunk; built in the first reusable layer, reused by the others)."""
    idx: torch.Tensor | None
    pos: torch.Tensor
    pos_host: np.ndarray
    trig: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.pos_host.shape[0]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.idx is None else t.index_select(0, self.idx)

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """dst with these rows replaced by src (out of place)."""
        return src if self.idx is None else dst.index_copy(0, self.idx, src.to(dst.dtype))

    def put_(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """These rows of dst replaced by src, in place (or src itself when these are all the rows)."""
        return src if self.idx is None else dst.index_copy_(0, self.idx, src.to(dst.dtype))


@dataclass
class Split:
    """Active rows (every head, MoE) and the others (Global heads + restored Local), decided once per request;
    every index tensor the reusable layers need is built here, so the per-layer path has no host syncs."""
    act: Rows | None
    rest: Rows | None
    # relocated documents: per document (its index in docs, its active rows' local ids, their offset in the active
    # relocated rows) and (its other rows' local ids, their offset among the other rows)
    act_local: list = field(default_factory=list)
    rest_local: list = field(default_factory=list)
    act_reloc: torch.Tensor | None = None       # active relocated rows among the call's rows [n_ar]
    act_cpos: torch.Tensor | None = None        # their canonical positions in their own document
    blocks: dict = field(default_factory=dict)  # (ratio, overlap) -> BlockPlan
    seg_ranges: list = field(default_factory=list)   # relocated documents: (start row, n)
    ra_host: torch.Tensor | None = None         # row_active on the host
    # one-view row ids (`rows_view`): (what, the documents' first rows in the view) -> their rows in the view
    view_rows: dict = field(default_factory=dict)
    # where both kinds of rows exist: each call row's place in the split order (active rows, then the others),
    # in which the projected state is written (`_rows`)
    split_pos: torch.Tensor | None = None


@dataclass
class BlockPlan:
    """Compressed blocks of the relocated documents to re-pool (blocks holding an active row) and the rows whose
    compressor projections that needs (with overlap: each such block's predecessor, and every document's last
    block, whose Ca half carries into the next segment). Indices into the stacked `needed` blocks."""
    need_rows: torch.Tensor                     # call rows to project, needed block after needed block
    n_need: int
    dirty_src: torch.Tensor                     # per dirty block: its index among the needed blocks
    dirty_pos: torch.Tensor                     # per dirty block: its first canonical position (block id x ratio)
    prev_src: torch.Tensor | None               # per dirty block: its predecessor's index + 1 (0 = the prefix's state)
    per_doc: list                               # (doc index, dirty block ids, offset among dirty blocks)
    carry: int                                  # the last document's last block among the needed blocks



def to_device_all(host: list[torch.Tensor], dev) -> list[torch.Tensor]:
    """Host int64 tensors on `dev` through one copy that does not wait for the stream: views of one device
    tensor, in order."""
    flat = to_device_nowait(torch.cat([t.reshape(-1) for t in host]), dev)
    return list(flat.split([t.numel() for t in host]))


def split_rows(active, positions, reloc, n_q, geometries) -> Split:
    """Every per-request index the reusable layers use, built once on the host from one read of the active
    mask (the only host sync of the reuse layers' indices) and copied without waiting (`to_device_nowait`).
    `geometries`: every compressor's (ratio, overlap) in the reusable layers, planned before the first layer."""
    dev = positions.device
    n_reloc = active.shape[0]
    row_active = torch.cat([active, torch.ones(n_q, dtype=torch.bool, device=dev)])
    ra_host, pos_host = row_active.cpu(), positions.cpu()
    act_h, rest_h = torch.nonzero(ra_host).flatten(), torch.nonzero(~ra_host).flatten()

    def rows(ids):
        if ids.numel() == 0:
            return None
        if ids.numel() == row_active.shape[0]:
            return Rows(None, positions, pos_host.numpy())
        d = to_device_nowait(ids, dev)
        return Rows(d, positions.index_select(0, d), pos_host[ids].numpy())
    sp = Split(rows(act_h), rows(rest_h))
    if sp.act is not None and sp.rest is not None:
        split_pos = torch.empty(row_active.shape[0], dtype=torch.long)
        split_pos[act_h] = torch.arange(act_h.numel())
        split_pos[rest_h] = torch.arange(act_h.numel(), row_active.shape[0])
        sp.split_pos = to_device_nowait(split_pos, dev)
    a = n_act = n_rest = 0
    act_local, rest_local = [], []
    for j, d in enumerate(reloc, start=1):
        mine = ra_host[a:a + d.n]
        ai, ri = torch.nonzero(mine).flatten(), torch.nonzero(~mine).flatten()
        if ai.numel():
            act_local.append((j, ai, n_act))
        if ri.numel():
            rest_local.append((j, ri, n_rest))
        sp.seg_ranges.append((a, d.n))
        n_act, n_rest, a = n_act + ai.numel(), n_rest + ri.numel(), a + d.n
    ar = act_h[act_h < n_reloc]
    starts = torch.tensor([st for st, _ in sp.seg_ranges], dtype=torch.long)
    owner = torch.searchsorted(starts, ar, right=True) - 1
    cpos = ar - starts[owner] if ar.numel() else ar
    # every document's row ids go to the device in ONE copy (views of it), not one copy per document
    *local, sp.act_reloc, act_cpos = to_device_all([t for _, t, _ in act_local + rest_local] + [ar, cpos], dev)
    sp.act_local = [(j, t, off) for (j, _, off), t in zip(act_local, local)]
    sp.rest_local = [(j, t, off) for (j, _, off), t in zip(rest_local, local[len(act_local):])]
    sp.act_cpos = share_positions(act_cpos)
    sp.ra_host = ra_host
    for r, overlap in geometries:
        block_plan(sp, r, overlap)
    return sp

def block_plan(sp: Split, r: int, overlap: bool) -> BlockPlan:
    """`sp`'s plan of the blocks to re-pool for compressors of ratio `r` (and `overlap`), made once."""
    if (r, overlap) in sp.blocks:
        return sp.blocks[(r, overlap)]
    ra = sp.ra_host
    need_rows, dirty_src, dirty_pos, prev_src, per_doc = [], [], [], [], []
    n_need, carry = 0, -1
    last_of_prev = 0                                  # predecessor of a document's first block: 0 = prefix
    for j, (a, n) in enumerate(sp.seg_ranges, start=1):
        nb = n // r
        blk = ra[a:a + nb * r].view(nb, r).any(dim=1)
        needed = blk.clone()
        if overlap:
            needed[:-1] |= blk[1:]
            needed[-1] = True
        ids = torch.nonzero(needed).flatten()
        where = torch.full((nb,), -1, dtype=torch.long)
        where[ids] = torch.arange(n_need, n_need + ids.numel())
        need_rows.append((a + ids[:, None] * r + torch.arange(r)).flatten())
        B = torch.nonzero(blk).flatten()
        if B.numel():
            per_doc.append((j, B, sum(x.numel() for x in dirty_src)))
            dirty_src.append(where[B])
            dirty_pos.append(B * r)
            if overlap:
                prev = torch.where(B > 0, where[(B - 1).clamp(min=0)] + 1, torch.full_like(B, last_of_prev))
                prev_src.append(prev)
        if overlap:
            carry = int(where[nb - 1])
            last_of_prev = carry + 1
        n_need += ids.numel()
    cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long))
    need, src, pos, prev, *Bs = to_device_all([cat(need_rows), cat(dirty_src), cat(dirty_pos), cat(prev_src)]
                                              + [B for _, B, _ in per_doc], sp.act_reloc.device)
    plan = BlockPlan(need, n_need, src, share_positions(pos), prev if overlap else None,
                     [(j, B, off) for (j, _, off), B in zip(per_doc, Bs)], carry)
    sp.blocks[(r, overlap)] = plan
    return plan

