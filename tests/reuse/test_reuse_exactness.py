"""The reuse path is exact where the math is exact (SPEC §3, §5) and measurably approximate elsewhere."""
import math

import pytest
import torch

from runtime.model.config import FLASH, PRO, tiny_reuse
from runtime.model.deepseek_v4 import (entry_attention, gathered_attention, merge_with_sink, Rotary,
                                       unweighted_rms_norm, window_attention)
from runtime.reuse.controller import choose
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.keys import SegmentKeys
from runtime.reuse.segments import segment_attention
from runtime.reuse.producer import produce
from runtime.reuse.profile import FLASH_PROFILE, PRO_PROFILE, ReuseProfile, degenerate
from runtime.reuse.roles import global_mask, local_mask
from tests.tiny import tiny_model

TOL = 1e-4
CFG = tiny_reuse()
BASE = dict(first_fences=2, last_fences=2, align=16)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def model():
    m = tiny_model(CFG, seed=1)
    return m


@pytest.fixture(scope="module")
def request_tokens():
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (100, 150, 60)]
    return docs, torch.randint(2, CFG.vocab_size, (20,), generator=g).tolist()


def test_split_projection_equals_native(model):
    """Seed eq. 4: W_a,L O_L + W_a,G O_G = W_a O, then W_b once."""
    attn = model.layers[3].attn
    o = torch.randn(30, attn.n_heads, CFG.head_dim)
    pos = torch.arange(500, 530)
    prof = ReuseProfile(**BASE)
    gm = global_mask(CFG, prof, attn.n_heads)[None, :, None].float()
    lm = local_mask(CFG, prof, attn.n_heads)[None, :, None].float()
    split = attn.project(o * lm, pos) + attn.project(o * gm, pos)
    assert rel_err(attn.output(split), attn.output(attn.project(o, pos))) <= 1e-6


