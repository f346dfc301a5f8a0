"""The preamble lever (issue 31 item 4): documents built after a fixed deployment-wide preamble that opens every
request. A document's artifact then holds its rows as computed after the preamble (canonical positions P..P+n-1),
the preamble's own artifact is itself, and relocation moves each document by its offset less P. Exact where the
math is exact: the degenerate profile equals full recomputation of [preamble, documents, question] on both passes;
the naive arm over documents built after the preamble is closer to full recomputation than over documents built
alone; the preamble binds the certificate; DeepSeek-V4 refuses it."""
import pytest
import torch

from runtime.families import check_profile
from runtime.llama.artifacts import produce_llama, produce_llama_packed
from runtime.model.config import tiny_reuse
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.profile import ProfileError, ReuseProfile
from tests.tiny import TINY_LLAMA, tiny_llama

CFG = TINY_LLAMA
BASE = dict(first_fences=2, last_fences=2, align=1, join_rows=4, recent_rows=8)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def setup():
    m = tiny_llama(CFG)
    g = torch.Generator().manual_seed(1)
    pre = torch.randint(3, 128, (12,), generator=g).tolist()
    docs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 41, 25)]
    question = torch.randint(3, 128, (9,), generator=g).tolist()
    return m, pre, docs, question


def test_documents_after_the_preamble_hold_the_rows_of_that_run(setup):
    m, pre, docs, _ = setup
    prof = ReuseProfile(**BASE, preamble=tuple(pre))
    art = produce_llama(m, docs[0], prof)
    cache = m.new_cache()
    for lc in cache.layers:
        lc.capture = {}
    m(torch.tensor(pre + docs[0]), cache)
    assert art.start == len(pre) and art.n == len(docs[0])
    assert all(torch.equal(a, lc.capture["k"][len(pre):]) for a, lc in zip(art.k, cache.layers))
    own = produce_llama(m, pre, prof)                       # the preamble's own artifact: computed alone
    assert own.start == 0 and own.n == len(pre)
    packed = produce_llama_packed(m, [pre] + docs, [prof])[0]
    assert [a.start for a in packed] == [0] + [len(pre)] * len(docs)
    assert max(rel_err(a, b) for a, b in zip(packed[1].k, art.k)) < 1e-5
    assert art.cert.profile["preamble"] == pre              # bound by the certificate
    assert "preamble" not in ReuseProfile(**BASE).to_dict()


@pytest.mark.parametrize("path", ["segments", "cache"])
def test_degenerate_profile_with_a_preamble_equals_full_recompute(setup, path):
    m, pre, docs, question = setup
    G = CFG.num_attention_heads // CFG.num_key_value_heads
    prof = ReuseProfile(**BASE, budget=1.0, global_per_group=G, ffn_mode="native", select="attention",
                        preamble=tuple(pre))
    arts = [produce_llama(m, s, prof) for s in [pre] + docs]
    eng = ReuseEngine(m, prof)
    r = eng.prefill(arts, question) if path == "segments" else eng.prefill_cache(arts, question)
    full = m(torch.tensor(pre + [t for d in docs for t in d] + question))
    assert rel_err(r.logits, full) < 1e-4
    assert r.ledger.active == sum(len(d) for d in docs)


def test_naive_reuse_after_the_preamble_is_closer_to_recompute(setup):
    m, pre, docs, question = setup
    full = m(torch.tensor(pre + [t for d in docs for t in d] + question))
    kl = {}
    for name, prof in (("alone", ReuseProfile(**BASE)), ("after", ReuseProfile(**BASE, preamble=tuple(pre)))):
        arts = [produce_llama(m, s, prof) for s in [pre] + docs]
        r = ReuseEngine(m, prof, mode="naive").prefill_cache(arts, question)
        lp, lq = torch.log_softmax(full, -1), torch.log_softmax(r.logits, -1)
        kl[name] = float((lp.exp() * (lp - lq)).sum())
    assert kl["after"] < kl["alone"], kl


def test_deepseek_refuses_a_preamble_and_the_llama_family_serves_it(setup):
    prof = ReuseProfile(**BASE, preamble=(5, 6))
    with pytest.raises(ProfileError, match="Llama family only"):
        prof.replace(align=16).check(tiny_reuse())
    check_profile(prof, setup[0])           # the services serve it (tests/reuse/test_preamble_served.py)
    assert ReuseProfile(**prof.to_dict()) == prof          # a JSON list comes back as the tuple
