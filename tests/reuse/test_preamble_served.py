"""A profile with a preamble through the serving path's runtime side (`answer`, `answer_staged`): every request is
[preamble][documents][question] in both arms. The reuse arm's prefix is the preamble's own artifact (computed on
the server, certified with its identity), every named document is relocated from its stored artifact built after
the preamble; the recompute arm is the model's own forward over the same tokens. A document built under another
preamble (or none) is refused by its certificate: a counted fallback to that exact recompute."""
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from runtime.families import build, check_profile, load_checkpoint
from runtime.llama.artifacts import produce_llama
from runtime.llama.loader import save_llama
from runtime.model.config import tiny_reuse
from runtime.reuse.certificate import FallbackCounter, FallbackReason
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.profile import ProfileError, ReuseProfile, load_profile
from runtime.reuse.request import ServingIdentity, answer, answer_staged, preamble_artifact, served_tokens
from runtime.reuse.stager import StagedSource
from runtime.reuse.store import CERTIFICATE_FILE, MANIFEST_FILE
from tests.tiny import TINY_LLAMA, tiny_llama

CFG = TINY_LLAMA
BASE = dict(name="t", first_fences=2, last_fences=2, align=1, join_rows=4, recent_rows=8, budget=0.25,
            select="attention")
IDENT = ServingIdentity("f" * 64, "tok")
G = CFG.num_attention_heads // CFG.num_key_value_heads


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    m = tiny_llama(CFG)
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_llama(m, ckpt)
    m = load_checkpoint(ckpt)                       # the services' loader, by config.json's model_type
    g = torch.Generator().manual_seed(3)
    pre = torch.randint(3, 128, (12,), generator=g).tolist()
    docs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 41, 25)]
    question = torch.randint(3, 128, (9,), generator=g).tolist()
    root = tmp_path_factory.mktemp("arts")
    profs = {"plain": ReuseProfile(**BASE), "preamble": ReuseProfile(**BASE, preamble=tuple(pre)),
             "degenerate": ReuseProfile(**dict(BASE, budget=1.0), global_per_group=G, ffn_mode="native",
                                        preamble=tuple(pre))}
    dirs = {k: [build(m, d, p, IDENT.fingerprint, IDENT.tokenizer_fingerprint, root / f"{k}{i}", generation=1)
                for i, d in enumerate(docs)] for k, p in profs.items()}
    return m, pre, docs, question, profs, dirs


def _source(d: Path) -> StagedSource:
    files = {f.name: f.read_bytes() for f in d.iterdir()}
    head: Future = Future()
    head.set_result({k: files[k] for k in (CERTIFICATE_FILE, MANIFEST_FILE)})
    layers: Future = Future()
    layers.set_result({k: v for k, v in files.items() if k.startswith("layer")})
    return StagedSource(head, ((range(0, CFG.num_hidden_layers), layers),))


def _serve(m, prof, docs, dirs, question, staged, **kw):
    if staged:
        return answer_staged(m, prof, docs, [_source(d) for d in dirs], question, IDENT, 1, **kw)
    return answer(m, prof, docs, dirs, question, IDENT, 1, **kw)


@pytest.mark.parametrize("staged", [False, True])
def test_reuse_arm_opens_with_the_preamble_and_relocates_every_document(setup, staged):
    m, pre, docs, question, profs, dirs = setup
    prof = profs["preamble"]
    arts = [produce_llama(m, s, prof) for s in [pre] + docs]       # the preamble's own artifact is docs[0]
    own = preamble_artifact(m, prof, IDENT)                         # what a worker computes once and keeps
    for given in (None, own):
        ref = ReuseEngine(m, prof).prefill_cache(arts, question)
        out = _serve(m, prof, docs, dirs["preamble"], question, staged, preamble=given)
        assert out.arm == "reuse" and out.verdict.ok
        assert torch.equal(out.logits, ref.logits)              # the same tensors in, the same math: bit-equal
        rows = out.ledger.summary()["rows"]
        assert rows == ref.ledger.summary()["rows"]
        # the preamble is the prefix (exact, from its artifact); every named document is relocated
        assert rows["prefix"] == len(pre) and rows["relocated"] == sum(map(len, docs)) and rows["active"] > 0
        nxt = int(out.logits.argmax())
        assert torch.equal(out.step(nxt), m(torch.tensor([nxt]), ref.state))


