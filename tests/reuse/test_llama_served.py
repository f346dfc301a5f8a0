"""The Llama family through the serving path's runtime side: artifacts certified into the shared store format
(a `kv` and a `local` shard per layer), read back layer by layer and verified as any artifact, and a request over
them (`answer`, `answer_staged`) equal to the engine on the artifacts it produced in memory; bad artifacts fall
back, counted, to the recompute arm's exact answer."""
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from runtime.families import build, check_profile, expectations
from runtime.llama.artifacts import produce_llama
from runtime.reuse.artifact import KVLayerArtifact
from runtime.reuse.certificate import FallbackCounter, FallbackReason, token_hash
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.profile import ProfileError, ReuseProfile
from runtime.reuse.request import ServingIdentity, answer, answer_staged
from runtime.reuse.stager import StagedSource
from runtime.reuse.store import CERTIFICATE_FILE, MANIFEST_FILE, load_artifact
from tests.tiny import TINY_LLAMA, random_request, stored_tiny_llama

CFG = TINY_LLAMA
PROF = ReuseProfile(name="t", first_fences=2, last_fences=2, align=1, join_rows=4, recent_rows=8, budget=0.25,
                    select="attention")
IDENT = ServingIdentity("f" * 64, "tok")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    m = stored_tiny_llama(tmp_path_factory.mktemp("ckpt"), CFG)
    docs, question = random_request(1, (30, 41, 25), 9)
    root = tmp_path_factory.mktemp("arts")
    dirs = [build(m, d, PROF, IDENT.fingerprint, IDENT.tokenizer_fingerprint, root / f"d{i}", generation=1)
            for i, d in enumerate(docs)]
    return m, docs, question, dirs


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in d.iterdir()}


def _source(d: Path, groups: list[range], drop: str | None = None) -> StagedSource:
    files = _files(d)
    head: Future = Future()
    head.set_result({k: files[k] for k in (CERTIFICATE_FILE, MANIFEST_FILE)})
    out = []
    for r in groups:
        fut: Future = Future()
        fut.set_result({k: v for k, v in files.items() if k.startswith(tuple(f"layer{i:02d}." for i in r))
                        and k != drop})
        out.append((r, fut))
    return StagedSource(head, tuple(out))


def test_stored_layers_are_the_produced_tensors(setup):
    m, docs, _, dirs = setup
    expect = dict(expectations(m, PROF, IDENT.fingerprint), current_generation=1,
                  tokens_hash=token_hash(docs[0], IDENT.tokenizer_fingerprint))
    doc, v = load_artifact(dirs[0], expect)
    assert v.ok, v
    ref = produce_llama(m, docs[0], PROF)
    assert all(isinstance(la, KVLayerArtifact) for la in doc.layers) and doc.meta["family"] == "llama"
    for i, la in enumerate(doc.layers):
        assert torch.equal(la.k, ref.k[i]) and torch.equal(la.v, ref.v[i])
        assert (la.local_p is None) == (ref.local[i] is None)
        if la.local_p is not None:
            assert torch.equal(la.local_p, ref.local[i])
    assert sum(la.local_p is not None for la in doc.layers) == CFG.num_hidden_layers - 4       # reusable layers
    # a document bound to other tokens, another profile or another checkpoint is refused by its certificate
    assert load_artifact(dirs[0], dict(expect, tokens_hash=token_hash(docs[1], "tok")))[1].reason \
        is FallbackReason.TOKEN_MISMATCH
    other = expectations(m, PROF.replace(budget=0.5), IDENT.fingerprint)
    assert load_artifact(dirs[0], dict(expect, profile=other["profile"]))[1].reason is FallbackReason.PROFILE_MISMATCH
    assert load_artifact(dirs[0], dict(expect, fingerprint="0" * 64))[1].reason is FallbackReason.CHECKPOINT_MISMATCH


@pytest.mark.parametrize("staged", [False, True])
def test_a_request_over_stored_artifacts_equals_the_engine_on_produced_ones(setup, staged):
    m, docs, question, dirs = setup
    ref = ReuseEngine(m, PROF).prefill_cache([produce_llama(m, d, PROF) for d in docs], question)
    if staged:
        out = answer_staged(m, PROF, docs, [_source(d, [range(0, 3), range(3, 8)]) for d in dirs], question, IDENT, 1)
    else:
        out = answer(m, PROF, docs, dirs, question, IDENT, 1)
    assert out.arm == "reuse" and out.verdict.ok
    assert torch.equal(out.logits, ref.logits)                  # the same tensors in, the same math: bit-equal
    assert out.ledger.summary()["rows"] == ref.ledger.summary()["rows"]
    assert out.ledger.summary()["rows"]["active"] > 0           # the budget recomputed rows: the reuse path ran
    # decoding continues the request's own KV cache, as the engine's result does
    nxt = int(out.logits.argmax())
    assert torch.equal(out.step(nxt), m(torch.tensor([nxt]), ref.state))


def test_a_missing_or_altered_shard_falls_back_counted_to_the_exact_recompute(setup):
    m, docs, question, dirs = setup
    full = m(torch.tensor([t for d in docs for t in d] + question))
    counter = FallbackCounter()
    srcs = [_source(dirs[0], [range(0, 8)]), _source(dirs[1], [range(0, 8)], drop="layer04.kv.safetensors"),
            _source(dirs[2], [range(0, 8)])]
    out = answer_staged(m, PROF, docs, srcs, question, IDENT, 1, counter=counter)
    assert out.arm == "recompute" and out.verdict.reason is FallbackReason.MISSING_SHARD and out.document == 1
    assert torch.allclose(out.logits, full, atol=1e-5, rtol=1e-5)
    bad = _source(dirs[2], [range(0, 8)])
    files = bad.groups[0][1].result()
    name = "layer03.kv.safetensors"
    files[name] = files[name][:-1] + bytes([files[name][-1] ^ 1])
    out = answer_staged(m, PROF, docs, [_source(dirs[0], [range(0, 8)]), _source(dirs[1], [range(0, 8)]), bad],
                        question, IDENT, 1, counter=counter)
    assert out.arm == "recompute" and out.verdict.reason is FallbackReason.DIGEST_MISMATCH and out.document == 2
    counts = counter.snapshot()
    assert counts["missing_shard"] == 1 and counts["digest_mismatch"] == 1 and sum(counts.values()) == 2
    # a stale generation: the certificate says 1, the store's current one is 2
    out = answer(m, PROF, docs, dirs, question, IDENT, [1, 2, 1])
    assert out.arm == "recompute" and out.verdict.reason is FallbackReason.STALE_GENERATION


def test_profiles_the_llama_family_cannot_serve_are_refused(setup):
    m = setup[0]
    check_profile(PROF, m)
    with pytest.raises(ProfileError, match="align"):
        check_profile(PROF.replace(align=128), m)
    with pytest.raises(ProfileError):
        check_profile(PROF.replace(ffn_mode="shared"), m)
