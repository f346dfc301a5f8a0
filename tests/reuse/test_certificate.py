"""Certificates, hashes, validate's reasons and order, agree's logic (a stub Parallel), the fallback counter.
The real two-process agree over gloo lives in test_store.py, where it loads a corrupted artifact."""
import threading

import blake3
import pytest
import torch

from runtime.model.config import tiny
from runtime.reuse.certificate import (Certificate, CertificateError, FallbackCounter, FallbackReason,
                                       FingerprintHasher, Verdict, agree, digest_bytes, model_fingerprint,
                                       token_hash, validate)
from runtime.model.parallel import Parallel
from runtime.reuse.profile import FLASH_PROFILE

R = FallbackReason
TOK = "tok-fp"


def make_cert(**kw) -> Certificate:
    base = dict(checkpoint_fingerprint="ckpt", token_hash=token_hash([5, 6, 7], TOK), n_tokens=3,
                profile=FLASH_PROFILE.to_dict(), tp_size=2, tp_rank=1, channel_range=(1024, 2048),
                layers=(0, 1, 2), dtype="bfloat16", producer_version="redknot 0.1.0",
                shard_digests={"layer00.latent": "aa", "layer01.latent": "bb", "manifest": "cc"}, generation=4)
    base.update(kw)
    return Certificate(**base)


def expect(**kw) -> dict:
    base = dict(fingerprint="ckpt", tokens_hash=token_hash([5, 6, 7], TOK), profile=FLASH_PROFILE.to_dict(),
                tp_size=2, tp_rank=1, channel_range=(1024, 2048), layers_needed={0, 1, 2}, current_generation=4,
                dtype="bfloat16", producer_version="redknot 0.1.0", shard_digests_seen=None)
    base.update(kw)
    return base


def test_reasons_are_fixed_lowercase_labels():
    assert len(R) == 12
    for r in R:
        assert r.value == r.name.lower() and isinstance(r, str)


def test_certificate_bytes_round_trip_and_digest():
    c = make_cert()
    back = Certificate.from_bytes(c.to_bytes())
    assert back == c and isinstance(back.channel_range, tuple) and isinstance(back.layers, tuple)
    assert back.certificate_digest() == c.certificate_digest()
    assert make_cert(layers=[0, 1, 2], channel_range=[1024, 2048]) == c      # lists normalize to tuples
    # dict insertion order does not change the bytes
    rev = make_cert(shard_digests=dict(reversed(list(c.shard_digests.items()))),
                    profile=dict(reversed(list(c.profile.items()))))
    assert rev.to_bytes() == c.to_bytes()
    assert make_cert(generation=5).certificate_digest() != c.certificate_digest()
    # rank-specific fields do not enter the binding every rank must share
    assert make_cert(tp_rank=0, channel_range=(0, 1024), shard_digests={}).binding_digest() == c.binding_digest()
    assert make_cert(generation=5).binding_digest() != c.binding_digest()


@pytest.mark.parametrize("raw", [b"", b"\xc1garbage", b"\x93\x01\x02\x03", None])
def test_from_bytes_rejects_garbage(raw):
    if raw is None:     # well-formed msgpack, malformed certificate
        d = make_cert().to_dict()
        d["tp_rank"] = 7
        import msgpack
        raw = msgpack.packb(d)
    with pytest.raises(CertificateError):
        Certificate.from_bytes(raw)


def test_token_hash():
    h = token_hash([1, 2, 3], TOK)
    assert h == token_hash(torch.tensor([1, 2, 3]), TOK) == token_hash((1, 2, 3), TOK)
    assert h != token_hash([1, 2, 4], TOK)
    assert h != token_hash([1, 2, 3, 0], TOK)
    assert h != token_hash([1, 2, 3], "other-tokenizer")
    assert token_hash([], TOK) != token_hash([0], TOK)
    assert digest_bytes(b"abc") == blake3.blake3(b"abc").hexdigest()