def test_recompute_arm_is_the_model_over_preamble_documents_question(setup):
    m, pre, docs, question, profs, dirs = setup
    prof = profs["preamble"]
    assert served_tokens(prof, docs, question, m.cfg.eos_token_id) == pre + [t for d in docs for t in d] + question
    full = m(torch.tensor(pre + [t for d in docs for t in d] + question))
    counter = FallbackCounter()
    out = answer(m, prof, docs, dirs["preamble"], question, IDENT, [1, 2, 1], counter=counter)   # a stale one
    assert out.arm == "recompute" and out.verdict.reason is FallbackReason.STALE_GENERATION
    assert torch.allclose(out.logits, full, atol=1e-5, rtol=1e-5)
    nxt = int(full.argmax())
    assert torch.allclose(out.step(nxt), m(torch.tensor(pre + [t for d in docs for t in d] + question + [nxt])),
                          atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("staged", [False, True])
def test_degenerate_profile_with_a_preamble_serves_the_recompute_answer(setup, staged):
    m, pre, docs, question, profs, dirs = setup
    out = _serve(m, profs["degenerate"], docs, dirs["degenerate"], question, staged)
    full = m(torch.tensor(pre + [t for d in docs for t in d] + question))
    assert out.arm == "reuse" and out.ledger.active == sum(map(len, docs))
    assert rel_err(out.logits, full) < 1e-4


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("served, built", [("preamble", "plain"), ("plain", "preamble")])
def test_a_document_built_under_another_preamble_falls_back_counted(setup, staged, served, built):
    m, pre, docs, question, profs, dirs = setup
    prof = profs[served]
    counter = FallbackCounter()
    out = _serve(m, prof, docs, dirs[built], question, staged, counter=counter)
    assert out.arm == "recompute" and out.verdict.reason is FallbackReason.PROFILE_MISMATCH
    assert out.document == (0 if staged else None)          # the staged path names the document at fault
    assert "preamble" in out.verdict.detail
    counts = counter.snapshot()
    assert counts["profile_mismatch"] == 1 and sum(counts.values()) == 1
    opening = pre if served == "preamble" else []
    full = m(torch.tensor(opening + [t for d in docs for t in d] + question))
    assert torch.allclose(out.logits, full, atol=1e-5, rtol=1e-5)


def test_a_preamble_artifact_of_another_profile_or_model_is_refused(setup):
    m, pre, docs, question, profs, dirs = setup
    wrong = [preamble_artifact(m, profs["degenerate"], IDENT),                      # another profile
             preamble_artifact(m, profs["preamble"], ServingIdentity("0" * 64, "tok"))]   # another checkpoint
    for w in wrong:
        with pytest.raises(ValueError, match="preamble artifact"):
            answer(m, profs["preamble"], docs, dirs["preamble"], question, IDENT, 1, preamble=w)
    with pytest.raises(ValueError, match="no preamble"):
        answer(m, profs["plain"], docs, dirs["plain"], question, IDENT, 1, preamble=wrong[0])


def test_profile_checks(setup):
    m, pre, *_ = setup
    prof = load_profile('{"name": "p", "first_fences": 2, "last_fences": 2, "align": 1, "preamble": [5, 6, 7]}')
    assert prof.preamble == (5, 6, 7) and prof.to_dict()["preamble"] == [5, 6, 7]
    check_profile(prof, m)                                  # the Llama family serves a preamble
    with pytest.raises(ProfileError, match="outside the vocabulary"):
        check_profile(prof.replace(preamble=(5, CFG.vocab_size)), m)
    with pytest.raises(ProfileError, match="Llama family only"):    # DeepSeek-V4 does not
        prof.replace(align=16).check(tiny_reuse())
