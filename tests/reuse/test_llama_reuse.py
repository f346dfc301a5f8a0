"""The reuse path on a Llama-family model (GQA, whole-head RoPE, no output RoPE, W_o sliced by heads): exact
where the math is exact, measurably approximate elsewhere; naive reuse runs as the skeptic's baseline."""
import pytest
import torch

from runtime.llama.config import LlamaConfig
from runtime.llama.artifacts import produce_llama
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.profile import ReuseProfile
from tests.tiny import TINY_LLAMA, tiny_llama


def parts(r):
    """(logits, state, ledger) of a ReuseResult."""
    return r.logits, r.state, r.ledger

TOL = 1e-4
CFGS = {
    "llama": TINY_LLAMA,
    "qwen2-bias": LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=8,
                              num_attention_heads=6, num_key_value_heads=2, rope_theta=500.0, bos_token_id=1,
                              eos_token_ids=(2,), model_type="qwen2", qkv_bias=True),
}
BASE = dict(first_fences=2, last_fences=2, align=1, join_rows=4, recent_rows=8)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=list(CFGS))
def setup(request):
    m = tiny_llama(CFGS[request.param])
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 41, 25, 33)]
    question = torch.randint(3, 128, (9,), generator=g).tolist()
    return m.eval(), docs, question


def full(m, docs, question):
    return m(torch.tensor([t for d in docs for t in d] + question))


@pytest.mark.parametrize("last_fence_kv", ["recompute", "artifact"])
@pytest.mark.parametrize("select", ["mixed", "deviation", "attention"])
def test_degenerate_profile_equals_full_recompute_prefill_and_decode(setup, last_fence_kv, select):
    m, docs, question = setup
    G = m.cfg.num_attention_heads // m.cfg.num_key_value_heads
    prof = ReuseProfile(**BASE, budget=1.0, global_per_group=G, ffn_mode="native", last_fence_kv=last_fence_kv,
                        select=select)
    arts = [produce_llama(m, d, prof) for d in docs]
    eng = ReuseEngine(m, prof)
    logits, state, _ = parts(eng.prefill(arts, question))
    cache = m.new_cache()
    ref = m.prefill(torch.tensor([t for d in docs for t in d] + question), cache)
    assert rel_err(logits, ref) <= TOL
    for _ in range(3):
        nxt = int(ref.argmax())
        got, ref = eng.decode(state, nxt), m(torch.tensor([nxt]), cache)
        assert rel_err(got, ref) <= TOL


def test_prefix_plus_question_is_exact(setup):
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.1)
    logits, _, _ = parts(ReuseEngine(m, prof).prefill([produce_llama(m, docs[0], prof)], question))
    assert rel_err(logits, full(m, docs[:1], question)) <= TOL


def test_reuse_is_approximate_and_counted_naive_is_cheaper(setup):
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.25)
    arts = [produce_llama(m, d, prof) for d in docs]
    ref = full(m, docs, question)
    logits, _, led = parts(ReuseEngine(m, prof).prefill(arts, question))
    s = led.summary()
    n_reloc = sum(len(d) for d in docs[1:])
    assert s["rows"]["active"] == -(-n_reloc // 4)
    assert rel_err(logits, ref) > 1e-3
    R, L, H = 8 - 4, 8, m.cfg.num_attention_heads
    Hg = m.cfg.num_key_value_heads
    skipped = (n_reloc - s["rows"]["active"]) * R
    assert s["token_row_saving"] == pytest.approx(skipped / (n_reloc * L))
    assert s["head_row_saving"] == pytest.approx(skipped * (H - Hg) / (n_reloc * L * H))
    nl, _, nled = parts(ReuseEngine(m, prof, mode="naive").prefill(arts, question))
    assert nled.summary()["head_row_saving"] == 1.0 and nled.summary()["flop_ratio"] > s["flop_ratio"] > 1
    assert torch.isfinite(nl).all() and rel_err(nl, ref) > 1e-3


def test_certificate_binding_is_checked(setup):
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.25)
    arts = [produce_llama(m, d, prof) for d in docs]
    assert ReuseEngine(m, prof).verify(arts).ok
    assert ReuseEngine(m, prof.replace(budget=0.2)).verify(arts).reason.value == "profile_mismatch"
    # the shared certificate format and check: a consumer bound to another checkpoint refuses them too
    assert ReuseEngine(m, prof, fingerprint="other").verify(arts).reason.value == "checkpoint_mismatch"
    arts[1].tokens = arts[1].tokens[:-1] + [5]
    assert ReuseEngine(m, prof).verify(arts).reason.value == "token_mismatch"


