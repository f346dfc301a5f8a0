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
    `geometries`: every compressor's (ratio, overlap) in the reusable layers, planned before the first layer.
    The host work is numpy over every relocated document at once (no step per document), so its cost follows the
    rows, not the number of documents."""
    dev = positions.device
    n_reloc = active.shape[0]
    row_active = torch.cat([active, torch.ones(n_q, dtype=torch.bool, device=dev)])
    ra_host, pos_host = row_active.cpu(), positions.cpu()
    ra = ra_host.numpy()
    act_h, rest_h = np.flatnonzero(ra), np.flatnonzero(~ra)

    def rows(ids):
        if ids.size == 0:
            return None
        if ids.size == ra.shape[0]:
            return Rows(None, positions, pos_host.numpy())
        d = to_device_nowait(torch.from_numpy(ids), dev)
        return Rows(d, positions.index_select(0, d), pos_host.numpy()[ids])
    sp = Split(rows(act_h), rows(rest_h))
    if sp.act is not None and sp.rest is not None:
        split_pos = np.empty(ra.shape[0], dtype=np.int64)
        split_pos[act_h] = np.arange(act_h.size)
        split_pos[rest_h] = np.arange(act_h.size, ra.shape[0])
        sp.split_pos = to_device_nowait(torch.from_numpy(split_pos), dev)
    lens = np.array([d.n for d in reloc], dtype=np.int64)
    starts = np.cumsum(lens) - lens
    sp.seg_ranges = list(zip(starts.tolist(), lens.tolist()))
    # each relocated row's local id in its document: the active ones, then the others, document after document
    ar, rr = act_h[act_h < n_reloc], rest_h[rest_h < n_reloc]
    a_doc = np.searchsorted(starts, ar, side="right") - 1
    r_doc = np.searchsorted(starts, rr, side="right") - 1
    cpos, rest_ids = ar - starts[a_doc], rr - starts[r_doc]
    # every document's row ids go to the device in ONE copy (views of it), not one copy per document
    # (an active row's local id IS its canonical position in its document: act_cpos)
    act_ids, rest_dev, sp.act_reloc = to_device_all([torch.from_numpy(t) for t in (cpos, rest_ids, ar)], dev)
    sp.act_local = _per_doc(act_ids, np.bincount(a_doc, minlength=len(reloc)))
    sp.rest_local = _per_doc(rest_dev, np.bincount(r_doc, minlength=len(reloc)))
    sp.act_cpos = share_positions(act_ids)
    sp.ra_host = ra_host
    for r, overlap in geometries:
        block_plan(sp, r, overlap)
    return sp


def _per_doc(ids: torch.Tensor, counts: np.ndarray) -> list:
    """Per relocated document j (from 1) that has any: (j, its slice of `ids` (documents one after the other,
    `counts` each), the slice's offset)."""
    offs = np.cumsum(counts) - counts
    return [(j + 1, ids[o:o + c], o) for j, (c, o) in enumerate(zip(counts.tolist(), offs.tolist())) if c]


def block_plan(sp: Split, r: int, overlap: bool) -> BlockPlan:
    """`sp`'s plan of the blocks to re-pool for compressors of ratio `r` (and `overlap`), made once: numpy over
    every document's blocks at once (a document's trailing rows short of a block belong to none)."""
    if (r, overlap) in sp.blocks:
        return sp.blocks[(r, overlap)]
    ra = sp.ra_host.numpy()
    a = np.array([a for a, _ in sp.seg_ranges], dtype=np.int64)
    nb = np.array([n // r for _, n in sp.seg_ranges], dtype=np.int64)
    doc = np.repeat(np.arange(nb.size), nb)                     # every block's document (index into seg_ranges)
    first_blk = np.cumsum(nb) - nb                              # each document's first block among all
    b = np.arange(doc.size) - first_blk[doc]                    # the block's id in its document
    start = a[doc] + b * r                                      # its first call row
    blk = ra[start[:, None] + np.arange(r)].any(axis=1) if doc.size else np.zeros(0, dtype=bool)
    needed = blk.copy()
    has = nb > 0
    last = (first_blk + nb - 1)[has]                            # each document's last block
    if overlap:
        needed[:-1] |= blk[1:] & (doc[:-1] == doc[1:])          # a dirty block's predecessor in its document
        needed[last] = True                                     # its Ca half carries into the next segment
    where = np.cumsum(needed) - 1                               # a needed block's index among the needed
    ids = np.flatnonzero(needed)
    need_rows = (start[ids][:, None] + np.arange(r)).reshape(-1)
    B = np.flatnonzero(blk)
    dirty_src, dirty_pos = where[B], b[B] * r
    prev_src = np.zeros(0, dtype=np.int64)
    carry = -1
    if overlap:
        # the predecessor of a document's first block: the previous document's last block (0 = the prefix's state)
        prev_last = np.zeros(nb.size, dtype=np.int64)
        prev_last[np.flatnonzero(has)[1:]] = where[last[:-1]] + 1
        prev_src = np.where(b[B] > 0, where[np.maximum(B - 1, 0)] + 1, prev_last[doc[B]])
        carry = int(where[last[-1]]) if last.size else -1
    need, src, pos, prev, Bs = to_device_all([torch.from_numpy(t) for t in (need_rows, dirty_src, dirty_pos,
                                                                             prev_src, b[B])], sp.act_reloc.device)
    plan = BlockPlan(need, int(ids.size), src, share_positions(pos), prev if overlap else None,
                     _per_doc(Bs, np.bincount(doc[B], minlength=nb.size)), carry)
    sp.blocks[(r, overlap)] = plan
    return plan
