"""The per-request row plan (runtime/reuse/rows.py `split_rows` and `block_plan`, issue 34): built with numpy over
every relocated document at once, it equals a plan made document by document (the straightforward loops below,
the plan's definition) on random layouts of 1 to 64 documents, even and uneven lengths (a document's trailing rows
short of a block included), documents with no active row or no other row, both compressor geometries (ratio 4
with overlap, ratio 128 without) and a prefix-only request; and its host work does not grow with the number of
documents (a fixed number of numpy calls, counted)."""
import types

import numpy as np
import pytest
import torch

from runtime.reuse import rows as R

GEOMETRIES = [(4, True), (128, False), (8, False), (2, True)]


def reference_split(active, n_q, lens):
    """Document by document: active and other rows, each relocated document's active / other local ids with
    their offsets, the active relocated rows and their canonical positions."""
    ra = torch.cat([active, torch.ones(n_q, dtype=torch.bool)])
    act, rest = torch.nonzero(ra).flatten(), torch.nonzero(~ra).flatten()
    act_local, rest_local, seg_ranges, cpos = [], [], [], []
    a = n_act = n_rest = 0
    for j, n in enumerate(lens, start=1):
        mine = ra[a:a + n]
        ai, ri = torch.nonzero(mine).flatten(), torch.nonzero(~mine).flatten()
        if ai.numel():
            act_local.append((j, ai.tolist(), n_act))
        if ri.numel():
            rest_local.append((j, ri.tolist(), n_rest))
        cpos += ai.tolist()
        seg_ranges.append((a, n))
        n_act, n_rest, a = n_act + ai.numel(), n_rest + ri.numel(), a + n
    return dict(act=act.tolist(), rest=rest.tolist(), act_local=act_local, rest_local=rest_local,
                seg_ranges=seg_ranges, act_reloc=[r for r in act.tolist() if r < a], act_cpos=cpos)


def reference_blocks(ra, seg_ranges, r, overlap):
    """Document by document, block by block: the blocks holding an active row (dirty), the blocks to project
    (dirty ones, with overlap their predecessors and every document's last block), each dirty block's source
    among the projected, its first canonical position, its predecessor (+1; 0 = the prefix's state, a document's
    first block: the previous document's last), the last document's last block."""
    need_rows, src, pos, prev, per_doc = [], [], [], [], []
    n_need, carry, last_of_prev, n_dirty = 0, -1, 0, 0
    for j, (a, n) in enumerate(seg_ranges, start=1):
        nb = n // r
        blk = [bool(ra[a + b * r:a + (b + 1) * r].any()) for b in range(nb)]
        needed = list(blk)
        if overlap and nb:
            for b in range(nb - 1):
                needed[b] = needed[b] or blk[b + 1]
            needed[-1] = True
        where = {}
        for b in range(nb):
            if needed[b]:
                where[b] = n_need + len(where)
                need_rows += [a + b * r + i for i in range(r)]
        dirty = [b for b in range(nb) if blk[b]]
        if dirty:
            per_doc.append((j, dirty, n_dirty))
        for b in dirty:
            src.append(where[b])
            pos.append(b * r)
            if overlap:
                prev.append(where[b - 1] + 1 if b > 0 else last_of_prev)
        n_dirty += len(dirty)
        if overlap and nb:
            carry = where[nb - 1]
            last_of_prev = carry + 1
        n_need += len(where)
    return dict(need_rows=need_rows, n_need=n_need, dirty_src=src, dirty_pos=pos, prev_src=prev if overlap else None,
                per_doc=per_doc, carry=carry)


def plan_of(lens, active, n_q, geometries=GEOMETRIES):
    reloc = [types.SimpleNamespace(n=n) for n in lens]
    start = 256                                        # the prefix's rows come before the relocated ones
    positions = torch.arange(start, start + sum(lens) + n_q)
    return R.split_rows(active, positions, reloc, n_q, geometries)