@pytest.mark.parametrize("layer", [0, 1, 2])       # window-only, CSA, HCA
@torch.no_grad()
def test_relocation_equals_rerope_concatenation(model, layer):
    """Query rotation + per-segment de-rotation + LSE merge (sink once) equals native attention over a physically
    re-roped, concatenated cache, followed by the inverse output RoPE at the query position (segment_attention
    de-rotates each part at its own t - Delta, which is both steps in one). Segments at offsets 0, 128 and 4224."""
    attn = model.layers[layer].attn
    g = torch.Generator().manual_seed(layer)
    D, ih = CFG.head_dim, CFG.index_head_dim
    lens, deltas = (128, 4096, 80), (0, 128, 4224)
    segs = []
    for n, dl in zip(lens, deltas):
        N = n // attn.ratio if attn.ratio else 0
        segs.append(SegmentKeys(dl, torch.randn(n, D, generator=g),
                                torch.randn(N, D, generator=g) if attn.ratio else None,
                                torch.randn(N, ih, generator=g) if attn.kind == "csa" else None))
    qpos = torch.cat([torch.arange(130, 140), torch.arange(4200, 4230), torch.arange(4280, 4304)])
    T = qpos.shape[0]
    q_raw = unweighted_rms_norm(torch.randn(T, attn.n_heads, D, generator=g), 1e-6)
    h, qr = torch.randn(T, CFG.dim, generator=g), torch.randn(T, CFG.q_lora_rank, generator=g)
    got, _ = segment_attention(attn, q_raw, qpos, segs, attn.attn_sink, (h, qr))

    def moved(t, dl):
        return Rotary.apply(t, *attn.rotary.cos_sin(torch.full((t.shape[0],), dl)))
    keys = torch.cat([moved(s.latent, s.delta) for s in segs])
    q = Rotary.apply(q_raw, *attn.rotary.cos_sin(qpos))
    outs = []
    for t in range(T):                       # one query at a time: each at its own place in the concatenation
        qt, pt = q[t:t + 1], qpos[t:t + 1]
        parts = [window_attention(qt, keys[: pt.item() + 1], pt.item(), CFG.window_size, attn.scale)]
        if attn.kind != "window":
            ent = torch.cat([moved(s.entries, s.delta) for s in segs])
            if attn.kind == "hca":
                vis = torch.arange(ent.shape[0])[None, :] < ((pt + 1) // attn.ratio)[:, None]
                parts.append(entry_attention(qt, ent, vis, attn.scale))
            else:
                ik = torch.cat([moved(s.index_keys, s.delta) for s in segs])
                sc = attn.indexer.scores(h[t:t + 1], qr[t:t + 1], pt, ik)
                top = sc.topk(min(attn.indexer.topk, ik.shape[0]), dim=-1)
                idx = torch.where(torch.isinf(top.values), torch.full_like(top.indices, -1), top.indices)
                parts.append(gathered_attention(qt, ent, idx, attn.scale))
        outs.append(Rotary.apply(merge_with_sink(parts, attn.attn_sink), *attn.rotary.cos_sin(pt), inverse=True))
    # float32 RoPE angles at positions ~4K carry ~1e-4 rad of rounding, and the two sides round differently
    # (one rotation by t against rotations by t - Delta and Delta): 1e-4 relative, as for logits
    assert rel_err(got, torch.cat(outs)) <= TOL


def test_degenerate_profile_equals_full_recompute(model, request_tokens):
    docs, question = request_tokens
    prof = degenerate(CFG).replace(**BASE)
    arts = [produce(model, t, prof) for t in docs]
    ref = model(torch.tensor([t for a in arts for t in a.tokens] + question))
    res = ReuseEngine(model, prof).prefill(arts, question)
    assert res.ledger.active == sum(a.n for a in arts[1:])
    assert rel_err(res.logits, ref) <= TOL


def test_prefix_document_plus_question_is_exact(model, request_tokens):
    docs, question = request_tokens
    prof = ReuseProfile(**BASE, budget=0.1)
    art = produce(model, docs[0], prof)
    res = ReuseEngine(model, prof).prefill([art], question)
    assert rel_err(res.logits, model(torch.tensor(art.tokens + question))) <= TOL


def test_normal_profile_is_approximate_and_ledger_counts_what_was_skipped(model, request_tokens):
    docs, question = request_tokens
    prof = ReuseProfile(**BASE, budget=0.25, recent_rows=16, join_rows=8)
    arts = [produce(model, t, prof) for t in docs]
    ref = model(torch.tensor([t for a in arts for t in a.tokens] + question))
    res = ReuseEngine(model, prof).prefill(arts, question)
    assert rel_err(res.logits, ref) > 1e-3                    # the approximation is really active
    led = res.ledger
    n_reloc = sum(a.n for a in arts[1:])
    assert led.active == math.ceil(0.25 * n_reloc) == res.active_rows.numel()
    L, H = CFG.n_layers, CFG.n_heads
    R = len(prof.reusable_layers(CFG))
    Hg = prof.global_per_group * CFG.o_groups
    skipped = (n_reloc - led.active) * R
    assert led.token_row_saving() == pytest.approx(skipped / (n_reloc * L))
    assert led.head_row_saving() == pytest.approx(skipped * (H - Hg) / (n_reloc * L * H))
    assert 0 < led.head_row_saving() < led.structural_ceiling()
    fs = led.flop_saving()
    assert all(fs[k] > 0 for k in ("projections", "attention", "moe", "total"))


def test_controller_priority_order(model):
    """dirty (top half of the budget) -> join rows nearest the join -> indexer picks -> recency -> deviation."""
    prof = ReuseProfile(**BASE, budget=0.25, join_rows=2, recent_rows=4)
    prof.check(model.cfg)
    reloc, deltas = [16, 16], [16, 32]
    dev = torch.zeros(32)
    dev[[5, 20, 9]] = torch.tensor([3.0, 2.0, 1.0])
    idx = torch.zeros(32)
    idx[12] = 5.0
    # the engine's rule (controller.choose with the profile's default select="mixed"): no draft is needed
    act = choose(prof, dev, idx, None, reloc, deltas, q_start=48, n_q=4)
    assert int(act.sum()) == 8
    # dirty: top 4 by deviation (5, 20, 9, then the stable first zero: 0); joins nearest first: 0,15,16,31
    assert set(torch.nonzero(act).flatten().tolist()) == {5, 20, 9, 0, 15, 16, 31, 1}


@pytest.mark.parametrize("seed,budget", [(0, 0.05), (1, 0.25), (2, 0.5), (3, 1.0)])
def test_controller_fill_equals_walking_the_classes(seed, budget):
    """The controller fills the budget without a per-row loop; its set equals walking the priority classes row by
    row and skipping rows already taken, on random deviations, picks and segment lengths (classes overlap)."""
    from runtime.reuse.controller import choose_active
    g = torch.Generator().manual_seed(seed)
    lens = [int(v) * 16 for v in torch.randint(1, 9, (5,), generator=g)]
    deltas = [64 + sum(lens[:k]) for k in range(len(lens))]
    n, q_start = sum(lens), 64 + sum(lens)
    dev = torch.rand(n, generator=g).round(decimals=1)            # ties: the stable order decides
    idx = torch.randint(0, 4, (n,), generator=g).float() * (torch.rand(n, generator=g) < 0.2)
    prof = ReuseProfile(**BASE, budget=budget, join_rows=8, recent_rows=100)
    got = choose_active(prof, dev, idx, lens, deltas, q_start, 4)
    # the rule spelled out as a walk
    k = min(n, math.ceil(budget * n - 1e-9))
    order = torch.argsort(dev, descending=True, stable=True)[: (k + 1) // 2].tolist()
    dist = []
    for ln in lens:
        dist += [min(r, ln - 1 - r) if min(r, ln - 1 - r) < 8 else 1 << 30 for r in range(ln)]
    order += [r for r in sorted(range(n), key=lambda r: dist[r]) if dist[r] < 1 << 30]
    order += [r for r in torch.argsort(idx, descending=True, stable=True).tolist() if idx[r] > 0]
    req = [dl + r for ln, dl in zip(lens, deltas) for r in range(ln)]
    order += [r for r in sorted(range(n), key=lambda r: -req[r]) if req[r] >= q_start + 4 - 100]
    order += torch.argsort(dev, descending=True, stable=True).tolist()
    want = []
    for r in order:
        if len(want) < k and r not in want:
            want.append(r)
    assert int(got.sum()) == k
    assert set(torch.nonzero(got).flatten().tolist()) == set(want)


def test_structural_ceilings():
    assert FLASH_PROFILE.structural_ceiling(FLASH) == pytest.approx(0.7529, abs=5e-5)
    assert PRO_PROFILE.structural_ceiling(PRO) == pytest.approx(0.7889, abs=5e-5)


@pytest.mark.parametrize("last_fence_kv", ["recompute", "artifact"])
def test_degenerate_prefill_and_decode_equal_full_recompute(model, request_tokens, last_fence_kv):
    """Decoding after a reuse prefill continues over the kept segment keys; in the degenerate profile every
    decoded step's logits equal full recomputation, with either source of the last fences' KV."""
    docs, question = request_tokens
    prof = degenerate(CFG).replace(**BASE, last_fence_kv=last_fence_kv)
    arts = [produce(model, t, prof) for t in docs]
    eng = ReuseEngine(model, prof)
    res = eng.prefill(arts, question)
    seq = [t for a in arts for t in a.tokens] + question
    cache = model.new_cache()
    ref = model.prefill(torch.tensor(seq), cache)
    assert rel_err(res.logits, ref) <= TOL
    for step in range(5):
        nxt = int(ref.argmax())
        got = eng.decode(res.state, nxt)
        ref = model(torch.tensor([nxt]), cache)
        assert rel_err(got, ref) <= TOL, step


def test_artifact_kv_in_last_fences_skips_non_active_rows(model, request_tokens):
    docs, question = request_tokens
    base = ReuseProfile(**BASE, budget=0.25, recent_rows=16, join_rows=8)
    arts = [produce(model, t, base) for t in docs]
    rec = ReuseEngine(model, base).prefill(arts, question)
    art = ReuseEngine(model, base.replace(last_fence_kv="artifact")).prefill(arts, question)
    n_reloc = sum(a.n for a in arts[1:])
    skipped_more = (n_reloc - art.ledger.active) * base.last_fences
    assert art.ledger.token_row_saving() == pytest.approx(
        rec.ledger.token_row_saving() + skipped_more / (n_reloc * CFG.n_layers))
    assert art.ledger.flop_saving()["total"] > rec.ledger.flop_saving()["total"]
    out, _ = ReuseEngine(model, base.replace(last_fence_kv="artifact")).generate(arts, question, 4, stop=set())
    assert len(out) == 4


def test_artifact_picks_for_global_heads_skip_the_online_indexer(model, request_tokens):
    """global_picks="artifact": non-active rows' Global heads take their own document's offline top-k in CSA
    layers, so the online indexer runs on active rows only; still exact in the degenerate profile."""
    docs, question = request_tokens
    online = ReuseProfile(**BASE, budget=0.25, recent_rows=16, join_rows=8)
    stored = online.replace(global_picks="artifact")
    arts = [produce(model, t, stored) for t in docs]
    assert all(arts[1].layers[i].picks is not None for i in stored.reusable_layers(CFG)
               if CFG.layer_kind(i) == "csa")
    a = ReuseEngine(model, online).prefill(arts, question)
    b = ReuseEngine(model, stored).prefill(arts, question)
    assert b.ledger.flop_saving()["indexer"] > a.ledger.flop_saving()["indexer"]
    assert torch.isfinite(b.logits).all() and not torch.equal(a.logits, b.logits)
    deg = degenerate(CFG).replace(**BASE, global_picks="artifact")
    arts = [produce(model, t, deg) for t in docs]
    ref = model(torch.tensor([t for x in arts for t in x.tokens] + question))
    assert rel_err(ReuseEngine(model, deg).prefill(arts, question).logits, ref) <= TOL


def test_overlays_in_place_on_private_copies_equal_the_copying_path(model, request_tokens):
    """Active rows' latent and re-pooled entries overwrite the request's own staged copies instead of clones:
    the same logits bit for bit, the caller's artifacts untouched, and the private copies really written."""
    from runtime.reuse.packing import owned_copy
    docs, question = request_tokens
    prof = ReuseProfile(**BASE, budget=0.25, recent_rows=16, join_rows=8)
    arts = [produce(model, t, prof) for t in docs]
    before = [[la.latent.clone() for la in a.layers] for a in arts]
    ref = ReuseEngine(model, prof).prefill(arts, question)
    own = [owned_copy(a) for a in arts]
    got = ReuseEngine(model, prof).prefill(own, question)
    assert torch.equal(got.logits, ref.logits)
    assert all(torch.equal(la.latent, b) for a, bs in zip(arts, before) for la, b in zip(a.layers, bs))
    i = prof.reusable_layers(CFG)[0]
    written = [not torch.equal(o.layers[i].latent, a.layers[i].latent) for o, a in zip(own[1:], arts[1:])]
    assert any(written)                                          # the in-place path was taken
    for j, w in enumerate(written, start=1):                     # written in place: no clone between them
        if w:
            assert got.state.seg_keys[i][j].latent is own[j].layers[i].latent


def test_shared_angles_save_their_recomputation_and_change_nothing(model, request_tokens, monkeypatch):
    """The prefill's angle scope (`shared_angles`): far fewer cos/sin computations, the same logits bit for bit."""
    import contextlib
    import runtime.reuse.deepseek as deepseek
    docs, question = request_tokens
    prof = ReuseProfile(**BASE, budget=0.25, recent_rows=16, join_rows=8, global_picks="artifact")
    arts = [produce(model, t, prof) for t in docs]
    calls = []
    real = Rotary._cos_sin
    monkeypatch.setattr(Rotary, "_cos_sin", lambda self, p: (calls.append(1), real(self, p))[1])
    got = ReuseEngine(model, prof).prefill(arts, question)
    shared = len(calls)
    calls.clear()
    monkeypatch.setattr(deepseek, "shared_angles", contextlib.nullcontext)
    ref = ReuseEngine(model, prof).prefill(arts, question)
    assert torch.equal(got.logits, ref.logits)
    assert shared < 0.75 * len(calls), (shared, len(calls))


def test_own_picks_plan_and_their_global_ids():
    """`_plan` with own picks: each segment's part covers its own rows and the rows past its end that its window
    still reaches, found once per call's rows (`trig`); the rows' own picks go to every part as one tensor of
    global ids (`own_global_picks`), and each part takes back exactly its own rows' picks (`local_picks`): -1 for
    the rows past its end, whose picks are their own segment's."""
    import types
    import numpy as np
    from runtime.reuse.keys import offsets
    from runtime.reuse.picks import local_picks, own_global_picks
    from runtime.reuse.segments import _plan
    attn = types.SimpleNamespace(kind="csa", cfg=types.SimpleNamespace(window_size=4))
    segs = [SegmentKeys(d, torch.zeros(n, 2), torch.zeros(n // 4, 2)) for d, n in ((0, 8), (8, 12), (20, 8))]
    host = np.arange(2, 28)                                  # rows at positions 2..27
    own = torch.randint(-1, 2, (26, 3), generator=torch.Generator().manual_seed(0)).int()   # each < 2 entries
    trig = {}
    plan = _plan(attn, host, segs, "own", trig)
    assert plan == [(0, 0, 9, "picks"), (1, 6, 21, "picks"), (2, 18, 26, "picks")]
    first, total = offsets(segs, "entries")
    gp = own_global_picks(segs, torch.from_numpy(host), own, first, total, trig)
    for j, lo, hi, _ in plan:
        own_hi = int(np.searchsorted(host, segs[j].delta + segs[j].latent.shape[0]))
        pk = local_picks(gp[lo:hi], first[j], segs[j].entries.shape[0])
        assert torch.equal(pk[:own_hi - lo], own[lo:own_hi].long()) and (pk[own_hi - lo:] == -1).all()
    assert _plan(attn, host, segs, "own", trig) is plan and len([k for k in trig if k[0] == "plan"]) == 1


def test_documents_in_one_buffer_take_one_view_overlays_and_gathers(model, request_tokens, monkeypatch):
    """Documents staged as LayerPrefetcher stages pinned ones (each layer of all documents in one buffer,
    `owned_copies`): the overlays, the Local restore and the own picks take one launch for all documents through
    one view, with the same logits bit for bit as document by document, and the caller's artifacts untouched."""
    import runtime.reuse.deepseek as deepseek
    from runtime.reuse.packing import owned_copies, owned_copy
    docs, question = request_tokens
    prof = ReuseProfile(**BASE, budget=0.25, recent_rows=16, join_rows=8, global_picks="artifact")
    arts = [produce(model, t, prof) for t in docs]
    before = [[la.latent.clone() for la in a.layers] for a in arts]
    ref = ReuseEngine(model, prof).prefill([owned_copy(a) for a in arts], question)
    views = []
    real = deepseek.rows_view
    monkeypatch.setattr(deepseek, "rows_view", lambda ts: (views.append(real(ts) is not None), real(ts))[1])
    one = owned_copies(arts)
    got = ReuseEngine(model, prof).prefill(one, question)
    assert torch.equal(got.logits, ref.logits)
    assert views and all(views)                                   # every overlay and gather took the one view
    n_csa = sum(CFG.layer_kind(i) == "csa" for i in prof.reusable_layers(CFG))
    assert len(views) >= 2 * len(prof.reusable_layers(CFG)) + 2 * n_csa   # latent + Local; picks + entries
    assert all(torch.equal(la.latent, b) for a, bs in zip(arts, before) for la, b in zip(a.layers, bs))
    # what the request keeps (segment keys, carried compressor state) holds no view of the staged layer buffers,
    # which would keep each whole layer (W_a,L O_L and picks included) alive to the request's end
    from dataclasses import fields as dc_fields
    from runtime.reuse.packing import layer_tensors
    staged = {t.untyped_storage().data_ptr() for d in one for la in d.layers for t in layer_tensors(la)}
    st = got.state
    kept = [t for segs in st.seg_keys.values() for sk in segs for t in (sk.latent, sk.entries, sk.index_keys)]
    kept += [getattr(c, f.name) for c in [*st.new_comp.values(), *st.new_index.values()] for f in dc_fields(c)]
    kept = [t for t in kept if isinstance(t, torch.Tensor)]
    assert kept and not any(t.untyped_storage().data_ptr() in staged for t in kept)
    i = prof.reusable_layers(CFG)[0]
    assert any(not torch.equal(o.layers[i].latent, a.layers[i].latent) for o, a in zip(one[1:], arts[1:]))
    views.clear()
    got = ReuseEngine(model, prof).prefill([owned_copy(a) for a in arts], question)   # separate tensors
    assert torch.equal(got.logits, ref.logits) and views and not any(views)


def test_split_layout_of_the_projected_state_is_taken(model, request_tokens, monkeypatch):
    """With active and other rows both present, a reusable layer lays its projected state out active rows first,
    then the others: each part's W_a GEMM (and the Local restore) writes its own block in place and hc_post reads
    W_b's output through `split_pos`, instead of two scatters into the rows' order: it was really taken in every
    reusable layer that has both kinds of rows, and decoding goes on from its state. (The row maps themselves equal
    gathering and scattering: the next test.)"""
    docs, question = request_tokens
    prof = ReuseProfile(**BASE, budget=0.25, recent_rows=16, join_rows=8)
    arts = [produce(model, t, prof) for t in docs]
    from runtime.model.deepseek_v4 import Block
    real_post, maps = Block.hc_post, []

    def post(y, x, p, c, y_rows=None, out=None, out_rows=None):
        maps.append((y_rows is not None, out_rows is not None))
        return real_post(y, x, p, c, y_rows, out, out_rows)
    monkeypatch.setattr(Block, "hc_post", staticmethod(post))
    got = ReuseEngine(model, prof).prefill(arts, question)
    n_reusable = sum(1 for i in prof.reusable_layers(CFG) if i >= prof.first_fences)
    assert maps.count((True, False)) == n_reusable                 # W_b's output read through split_pos
    assert maps.count((False, True)) == n_reusable                 # the FFN's new streams written into their rows
    step = ReuseEngine(model, prof)
    nxt = int(got.logits.argmax())
    got_next = step.decode(got.state, nxt)

    assert torch.isfinite(got.logits).all() and torch.isfinite(got_next).all()


def test_hc_post_row_maps_equal_gathering_and_scattering_around_it():
    """`Block.hc_post` with `y_rows` (block output in another row order) and with `out`/`out_rows` (written into
    the given rows of an existing tensor) equals gathering y first and index_copy_ of the result; the other rows
    of `out` are left as they were; out without out_rows is refused."""
    from runtime.model.deepseek_v4 import Block
    g = torch.Generator().manual_seed(5)
    T, hc, D = 9, 4, 16
    x, y = torch.randn(T, hc, D, generator=g), torch.randn(T, D, generator=g)
    post = torch.rand(T, hc, generator=g)
    comb = torch.rand(T, hc, hc, generator=g)
    perm = torch.randperm(T, generator=g)
    want = Block.hc_post(y[perm], x, post, comb)
    assert torch.equal(Block.hc_post(y, x, post, comb, y_rows=perm), want)
    dst = torch.randn(20, hc, D, generator=g)
    rows = torch.randperm(20, generator=g)[:T]
    keep = dst.clone()
    out = Block.hc_post(y, x, post, comb, perm, out=dst, out_rows=rows)
    assert out is dst and torch.equal(out[rows], want)
    others = torch.ones(20, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(out[others], keep[others])
    with pytest.raises(ValueError, match="come together"):
        Block.hc_post(y, x, post, comb, out=dst)
