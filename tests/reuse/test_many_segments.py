"""Exactness at many segments (issue 34): where the math is exact (SPEC §3, §5: the degenerate profile, and the
prefix document with the question), the reuse arm equals full recomputation at 1, 8 and 64 documents of uneven
lengths, prefill and decode; at 64 documents under a real budget the reuse arm really reuses.

The equality runs with the indexer's top-k wide enough to keep every compressed entry: with the tiny config's
top-4, float32 rounding (segment-wise attention and merges against one full pass) can flip a near-tied pick, a
discrete change of the selection, not of the math (measured: 64 documents, seed 64, rel err 2.3e-4 at top-4 against
4.0e-7 at top-4096; the other seeds 4e-7 to 9e-7 at 3 to 64 documents). The picks themselves are compared exactly
in tests/reuse/test_reuse_exactness.py."""
import pytest
import torch

from runtime.model.config import tiny_reuse
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.producer import produce
from runtime.reuse.profile import ReuseProfile, degenerate
from tests.tiny import tiny_model

from .test_reuse_exactness import BASE, TOL, rel_err

CFG = tiny_reuse().replace(index_topk=4096)


@pytest.fixture(scope="module")
def model():
    m = tiny_model(CFG, seed=1)
    return m


def uneven(n_docs: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """n_docs documents of uneven lengths (5 to 60 tokens, none a multiple of the alignment by design) and a
    question."""
    g = torch.Generator().manual_seed(seed)
    lens = [int(v) for v in torch.randint(5, 61, (n_docs,), generator=g)]
    lens = [n + 1 if n % 16 == 0 else n for n in lens]
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in lens]
    return docs, torch.randint(2, CFG.vocab_size, (12,), generator=g).tolist()


@pytest.mark.parametrize("n_docs", [1, 8, 64])
def test_degenerate_profile_equals_full_recompute_at_many_segments(model, n_docs):
    docs, question = uneven(n_docs, seed=n_docs)
    prof = degenerate(CFG).replace(**BASE)
    arts = [produce(model, t, prof) for t in docs]
    assert len({a.n for a in arts}) > 1 or n_docs == 1            # the lengths really are uneven
    seq = [t for a in arts for t in a.tokens] + question
    cache = model.new_cache()
    ref = model.prefill(torch.tensor(seq), cache)
    eng = ReuseEngine(model, prof)
    res = eng.prefill(arts, question)
    assert res.ledger.active == sum(a.n for a in arts[1:])
    assert rel_err(res.logits, ref) <= TOL
    for step in range(3):                                         # decode continues over the 64 segments' keys
        nxt = int(ref.argmax())
        got = eng.decode(res.state, nxt)
        ref = model(torch.tensor([nxt]), cache)
        assert rel_err(got, ref) <= TOL, step


def test_sixty_four_segments_under_a_budget_reuse_and_stay_close(model):
    """Not exact (non-active rows keep their document-local state): the arm restored rows and skipped heads, and
    its logits stay within the distance the naive arm (no row recomputed) does not."""
    docs, question = uneven(64, seed=7)
    prof = ReuseProfile(**BASE, budget=0.25)
    arts = [produce(model, t, prof) for t in docs]
    ref = model(torch.tensor([t for a in arts for t in a.tokens] + question))
    res = ReuseEngine(model, prof).prefill(arts, question)
    led = res.ledger.summary()
    assert 0 < led["rows"]["active"] < led["rows"]["relocated"] and led["head_row_saving"] > 0, led
    err = rel_err(res.logits, ref)
    assert 0 < err < 1.0, err