def check(lens, active, n_q):
    sp = plan_of(lens, active, n_q)
    ref = reference_split(active, n_q, lens)
    n = sum(lens) + n_q
    assert (sp.act.idx.tolist() if sp.act is not None and sp.act.idx is not None
            else list(range(n)) if sp.act is not None else []) == ref["act"]
    assert (sp.rest.idx.tolist() if sp.rest is not None and sp.rest.idx is not None
            else list(range(n)) if sp.rest is not None else []) == ref["rest"]
    if sp.act is not None:
        assert sp.act.pos_host.tolist() == [256 + i for i in ref["act"]]
    if sp.act is not None and sp.rest is not None:
        order = ref["act"] + ref["rest"]
        assert sp.split_pos[torch.tensor(order)].tolist() == list(range(n))     # each row's place: active, then others
    assert [(j, t.tolist(), o) for j, t, o in sp.act_local] == ref["act_local"]
    assert [(j, t.tolist(), o) for j, t, o in sp.rest_local] == ref["rest_local"]
    assert sp.seg_ranges == ref["seg_ranges"]
    assert sp.act_reloc.tolist() == ref["act_reloc"] and sp.act_cpos.tolist() == ref["act_cpos"]
    for r, overlap in GEOMETRIES:
        got, want = sp.blocks[(r, overlap)], reference_blocks(sp.ra_host, sp.seg_ranges, r, overlap)
        assert got.need_rows.tolist() == want["need_rows"] and got.n_need == want["n_need"]
        assert got.dirty_src.tolist() == want["dirty_src"] and got.dirty_pos.tolist() == want["dirty_pos"]
        assert (None if got.prev_src is None else got.prev_src.tolist()) == want["prev_src"]
        assert [(j, B.tolist(), o) for j, B, o in got.per_doc] == want["per_doc"]
        assert got.carry == want["carry"]
        assert R.block_plan(sp, r, overlap) is got                   # made once per request and geometry
    return sp


@pytest.mark.parametrize("seed", range(12))
def test_row_plan_equals_the_plan_made_document_by_document(seed):
    g = np.random.default_rng(seed)
    n_docs = int(g.choice([1, 2, 3, 8, 17, 64]))
    lens = (g.integers(1, 40, n_docs) * 8 + g.integers(0, 8, n_docs) * int(seed % 2)).tolist()   # odd: uneven tails
    p = float(g.choice([0.0, 0.03, 0.1, 0.5, 1.0]))
    active = torch.from_numpy(g.random(sum(lens)) < p)
    if n_docs > 2:                                     # one document all active, one with no active row
        a = sum(lens[:1])
        active[a:a + lens[1]] = False
        b = sum(lens[:2])
        active[b:b + lens[2]] = True
    check(lens, active, int(g.integers(1, 70)))


def test_row_plan_every_row_active_and_no_relocated_document():
    check([16, 24], torch.ones(40, dtype=torch.bool), 5)             # no other rows: rest is None
    sp = check([], torch.zeros(0, dtype=torch.bool), 7)              # the prefix alone: question rows only
    assert sp.act_local == [] and sp.rest is None and sp.act_reloc.numel() == 0
    assert all(p.n_need == 0 and p.carry == -1 for p in sp.blocks.values())


def test_row_plan_host_work_does_not_grow_with_the_documents(monkeypatch):
    """The same rows as 2 and as 64 documents: the plan's numpy and torch calls are counted (no call per
    document; the only per-document work is slicing the one device tensor into each document's view)."""
    counts = {}

    def counting(mod, name):
        fn = getattr(mod, name)

        def wrapped(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        monkeypatch.setattr(mod, name, wrapped)
    for name in ("flatnonzero", "searchsorted", "bincount", "cumsum", "repeat", "arange", "where"):
        counting(R.np, name)
    for name in ("from_numpy", "cat", "nonzero"):
        counting(R.torch, name)
    seen = []
    for n_docs in (2, 64):
        counts.clear()
        g = np.random.default_rng(n_docs)
        plan_of([256 * 64 // n_docs] * n_docs, torch.from_numpy(g.random(256 * 64) < 0.1), 16)
        seen.append(dict(counts))
    assert seen[0] == seen[1] and sum(seen[0].values()) > 0, seen
