"""`select="attention"` on DeepSeek-V4 (draft.py): the question rows drafted through the reusable layers over the
artifacts rank the relocated rows, and the budget goes to the top ones. The draft's mass is a softmax over every
document row; it takes other rows than the default rule, the rows it ranks highest, leaves no trace but its cost,
and the degenerate profile still reproduces full recomputation."""
import torch

from runtime.model.config import tiny_reuse
from runtime.model.deepseek_v4 import LayerCache, Rotary
from runtime.reuse.call import Call
from runtime.reuse.controller import choose_top, doc_offsets
from runtime.reuse.draft import document_mass, draft_rows
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.producer import produce
from runtime.reuse.profile import ReuseProfile, degenerate
from tests.tiny import tiny_model

CFG = tiny_reuse()
BASE = dict(first_fences=2, last_fences=2, align=16, recent_rows=16, join_rows=8)
TOL = 1e-4


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def setup():
    model = tiny_model(CFG, seed=1)
    model.eval()
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (48, 64, 32)]
    question = torch.randint(2, CFG.vocab_size, (8,), generator=g).tolist()
    return model, docs, question


def test_document_mass_is_a_softmax_over_every_document_row():
    """Per-segment query rotation (t - Delta) against the canonical latent equals scoring the latent moved to its
    request positions; the masses of all documents sum to one per query row and head."""
    model, docs, _ = setup()
    attn = model.layers[2].attn
    g = torch.Generator().manual_seed(2)
    lat = [torch.randn(n, CFG.head_dim, generator=g) for n in (48, 64, 32)]
    deltas = doc_offsets([48, 64, 32])
    pos = torch.arange(144, 150)
    q = Rotary.apply(torch.randn(6, attn.n_heads, CFG.head_dim, generator=g), *attn.rotary.cos_sin(pos))
    got = torch.cat(document_mass(attn, q, lat, deltas))
    moved = torch.cat([Rotary.apply(k, *attn.rotary.cos_sin(torch.full((k.shape[0],), dl)))
                       for k, dl in zip(lat, deltas)])
    want = torch.softmax(torch.einsum("thd,sd->ths", q, moved) * attn.scale, -1).sum((0, 1))
    assert rel_err(got, want) <= TOL and abs(got.sum().item() - 6 * attn.n_heads) < 1e-3


def test_attention_rule_takes_the_drafts_top_rows():
    model, docs, question = setup()
    prof = ReuseProfile(**BASE, budget=0.25, select="attention")
    arts = [produce(model, d, prof) for d in docs]
    res = ReuseEngine(model, prof).prefill(arts, question)
    n0, n_reloc = arts[0].n, sum(a.n for a in arts[1:])
    # the draft from the question rows' exact streams after the first fences (the full model's at that depth)
    tokens = torch.tensor([t for a in arts for t in a.tokens] + question)
    pos = torch.arange(tokens.shape[0])
    q_start = n0 + n_reloc
    eng = ReuseEngine(model, prof)
    with torch.inference_mode():
        x = model.embed_streams(tokens)
        for block in model.layers[:prof.first_fences]:
            x = block(x, tokens, pos, LayerCache(), model.q_chunk)
        score = draft_rows(eng.adapter, Call(arts, None), x[q_start:], tokens[q_start:], pos[q_start:],
                           doc_offsets([a.n for a in arts]))
    assert score.shape == (n_reloc,) and (score > 0).all()
    top = choose_top(prof, score)
    assert torch.equal(res.active_rows, torch.nonzero(top).flatten() + n0)
    assert score[top].min() >= score[~top].max()
    # the default rule (the controller's classes with the native indexer's picks) takes other rows
    mixed = ReuseProfile(**BASE, budget=0.25)
    ref = ReuseEngine(model, mixed).prefill([produce(model, d, mixed) for d in docs], question)
    assert ref.ledger.active == res.ledger.active and not torch.equal(ref.active_rows, res.active_rows)
    # the draft leaves nothing behind but its cost: the same rows forced give the same logits, without the draft
    forced = eng.prefill(arts, question, active=top)
    assert torch.equal(forced.logits, res.logits)
    assert forced.ledger.head_row_saving() == res.ledger.head_row_saving()
    assert sum(res.ledger.reuse_flops.values()) > sum(forced.ledger.reuse_flops.values())


def test_degenerate_profile_with_the_attention_rule_equals_full_recompute():
    model, docs, question = setup()
    prof = degenerate(CFG).replace(**BASE, select="attention")
    arts = [produce(model, d, prof) for d in docs]
    ref = model(torch.tensor([t for a in arts for t in a.tokens] + question))
    res = ReuseEngine(model, prof).prefill(arts, question)
    assert res.ledger.active == sum(a.n for a in arts[1:])
    assert rel_err(res.logits, ref) <= TOL


def test_the_rule_is_certified_and_old_certificates_of_the_default_rule_still_match():
    """select/signal are part of the profile's dict (certificates, store keys) where they differ from the rule
    every profile ran before they existed; at those defaults the dict is what it was, so artifacts certified
    then are still accepted."""
    old = ReuseProfile(**BASE).to_dict()
    assert "select" not in old and "signal" not in old
    assert ReuseProfile(**old) == ReuseProfile(**BASE)
    new = ReuseProfile(**BASE, select="attention", signal="kv")
    assert new.to_dict()["select"] == "attention" and ReuseProfile(**new.to_dict()) == new
