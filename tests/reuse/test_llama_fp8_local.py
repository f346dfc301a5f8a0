"""The Llama family stores its Local contribution W_o,L O_L in FP8 under `local_format="fp8"`, as DeepSeek-V4's
artifacts do: e4m3 codes with one power-of-two scale per row and 128 channels, in the `local` shard beside K/V,
dequantized where the engine restores the contribution. An approximation: the tests prove it active (codes stored,
logits move), bound it (against the model-dtype storage), and prove the store path exact around it (the stored
codes and scales are the produced ones; a request over stored artifacts equals the engine on produced ones)."""
import pytest
import torch

from runtime.eval.arms import ArmError, parse_arm
from runtime.families import build, expectations
from runtime.llama.artifacts import produce_llama, produce_llama_many, produce_llama_packed
from runtime.model.quant import FP8_ROW_BLOCK
from runtime.reuse.certificate import FallbackReason, token_hash
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.profile import ReuseProfile
from runtime.reuse.request import ServingIdentity, answer
from runtime.reuse.store import load_artifact
from tests.tiny import TINY_LLAMA, random_request, stored_tiny_llama

CFG = TINY_LLAMA
NATIVE = ReuseProfile(name="t", first_fences=2, last_fences=2, align=1, join_rows=4, recent_rows=8, budget=0.25,
                      select="attention")
FP8 = NATIVE.replace(local_format="fp8")
IDENT = ServingIdentity("f" * 64, "tok")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    m = stored_tiny_llama(tmp_path_factory.mktemp("ckpt"), CFG)
    docs, question = random_request(3, (30, 41, 25), 9)
    return m, docs, question


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[n, C] -> [n, blocks, FP8_ROW_BLOCK], the last block padded with zeros."""
    pad = -x.shape[1] % FP8_ROW_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(x.shape[0], -1, FP8_ROW_BLOCK)


def test_fp8_artifacts_hold_codes_and_scales_of_the_native_contribution(setup):
    m, docs, _ = setup
    nat, f8 = produce_llama_many(m, docs[1], [NATIVE, FP8])
    assert nat.local_s is None
    reusable = [i for i, p in enumerate(nat.local) if p is not None]
    assert reusable == list(range(2, CFG.num_hidden_layers - 2))
    for i in range(CFG.num_hidden_layers):
        assert torch.equal(f8.k[i], nat.k[i]) and torch.equal(f8.v[i], nat.v[i])      # K/V do not depend on it
        if i not in reusable:
            assert f8.local[i] is None and f8.local_s[i] is None
            continue
        codes, scales, ref = f8.local[i], f8.local_s[i], nat.local[i]
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == ref.shape
        assert scales.dtype == torch.uint8 and scales.shape == (ref.shape[0], -(-ref.shape[1] // FP8_ROW_BLOCK))
        assert codes.element_size() * codes.numel() * 2 <= ref.element_size() * ref.numel()   # at most half
        deq = f8.local_at(i, torch.float32)
        # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, relative to its block's power-of-two scale
        err, amax = _blocks((deq - ref.float()).abs()), _blocks(ref.float().abs()).amax(dim=2, keepdim=True)
        assert bool((err <= amax / 16 + 1e-12).all())
        assert 0 < float((deq - ref).norm() / ref.norm()) < 0.05
    # the packed producer quantizes each document's rows on their own: the same codes as producing it alone
    packed = produce_llama_packed(m, docs, [FP8])[0][1]
    for i in reusable:
        assert torch.equal(packed.local_s[i], f8.local_s[i])
        assert torch.allclose(packed.local_at(i, torch.float32), f8.local_at(i, torch.float32), atol=1e-5, rtol=0.07)


def test_reuse_over_fp8_artifacts_is_close_to_the_native_storage_and_not_equal(setup):
    m, docs, question = setup
    nat = ReuseEngine(m, NATIVE).prefill_cache([produce_llama(m, d, NATIVE) for d in docs], question)
    f8 = ReuseEngine(m, FP8).prefill_cache([produce_llama(m, d, FP8) for d in docs], question)
    full = m(torch.tensor([t for d in docs for t in d] + question))
    assert not torch.equal(f8.logits, nat.logits)                       # the approximation is active
    rel = float((f8.logits - nat.logits).norm() / nat.logits.norm())
    own = float((nat.logits - full).norm() / full.norm())               # the reuse arm's own deviation
    assert 0 < rel < 0.25 * own, (rel, own)                             # FP8 adds a fraction of it
    assert f8.ledger.summary()["rows"] == nat.ledger.summary()["rows"]  # the same rows recomputed


def test_stored_fp8_artifacts_serve_exactly_what_was_produced(setup, tmp_path):
    m, docs, question = setup
    dirs = [build(m, d, FP8, IDENT.fingerprint, IDENT.tokenizer_fingerprint, tmp_path / f"d{i}", generation=1)
            for i, d in enumerate(docs)]
    expect = dict(expectations(m, FP8, IDENT.fingerprint), current_generation=1,
                  tokens_hash=token_hash(docs[0], IDENT.tokenizer_fingerprint))
    doc, v = load_artifact(dirs[0], expect)
    assert v.ok, v
    ref = produce_llama(m, docs[0], FP8)
    for i, la in enumerate(doc.layers):
        assert (la.local_s is None) == (ref.local_s[i] is None)
        if la.local_s is not None:
            assert la.local_p.dtype == torch.float8_e4m3fn
            assert torch.equal(la.local_p.view(torch.uint8), ref.local[i].view(torch.uint8))
            assert torch.equal(la.local_s, ref.local_s[i])
    out = answer(m, FP8, docs, dirs, question, IDENT, 1)
    eng = ReuseEngine(m, FP8).prefill_cache([produce_llama(m, d, FP8) for d in docs], question)
    assert out.arm == "reuse" and torch.equal(out.logits, eng.logits)
    # the storage format is part of what the certificate binds: a native-format consumer refuses these
    assert load_artifact(dirs[0], dict(expect, profile=expectations(m, NATIVE, IDENT.fingerprint)["profile"]))[1] \
        .reason is FallbackReason.PROFILE_MISMATCH


def test_the_harness_names_the_storage_format_as_a_knob():
    assert parse_arm("reuse@25%:local=fp8").profile(NATIVE).local_format == "fp8"
    assert parse_arm("reuse@25%:local=native").name == "reuse@25%"
    with pytest.raises(ArmError, match="local"):
        parse_arm("reuse@25%:local=int4")
