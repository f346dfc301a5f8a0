"""Exactness at many segments (issue 34): where the math is exact (SPEC §3, §5: the degenerate profile, and the
prefix document with the question), the reuse arm equals full recomputation at 1, 8 and 64 documents of uneven
lengths, prefill and decode; at 64 documents under a real budget the reuse arm really reuses (that case is in
test_many_segments_budget.py, a file of its own so two test processes share the two 64-document cases).

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


def test_stacked_calls_over_many_segments_take_fewer_rows_per_chunk_and_equal_one_chunk(model, monkeypatch):
    """The stacked path holds one float32 part per segment a call reaches; past `policy.stacked_parts` segments its
    query chunk shrinks in proportion (bounded memory whatever the document count: 32 documents at 32K ran out of
    memory on an H100 with one chunk). The rows are independent, so the chunked call equals one chunk (to float32
    rounding of the same operations: the same parts per row)."""
    import runtime.reuse.deepseek as ds
    docs, question = uneven(16, seed=5)
    prof = ReuseProfile(**BASE, budget=0.25)
    arts = [produce(model, t, prof) for t in docs]
    rows, orig = [], ds.segment_attention

    def counted(attn, q_raw, *a, **kw):                # the rows of every segment_attention call
        rows.append(q_raw.shape[0])
        return orig(attn, q_raw, *a, **kw)
    monkeypatch.setattr(ds, "segment_attention", counted)
    monkeypatch.setattr(model, "q_chunk", 512)          # above the request's rows: one chunk per call without a bound
    out = {}
    for parts in (0, 2):
        rows.clear()
        with model.policy_as(model.policy.replace(stacked_parts=parts)):
            out[parts] = ReuseEngine(model, prof).prefill(arts, question), list(rows)
    (one, one_rows), (chunked, chunked_rows) = out[0], out[2]
    assert sum(one_rows) == sum(chunked_rows) and len(chunked_rows) > len(one_rows)   # the bound split the calls
    assert max(chunked_rows) < max(one_rows)
    assert rel_err(chunked.logits, one.logits) <= 1e-5
    assert chunked.ledger.summary()["rows"] == one.ledger.summary()["rows"]