def test_model_fingerprint_binds_names_shapes_dtypes_bytes_config_tokenizer():
    g = torch.Generator().manual_seed(0)
    state = {"b.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16), "a.bias": torch.randn(8, generator=g)}
    cfg = tiny(n_layers=2).to_dict()
    fp = model_fingerprint(state, cfg, TOK)
    assert fp == model_fingerprint(dict(reversed(list(state.items()))), cfg, TOK)
    flipped = state["b.weight"].clone()
    flipped.view(torch.int16)[2, 3] ^= 1          # one bit in a bf16 weight
    variants = [
        {**state, "b.weight": flipped},
        {**state, "b.weight": state["b.weight"].reshape(8, 4)},
        {**state, "b.weight": state["b.weight"].view(torch.int16)},   # same bytes, other dtype
        {"c.weight": state["b.weight"], "a.bias": state["a.bias"]},
    ]
    for v in variants:
        assert model_fingerprint(v, cfg, TOK) != fp
    assert model_fingerprint(state, {**cfg, "window_size": 64}, TOK) != fp
    assert model_fingerprint(state, cfg, "other") != fp
    # the streaming hasher gives the same answer and refuses out-of-order names
    h = FingerprintHasher()
    h.add("a.bias", state["a.bias"])
    h.add("b.weight", state["b.weight"])
    assert h.finish(cfg, TOK) == fp
    with pytest.raises(AssertionError):
        h2 = FingerprintHasher()
        h2.add("b", state["a.bias"])
        h2.add("a", state["a.bias"])


def test_validate_accepts_then_each_reason():
    c = make_cert()
    assert validate(c, **expect()) == Verdict.accept()
    seen = dict(c.shard_digests)
    assert validate(c, **expect(shard_digests_seen=seen)).ok
    cases = [
        (dict(fingerprint="other"), R.CHECKPOINT_MISMATCH),
        (dict(tokens_hash=token_hash([5, 6, 8], TOK)), R.TOKEN_MISMATCH),
        (dict(profile=FLASH_PROFILE.replace(budget=0.2).to_dict()), R.PROFILE_MISMATCH),
        (dict(dtype="float32"), R.PRODUCER_MISMATCH),
        (dict(producer_version="redknot 0.2.0"), R.PRODUCER_MISMATCH),
        (dict(tp_size=4), R.TP_GEOMETRY_MISMATCH),
        (dict(tp_rank=0), R.TP_GEOMETRY_MISMATCH),
        (dict(channel_range=(0, 1024)), R.TP_GEOMETRY_MISMATCH),
        (dict(layers_needed={0, 3}), R.MISSING_LAYER),
        (dict(current_generation=5), R.STALE_GENERATION),
        (dict(shard_digests_seen={k: v for k, v in seen.items() if k != "layer01.latent"}), R.MISSING_SHARD),
        (dict(shard_digests_seen={**seen, "layer01.latent": "bc"}), R.DIGEST_MISMATCH),
    ]
    for kw, reason in cases:
        v = validate(c, **expect(**kw))
        assert not v.ok and v.reason is reason and v.detail, (kw, v)
    # a ReuseProfile works as the expected profile, and the detail names the differing key
    assert validate(c, **expect(profile=FLASH_PROFILE)).ok
    assert "budget" in validate(c, **expect(profile=FLASH_PROFILE.replace(budget=0.2))).detail


def test_validate_order_is_fixed():
    c = make_cert()
    everything_wrong = expect(fingerprint="x", tokens_hash="y", profile={}, dtype="float32", tp_rank=0,
                              layers_needed={9}, current_generation=0, shard_digests_seen={})
    order = [("fingerprint", R.CHECKPOINT_MISMATCH), ("tokens_hash", R.TOKEN_MISMATCH),
             ("profile", R.PROFILE_MISMATCH), ("dtype", R.PRODUCER_MISMATCH), ("tp_rank", R.TP_GEOMETRY_MISMATCH),
             ("layers_needed", R.MISSING_LAYER), ("current_generation", R.STALE_GENERATION),
             ("shard_digests_seen", R.MISSING_SHARD)]
    good = expect(shard_digests_seen=dict(c.shard_digests))
    for i, (_, reason) in enumerate(order):
        kw = {**good, **{k: everything_wrong[k] for k, _ in order[i:]}}
        assert validate(c, **kw).reason is reason


@pytest.mark.parametrize("cert", [None, b"bytes", make_cert(tp_rank="1"), make_cert(channel_range=(5, 2)),
                                  make_cert(layers=("0", 1)), make_cert(shard_digests={"a": 1}),
                                  make_cert(profile=None), make_cert(generation=True)])
def test_validate_never_raises_on_malformed(cert):
    v = validate(cert, **expect())
    assert not v.ok and v.reason is R.MISSING_SHARD and v.detail


class StubPar:
    """A Parallel stand-in that returns prepared gathers and counts collectives."""

    def __init__(self, rank, others):
        self.rank, self.size, self.others, self.calls = rank, len(others), others, 0

    def all_gather_object(self, obj):
        self.calls += 1
        out = list(self.others)
        out[self.rank] = obj
        return out


def test_agree():
    ok, bad = Verdict.accept(), Verdict.reject(R.DIGEST_MISMATCH, "shard layer01.latent")
    # size 1: no collective, verdict unchanged
    assert agree(bad, Parallel()) is bad and agree(ok, Parallel()) is ok
    par = StubPar(0, [None, (True, None, None), (True, None, None)])
    assert agree(ok, par) == ok and par.calls == 1
    # rank 0 fine, rank 2 rejected: rank 0 learns who and why
    par = StubPar(0, [None, (True, None, None), (False, "digest_mismatch", None)])
    v = agree(ok, par)
    assert par.calls == 1 and v.reason is R.RANK_DISAGREEMENT and "rank 2: digest_mismatch" in v.detail
    # a rejecting rank keeps its own reason
    par = StubPar(2, [(True, None, None), (False, "stale_generation", None), None])
    assert agree(bad, par) is bad and par.calls == 1
    # every rank accepted, but different artifacts: all reject
    par = StubPar(1, [(True, None, "b1"), None])
    v = agree(ok, par, binding="b2")
    assert v.reason is R.RANK_DISAGREEMENT and "different artifacts" in v.detail


def test_fallback_counter_threads():
    c = FallbackCounter()
    assert c.snapshot() == {r.value: 0 for r in R}

    def work():
        for _ in range(1000):
            c.inc(R.DIGEST_MISMATCH)
            c.inc("stale_generation")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.observe(Verdict.reject(R.MISSING_LAYER, "x"))
    c.observe(Verdict.accept())
    snap = c.snapshot()
    assert snap["digest_mismatch"] == 4000 and snap["stale_generation"] == 4000 and snap["missing_layer"] == 1
    assert sum(snap.values()) == 8001
    with pytest.raises(ValueError):
        c.inc("made_up_reason")