def test_artifact_last_fences_make_non_active_rows_dead(setup):
    """With the last fences keeping non-active rows' artifact K/V, nothing reads those rows' hidden states:
    the answer cannot depend on whether they ran the FFN or which heads are Global for them. With recomputed
    last fences it does."""
    m, docs, question = setup
    arts = lambda p: [produce_llama(m, d, p) for d in docs]          # noqa: E731
    out = {}
    for kv in ("artifact", "recompute"):
        for ffn in ("skip", "native"):
            p = ReuseProfile(**BASE, budget=0.25, ffn_mode=ffn, last_fence_kv=kv)
            out[kv, ffn] = ReuseEngine(m, p).prefill(arts(p), question)
    assert torch.equal(out["artifact", "skip"].logits, out["artifact", "native"].logits)
    assert rel_err(out["recompute", "skip"].logits, out["recompute", "native"].logits) > 1e-4
    # ledger: the last fences save every head of non-active rows; the FFN of non-active rows costs FLOPs
    n_reloc = sum(len(d) for d in docs[1:])
    s = out["artifact", "skip"].ledger.summary()
    skipped_rows = n_reloc - s["rows"]["active"]
    H, Hg, R, L = m.cfg.num_attention_heads, m.cfg.num_key_value_heads, 8 - 4, 8
    assert s["head_row_saving"] == pytest.approx(skipped_rows * (R * (H - Hg) + 2 * H) / (n_reloc * L * H))
    assert s["token_row_saving"] == pytest.approx(skipped_rows * (R + 2) / (n_reloc * L))
    assert out["recompute", "native"].ledger.summary()["flop_ratio"] < out["recompute", "skip"].ledger.summary()["flop_ratio"]


def test_deviation_selection_takes_the_most_deviating_rows(setup):
    m, docs, question = setup
    from runtime.reuse.controller import choose_by_deviation
    p = ReuseProfile(**BASE, budget=0.25)
    dev = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.0, 0.5, 0.2, 0.7])
    assert choose_by_deviation(p, dev).nonzero().flatten().tolist() == [1, 3]
    a = [produce_llama(m, d, p) for d in docs]
    mixed = ReuseEngine(m, p).prefill(a, question)
    top = ReuseEngine(m, p.replace(select="deviation")).prefill(a, question)
    kv = ReuseEngine(m, p.replace(select="deviation", signal="kv")).prefill(a, question)
    n_reloc = sum(len(d) for d in docs[1:])
    assert mixed.ledger.active == top.ledger.active == kv.ledger.active == -(-n_reloc // 4)
    assert not torch.equal(mixed.logits, top.logits) and not torch.equal(top.logits, kv.logits)


def test_attention_selection_takes_the_rows_the_question_drafts_to(setup):
    """select=attention: the question rows alone, from their exact hidden states after the first fences, run on
    through the reusable layers over the relocated artifact K/V; the budget goes to the relocated rows their
    heads attend to most. The draft's scores equal an independent computation with the model's own layers and
    an explicit softmax; the selection is those scores' top rows, differs from the other rules, and its cost is
    in the ledger."""
    m, docs, question = setup
    from runtime.llama.model import LayerCache
    from runtime.reuse.controller import choose_top
    from runtime.llama.artifacts import relocate
    p = ReuseProfile(**BASE, budget=0.25, select="attention")
    arts = [produce_llama(m, d, p) for d in docs]
    reloc = relocate(m, arts)
    n0, q_start, nq = len(docs[0]), reloc.n, len(question)
    T, G = q_start + nq, m.cfg.num_attention_heads // m.cfg.num_key_value_heads
    # the question rows' exact hidden states after the first fences = the full model's at that depth
    pos = torch.arange(T)
    x = m.embed(torch.tensor([t for d in docs for t in d] + question))
    for layer in m.layers[:p.first_fences]:
        x = layer(x, pos, LayerCache())
    xq, want = x[q_start:], torch.zeros(q_start - n0)
    for layer in m.layers[p.first_fences:len(m.layers) - p.last_fences]:
        lc = LayerCache()
        lc.append(reloc.k[layer.self_attn.layer], reloc.v[layer.self_attn.layer])
        lc.capture = {}
        xq_next = layer(xq, pos[q_start:], lc)
        q, k = lc.capture["q"], lc.k[:T].repeat_interleave(G, dim=1)
        s = torch.einsum("thd,shd->ths", q, k) * m.cfg.head_dim ** -0.5
        s = s.masked_fill(pos[None, None, :] > pos[q_start:, None, None], float("-inf"))
        want += torch.softmax(s, -1)[:, :, n0:q_start].sum((0, 1))
        xq = xq_next
    eng = ReuseEngine(m, p)
    led = eng.adapter.ledger(n0, q_start - n0, nq)
    got = eng.adapter.draft_attention(x[q_start:], pos[q_start:], reloc, n0, q_start, led)
    assert rel_err(got, want) <= TOL and led.flops > 0
    # the budget goes to the top rows by that score; the rules pick different rows and give different logits
    top = choose_top(p, got)
    assert int(top.sum()) == -(-(q_start - n0) // 4) and got[top].min() >= got[~top].max()
    outs = {r: ReuseEngine(m, p.replace(select=r)).prefill_cache(arts, question) for r in ("mixed", "attention")}
    assert outs["mixed"].ledger.active == outs["attention"].ledger.active == int(top.sum())
    assert not torch.equal(outs["mixed"].logits, outs["attention"].logits)
    # the same active count, so the ledgers differ by the draft alone: question rows x reusable layers
    R = len(m.layers) - p.first_fences - p.last_fences
    draft = R * nq * led.flops_row(m.cfg.num_attention_heads, (q_start + T + 1) / 2, True)
    assert outs["attention"].ledger.flops - outs["mixed"].ledger.flops == pytest.approx(draft)


def test_a_given_active_mask_replaces_the_rule_and_bad_masks_are_refused(setup):
    """prefill_cache(active=...): the rule's own rows (the ledger's `active_rows`) give the rule's result; other
    rows give another result with the same ledger counts; a mask of the wrong shape, or one given to the naive
    arm, is refused."""
    m, docs, question = setup
    from runtime.reuse.controller import choose_top
    p = ReuseProfile(**BASE, budget=0.25)
    arts = [produce_llama(m, d, p) for d in docs]
    n_reloc = sum(len(d) for d in docs[1:])
    ref, _, ref_led = parts(ReuseEngine(m, p.replace(select="deviation")).prefill_cache(arts, question))
    mask = torch.zeros(n_reloc, dtype=torch.bool)
    mask[list(ref_led.active_rows)] = True
    assert int(mask.sum()) == ref_led.active == -(-n_reloc // 4)
    same, _, led = parts(ReuseEngine(m, p.replace(select="deviation")).prefill_cache(arts, question, active=mask))
    assert torch.equal(same, ref) and led.__dict__ == ref_led.__dict__
    other = choose_top(p, torch.arange(n_reloc, dtype=torch.float32))          # the last rows instead
    assert not torch.equal(other, mask)
    got, _, led = parts(ReuseEngine(m, p).prefill_cache(arts, question, active=other))
    assert not torch.equal(got, ref) and led.active == ref_led.active
    with pytest.raises(ValueError, match="one bool per relocated row"):
        ReuseEngine(m, p).prefill_cache(arts, question, active=other[:-1])
    with pytest.raises(ValueError, match="naive arm takes none"):
        ReuseEngine(m, p, mode="naive").prefill_cache(arts, question, active=other)


def test_profiles_a_llama_cannot_run_are_refused(setup):
    m, _, _ = setup
    from runtime.reuse.profile import ProfileError
    with pytest.raises(ProfileError, match="no shared expert"):
        ReuseEngine(m, ReuseProfile(**BASE, ffn_mode="shared-expert-only"))
    with pytest.raises(ProfileError, match="global_per_group"):
        ReuseEngine(m, ReuseProfile(**BASE, global_per_group=m.cfg.heads_per_kv + 1))
    with pytest.raises(ValueError, match="select"):
        ReuseEngine(m, ReuseProfile(**BASE, select="random"))


@pytest.mark.parametrize("mode, last_fence_kv", [("reuse", "recompute"), ("reuse", "artifact"), ("naive", "recompute")])
def test_decoding_on_the_assembled_cache_equals_the_segment_path(setup, mode, last_fence_kv):
    """The fast path (segments' K rotated to request positions once, then the model's own decode) against the
    reference (queries rotated per segment, LSE merge) over several greedy steps."""
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.25, last_fence_kv=last_fence_kv)
    arts = [produce_llama(m, d, prof) for d in docs]
    eng = ReuseEngine(m, prof, mode=mode)
    ref_logits, ref_state, _ = parts(eng.prefill(arts, question))
    logits, state, _ = parts(eng.prefill(arts, question))
    cache = eng.adapter.assemble(state)
    assert cache.pos == sum(len(d) for d in docs) + len(question)
    for _ in range(4):
        nxt = int(ref_logits.argmax())
        ref_logits, logits = eng.decode(ref_state, nxt), m(torch.tensor([nxt]), cache)
        assert rel_err(logits, ref_logits) <= TOL
    ids, _ = eng.generate(arts, question, 5, set(), cache=True)
    assert ids == eng.generate(arts, question, 5, set())[0]


@pytest.mark.parametrize("mode, last_fence_kv, ffn, select, signal", [
    ("reuse", "recompute", "skip", "mixed", "k"), ("reuse", "artifact", "skip", "mixed", "k"),
    ("reuse", "recompute", "native", "deviation", "kv"), ("reuse", "artifact", "native", "deviation", "k"),
    ("reuse", "recompute", "skip", "attention", "k"), ("reuse", "artifact", "skip", "attention", "k"),
    ("naive", "recompute", "skip", "mixed", "k")])
@pytest.mark.parametrize("split_heads", [False, True])
def test_prefill_on_the_request_cache_equals_the_segment_path(setup, mode, last_fence_kv, ffn, select, signal,
                                                              split_heads):
    """`prefill_cache` (relocated K rotated once, attention over the request's cache: one call per layer, or
    split by heads) against `prefill` (queries rotated per segment, LSE merge): the same logits, the same
    ledger, and the cache equals the reference's assembled one."""
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.25, last_fence_kv=last_fence_kv, ffn_mode=ffn, select=select, signal=signal)
    arts = [produce_llama(m, d, prof) for d in docs]
    eng = ReuseEngine(m, prof, mode=mode, split_heads=split_heads)
    ref, state, ref_led = parts(eng.prefill(arts, question))
    got, cache, led = parts(eng.prefill_cache(arts, question))
    assert rel_err(got, ref) <= TOL
    assert led.__dict__ == ref_led.__dict__
    want = eng.adapter.assemble(state)
    assert cache.pos == want.pos
    for a, b in zip(cache.layers, want.layers):
        assert a.n == b.n and rel_err(a.k[:a.n], b.k[:b.n]) <= TOL and rel_err(a.v[:a.n], b.v[:b.n]) <= TOL


def test_artifacts_of_several_profiles_share_one_forward(setup):
    m, docs, _ = setup
    from runtime.llama.artifacts import produce_llama_many
    profs = [ReuseProfile(**BASE, budget=b) for b in (0.1, 0.25)] + [ReuseProfile(**BASE, global_per_group=2)]
    many = produce_llama_many(m, docs[1], profs)
    for p, a in zip(profs, many):
        one = produce_llama(m, docs[1], p)
        assert a.cert == one.cert and a.k[0] is many[0].k[0]
        for x, y in zip(a.local, one.local):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


def test_packed_artifacts_equal_one_document_at_a_time(setup):
    """All documents in one packed forward (block-diagonal mask) against one forward per document."""
    m, docs, _ = setup
    from runtime.llama.artifacts import produce_llama_packed
    profs = [ReuseProfile(**BASE, budget=0.25), ReuseProfile(**BASE, global_per_group=2)]
    packed = produce_llama_packed(m, docs, profs)
    for p, arts in zip(profs, packed):
        for d, a in zip(docs, arts):
            one = produce_llama(m, d, p)
            assert a.tokens == one.tokens and a.cert == one.cert
            for x, y in zip(a.k + a.v, one.k + one.v):
                assert rel_err(x, y) <= TOL
            for x, y in zip(a.local, one.local):
                assert (x is None) == (y is None) and (x is None or rel_err(x, y) <= TOL)
